"""Ahead-of-time memory planning: compile the train step and the rollout's decode on abstract inputs.

`python -m turnsight_jax.train --config configs/qwen3_8b.py --dry-run --fake-devices 8` builds
the mesh, abstract (never allocated) parameters, optimizer state and a batch of the config's
worst-case geometry, compiles the fused step with XLA, and prints XLA's per-device memory
analysis against the device memory budget. It then plans the rollout (the paged engine): the
trainer state that stays resident while rollouts run, the decode copy of the weights, the KV
block pool for the configured slots and lengths, and the decode program's temporaries (compiled
at its widest: every slot decoding at the longest context), on a line
`rollout plan: peak X GiB per device`.
"""

from __future__ import annotations

import math
import os
import pathlib
import time

import jax
import jax.numpy as jnp
import ml_collections as mlc
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from turnsight_jax import model_setup
from turnsight_jax.config import validate
from turnsight_jax.errors import ConfigError
from turnsight_jax.models.qwen3 import Qwen3
from turnsight_jax.models.sharding import make_mesh, opt_state_shardings, state_shardings
from turnsight_jax.rl.batch import abstract_batch, worst_case_geometry
from turnsight_jax.rl.step import init_aux, make_aux_optimizers, make_optimizer, make_train_step
from turnsight_jax.runlog import log


