"""A Hugging Face folder from any checkpoint of a training run.

    python -m turnsight_jax.export RUN_DIR [--step N] [--out DIR]

The trainer exports the final policy to RUN_DIR/export; this exports the policy of any finished
checkpoint (the latest valid one by default; an unfinished or corrupt step is refused with its
reason) to DIR (default RUN_DIR/export-step-N), in the same form: safetensors + config.json, the
run's tokenizer, and the run's config as turnsight_run.json, so `python -m turnsight_jax.evaluate
--hf DIR --benchmarks builtin` evaluates it on the run's held-out tasks as the run did.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from typing import Sequence


def export_step(run_dir: str | pathlib.Path, step: int | None = None, out: str | pathlib.Path | None = None,
                log=lambda s: print(s, file=sys.stderr)) -> pathlib.Path:
    """Writes the Hugging Face folder of `run_dir`'s checkpoint `step` (latest valid: None) to `out`
    (default run_dir/export-step-<step>) and returns it."""
    from flax import nnx

    from turnsight_jax.checkpointing import load_policy_from_run, read_run_config
    from turnsight_jax.train import export

    run_dir = pathlib.Path(run_dir)
    cfg = read_run_config(run_dir)
    model, tokdir, step = load_policy_from_run(run_dir, step=step)
    target = pathlib.Path(out) if out is not None else run_dir / f"export-step-{step}"
    if target.exists() and any(target.iterdir()):
        raise FileExistsError(f"{target} exists and is not empty: pass another --out")
    graphdef, params = nnx.split(model)
    export(graphdef, params, target, tokdir, cfg)
    log(f"checkpoint step {step} of {run_dir} -> {target}")
    return target


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m turnsight_jax.export", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", help="a training run folder (holds checkpoints/)")
    ap.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest valid one)")
    ap.add_argument("--out", default=None, help="output folder (default: RUN_DIR/export-step-N); must be new or empty")
    args = ap.parse_args(argv)
    try:
        export_step(args.run_dir, args.step, args.out)
    except (FileNotFoundError, FileExistsError, ValueError) as e:  # CheckpointError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
