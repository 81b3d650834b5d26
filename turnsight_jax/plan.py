"""Ahead-of-time memory planning: compile the train step on abstract parameters.

`python -m turnsight_jax.train --config configs/qwen3_8b.py --dry_run --fake_devices 8` builds
the mesh, abstract (never allocated) parameters, optimizer state and a batch of the config's
worst-case geometry, compiles the fused step with XLA, and prints XLA's per-device memory
analysis against the device memory budget.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import ml_collections as mlc
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from turnsight_jax import runtime
from turnsight_jax.config import validate
from turnsight_jax.models.attention import Layout
from turnsight_jax.models.qwen3 import Qwen3
from turnsight_jax.sharding import BATCH, _fit, leaf_name, make_mesh, param_sharding, state_shardings
from turnsight_jax.train_step import TrainBatch, make_optimizer, make_train_step, row_axis
from turnsight_jax.views import DEFAULT_PACKED_BUCKETS, PackedViews, pick_bucket, policy_bucket
from turnsight_jax.chat.trajectory import DEFAULT_BUCKETS


@dataclasses.dataclass
class Geometry:
    batch: int  # trajectories per step (B)
    length: int  # T: bucketed prompt + response
    policy: int  # N: policy tokens per row (bucketed response budget)
    packed: int  # P: packed teacher row
    distinct: int  # U: distinct teacher predictors per row
    views: int  # R: teacher views (depths, + reference row with KL)
    turns: int


def worst_case_geometry(cfg: mlc.ConfigDict) -> Geometry:
    r, t = cfg.rollout, cfg.train
    length = pick_bucket(r.max_prompt_tokens + r.max_response_tokens, DEFAULT_BUCKETS, "plan: trajectory")
    policy = policy_bucket(r.max_response_tokens)
    packed = pick_bucket(int(length * cfg.plan.packed_factor), DEFAULT_PACKED_BUCKETS, "plan: packed row")
    views = len(cfg.rl.depths) + int(bool(cfg.loss.kl_coef))
    distinct = policy_bucket(int(policy * min(views, cfg.plan.distinct_factor)))
    return Geometry(t.prompts_per_step * t.group_size, length, policy, packed, distinct, views, r.max_turns)


def abstract_batch(g: Geometry, mesh, uses_views: bool) -> TrainBatch:
    def arr(shape, dtype, path_name=""):
        axis = 1 if path_name in ("view_pred", "slot") else 0
        spec = [None] * len(shape)
        spec[axis] = BATCH
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, _fit(P(*spec), shape, mesh)))

    b, i32 = g.batch, jnp.int32
    views = None
    if uses_views:
        lay = Layout(*(arr((b, g.packed), i32) for _ in range(6)))
        views = PackedViews(arr((b, g.packed), i32), lay, arr((g.views, b, g.policy), i32, "view_pred"),
                            arr((b, g.distinct), i32), arr((b, g.distinct), i32), arr((g.views, b, g.policy), i32, "slot"))
    return TrainBatch(
        tokens=arr((b, g.length), i32), valid=arr((b, g.length), bool), pol_pos=arr((b, g.policy), i32),
        pol_valid=arr((b, g.policy), bool), turn_ids=arr((b, g.policy), i32),
        old_logprobs=arr((b, g.policy), jnp.float32), group_ids=arr((b,), i32), rewards=arr((b,), jnp.float32),
        num_turns=arr((b,), i32), turn_rewards=arr((b, g.turns), jnp.float32), views=views,
    )


def _with_shardings(tree, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def opt_state_shardings(abstract_opt, mesh):
    """Optimizer moments shard like their parameters; scalars (step counts) are replicated."""
    def leaf(path, x):
        if x.ndim == 0:
            return NamedSharding(mesh, P())
        return param_sharding(leaf_name(path), x.shape, mesh)

    return jax.tree_util.tree_map_with_path(leaf, abstract_opt)


def compile_step(cfg: mlc.ConfigDict):
    """(compiled step, geometry, seconds to compile) for the config on the current devices."""
    step_cfg = validate(cfg, jax.device_count(), check_data=False)
    mesh = make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
    qcfg = runtime.model_config(cfg)
    opts = runtime.runtime_options(cfg)
    pdtype = runtime.DTYPES[cfg.model.param_dtype]
    abstract = nnx.eval_shape(lambda: Qwen3(qcfg, rngs=nnx.Rngs(0), param_dtype=pdtype, options=opts))
    graphdef, params = nnx.split(abstract)
    params = _with_shardings(params, state_shardings(params, mesh))
    rdtype = runtime.DTYPES[cfg.model.ref_dtype]
    ref = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, rdtype, sharding=x.sharding), params)
    optimizer = make_optimizer(step_cfg.optim)
    opt = jax.eval_shape(optimizer.init, params)
    opt = _with_shardings(opt, opt_state_shardings(opt, mesh))
    geo = worst_case_geometry(cfg)
    batch = abstract_batch(geo, mesh, step_cfg.algo.uses_views)
    step = make_train_step(graphdef, step_cfg, optimizer)
    t0 = time.perf_counter()
    with jax.set_mesh(mesh):
        compiled = step.lower(params, opt, ref, batch).compile()
    return compiled, geo, time.perf_counter() - t0, mesh, step_cfg


def dry_run(cfg: mlc.ConfigDict) -> dict:
    runtime.log(f"dry run: compiling the train step for {jax.device_count()} {jax.devices()[0].platform} device(s) "
                "on abstract parameters (nothing is allocated)")
    compiled, geo, secs, mesh, step_cfg = compile_step(cfg)
    mem = compiled.memory_analysis()
    gib = 1024**3
    fields = {
        "arguments (params, optimizer, reference, batch)": mem.argument_size_in_bytes,
        "outputs": mem.output_size_in_bytes,
        "aliased (donated) outputs": mem.alias_size_in_bytes,
        "temporaries (activations, logits chunks)": mem.temp_size_in_bytes,
    }
    peak = mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes + mem.temp_size_in_bytes
    budget = cfg.plan.device_memory_gib
    print(f"\n## Memory plan: {cfg.name} on mesh {dict(mesh.shape)} (compiled in {secs:.0f}s)")
    print(f"geometry per step: B={geo.batch} trajectories, T={geo.length}, policy tokens/row N={geo.policy}, "
          f"packed teacher row P={geo.packed}, distinct teacher rows U={geo.distinct}; micro-batches "
          f"{step_cfg.micro_batches} (student), {step_cfg.teacher_micro_batches} (teacher); remat={cfg.model.remat}; "
          f"attention query chunk {cfg.model.attn_q_chunk}; log-prob chunk {cfg.train.logprob_chunk}")
    print("| per device | GiB |\n|---|---|")
    for k, v in fields.items():
        print(f"| {k} | {v / gib:.2f} |")
    print(f"| **peak estimate** (args + outputs - aliased + temporaries) | **{peak / gib:.2f}** |")
    verdict = "fits" if peak / gib <= budget else "does NOT fit"
    print(f"\n{verdict} in {budget} GiB per device")
    return {"peak_gib": peak / gib, "fits": peak / gib <= budget, "compile_s": secs, **{k: v / gib for k, v in fields.items()}}