def _with_shardings(tree, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def abstract_teacher(cfg, step_cfg, method, qcfg, params, mesh):
    """(graphdef or None, abstract parameters or None) of the teacher's own weights, kept next to
    the policy's through the run when it is an EMA of the policy or another model (teacher.weights;
    train.py): sharded like the reference, in model.ref_dtype for an external model."""
    tw = step_cfg.teacher.weights if method.uses_teacher else "reference"
    if tw == "ema":
        return None, params
    if tw != "external":
        return None, None
    tq = model_setup.teacher_config(cfg, qcfg)
    rdtype = model_setup.DTYPES[cfg.model.ref_dtype]
    opts = model_setup.runtime_options(cfg)
    graphdef, teacher = nnx.split(nnx.eval_shape(lambda: Qwen3(tq, rngs=nnx.Rngs(0), param_dtype=rdtype, options=opts)))
    return graphdef, _with_shardings(teacher, state_shardings(teacher, mesh))


def abstract_aux(step_cfg, method, qcfg, params, mesh):
    """The abstract state of the step's learned auxiliaries (rl.step.init_aux: the critic, the
    step-PRM) with their shardings; None for a method without any."""
    if not method.aux:
        return None
    state = jax.eval_shape(lambda p: init_aux(method, p, qcfg.hidden_size, make_aux_optimizers(step_cfg, method)),
                           params)
    return _with_shardings(state, opt_state_shardings(state, mesh))


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
    geo = worst_case_geometry(cfg, method, step_cfg, mesh.shape["data"] * mesh.shape["fsdp"])
    batch = abstract_batch(geo, mesh, method)
    teacher_graphdef, teacher = abstract_teacher(cfg, step_cfg, method, qcfg, params, mesh)
    aux = abstract_aux(step_cfg, method, qcfg, params, mesh)
    step = make_train_step(graphdef, step_cfg, optimizer, method, teacher_graphdef=teacher_graphdef)
    t0 = time.perf_counter()
    with jax.set_mesh(mesh):
        compiled = step.lower(params, opt, ref, batch, teacher, aux).compile()
    # what a checkpoint holds (checkpointing.Checkpointer.save): the policy, its optimizer state, an
    # EMA teacher, the learned auxiliaries with theirs; an external teacher is read, never saved
    saved = {"params": params, "optimizer state": opt, "critic / PRM": aux,
             "EMA teacher": teacher if method.uses_teacher and step_cfg.teacher.weights == "ema" else None}
    sizes = {name: _global_bytes(tree) for name, tree in saved.items() if tree is not None}
    sizes["param count"] = sum(x.size for x in jax.tree.leaves(params))
    return compiled, geo, time.perf_counter() - t0, mesh, step_cfg, sizes


def _global_bytes(tree) -> int:
    return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


# XLA's GPU client: the share of each card it preallocates and will not exceed, unless told
# otherwise (JAX's documented default, used when the variable is unset)
JAX_DEFAULT_MEM_FRACTION = 0.75
# kept free under the allocator's limit for what the compiled plan does not count: cuBLAS/cuDNN
# workspaces, NCCL buffers, allocator fragmentation
HEADROOM = 0.05


def memory_budget(cfg: mlc.ConfigDict, environ=None) -> tuple[float, str]:
    """(GiB per device the train step may plan to use, how it was derived) from the card's memory
    (plan.device_memory_gib) and the allocator settings in the environment the run will have:
    the launchers (launch/gpu_single_host.sh, slurm_multinode.sh) set XLA_PYTHON_CLIENT_MEM_FRACTION
    (their --mem-fraction, 0.90 by default); unset, JAX takes 0.75 of the card. A HEADROOM share of
    that limit is kept free."""
    env = os.environ if environ is None else environ
    card = float(cfg.plan.device_memory_gib)
    if env.get("XLA_PYTHON_CLIENT_ALLOCATOR", "") == "platform":
        limit, why = card, "XLA_PYTHON_CLIENT_ALLOCATOR=platform: no allocator limit, the card's memory"
    elif "XLA_PYTHON_CLIENT_MEM_FRACTION" in env:
        try:
            frac = float(env["XLA_PYTHON_CLIENT_MEM_FRACTION"])
        except ValueError:
            raise ConfigError(f"XLA_PYTHON_CLIENT_MEM_FRACTION must be a number in (0, 1], got "
                              f"{env['XLA_PYTHON_CLIENT_MEM_FRACTION']!r}") from None
        limit, why = card * frac, f"XLA_PYTHON_CLIENT_MEM_FRACTION={env['XLA_PYTHON_CLIENT_MEM_FRACTION']} of the card"
    else:
        limit, why = card * JAX_DEFAULT_MEM_FRACTION, (
            f"XLA_PYTHON_CLIENT_MEM_FRACTION unset: JAX's default {JAX_DEFAULT_MEM_FRACTION} of the card (the "
            f"launchers set 0.90: run the dry run under the same variable)")
    budget = limit * (1 - HEADROOM)
    return budget, (f"{budget:.2f} GiB per device = {card:g} GiB (plan.device_memory_gib) x "
                    f"{limit / card:.2f} ({why}) - {HEADROOM:.0%} headroom")


def missing_inputs(cfg: mlc.ConfigDict) -> list[str]:
    """Every data and weights path the run will read that is not on this machine (one line each)."""
    from turnsight_jax.sources import get_source

    problems = []
    d = cfg.data
    for key, path, source_key, source in (("data.path", d.path, "data.source", d.source),
                                          ("data.eval_path", d.eval_path, "data.eval_source", d.eval_source)):
        if get_source(source).needs_path:
            if not path:
                problems.append(f"{key}: not set ({source_key}={source!r} reads a file)")
            elif not pathlib.Path(path).exists():
                problems.append(f"{key}={path}: no such file")
    if not cfg.model.hf_path and not cfg.model.allow_random_init:
        problems.append(f"model.hf_path: not set (model.preset={cfg.model.preset!r} would start from random weights)")
    folders = [("model.hf_path", cfg.model.hf_path, "config.json"),
               ("tokenizer_path", cfg.tokenizer_path, "tokenizer.json")]
    if cfg.teacher.weights == "external" and cfg.teacher.checkpoint not in ("", "warm_start"):
        folders.append(("teacher.checkpoint", cfg.teacher.checkpoint, "config.json"))
    for key, path, needed in folders:
        if path and not (pathlib.Path(path) / needed).is_file():
            problems.append(f"{key}={path}: not a Hugging Face folder here (no {needed})")
    return problems


def dry_run(cfg: mlc.ConfigDict) -> dict:
    log(f"dry run: compiling the train step for {jax.device_count()} {jax.devices()[0].platform} device(s) "
                "on abstract parameters (nothing is allocated)")
    compiled, geo, secs, mesh, step_cfg, sizes = compile_step(cfg)
    mem = compiled.memory_analysis()
    gib = 1024**3
    fields = {
        "arguments (params, optimizer, reference, batch, teacher, critic / PRM)": mem.argument_size_in_bytes,
        "outputs": mem.output_size_in_bytes,
        "aliased (donated) outputs": mem.alias_size_in_bytes,
        "temporaries (activations, logits chunks)": mem.temp_size_in_bytes,
    }
    peak = mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes + mem.temp_size_in_bytes
    budget, budget_why = memory_budget(cfg)
    print(f"\n## Memory plan: {cfg.name} on mesh {dict(mesh.shape)} (compiled in {secs:.0f}s)")
    print(f"geometry per step: B={geo.batch} trajectories, T={geo.length}, policy tokens/row N={geo.policy}, "
          f"packed teacher row P={geo.packed}, distinct teacher rows U={geo.distinct}; micro-batches "
          f"{step_cfg.micro_batches} (student), {step_cfg.teacher_micro_batches} (teacher); remat={cfg.model.remat}; "
          f"attention query chunk {cfg.model.attn_q_chunk}; log-prob chunk {cfg.train.logprob_chunk} "
          f"(no-gradient forwards: {step_cfg.scoring_chunk})"
          + (f"; packed rows (train.pack_rows) planned at their worst, every trajectory T long: "
             f"{geo.pack_student[0]} row(s) of {geo.pack_student[1]} per {geo.pack_cell} trajectories (student), "
             f"{geo.pack_teacher[0]} of {geo.pack_teacher[1]} (teacher)" if geo.pack_cell is not None else "")
          + (f"; micro-batches in {len(geo.micro_groups)} length groups (train.micro_batch_groups: "
             f"{'/'.join(map(str, geo.micro_groups))} micro-batches), each planned at its worst, T and P wide"
             if geo.micro_groups is not None else ""))
    print("| per device | GiB |\n|---|---|")
    for k, v in fields.items():
        print(f"| {k} | {v / gib:.2f} |")
    print(f"| **peak estimate** (args + outputs - aliased + temporaries) | **{peak / gib:.2f}** |")
    fits = peak / gib <= budget
    print(f"\nbudget: {budget_why}")
    print(f"{'fits' if fits else 'does NOT fit'}: peak {peak / gib:.2f} GiB, headroom {budget - peak / gib:+.2f} GiB"
          + ("" if fits else "; to fit: more train.micro_batches / train.teacher_micro_batches, model.remat=True, "
                             "a larger mesh.fsdp, or a larger XLA_PYTHON_CLIENT_MEM_FRACTION (the launchers' "
                             "--mem-fraction)"))
    print(f"train step: peak {peak / gib:.2f} GiB per device")
    keep = cfg.checkpoint.keep
    ckpt = sum(v for k, v in sizes.items() if k != "param count")
    print(f"\n## Disk and host memory\ncheckpoint: {ckpt / gib:.2f} GiB per step ("
          + ", ".join(f"{k} {v / gib:.2f}" for k, v in sizes.items() if k != "param count")
          + f"), x checkpoint.keep={keep}: {keep * ckpt / gib:.2f} GiB on disk (+ one step being written)")
    n = sizes["param count"]
    host = n * 2 + sizes["params"]
    print(f"host RAM to load the weights: about {host / gib:.2f} GiB per process ({n / 1e9:.2f} B parameters: the "
          f"bf16 safetensors, {n * 2 / gib:.2f} GiB, and one host copy in {cfg.model.param_dtype}, "
          f"{sizes['params'] / gib:.2f} GiB)")
    out = {"peak_gib": peak / gib, "fits": fits, "budget_gib": budget, "headroom_gib": budget - peak / gib,
           "compile_s": secs, "checkpoint_gib": ckpt / gib, "host_load_gib": host / gib,
           **{k: v / gib for k, v in fields.items()}}
    if cfg.rollout.engine == "paged":
        out["rollout"] = rollout_plan(cfg, budget, budget_why)
    out["missing_inputs"] = missing_inputs(cfg)
    if out["missing_inputs"]:
        print("\n## Inputs the run would refuse\n" + "\n".join(f"- {p}" for p in out["missing_inputs"]))
    return out


def _per_device_bytes(tree) -> int:
    """Bytes one device holds of abstract arrays with shardings (the largest shard of each)."""
    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
        total += math.prod(shape) * jnp.dtype(x.dtype).itemsize
    return total


def rollout_plan(cfg: mlc.ConfigDict, budget: float | None = None, budget_why: str = "") -> dict:
    """Per-device memory while the paged engine decodes, printed as a table and one line, against
    `budget` GiB (memory_budget's; None: computed here)."""
    if budget is None:
        budget, budget_why = memory_budget(cfg)
    from turnsight_jax.config import engine_config, rollout_config
    from turnsight_jax.models.paged_cache import (LiveBlocks, PagedKV, bytes_per_token, pool_shape, pool_spec,
                                                  storage_dtype)
    from turnsight_jax.rollout import engine as eng_lib
    from turnsight_jax.rollout.sampler import SamplingParams, pow2_bucket

    ecfg, rc = engine_config(cfg), rollout_config(cfg)
    mesh = make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
    qcfg = model_setup.model_config(cfg)
    opts = model_setup.runtime_options(cfg)
    pdtype, cdtype = model_setup.DTYPES[cfg.model.param_dtype], model_setup.DTYPES[cfg.model.compute_dtype]
    abstract = nnx.eval_shape(lambda: Qwen3(qcfg, rngs=nnx.Rngs(0), param_dtype=pdtype, options=opts))
    graphdef, params = nnx.split(abstract)
    params = _with_shardings(params, state_shardings(params, mesh))
    rdtype = model_setup.DTYPES[cfg.model.ref_dtype]
    ref = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, rdtype, sharding=x.sharding), params)
    step_cfg, method = validate(cfg, jax.device_count(), check_data=False)
    opt = jax.eval_shape(make_optimizer(step_cfg.optim).init, params)
    opt = _with_shardings(opt, opt_state_shardings(opt, mesh))
    decode = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, cdtype, sharding=x.sharding), params)
    shards = math.prod(mesh.shape[a] for a in ("data", "fsdp"))
    per_shard = -(-ecfg.slots // shards)
    context = rc.max_response_tokens + method.rollout.planned_extra(cfg)[0]  # an episode's slots after its prompt
    blocks = ecfg.pool_blocks or eng_lib.default_pool_blocks(per_shard, rc.max_prompt_tokens, context, ecfg.block_size)
    if method.rollout.plan_pool_blocks is not None:  # a controller whose engine needs more (APPO's kept rollouts)
        blocks = method.rollout.plan_pool_blocks(ecfg, rc, cfg, shards)
    shape = pool_shape(qcfg, shards, blocks, ecfg.block_size)
    kv_sharding = NamedSharding(mesh, pool_spec(shape, mesh))
    kv = PagedKV(*(jax.ShapeDtypeStruct(shape, storage_dtype(cdtype), sharding=kv_sharding) for _ in range(2)),
                 jnp.dtype(cdtype).name)
    rows = shards * per_shard
    table_width = pow2_bucket(-(-(rc.max_prompt_tokens + context) // ecfg.block_size) + 1)
    listed = per_shard * (-(-(rc.max_prompt_tokens + context) // ecfg.block_size))
    row = lambda shp, dt: jax.ShapeDtypeStruct(shp, dt, sharding=NamedSharding(  # noqa: E731
        mesh, P(("data", "fsdp"), *([None] * (len(shp) - 1)))))
    i32 = jnp.int32
    # the widest program: every slot decoding at the longest context reads every listed block
    live = LiveBlocks(row((shards, listed), i32), row((shards, listed), i32), row((shards, listed), i32),
                      row((shards, per_shard), i32))
    steps = ecfg.decode_chunk
    keys = jax.eval_shape(lambda: jax.vmap(jax.random.key)(jnp.zeros((rows,), jnp.uint32)))
    t0 = time.perf_counter()
    with jax.set_mesh(mesh):
        compiled = eng_lib._decode.lower(
            graphdef, decode, kv, row((rows, qcfg.hidden_size), cdtype), row((rows, table_width), i32), live,
            row((rows,), i32), row((rows,), i32), keys, row((rows,), i32), jax.ShapeDtypeStruct((2,), i32),
            row((rows, steps), i32), steps=steps, params=SamplingParams()).compile()
    secs = time.perf_counter() - t0
    temps = compiled.memory_analysis().temp_size_in_bytes
    gib = 1024**3
    _, teacher = abstract_teacher(cfg, step_cfg, method, qcfg, params, mesh)
    resident = _per_device_bytes(params) + _per_device_bytes(opt) + _per_device_bytes(ref)
    resident += 0 if teacher is None else _per_device_bytes(teacher)
    aux = abstract_aux(step_cfg, method, qcfg, params, mesh)
    resident += 0 if aux is None else _per_device_bytes(aux)
    previous = method.rollout.old_policy_kind(cfg) == "previous"  # a controller's copy of the last policy
    resident += _per_device_bytes(params) if previous else 0
    copy = 0 if pdtype == cdtype else _per_device_bytes(decode)
    pool = _per_device_bytes(kv)
    peak = resident + copy + pool + temps
    tokens_per_device = (blocks - 1) * ecfg.block_size
    print(f"\n## Rollout plan: paged engine, {per_shard * shards} decode slots ({per_shard} per row shard, "
          f"{shards} row shards), blocks of {ecfg.block_size}, {blocks} blocks per device = "
          f"{tokens_per_device:,} KV slots ({bytes_per_token(qcfg, cdtype) // 1024} KiB per token in {cfg.model.compute_dtype}); "
          f"lengths: prompt <= {rc.max_prompt_tokens:,}, response <= {rc.max_response_tokens:,} (decode compiled in "
          f"{secs:.0f}s)")
    print("| per device | GiB |\n|---|---|")
    kept = ("params, optimizer, reference" + ("" if teacher is None else f", {step_cfg.teacher.weights} teacher")
            + ("" if aux is None else f", {' and '.join(method.aux)} with optimizer")
            + (", the policy before the last update" if previous else ""))
    for name, v in ((f"trainer state kept while rolling out ({kept})", resident),
                    (f"decode copy of the weights ({cfg.model.compute_dtype})", copy),
                    ("KV block pool", pool), ("decode temporaries (widest program)", temps)):
        print(f"| {name} | {v / gib:.2f} |")
    print(f"rollout plan: peak {peak / gib:.2f} GiB per device")
    fits = peak / gib <= budget
    print(f"{'fits' if fits else 'does NOT fit'} the budget ({budget_why}): headroom {budget - peak / gib:+.2f} GiB"
          + ("" if fits else "; to fit: fewer rollout.decode_slots or rollout.kv_pool_blocks, a larger mesh.fsdp, "
                             "or a larger XLA_PYTHON_CLIENT_MEM_FRACTION"))
    return {"peak_gib": peak / gib, "fits": fits, "budget_gib": budget, "slots": per_shard * shards, "pool_gib": pool / gib, "resident_gib": resident / gib,
            "decode_copy_gib": copy / gib, "temps_gib": temps / gib, "compile_s": secs}
