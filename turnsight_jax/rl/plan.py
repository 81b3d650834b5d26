"""Ahead-of-time memory planning: compile the train step on abstract parameters.

`python -m turnsight_jax.train --config configs/qwen3_8b.py --dry_run --fake_devices 8` builds
the mesh, abstract (never allocated) parameters, optimizer state and a batch of the config's
worst-case geometry, compiles the fused step with XLA, and prints XLA's per-device memory
analysis against the device memory budget.
"""

from __future__ import annotations

import time

import jax
import ml_collections as mlc
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from turnsight_jax import model_setup
from turnsight_jax.config import validate
from turnsight_jax.models.qwen3 import Qwen3
from turnsight_jax.models.sharding import leaf_name, make_mesh, param_sharding, state_shardings
from turnsight_jax.rl.batch import abstract_batch, worst_case_geometry
from turnsight_jax.rl.step import make_optimizer, make_train_step
from turnsight_jax.runlog import log


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
    step_cfg, method = validate(cfg, jax.device_count(), check_data=False)
    mesh = make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
    qcfg = model_setup.model_config(cfg)
    if mismatch := model_setup.architecture_mismatch(cfg, qcfg):
        log(f"warning: {mismatch}")
    opts = model_setup.runtime_options(cfg)
    pdtype = model_setup.DTYPES[cfg.model.param_dtype]
    abstract = nnx.eval_shape(lambda: Qwen3(qcfg, rngs=nnx.Rngs(0), param_dtype=pdtype, options=opts))
    graphdef, params = nnx.split(abstract)
    params = _with_shardings(params, state_shardings(params, mesh))
    rdtype = model_setup.DTYPES[cfg.model.ref_dtype]
    ref = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, rdtype, sharding=x.sharding), params)
    optimizer = make_optimizer(step_cfg.optim)
    opt = jax.eval_shape(optimizer.init, params)
    opt = _with_shardings(opt, opt_state_shardings(opt, mesh))
    geo = worst_case_geometry(cfg, method)
    batch = abstract_batch(geo, mesh, method)
    step = make_train_step(graphdef, step_cfg, optimizer, method)
    t0 = time.perf_counter()
    with jax.set_mesh(mesh):
        compiled = step.lower(params, opt, ref, batch).compile()
    return compiled, geo, time.perf_counter() - t0, mesh, step_cfg


def dry_run(cfg: mlc.ConfigDict) -> dict:
    log(f"dry run: compiling the train step for {jax.device_count()} {jax.devices()[0].platform} device(s) "
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
