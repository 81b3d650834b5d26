"""Times the fused train step (TurnSight over GRPO, one update) on one benchmark geometry with
whatever `turnsight_jax` is importable: the current tree, or an earlier revision that
benchmarks/train_step.py extracted and put first on PYTHONPATH. Prints one JSON line.

    python benchmarks/_step_worker.py --geometry default --repeats 3 [--set length_classes=2] [--set pack_rows=true]

The step's and the model's settings are the embedded default's (`step_config(default_config())`,
its model options; tiny-default, f32), with max_turns from the geometry and `--set` fields of
StepConfig on top. Only names every measured revision has are used."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

sys.path.insert(0, __file__.rsplit("/", 1)[0])

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from common import time_fn  # noqa: E402
from geometries import GEOMETRIES, geometry_batch  # noqa: E402

import turnsight_jax  # noqa: E402
from turnsight_jax.assets import default_tokenizer  # noqa: E402
from turnsight_jax.config import default_config, step_config  # noqa: E402
from turnsight_jax.model_setup import runtime_options  # noqa: E402
from turnsight_jax.models.config import get_preset  # noqa: E402
from turnsight_jax.models.qwen3 import Qwen3  # noqa: E402
from turnsight_jax.rl.batch import make_train_batch  # noqa: E402
from turnsight_jax.rl.methods import resolve_method  # noqa: E402
from turnsight_jax.rl.step import make_optimizer, make_train_step  # noqa: E402


def _value(text: str):
    """A `--set` value: true / false, else an int."""
    flags = {"true": True, "false": False}
    return flags[text.lower()] if text.lower() in flags else int(text)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--geometry", choices=GEOMETRIES, required=True)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="a StepConfig field (an int, true or false)")
    ap.add_argument("--model", action="append", default=[], metavar="FIELD=VALUE",
                    help="a model option of the config (cfg.model, e.g. attn_q_chunk=128, remat=true)")
    args = ap.parse_args()
    tok = default_tokenizer()
    trajs, row_tasks, turns = geometry_batch(args.geometry, tok)
    cfg = default_config()
    for key, v in (s.split("=", 1) for s in args.model):
        cfg.model[key] = _value(v)
    sc = dataclasses.replace(step_config(cfg), max_turns=turns,
                             **{k: _value(v) for k, v in (s.split("=", 1) for s in args.set)})
    method = resolve_method(sc)
    batch, stats = make_train_batch(trajs, row_tasks, tok, sc, method)
    model = Qwen3(get_preset("tiny-default"), rngs=nnx.Rngs(0), param_dtype=jnp.float32,
                  options=runtime_options(cfg))
    graphdef, params = nnx.split(model)
    optimizer = make_optimizer(sc.optim)
    step = make_train_step(graphdef, sc, optimizer, method)
    dev = jax.tree.map(jnp.asarray, batch)
    holder = {"p": jax.tree.map(jnp.copy, params), "s": optimizer.init(params)}

    def full():
        holder["p"], holder["s"], m = step(holder["p"], holder["s"], params, dev)
        return m

    wall = time_fn(full, repeats=args.repeats)
    print(json.dumps({"wall": wall, "package": turnsight_jax.__file__, "T": stats.get("T", stats["batch_width"]),
                      "P": stats.get("P", stats.get("packed_width")), "tokens": stats["trajectory_tokens"]}))


if __name__ == "__main__":
    main()
