"""Step auxiliaries: what a method adds to the fused step beside the policy (docs/adding_an_algorithm.md).

An auxiliary is a small piece of the step a method brings with it, registered by name, that the
step (rl.step) loops over without knowing what it is: PPO's critic (methods.critic), PiCA's
step-PRM (methods.prm), Orchard's retrospective teacher (methods.orchard). Each may

* compute arrays **before the advantage** (`before_advantage`), no gradient to the policy: arrays
  the estimator reads ("values", "process_rewards") or a loss term reads ("rise_mask"), both named
  in `provides`; a learned auxiliary may also update its own state here (the PRM's head);
* compute per-row arrays **after the advantage** (`after_advantage`, from the estimator's outputs,
  e.g. the critic's returns), which its loss reads;
* add a **loss** to the policy's (`loss`): a per-token loss [B, N] whose gradient reaches only the
  auxiliary's own parameters (the critic's clipped value loss), accumulated over the same
  micro-batches as the policy's and followed by the auxiliary's own optimizer update.

An auxiliary may also bring **rows of its own** to the batch (`batch_rows`, built on the host
with the batch: Orchard's probe rows), which the step hands its stages as
`batch.aux_rows[name]`, with what the dry-run's memory plan needs to lay them out at the worst
case (`plan_width`, `abstract_rows`).

A *learned* auxiliary (`init` set) carries a state {"params", "opt_state"} across steps: the step's
`aux[name]`, its own checkpoint item, trained by the optimizer `optim(step_cfg)` configures. A
method lists the learned auxiliaries it trains (`Method.auxiliaries`); an auxiliary that only
provides loss-term arrays runs whenever a loss term reads one of them.

Every function runs inside the jitted step; `StageInputs` is what it may read.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple


@dataclasses.dataclass(frozen=True)
class StageInputs:
    """What an auxiliary's stage reads inside the step: the policy's `graphdef` (the critic's
    trunk has the same), the `StepConfig`, the step's `batch` (rl.batch.TrainBatch), the frozen
    reference model and the teacher model (teacher.weights), both merged; and the step's two ways
    of running a no-gradient pass over the rows (rl.micro_batches), so a stage's memory follows
    the run's micro-batching:

    student_pass(fn) -> fn over the student's rows (the batch without views or signals), in the
        gradient passes' micro-batches (train.micro_batches, micro-batch groups), merged back;
    teacher_pass(fn, rows=None) -> fn over `rows` (rows first; default the student's rows), in
        the teacher's micro-batches (teacher.micro_batches), every output leaf merged back."""

    graphdef: Any
    cfg: Any
    batch: Any
    ref_model: Any
    teacher_model: Any
    student_pass: Callable[[Callable], Any]
    teacher_pass: Callable[..., Any]


class StageOut(NamedTuple):
    """What `before_advantage` gives: `arrays` ({name in `provides`: [B, N] array}, no gradient),
    `metrics` (scalars, reported as they are named), the learned auxiliary's `state` when the
    stage updated it (else None: unchanged), and a `carry` its `after_advantage` receives."""

    arrays: dict
    metrics: dict
    state: Any = None
    carry: Any = None


@dataclasses.dataclass(frozen=True)
class RowsRequest:
    """What an auxiliary's `batch_rows` gets from rl.batch.make_train_batch: the trajectories and
    their tasks (row order), the tokenizer, the StepConfig, the packed-row buckets and the floor
    of its rows' width (batch_shapes: a width an earlier step compiled for)."""

    trajs: Any
    tasks: Any
    tokenizer: Any
    cfg: Any
    buckets: Any
    min_width: int = 0


@dataclasses.dataclass(frozen=True)
class StepAuxiliary:
    """A registered step auxiliary (module docstring).

    name: its key in the step's `aux` and the checkpoint, and the prefix of its loss metrics.
    provides: the arrays `before_advantage` gives (to the estimator and to loss terms).
    needs_outputs: reward outputs it reads from `batch.signals` (e.g. "rewards"); `resolve_method`
        refuses a method whose rewards fill none.
    init(params, hidden_size, optimizer) -> {"params", "opt_state"}: a learned auxiliary's state at
        the start of a run (`params`: the policy's, as nnx.State).
    optim(step_cfg) -> OptimConfig: its optimizer's settings.
    before_advantage(inputs, state, optimizer) -> StageOut.
    after_advantage(inputs, state, carry, estimator_outputs) -> (loss inputs {name: [B, ...]}, metrics).
    loss(graphdef, step_cfg, params, rows, loss_inputs) -> (per-token loss [B, N], {metric: [B, N]}):
        `rows` a micro-batch of the batch, `loss_inputs` its rows of after_advantage's arrays; the metrics
        are token-weighted like the loss and reported as "<name>/<metric>", with "<name>/grad_norm".
    loss_metrics: the names of those metrics (the step's accumulators are built before tracing).
    batch_rows(RowsRequest) -> (rows, stats): its own rows (a pytree of numpy arrays, rows first),
        and stats holding `rows_key`, their width (a batch shape: the step compiles once per
        distinct width; `RowsRequest.min_width` is its floor).
    plan_width(run_config, length) -> int: the worst-case width for trajectories of `length`
        tokens; abstract_rows(batch, width, max_turns) -> the rows as jax.ShapeDtypeStructs.
    describe: a few words for the method's one-line description.
    announce(step_cfg, model_cfg) -> str: the line the trainer logs about it at the start of a run."""

    name: str
    provides: tuple[str, ...] = ()
    needs_outputs: tuple[str, ...] = ()
    init: Callable[[Any, int, Any], dict] | None = None
    optim: Callable[[Any], Any] | None = None
    before_advantage: Callable[[StageInputs, Any, Any], StageOut] | None = None
    after_advantage: Callable[[StageInputs, Any, Any, dict], tuple[dict, dict]] | None = None
    loss: Callable[[Any, Any, Any, Any, dict], tuple[Any, dict]] | None = None
    loss_metrics: tuple[str, ...] = ()
    batch_rows: Callable[["RowsRequest"], tuple[Any, dict]] | None = None
    rows_key: str = ""
    plan_width: Callable[[Any, int], int] | None = None
    abstract_rows: Callable[[int, int, int], Any] | None = None
    describe: str = ""
    announce: Callable[[Any, Any], str] | None = None

    @property
    def learned(self) -> bool:
        return self.init is not None


AUXILIARIES: dict[str, StepAuxiliary] = {}


def register_auxiliary(aux: StepAuxiliary) -> StepAuxiliary:
    """Make `aux` available to methods (`Method.auxiliaries`) and to the loss terms reading its arrays."""
    if aux.name in AUXILIARIES:
        raise ValueError(f"step auxiliary {aux.name!r} already registered")
    if aux.learned != (aux.optim is not None):
        raise ValueError(f"step auxiliary {aux.name!r}: a learned auxiliary has both init and optim, others neither")
    if aux.batch_rows is not None and not (aux.rows_key and aux.plan_width and aux.abstract_rows):
        raise ValueError(f"step auxiliary {aux.name!r}: batch_rows needs rows_key, plan_width and abstract_rows")
    if aux.loss is not None and not aux.learned:
        raise ValueError(f"step auxiliary {aux.name!r}: a loss trains parameters; it needs init and optim")
    AUXILIARIES[aux.name] = aux
    return aux


def get_auxiliary(name: str) -> StepAuxiliary:
    if name not in AUXILIARIES:
        raise KeyError(f"unknown step auxiliary {name!r}; registered: {sorted(AUXILIARIES)}")
    return AUXILIARIES[name]
