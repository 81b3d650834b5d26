"""`python -m turnsight_jax.train [--config FILE] [--config.key=value ...] [--workdir DIR] [--dry-run]`

With no config this runs the embedded default end to end on a CPU: a tiny Qwen3 with the real
Qwen3 tokenizer, a supervised warm-start on gold built-in trajectories, TurnSight RL on built-in
tasks, and held-out FTRL metrics before and after RL.

Per step: rollouts with the current policy (KV-cached sampler ⇄ isolated tool environments) ->
trajectory batch + packed hindsight views -> the fused, sharded train step -> metrics; held-out
evaluation and checkpoints on schedule and on SIGTERM; automatic resume from the latest finished
checkpoint; a Hugging Face export at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import shutil
import signal
import sys
import time

import jax
import jax.numpy as jnp
import ml_collections as mlc
import numpy as np
from flax import nnx

import turnsight_jax.methods  # noqa: F401  (the composition root: the built-in methods register themselves)
from turnsight_jax import (batch_shapes, checkpointing, cost, distributed, errors, flops, model_setup, provenance,
                           records, sources)
from turnsight_jax.checkpointing import Checkpointer, write_run_config, write_run_files
from turnsight_jax.config import (engine_config, fault_config, load_run_config, model_layer_name, rollout_config,
                                  sampling_params, second_stage, validate)
from turnsight_jax.envs import faults as faults_lib
from turnsight_jax.distributed import maybe_initialize_distributed
from turnsight_jax.errors import ConfigError, NonFiniteTraining
from turnsight_jax.eval.heldout import evaluate_policy, flat_ftrl
from turnsight_jax.models.sharding import make_mesh, opt_state_shardings
from turnsight_jax.models.weights import save_pretrained
from turnsight_jax.rl import turn_outcomes
from turnsight_jax.rl.batch import batch_row_order, make_train_batch, packed_reference, row_axis, shard_batch
from turnsight_jax.rl.methods import PROGRESS_METRICS, RolloutContext, TrainerHookStart, start_trainer_hooks
from turnsight_jax.rl.step import TURNSIGHT_METRICS, init_aux, make_aux_optimizers, make_optimizer, make_train_step
from turnsight_jax.rollout.progress import ProgressLine
from turnsight_jax.runlog import ConsoleLog, MetricsLog, Progress, log, matmul_peak_flops, write_from_signal_handler


def _z_score(mean: float, se: float) -> float:
    """Improvement in standard errors; 0 when nothing changed at all (mean and spread both 0)."""
    if se > 0:
        return mean / se
    return 0.0 if mean == 0 else math.copysign(math.inf, mean)


class _Preemption:
    """SIGTERM (a preemption) or SIGINT (Ctrl-C, a notebook's interrupt) sets a flag; the loop
    checkpoints after the current step and exits. A second Ctrl-C stops at once, without a
    checkpoint (the last one stays valid: a save is verified before it counts)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.requested = False
        self._old = {s: signal.signal(s, self._handle) for s in self.SIGNALS}

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if signum == signal.SIGINT and self.requested:
            raise KeyboardInterrupt(f"second {name}: stopped without a checkpoint of this step")
        # every process says it (a preemption may reach only one of them); the stop is agreed
        # after the step (`distributed.any_process`)
        who = f"process {jax.process_index()}: " if jax.process_count() > 1 else ""
        again = "; press Ctrl-C again to stop now, without it" if signum == signal.SIGINT else ""
        self.requested = True  # before the message, so a signal arriving while it is written sees it
        write_from_signal_handler(f"{who}received {name}: checkpointing after this step, then exiting{again}\n")

    def restore(self):
        for s, h in self._old.items():
            signal.signal(s, h)


_TRAJ_METRICS = ("solve_f1", "solve_p", "solve_r", "num_turns", "num_calls", "response_tokens", "tool_error_rate",
                 "truncated", "policy_tokens", "faulted_calls")


def _rollout_metrics(trajs, own_groups: bool = False) -> dict[str, float]:
    """Means over the step's trajectories in a group (the rows the method trains; not padding
    rows or a controller's exemplars), over every process's (each holds its own episodes): the
    per-trajectory values are all-gathered, so the numbers equal a one-process run's.
    own_groups (a controller that forms its own groups): also the groups' count and sizes."""
    table = np.array([[t.reward, t.group_id] + [t.metrics.get(k, np.nan) for k in _TRAJ_METRICS] for t in trajs],
                     np.float64)
    table = distributed.gather(table).reshape(-1, table.shape[1])
    groups = table[:, 1]
    table = np.delete(table, 1, axis=1)
    out = {}
    if own_groups:  # group ids are global (a process's are numbered from its first prompt)
        _, sizes = np.unique(groups[groups >= 0], return_counts=True)
        out.update({"rollout/groups": float(sizes.size), "rollout/rows_in_groups": float(sizes.sum()),
                    "rollout/group_size_mean": float(sizes.mean()) if sizes.size else 0.0,
                    "rollout/group_size_min": float(sizes.min()) if sizes.size else 0.0,
                    "rollout/group_size_max": float(sizes.max()) if sizes.size else 0.0})
    grouped = groups >= 0
    trajs = [t for t in trajs if t.group_id >= 0]
    table = table[grouped]
    out["rollout/reward_mean"] = float(np.mean(table[:, 0])) if len(table) else 0.0
    for j, k in enumerate(_TRAJ_METRICS, start=1):
        vals = table[:, j][~np.isnan(table[:, j])]
        if vals.size:
            out[f"rollout/{k}"] = float(np.mean(vals))
    calls = table[:, 1 + _TRAJ_METRICS.index("num_calls")]
    out["rollout/tool_calls"] = float(np.nansum(calls))  # executed over all processes
    if distributed.is_multiprocess():  # who ran what: each process's own episodes, in process order
        ends = np.cumsum(distributed.gather(len(trajs)))
        for p, (a, b) in enumerate(zip(np.concatenate([[0], ends[:-1]]), ends)):
            out[f"dist/episodes_p{p}"] = float(b - a)
            out[f"dist/tool_calls_p{p}"] = float(np.nansum(calls[a:b]))
    return out


def _local_batch(trajs, row_tasks, first, tok, step_cfg, method, cfg, history, row_shards, cost):
    """This process's batch rows (its episodes, groups numbered from `first`; `row_tasks`: each
    row's task, block i of step_cfg.rows_per_prompt rows task i's), padded to a shape every
    process agrees on, chosen by train.shapes (turnsight_jax.batch_shapes; `history`: the shapes
    used so far, updated). cost(batch, stats): the batch's executed update FLOPs. Returns (batch,
    stats, the shape in use)."""
    def build(floors):
        return make_train_batch(trajs, row_tasks, tok, step_cfg, method, min_shapes=floors, group_offset=first,
                                row_shards=row_shards, processes=jax.process_count())

    return batch_shapes.choose_batch(build, cost, history)


VIEW_TOKEN_KINDS = ("view_tokens_trajectory", "view_tokens_blocks", "view_tokens_turn_copies")  # rl.views


def _write_records(workdir, step, trajs, row_tasks, batch, host, step_cfg, method, cfg, mesh, rows) -> None:
    """This process's trajectory records of `step` (turnsight_jax.records): the step's per-turn
    arrays (`host`: fetched, all-gathered across processes), this process's rows written to its
    own file."""
    start, stop = distributed.process_rows(mesh, rows) if distributed.is_multiprocess() else (0, rows)
    lines = records.build_step_records(
        step, trajs, row_tasks, batch, host, method, step_cfg, rows=range(start, stop),
        order=batch_row_order(trajs, step_cfg, local_row_shards(mesh)), text_chars=cfg.log.records_text_chars,
        max_bytes=cfg.log.records_max_kib * 1024, process=jax.process_index())
    records.write_records(records.records_path(workdir, step, jax.process_index()), lines)


def _update_flops(qcfg, batch, bstats, step_cfg, method, cfg, mesh, teacher_cfg=None) -> flops.UpdateFlops:
    """The update's FLOPs (turnsight_jax.flops) for this process's rows, as the step runs them."""
    one_update = step_cfg.mini_batches * step_cfg.ppo_epochs == 1
    trainer_old = (not step_cfg.algo.student_sees_observations) or step_cfg.loss.tis_threshold is not None
    return flops.update_flops(
        qcfg, batch, updates=step_cfg.ppo_epochs, extra_forwards=int(trainer_old and not one_update),
        ref_forward=method.needs_ref and not packed_reference(step_cfg, method), q_chunk=cfg.model.attn_q_chunk,
        remat=cfg.model.remat, teacher_distinct_rows=bstats.get("teacher_distinct_rows"),
        logprob_chunk=step_cfg.logprob_chunk, score_chunk=step_cfg.scoring_chunk, micro_batches=step_cfg.micro_batches,
        mini_batches=step_cfg.mini_batches, teacher_micro_batches=step_cfg.teacher_micro_batches,
        row_shards=local_row_shards(mesh), teacher_cfg=teacher_cfg, critic=method.uses("critic"), prm=method.uses("prm"),
        row_group=cfg.model.attn_row_group, key_block=cfg.model.attn_key_block,
        fused_block=cfg.model.attn_block if cfg.model.attn_impl != "xla" else 0)


def _new_aux(method, params, qcfg, optimizers, mesh) -> dict:
    """rl.step.init_aux on the mesh: a trunk and its moments sharded like the policy's, heads
    replicated (models.sharding.opt_state_shardings)."""
    with jax.set_mesh(mesh):
        state = init_aux(method, params, qcfg.hidden_size, optimizers)
    return jax.device_put(state, opt_state_shardings(state, mesh))


def fit_row_group(cfg: mlc.ConfigDict, mesh) -> str | None:
    """Turn model.attn_row_group off (and say so) on a mesh that shards the rows: the row groups run
    one after another along the row axis (models.attention.chunked_attention), so on sharded rows
    every group would be gathered across devices."""
    shards = mesh.shape["data"] * mesh.shape["fsdp"]
    if cfg.model.attn_row_group <= 0 or shards == 1:
        return None
    note = (f"model.attn_row_group={cfg.model.attn_row_group} is for unsharded rows; this mesh shards the rows "
            f"{shards} ways: attention runs without skipping the padding (attn_row_group=0)")
    cfg.model.attn_row_group = 0
    return note


def local_row_shards(mesh) -> int:
    """This process's share of the mesh's row shards (data x fsdp)."""
    return max(1, mesh.shape["data"] * mesh.shape["fsdp"] // jax.process_count())


def _eval_progress(cfg, n_tasks: int, *, greedy: bool = False) -> ProgressLine:
    """The held-out evaluation's throttled stderr line (silent with log.progress=False)."""
    samples = 1 if greedy or cfg.eval.temperature <= 0 else int(cfg.eval.samples)
    return ProgressLine(n_tasks * samples, label="held-out" + (" greedy" if greedy else ""),
                        quiet=not cfg.log.progress or jax.process_index() != 0)


def _evaluate(graphdef, params, tok, tasks, cfg, env) -> dict:
    """The configured held-out evaluation; when it samples, the greedy one too (under "greedy")."""
    out = evaluate_policy(graphdef, params, tok, tasks, cfg, env, progress=_eval_progress(cfg, len(tasks)))
    if out["mode"] != "greedy":
        greedy = evaluate_policy(graphdef, params, tok, tasks, cfg, env, greedy=True,
                                 progress=_eval_progress(cfg, len(tasks), greedy=True))
        out["greedy"] = {k: v for k, v in greedy.items() if k != "per_task_solve_f1"}
    return out


def _describe(ev: dict) -> str:
    """The paper's FTRL Avg and category-averaged Solve-F1, then the task-pooled Solve-F1 ± SE."""
    nan = float("nan")
    ftrl = ev.get("ftrl") or {"avg": nan, "average": {}}
    text = (f"FTRL Avg {ftrl['avg']:.3f}, Solve-F1 {ftrl['average'].get('solve_f1', nan):.3f} (category average); "
            f"task-mean Solve-F1 {ev.get('task_mean_solve_f1', nan):.3f} ± {ev.get('task_mean_solve_f1_se', 0):.3f} "
            f"({ev['mode']})")
    if "greedy" in ev:
        text += f", greedy FTRL Avg {(ev['greedy'].get('ftrl') or {'avg': nan})['avg']:.3f}"
    return text


def train(cfg: mlc.ConfigDict, workdir: pathlib.Path, *, allow_config_change: bool = False) -> dict:
    """Runs training in `workdir`, holding its lock (`checkpointing.WorkdirLock`, taken once the
    inputs are checked and before the folder is written; released however the run ends). A
    workdir that already holds a run is resumed only under the same config, up to the changes
    `turnsight_jax.provenance` calls harmless (`allow_config_change`: any change, recorded)."""
    lock = checkpointing.WorkdirLock(workdir, log=log)
    console = ConsoleLog()
    try:
        return _train(cfg, pathlib.Path(workdir), lock, allow_config_change, console)
    finally:
        console.stop()
        lock.release()


def _lock_workdir(lock: checkpointing.WorkdirLock) -> None:
    """Process 0 takes the run folder's lock; every process stops when it could not."""
    refused = None
    if jax.process_index() == 0:
        try:
            lock.acquire()
        except (errors.WorkdirInUse, errors.CheckpointError) as e:
            refused = e
    if distributed.any_process(refused is not None):
        raise refused or errors.WorkdirInUse(f"{lock.workdir}: process 0 could not take the workdir lock (its "
                                             f"error names the holder)")


def _check_provenance(workdir: pathlib.Path, cfg: mlc.ConfigDict, allow_change: bool) -> None:
    """Process 0 compares the config with the run already in the folder (provenance.check_resume);
    every process stops when it refused."""
    refused = None
    if jax.process_index() == 0:
        try:
            provenance.check_resume(workdir, cfg, allow_change=allow_change, log=log)
        except ConfigError as e:
            refused = e
    if distributed.any_process(refused is not None):
        raise refused or ConfigError(f"{workdir}: process 0 refused the config change (its error names the keys)")


def _train(cfg: mlc.ConfigDict, workdir: pathlib.Path, lock: checkpointing.WorkdirLock,
           allow_config_change: bool = False, console: ConsoleLog | None = None) -> dict:
    step_cfg, method = validate(cfg, jax.device_count())
    log(method.describe())
    mesh = make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
    if note := fit_row_group(cfg, mesh):
        log(note)
    # several processes: a batch that cannot be split into whole groups per process fails now, not
    # after the warm-start
    distributed.rollout_share(mesh, cfg.train.prompts_per_step, step_cfg.rows_per_prompt)
    qcfg = model_setup.model_config(cfg)
    if not cfg.model.hf_path and not cfg.model.allow_random_init:
        raise ConfigError(f"model.preset={cfg.model.preset!r} would start from random weights: set "
                          f"--config.model.hf_path=/path/to/Qwen3 (a Hugging Face folder)")
    # Everything that can fail on bad input happens before the run folder is touched.
    tok, tokdir = model_setup.setup_tokenizer(cfg, qcfg.vocab_size)
    if mismatch := model_setup.architecture_mismatch(cfg, qcfg):
        log(f"warning: {mismatch}")
    train_tasks = sources.load_tasks(cfg, "train")
    eval_tasks = sources.load_tasks(cfg, "eval")
    if not train_tasks:
        raise ConfigError("no training tasks")
    log(f"{len(train_tasks)} training tasks, {len(eval_tasks)} held-out tasks; mesh {dict(mesh.shape)}; "
                f"{jax.device_count()} {jax.devices()[0].platform} device(s)")

    workdir.mkdir(parents=True, exist_ok=True)
    _lock_workdir(lock)  # before anything in the folder is written: one trainer per run folder
    _check_provenance(workdir, cfg, allow_config_change)  # a changed config never silently continues a run
    write_run_files(workdir, qcfg, tokdir)
    write_run_config(workdir, cfg)  # `python -m turnsight_jax.evaluate --checkpoint` reads it back
    if console is not None and jax.process_index() == 0:
        console.start(workdir / "train.log")  # the console's lines from here on, kept with the run
    start_path = cfg.model.hf_path or None
    if (cfg.sft.steps > 0 or cfg.sft.curriculum_steps > 0) and cfg.data.source == "builtin" and not cfg.model.hf_path:
        from turnsight_jax.sft import run_sft

        start_path = str(run_sft(cfg, workdir, mesh, tok, tokdir))
    model = model_setup.build_model(cfg, mesh, hf_path=start_path, seed=cfg.seed)
    graphdef, params = nnx.split(model)
    # The frozen initial policy: teacher and KL reference (optionally in a narrower dtype).
    ref_dtype = model_setup.DTYPES[cfg.model.ref_dtype]
    ref_params = jax.tree.map(lambda x: x.astype(ref_dtype) if x.dtype != ref_dtype else jnp.copy(x), params)
    optimizer = make_optimizer(step_cfg.optim)
    with jax.set_mesh(mesh):
        opt_state = jax.jit(optimizer.init, out_shardings=None)(params)
    # The teacher when it is neither the reference nor the current policy (teacher.weights):
    # an EMA of the policy (kept here, checkpointed) or an external Hugging Face model.
    tw = step_cfg.teacher.weights if method.uses_teacher else "reference"
    teacher_graphdef = teacher_params = teacher_qcfg = None
    if tw == "ema":
        teacher_params = jax.tree.map(jnp.copy, params)
    elif tw == "external":
        teacher_graphdef, teacher_params, teacher_qcfg = model_setup.external_teacher(cfg, mesh, qcfg, start_path)
        log(f"external teacher: {cfg.teacher.checkpoint} ({sum(x.size for x in jax.tree.leaves(teacher_params)):,} "
            f"parameters)")
    ema_fn = None
    if tw == "ema":
        decay = step_cfg.teacher.ema_decay
        ema_fn = jax.jit(lambda t, p: jax.tree.map(lambda a, b: (decay * a + (1.0 - decay) * b).astype(a.dtype), t, p),
                         donate_argnums=0)
    # The learned auxiliaries (rl.step.init_aux; rl.auxiliaries), each
    # with its own optimizer, checkpointed as its own item next to the policy.
    aux_opts = make_aux_optimizers(step_cfg, method)
    aux_state = _new_aux(method, params, qcfg, aux_opts, mesh) if method.aux else None
    for auxiliary in method.auxiliaries:
        if auxiliary.announce is not None:
            log(auxiliary.announce(step_cfg, qcfg))
    shardings = (params, opt_state) + ((aux_state,) if aux_state is not None else ())
    # the step then also returns the records' per-turn arrays (and with log.turn_records the
    # teacher's token log-probs: StepConfig.record_teacher)
    with_records = cfg.log.records_every > 0 or cfg.log.turn_records
    step_fn = make_train_step(graphdef, step_cfg, optimizer, method,
                              state_shardings=jax.tree.map(lambda x: x.sharding, shardings),
                              teacher_graphdef=teacher_graphdef, aux_optimizers=aux_opts, records=with_records)

    # A two-stage recipe (rl.switch_step / rl.switch_method: one method, then another): the
    # second stage's step compiles when it starts (same state; config.second_stage checks it).
    later = second_stage(cfg, step_cfg, method)
    stage_steps = {0: (step_cfg, method, step_fn)}
    if later is not None:
        log(f"from step {later.start + 1}: {later.method.describe()}")

    def stage(at: int):
        """(StepConfig, ResolvedMethod, step function) that step `at` (0-based) runs."""
        if later is None or at < later.start:
            return stage_steps[0]
        if 1 not in stage_steps:
            stage_steps[1] = (later.step_config, later.method, make_train_step(
                graphdef, later.step_config, optimizer, later.method,
                state_shardings=jax.tree.map(lambda x: x.sharding, shardings), teacher_graphdef=teacher_graphdef,
                aux_optimizers=aux_opts, records=with_records))
        return stage_steps[1]

    # A rollout controller that scores with the policy before the last update (its pi_old,
    # rl.methods.RolloutController.old_policy): a copy of the parameters kept before each update,
    # checkpointed, so a resumed run continues with it; None before the first update.
    old_kinds = {m.rollout.old_policy_kind(cfg) for m in ([method] + ([later.method] if later is not None else []))}
    previous = None
    latest = checkpointing.resume_step(workdir, log)  # the newest valid step; invalid newer ones moved aside
    ckpt = Checkpointer(workdir, keep=cfg.checkpoint.keep, log=log)
    start = 0
    resumed_meta: dict = {}
    if latest is not None:
        params, opt_state, meta = ckpt.restore(latest, params, opt_state)
        if tw == "ema":
            saved = ckpt.restore_teacher(latest, teacher_params)
            teacher_params = saved if saved is not None else jax.tree.map(jnp.copy, params)
        if aux_state is not None:
            fresh = None  # built only for an item the checkpoint lacks (an auxiliary may copy the whole trunk)
            for name in method.aux:
                saved = ckpt.restore_item(latest, name, aux_state[name])
                if saved is None:
                    log(f"checkpoint {latest} has no {name}: it starts afresh (from the restored policy)")
                    fresh = fresh or _new_aux(method, params, qcfg, aux_opts, mesh)
                aux_state[name] = fresh[name] if saved is None else saved
        if "previous" in old_kinds:
            previous = ckpt.restore_item(latest, "previous_policy", params)
        start = int(meta["next_step"])
        resumed_meta = meta
        log(f"resumed from {workdir}/checkpoints/{latest} (next step {start})")
    wandb_run = None  # runlog.WandbRun's settings when log.wandb
    if cfg.log.wandb:
        wandb_run = dict(project=cfg.log.wandb_project, mode=cfg.log.wandb_mode, name=workdir.name,
                         config=cfg.to_dict())
    mlog = MetricsLog(workdir, tensorboard=cfg.log.tensorboard, resume_step=start - 1 if latest is not None else -1,
                      wandb=wandb_run)
    records.clear_from(workdir, start, jax.process_index())  # the steps this run will redo, like their metrics
    optimizer_probe = cost.OptimizerProbe(optimizer)
    # Controllers with state across steps (rl.methods.TrainerHook, e.g. a library of skills audited
    # after steps): a resumed run continues with the files saved in its checkpoint.
    hooks = start_trainer_hooks(
        [method, later.method if later is not None else None],
        TrainerHookStart(cfg, tok, train_tasks, workdir, mesh, qcfg.vocab_size, log=log,
                         checkpoint_file=lambda name: ckpt.read_file(latest, name) if latest is not None else None))

    # The training rollouts' environment, with faults injected when faults.* asks (envs.faults);
    # the held-out evaluation runs on the clean one.
    # rollout.max_tool_output_chars: .get, a run folder's config.json written before the key has none
    cap = cfg.rollout.get("max_tool_output_chars", None)
    clean_env = sources.make_env(cfg.data.source, max_output_chars=cap)
    env = faults_lib.wrap(clean_env, fault_config(cfg))
    eval_env = (clean_env if cfg.data.eval_source == cfg.data.source
                else sources.make_env(cfg.data.eval_source, max_output_chars=cap))
    summary: dict = {}
    eval_before_path = workdir / "eval_before_rl.json"
    before_here = None  # the evaluation before RL, when this run computed it
    if eval_tasks and not eval_before_path.exists():
        t0 = time.perf_counter()
        before = before_here = _evaluate(graphdef, ref_params, tok, eval_tasks, cfg, eval_env)
        if jax.process_index() == 0:
            eval_before_path.write_text(json.dumps(before))
        log(f"held-out before RL: {_describe(before)} ({time.perf_counter() - t0:.0f}s)")

    import grain

    n_steps = cfg.train.steps
    per_step = cfg.train.prompts_per_step
    epochs = max(1, math.ceil(n_steps * per_step / len(train_tasks)) + 1)
    # The data position is the step index: batch s is ds[s], so resuming needs no iterator state.
    ds = grain.MapDataset.range(len(train_tasks)).shuffle(seed=cfg.seed).repeat(epochs).batch(per_step, drop_remainder=True)
    sampling = sampling_params(cfg)
    rc = rollout_config(cfg)
    engine_cfg = engine_config(cfg)
    peak = matmul_peak_flops() if jax.devices()[0].platform == "cpu" else None
    rollout_mesh = distributed.local_mesh(mesh)  # this process's devices (the whole mesh with one)
    progress = Progress(n_steps, start, cfg.log.progress)
    preempt = _Preemption()
    step = start
    # The shapes used so far (train.shapes: batch_shapes), saved with each checkpoint so a resumed
    # run pads its batches exactly as the uninterrupted one.
    history = batch_shapes.ShapeHistory.from_meta(resumed_meta, cfg.train.shapes, cfg.train.shape_reuse)
    fault_nan_steps = _fault_nan_steps()
    skipped_in_a_row = 0
    loop_done = False  # the metrics log stays open for the run's summary unless the loop ends the run
    try:
        for step in range(start, n_steps):
            t_step = time.perf_counter()
            tasks = [train_tasks[int(i)] for i in ds[step]]
            # Each process rolls out the prompts whose batch rows live on its devices (all of
            # them with one process), on its own devices with its own copy of the policy.
            step_cfg, method, step_fn = stage(step)
            first, share = distributed.rollout_share(mesh, len(tasks), step_cfg.rows_per_prompt)
            mine = tasks[first:first + share]
            # Paper-scale rollouts take minutes: a line every 30 s (none for a short step).
            line = ProgressLine(len(mine) * step_cfg.rows_per_prompt, label=f"step {step + 1} rollouts", every_s=30.0,
                                patient=True, quiet=not cfg.log.progress or jax.process_index() != 0)
            ctx = RolloutContext(graphdef, distributed.local_replica(params, mesh, rollout_mesh), tok, env, sampling,
                                 rc, cfg.train.group_size, cfg.rollout.prompts_per_chunk,
                                 model_setup.DTYPES[cfg.model.compute_dtype], line, engine=engine_cfg,
                                 mesh=rollout_mesh, group_offset=first, run_config=cfg, task_pool=train_tasks)
            hook = hooks.get(method.rollout.name)
            if hook is not None:  # what the controller reads (e.g. the skills it puts in the prompts)
                ctx = dataclasses.replace(ctx, state=hook.rollout_state())
            old_kind = method.rollout.old_policy_kind(cfg)
            if old_kind:
                old = previous if old_kind == "previous" else ref_params
                ctx = dataclasses.replace(ctx, old_params=None if old is None else
                                          distributed.local_replica(old, mesh, rollout_mesh))
            res = method.rollout.fn(ctx, mine, cfg.seed * 100_003 + step)
            if res.tasks is not None:  # the controller rolled out other prompts (MM-GRPO's refills)
                mine = list(res.tasks)
            distributed.settle()  # the rollout's local collectives end before the step's cross-process ones
            if len(res.trajectories) != len(mine) * step_cfg.rows_per_prompt:  # the batch's static row count
                raise ValueError(f"rollout controller {method.rollout.name!r} returned {len(res.trajectories)} "
                                 f"trajectories for {len(mine)} prompts; expected {step_cfg.rows_per_prompt} per "
                                 f"prompt (rl.methods.RolloutController)")
            t_roll = time.perf_counter() - t_step
            row_tasks = [t for t in mine for _ in range(step_cfg.rows_per_prompt)]  # block i: task i's rows
            batch, bstats, shapes = _local_batch(
                res.trajectories, row_tasks, first, tok, step_cfg, method, cfg, history, local_row_shards(mesh),
                lambda b, st: _update_flops(qcfg, b, st, step_cfg, method, cfg, mesh, teacher_qcfg).executed)
            work = _update_flops(qcfg, batch, bstats, step_cfg, method, cfg, mesh, teacher_qcfg)
            if step in fault_nan_steps:
                batch = _poison(batch)
            rows = len(tasks) * step_cfg.rows_per_prompt
            global_batch = (distributed.assemble_rows(batch, mesh, rows, row_axis) if distributed.is_multiprocess()
                            else shard_batch(batch, mesh))
            if "previous" in old_kinds:  # the update donates params: the copy is taken first
                previous = jax.tree.map(jnp.copy, params)
            t_step_fn = time.perf_counter()
            with jax.set_mesh(mesh):
                if aux_state is None:
                    params, opt_state, m = step_fn(params, opt_state, ref_params, global_batch, teacher_params)
                else:
                    params, opt_state, m, aux_state = step_fn(params, opt_state, ref_params, global_batch,
                                                              teacher_params, aux_state)
                if ema_fn is not None:
                    teacher_params = ema_fn(teacher_params, params)
                record_arrays = m.pop("records", None)  # fetched only on the steps that use them (below)
                m = jax.device_get(m)
            step_fn_s = time.perf_counter() - t_step_fn
            if m["skipped_updates"] > 0:
                skipped_in_a_row += 1
                log(f"step {step + 1}: non-finite loss or gradient, {int(m['skipped_updates'])} update(s) skipped "
                    f"({skipped_in_a_row} step(s) in a row; the run stops at train.max_skipped_steps="
                    f"{cfg.train.max_skipped_steps})")
            else:
                skipped_in_a_row = 0
            t_total = time.perf_counter() - t_step
            metrics = _rollout_metrics(res.trajectories, own_groups=bool(step_cfg.prompt_rows))
            metrics.update(res.metrics)  # the controller's own (already over every process)
            if step == start:  # once per process: the optimizer's share of the fused step (turnsight_jax.cost)
                with jax.set_mesh(mesh):
                    optimizer_probe.measure(params, opt_state)
            records_s = 0.0
            write_now = record_arrays is not None and records.due(step, cfg.log.records_every)
            host_records = None
            if record_arrays is not None and (write_now or cfg.log.turn_records):
                host_records = records.host_arrays(record_arrays)  # all-gathered: every process the global rows
            if write_now:
                t0 = time.perf_counter()
                _write_records(workdir, step, res.trajectories, row_tasks, batch, host_records, step_cfg, method, cfg,
                               mesh, rows)
                records_s = time.perf_counter() - t0
            if later is not None:  # which stage of a two-stage recipe ran (1, then 2)
                metrics["rl/stage"] = 1.0 + float(step >= later.start)
            for k, v in m.items():
                # a plug-in method's own diagnostics carry their prefix ("<method>/...", "teacher/...")
                metrics[k if "/" in k else ("turnsight/" if k in TURNSIGHT_METRICS else "train/") + k] = v
            # what each turn was (faults, tool outcome, dependency) and, when the step returned its
            # per-turn arrays, what it received (rl.turn_outcomes): the studies' metrics, and with
            # log.turn_records their per-step arrays
            lo = distributed.process_rows(mesh, rows)[0] if distributed.is_multiprocess() else 0
            outcomes = turn_outcomes.step_records(
                res.trajectories, row_tasks, host_records, batch_row_order(res.trajectories, step_cfg,
                                                                           local_row_shards(mesh)),
                step_cfg.max_turns, first_row=lo, depths=step_cfg.algo.depths,
                views=[f"depth {d}" for d in step_cfg.algo.depths] if method.teacher == "hindsight" else ["privileged"])
            sums = turn_outcomes.metric_sums(outcomes, step_cfg.algo.depths)
            summed = distributed.summed({f"{k}|{i}": v[i] for k, v in sums.items() for i in (0, 1)})
            metrics.update(turn_outcomes.ratios({k: (summed[f"{k}|0"], summed[f"{k}|1"]) for k in sums}))
            if cfg.log.turn_records:
                turn_outcomes.write(workdir, step + 1, outcomes, jax.process_index(), jax.process_count())
            if "hindsight_blocks" in bstats:  # the hindsight messages' length (rl.hindsight_budget: exactly it)
                hb = distributed.summed({k: bstats[k] for k in ("hindsight_blocks", "hindsight_block_tokens",
                                                                "hindsight_blocks_cut")})
                metrics["hindsight/block_tokens_mean"] = hb["hindsight_block_tokens"] / max(hb["hindsight_blocks"], 1.0)
                metrics["hindsight/blocks_cut_frac"] = hb["hindsight_blocks_cut"] / max(hb["hindsight_blocks"], 1.0)
            if "views_skipped" in bstats:  # privileged views without a block (e.g. no successful sibling)
                metrics["teacher/views_skipped"] = bstats["views_skipped"]
                metrics["teacher/views_built"] = bstats.get("views_built", 0.0)
            counts = distributed.summed({**{f"r.{k}": res.stats.get(k, 0.0) for k in ("tokens", "decoded_tokens", "env_errors",
                                                                            "episodes")},
                              **{f"b.{k}": bstats.get(k, 0.0) for k in ("trajectory_tokens", "view_tokens",
                                                                        "policy_tokens", *VIEW_TOKEN_KINDS)},
                              "f.rollout": flops.rollout_flops(qcfg, [t.length for t in res.trajectories],
                                                               res.stats.get("decoded_tokens", 0.0)),
                              **{f"f.{part}_{kind}": v for part, pair in work.parts.items()
                                 for kind, v in zip(("necessary", "executed"), pair)}})
            tokens = counts["r.tokens"] + counts["b.trajectory_tokens"] + counts["b.view_tokens"]
            update = {kind: sum(counts[f"f.{part}_{kind}"] for part in work.parts) for kind in ("necessary", "executed")}
            necessary = counts["f.rollout"] + update["necessary"]
            metrics.update({"perf/update_flops_necessary": update["necessary"],
                            "perf/update_flops_executed": update["executed"],
                            # executed / necessary FLOPs of the update: the padding it pays for
                            "perf/update_padding_ratio": update["executed"] / max(update["necessary"], 1.0),
                            # and per part (student, teacher, student_forward): where the padding is
                            **{f"perf/update_padding_ratio_{part}": counts[f"f.{part}_executed"]
                               / max(counts[f"f.{part}_necessary"], 1.0) for part in work.parts}})
            if "teacher" in work.parts:  # the teacher's forward (on its own architecture when external)
                metrics.update({"perf/teacher_flops_necessary": counts["f.teacher_necessary"],
                                "perf/teacher_flops_executed": counts["f.teacher_executed"],
                                "perf/teacher_flops_share": counts["f.teacher_necessary"] / max(update["necessary"], 1.0)})
            # the wall split (turnsight_jax.cost: measured, and the fused step's parts estimated)
            metrics.update({**cost.rollout_split(res.stats), "perf/batch_s": t_step_fn - t_step - t_roll,
                            "perf/step_fn_s": step_fn_s, "perf/records_s": records_s,
                            "perf/eval_s": 0.0, "perf/checkpoint_s": 0.0,  # set below when the step has them
                            **cost.step_fn_split(step_fn_s, {part: counts[f"f.{part}_executed"] for part in work.parts},
                                                 optimizer_probe.seconds, step_cfg.mini_batches * step_cfg.ppo_epochs),
                            **cost.memory_metrics(),
                            # tokens scored: the student's trajectories, the teacher's packed views by kind
                            "perf/student_tokens": counts["b.trajectory_tokens"],
                            **({f"perf/teacher_tokens_{k.removeprefix('view_tokens_')}": counts[f"b.{k}"]
                                for k in VIEW_TOKEN_KINDS} if "view_tokens" in bstats else {})})
            if optimizer_probe.seconds is not None:
                metrics["perf/optimizer_probe_s"] = optimizer_probe.seconds
            metrics.update({"perf/step_s": t_total, "perf/rollout_s": t_roll, "perf/update_s": t_total - t_roll,
                            "perf/tool_s": res.stats["tool_s"], "perf/tokens_per_s": tokens / t_total,
                            # the rollouts' own throughput: episodes and generated + observed tokens per second
                            "perf/rollout_episodes_per_s": counts["r.episodes"] / max(t_roll, 1e-9),
                            "perf/rollout_tokens_per_s": counts["r.tokens"] / max(t_roll, 1e-9),
                            # episodes an environment error ended (a raising step or scorer), a count
                            "rollout/env_errors": counts["r.env_errors"],
                            # what the controller sampled (every round and extra group included):
                            # episodes, their tokens after the prompt, the policy tokens decoded
                            "rollout/episodes": counts["r.episodes"],
                            "rollout/episode_tokens": counts["r.tokens"],
                            "rollout/decoded_tokens": counts["r.decoded_tokens"],
                            "perf/compilations": res.stats.get("compilations", 0.0),
                            "perf/step_compilations": float(step_fn._cache_size()),  # programs compiled so far
                            **{f"shape/{k}": float(v) for k, v in shapes.items()},
                            "perf/view_overhead": counts["b.view_tokens"] / max(counts["b.trajectory_tokens"], 1.0)
                            if "view_tokens" in bstats else 0.0})
            if "engine/decode_slot_steps" in res.stats:  # the paged engine's occupancy and memory
                st = res.stats
                metrics["rollout/slot_occupancy"] = st["engine/decode_row_steps"] / max(st["engine/decode_slot_steps"], 1)
                metrics["rollout/kv_in_use_gib_peak"] = st["engine/kv_in_use_bytes_peak_per_shard"] / 2**30
                metrics["rollout/prefill_tokens"] = st.get("engine/prefill_tokens", 0.0)
            if peak:
                metrics["perf/mfu_vs_measured_matmul"] = necessary / t_total / peak
            if hook is not None:  # the hook's own work after the step (e.g. audits)
                metrics.update(hook.after_step(step, graphdef, params, env))
            if cfg.eval.every and (step + 1) % cfg.eval.every == 0 and step + 1 < n_steps and eval_tasks:
                t0 = time.perf_counter()
                ev = evaluate_policy(graphdef, params, tok, eval_tasks, cfg, eval_env,
                                     progress=_eval_progress(cfg, len(eval_tasks)))
                metrics.update({f"eval/{k}": v for k, v in {**ev, **flat_ftrl(ev)}.items() if isinstance(v, float)})
                metrics["perf/eval_s"] = time.perf_counter() - t0
            mlog.write(step, metrics)
            progress.update(step, {"reward": metrics["rollout/reward_mean"],
                                   "solve_f1": metrics.get("rollout/solve_f1", float("nan")),
                                   **{label: float(metrics[key]) for key, label in PROGRESS_METRICS.items()
                                      if key in metrics}})
            if skipped_in_a_row >= cfg.train.max_skipped_steps:
                raise NonFiniteTraining(
                    f"{skipped_in_a_row} steps in a row (to step {step + 1}) had a non-finite loss or gradient; "
                    f"stopped with the last checkpoint ({ckpt.latest_step() or 'none'}) intact")
            last = step + 1 == n_steps
            # every process stops after the same step (a signal reaches one of them): the save
            # and the exit are collective
            stop = distributed.any_process(preempt.requested)
            if stop or (cfg.checkpoint.every and (step + 1) % cfg.checkpoint.every == 0) or last:
                if not bool(_all_finite(params)) or (aux_state is not None and not bool(_all_finite(aux_state))):  # never rotate good checkpoints out for a NaN one
                    raise NonFiniteTraining(f"parameters are not finite after step {step + 1}; not checkpointed "
                                            f"(last checkpoint: {ckpt.latest_step() or 'none'})")
                t0 = time.perf_counter()
                ckpt.save(step + 1, params, opt_state, {"next_step": step + 1, "seed": cfg.seed,
                                                        "data_position": step + 1, **history.to_meta()},
                          teacher=teacher_params if tw == "ema" else None,
                          aux={**(aux_state or {}), **({"previous_policy": previous} if previous is not None else {})}
                          or None,
                          files={k: v for h in hooks.values() for k, v in h.checkpoint_files().items()} or None)
                # the step's line is written before its checkpoint (a resume keeps every line up to
                # it): the save's time is added to that line afterwards
                mlog.amend(step, {"perf/checkpoint_s": time.perf_counter() - t0})
            if stop:
                log(f"stopped after step {step + 1} (checkpoint {step + 1} written by all processes); rerun "
                    f"the same command to resume" if jax.process_count() > 1 else
                    f"stopped after step {step + 1}; rerun the same command to resume")
                return {"preempted_at": step + 1}
        loop_done = True
    except BaseException:
        mlog.close(exit_code=1)
        raise
    finally:
        preempt.restore()
        if not loop_done:
            mlog.close()  # a preemption's stop (after an error: already closed, a no-op)
    try:  # the held-out evaluation after RL, against the one before it
        if eval_tasks:
            if n_steps == 0 and latest is None and before_here is not None:
                # No RL step and nothing restored: the policy is the one just evaluated, and the
                # evaluation's seeds are fixed (cfg.seed), so a second pass would repeat it exactly.
                # (Every process takes the same branch: each computed `before_here` itself.)
                after = before_here
                log("held-out after RL: no RL step ran (train.steps=0), so it is the evaluation before RL")
            else:
                after = _evaluate(graphdef, params, tok, eval_tasks, cfg, eval_env)
            before = json.loads(eval_before_path.read_text()) if eval_before_path.exists() else None
            summary["eval_after_rl"] = after
            if before:
                summary["eval_before_rl"] = before
                diff = np.array(after["per_task_solve_f1"]) - np.array(before["per_task_solve_f1"])
                se = float(diff.std(ddof=1) / math.sqrt(len(diff))) if len(diff) > 1 else float("nan")
                summary["improvement"] = {"metric": "task_mean_solve_f1", "mean": float(diff.mean()), "paired_se": se,
                                          "z": _z_score(float(diff.mean()), se)}
                log(f"held-out: after warm-start {_describe(before)} -> after RL {_describe(after)}")
                log(f"held-out task-mean Solve-F1: paired difference {diff.mean():+.3f} ± {se:.3f} "
                    f"({_z_score(float(diff.mean()), se):.1f} SE)")
            if jax.process_index() == 0:
                (workdir / "summary.json").write_text(json.dumps(summary, indent=2))
    except BaseException:
        mlog.close(exit_code=1)
        raise
    mlog.close(summary=summary)
    if cfg.checkpoint.export_at_end:
        export(graphdef, params, workdir / "export", workdir / "tokenizer", cfg)
    ckpt.close()
    env.close()  # closes clean_env too when it wraps it
    if eval_env is not clean_env:
        eval_env.close()
    return summary


def export(graphdef, params, out: pathlib.Path, tokdir: pathlib.Path,
           cfg: mlc.ConfigDict | None = None) -> pathlib.Path:
    """The trained policy as a Hugging Face folder (safetensors + config + tokenizer), with the
    run's config as `turnsight_run.json` (checkpointing.EXPORT_RUN_CONFIG) so that
    `python -m turnsight_jax.evaluate --hf EXPORT` evaluates it as the run did: its rollout
    settings and its own held-out tasks (other Hugging Face tools ignore the file)."""
    save_pretrained(nnx.merge(graphdef, params), out)
    if jax.process_index() == 0:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            if (tokdir / name).is_file():
                shutil.copyfile(tokdir / name, out / name)
        if cfg is not None:
            (out / checkpointing.EXPORT_RUN_CONFIG).write_text(cfg.to_json(indent=2) + "\n")
    log(f"exported Hugging Face folder {out}")
    return out


def _fault_nan_steps() -> frozenset[int]:
    """Fault injection for tests: `TURNSIGHT_FAULT_NAN_STEPS=2,3` poisons the batches of RL steps
    2 and 3 (0-based), so their loss and gradient are NaN."""
    raw = os.environ.get("TURNSIGHT_FAULT_NAN_STEPS", "").strip()
    try:
        return frozenset(int(x) for x in raw.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"TURNSIGHT_FAULT_NAN_STEPS must be comma-separated step numbers, got {raw!r}") from None


@jax.jit
def _all_finite(tree) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def _poison(batch):
    """The batch with one NaN old log-prob (a valid policy token): every loss and gradient is NaN."""
    old = np.array(batch.old_logprobs, copy=True)
    old[tuple(np.argwhere(np.asarray(batch.pol_valid))[0])] = np.nan
    return batch.replace(old_logprobs=old)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m turnsight_jax.train", description=__doc__.split("\n\n")[1],
                                 epilog="Overrides: --config.<key>=<value>, e.g. --config.rl.lam=0.3")
    ap.add_argument("--config", default=None, help="a configs/*.py file (default: the embedded tiny CPU config)")
    ap.add_argument("--workdir", default=None, help="run folder (default: runs/<config name>)")
    ap.add_argument("--allow-config-change", "--allow_config_change", dest="allow_config_change",
                    action="store_true",
                    help="resume a run folder whose config differs in keys that change results (recorded in "
                         "its config_history.jsonl); without it such a re-run exits 2 naming the keys")
    # hyphenated flags, as every other CLI and the launchers; the underscore spellings stay as aliases
    ap.add_argument("--dry-run", "--dry_run", dest="dry_run", action="store_true",
                    help="compile the train step on abstract parameters and print its memory plan; allocate nothing")
    ap.add_argument("--fake-devices", "--fake_devices", dest="fake_devices", type=int, default=0,
                    help="with --dry-run on a CPU: pretend to have N devices (sets XLA's host device count)")
    args, rest = ap.parse_known_args(argv)
    if args.fake_devices:
        import os

        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={args.fake_devices}")
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    maybe_initialize_distributed()
    try:
        if args.workdir and pathlib.Path(args.workdir).exists() and not pathlib.Path(args.workdir).is_dir():
            raise ConfigError(f"--workdir {args.workdir} is a file, not a run folder: name a new or existing folder")
        cfg = load_run_config(args.config, rest)
        if jax.process_index() == 0:
            source = args.config or "embedded default"
            layer = model_layer_name(cfg)
            print(f"# resolved config ({source}{'; model layer ' + layer if layer else ''})\n{cfg}", file=sys.stderr)
        if args.dry_run:
            from turnsight_jax.rl.plan import dry_run  # compiles for abstract devices only

            plan = dry_run(cfg)
            over = [name for name, p in (("train step", plan), ("rollout", plan.get("rollout"))) if p and not p["fits"]]
            if over:  # exit non-zero so that a launch script can gate on the plan
                if plan["missing_inputs"]:
                    print(f"warning: on this machine the run would also refuse {len(plan['missing_inputs'])} "
                          f"input(s): {'; '.join(plan['missing_inputs'])}", file=sys.stderr)
                print(f"error: the {' and the '.join(over)} plan does not fit the budget of {plan['budget_gib']:.2f} "
                      f"GiB per device (plan.device_memory_gib = {cfg.plan.device_memory_gib} and the allocator's "
                      f"share, above)", file=sys.stderr)
                return 1
            if plan["missing_inputs"]:  # the plan holds; the run itself would stop at these
                print(f"warning: on this machine the run would refuse {len(plan['missing_inputs'])} input(s): "
                      f"{'; '.join(plan['missing_inputs'])}", file=sys.stderr)
            return 0
        workdir = pathlib.Path(args.workdir or f"runs/{cfg.name}")
        train(cfg, workdir, allow_config_change=args.allow_config_change)
    except (ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:  # dataset rows, checkpoint files: the message names file/row/key
        print(f"error: {e}", file=sys.stderr)
        return 2
    except errors.WorkdirInUse as e:  # another trainer holds the run folder: one line naming it
        print(f"error: {e}", file=sys.stderr)
        return 2
    except NonFiniteTraining as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:  # Ctrl-C outside the RL loop, or a second one inside it
        print(f"error: interrupted ({e or 'Ctrl-C'}); every finished checkpoint is intact: rerun the same command "
              f"to resume", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
