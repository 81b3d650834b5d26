"""Run configuration: the config layers, config files, command-line overrides, validation, and
the translation of the ConfigDict into the typed configs each part takes (the one such seam).

A run config is three layers (`layered`):

1. `base_config()`: every key, documented, at the paper's values where the paper has one
   (docs/spec.md §2) and a neutral value otherwise; no model.
2. a model layer: a `configs/models/*.py` file whose `get_model()` returns `model.*` keys only
   (the architecture preset, dtypes, memory knobs). Its `model.preset` is fixed: an override that
   changes it is refused (use a config with that model instead).
3. an experiment: a function that sets the run's other values (data, batch, schedule, ...).

A config file is a Python file defining `get_config()` that returns an `ml_collections`
ConfigDict (see configs/), normally `layered(model=model_file(__file__, "<model>"),
experiment=...)`. The embedded default (`default_config()`, what runs without --config) is the
tiny CPU experiment of turnsight_jax/embedded_default.py. Overrides use dotted keys:
`--config.rl.lam=0.3`. Values are parsed as Python literals and must match the type of the key
they replace; an unknown key is an error that names the closest known keys. Keys under `rl.args`
(plug-in method knobs) are free-form.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import importlib.util
import pathlib
import sys
from typing import Any, Callable, Mapping, Sequence

import ml_collections as mlc

from turnsight_jax.chat.hindsight_template import DEFAULT_FILLER
from turnsight_jax.chat.hindsight_template import HindsightTemplate
from turnsight_jax.errors import ConfigError
from turnsight_jax.rl.config import AlgoConfig, LossConfig, OptimConfig, StepConfig, TeacherConfig
from turnsight_jax.rl.config import CONFIG_SECTIONS, section_settings
from turnsight_jax.rl.methods import CONFIG_CHECKS, ResolvedMethod, resolve_method
from turnsight_jax.rollout.driver import RolloutConfig
from turnsight_jax.chat.template import OBSERVATION_TEMPLATES
from turnsight_jax.rollout.engine import EngineConfig
from turnsight_jax.rollout.sampler import SamplingParams
from turnsight_jax.sources import check_output_cap, check_provides, get_source


_HINDSIGHT = HindsightTemplate()  # rl.hindsight_template's defaults


# Keys whose None means "off" and may be given as --config.<key>=None over a number.
NULLABLE_KEYS = frozenset({"loss.clip_ratio_c", "loss.tis_threshold"})


ATTENTION_IMPLS = ("xla", "pallas", "pallas_interpret")


def base_config() -> mlc.ConfigDict:
    """Every key of a run config at its base value: the paper's training setup (docs/spec.md §2:
    Qwen3 with thinking on, TurnSight on MatchTIR, FTRL, no SFT) and no model (a model layer sets
    model.preset). Values the paper does not give are marked "paper silent"."""
    c = mlc.ConfigDict()
    c.name = "turnsight"  # the run's name: the default run folder is runs/<name>
    c.seed = 0  # model initialisation, built-in task generation, rollout sampling
    c.tokenizer_path = ""  # "" = the model folder's own tokenizer (model.hf_path), else the bundled Qwen3 one

    c.model = mlc.ConfigDict()  # set by a model layer (configs/models/*.py); see turnsight_jax.models.config
    c.model.preset = ""  # the architecture (a PRESETS name); fixed by the model layer, never overridden
    c.model.hf_path = ""  # the Hugging Face Qwen3 folder whose weights training starts from (must be the preset's shape)
    c.model.param_dtype = "float32"  # the trained policy and its optimizer moments (lr 1e-6 updates vanish in bfloat16)
    c.model.ref_dtype = "float32"  # the frozen reference/teacher copy (bfloat16 halves its memory)
    c.model.compute_dtype = "float32"  # matmul inputs and activations: float32 | bfloat16
    c.model.remat = False  # rematerialise each decoder layer in the backward pass
    c.model.attn_q_chunk = 512  # queries per attention chunk (bounds the [chunk, keys] score block)
    c.model.vocab_block = 0  # vocabulary columns per logits block of the log-prob head; 0: all at once (accelerators); ~1,024 on a CPU
    c.model.attn_row_group = 0  # > 0: the RL step's forwards (student and teacher) skip the padding's query chunks per group of this many rows (one device)
    c.model.attn_key_block = 0  # > 0 (with attn_row_group): a chunk's keys this many at a time, skipping blocks none of its queries reads (packed rows)
    c.model.attn_impl = "xla"  # the full-sequence forwards' attention: xla (any backend) | pallas (a fused flash kernel: GPUs) | pallas_interpret (that kernel interpreted: tests)
    c.model.attn_block = 64  # the fused kernel's tile side (tokens; a power of two)
    c.model.allow_random_init = False  # start from random weights when hf_path is "" (the paper starts from Qwen3)

    c.data = mlc.ConfigDict()  # the tasks (turnsight_jax.sources)
    c.data.source = "ftrl"  # training tasks: builtin | ftrl | toolhop (the paper trains on FTRL)
    c.data.path = ""  # the training file of a file-backed source (required for ftrl / toolhop)
    c.data.eval_source = "ftrl"  # held-out tasks: builtin | ftrl | toolhop
    c.data.eval_path = ""  # the held-out file of a file-backed source (required for ftrl / toolhop)
    c.data.num_train = 2000  # built-in tasks generated for training (file sources use every row)
    c.data.num_eval = 0  # held-out tasks: built-in tasks generated (a disjoint seed); files: the first N, 0 = all
    # Built-in task generator (data.source = builtin only; turnsight_jax.envs.synthetic.SyntheticConfig):
    c.data.categories = ("single_hop", "parallel_single_hop", "multi_hop", "parallel_multi_hop")  # task kinds
    c.data.hops = 2  # chain length of the multi-hop categories (>= 2)
    c.data.max_hops = 0  # 0: every chain has `hops` hops; else each multi-hop task's length uniform in [hops, max_hops] (long horizons)
    c.data.width = 2  # parallel sub-questions of the parallel categories (>= 2)
    c.data.min_distractors = 1  # distractor tools per task: uniform in [min, max]
    c.data.max_distractors = 2  # (see min_distractors)
    c.data.vocab_size = 64  # distinct entity names
    c.data.entity_style = "cvcv"  # cvcv (made-up four-letter words) | names (single-token first names)
    c.data.num_relations = 16  # relation names (tools) the tasks draw from (at most 32; a chain uses each once)
    c.data.extra_rows = 2  # table rows per tool beyond those the gold chain needs
    c.data.prompt_style = "short"  # short (FTRL's first sentence + the question) | ftrl (FTRL's full text)
    c.data.min_result_words = 0  # 0 / 0: a tool returns the bare entity; else each table row adds a record
    c.data.max_result_words = 0  #   note of uniform [min, max] words (FTRL-like long tool results)

    c.rollout = mlc.ConfigDict()  # multi-turn generation (turnsight_jax.rollout)
    c.rollout.max_turns = 10  # assistant turns per trajectory (paper: 10)
    c.rollout.max_prompt_tokens = 10_000  # the prompt (system + tools + question) (paper: <= 10,000)
    c.rollout.max_response_tokens = 13_000  # everything after the prompt, tool responses included (paper: <= 13,000)
    c.rollout.max_turn_tokens = 0  # per-turn generation cap, a turn reaching it ends the episode truncated; 0: none, only the response budget (paper silent; released: none)
    c.rollout.enable_thinking = True  # Qwen3's thinking mode (the post-trained Qwen3 the paper's scores fit)
    c.rollout.temperature = 1.0  # sampling temperature of the rollouts and of the log-probs (paper: 1.0)
    c.rollout.top_p = 1.0  # nucleus filter (1.0: off)
    c.rollout.top_k = 0  # top-k filter (0: off; the paper samples the full distribution)
    c.rollout.prompts_per_chunk = 0  # rollouts run this many prompts (x group) at a time; 0 = all at once
    c.rollout.engine = "paged"  # paged (continuous batching, paged KV, prefix sharing: docs/rollout_engine.md) | lockstep (one static cache, turns in lockstep)
    c.rollout.decode_slots = 64  # paged: sequences decoded at once over all devices (episodes queue for a free slot)
    c.rollout.kv_block_size = 16  # paged: KV slots per block
    c.rollout.decode_chunk = 16  # paged: decode steps between scheduling points
    c.rollout.kv_pool_blocks = 0  # paged: KV blocks per device; 0 = every slot at max prompt + response length
    # Parse semantics of the released code (docs/spec.md §3), off by default:
    c.rollout.end_on_unparsable_turn = False  # a turn whose calls all fail to parse ends the episode (else: errors go back)
    c.rollout.calls_in_think = False  # execute calls written inside <think> (else: reasoning, never executed)
    c.rollout.observation_template = "project"  # text after a turn's tool calls: project (the official Qwen3 chat template's) | released (MatchTIR's vllm_rollout_spmd.py; paper silent; docs/reproducing.md)
    c.rollout.max_tool_output_chars = 16_384  # a longer tool result is cut to this + a note (paper silent; released: no cut; docs/reproducing.md)

    c.rl = mlc.ConfigDict()  # the method and its knobs: turnsight_jax.rl.config.AlgoConfig
    c.rl.method = "turnsight"  # a registered method (turnsight_jax.rl.methods): grpo | matchtir | turnsight | ...
    c.rl.base = "matchtir"  # the method TurnSight wraps (its rewards and advantage); the paper uses MatchTIR
    c.rl.rollout = ""  # a registered rollout controller run instead of the method's own (with its rewards and loss terms); "": the method's
    c.rl.gamma = 0.9  # MatchTIR's turn-return discount
    c.rl.lam = 0.5  # lambda: mix of the TurnSight weight into the base advantage (paper: 0.5)
    c.rl.eps_w = 0.5  # eps_w: the weight's bound, w in [1 - eps_w, 1 + eps_w] (paper: 0.5)
    c.rl.selection = "vote"  # depth selection: vote (direction-consistent) | mean (fusion) | a depth index | dependency | saturation (adaptive horizons, rl.horizon)
    c.rl.horizon_tol = 0.05  # selection=saturation: a turn stops at the first depth whose next one moves its mean gap by <= this (nats/token; ours)
    c.rl.aggregation = "turn"  # turn (mean gap per turn) | token (no turn aggregation)
    c.rl.group_norm = True  # normalise the selected gap over the prompt's siblings
    c.rl.turns = "all"  # turns TurnSight reweights: all | first:N | last:N
    c.rl.depths = (1, 2, 3)  # hindsight depths D_H (paper: {1, 2, 3})
    c.rl.source = "tool_results"  # hindsight block: tool_results | tool_results_answer | answer
    c.rl.norm_pool = "turn_mean"  # group statistics pool: turn_mean (each token's δ̄*) | token_gap (raw gaps at d*) | per_turn (one δ̄* per turn) (paper silent)
    c.rl.uncovered_in_stats = True  # turns outside rl.turns still enter the group statistics (paper silent)
    c.rl.empty_block_turns = "weighted"  # turns with an empty hindsight block: weighted (like the others) | excluded (w = 1, out of the group statistics) (paper silent)
    # The hindsight message (docs/hindsight_views.md): str.format strings, the named fields in braces (paper silent).
    c.rl.hindsight_template = mlc.ConfigDict()  # pieces of chat.hindsight.HindsightTemplate; defaults are its own
    c.rl.hindsight_template.message_open = _HINDSIGHT.message_open  # opens the user message (no fields)
    c.rl.hindsight_template.answer = _HINDSIGHT.answer  # the gold answer, sources with the answer: {answer}
    c.rl.hindsight_template.item = _HINDSIGHT.item  # one turn: {calls} {results} {turn} (1-based) {offset} (0..d-1)
    c.rl.hindsight_template.call = _HINDSIGHT.call  # one call: {call} (its JSON, or a malformed call's raw text)
    c.rl.hindsight_template.result = _HINDSIGHT.result  # one tool result: {result}
    c.rl.hindsight_template.message_close = _HINDSIGHT.message_close  # closes the message (no fields)
    # The equal-length control (chat.budget): compare hindsight sources at one block length (paper silent).
    c.rl.hindsight_budget = 0  # every non-empty hindsight message exactly this many tokens (content cut to its head, or padded); 0: off
    c.rl.hindsight_filler = DEFAULT_FILLER  # the text that pads a message to the budget, tiled token by token (".\n": a line holding a period)
    c.rl.student_sees_observations = True  # False: observation tokens masked out of the student's training forward (released code)
    c.rl.matchtir_matching = "assignment"  # MatchTIR call matching: greedy (the released code's) | assignment (optimal) | transport (Sinkhorn)
    c.rl.matchtir_semantics = "clean"  # MatchTIR reward conventions: clean | released (quchangle1/MatchTIR's code; turnsight_jax/rewards.py)
    c.rl.matchtir_singleton = "zero"  # MatchTIR advantage of a group / (group, turn) of one: zero | raw (mean 0, std 1: the released code)
    c.rl.toolrl_format = True  # ToolRL reward R_format + R_correct (docs/spec.md §1.12); False: R_correct only (the released compute_toolrl)
    c.rl.switch_step = 0  # two-stage recipes (e.g. a dense-reward method, then the outcome): the first N steps run rl.method, the rest rl.switch_method; 0: off
    c.rl.switch_method = ""  # the method from step switch_step on (same rl.base and every other key)
    c.rl.args = mlc.ConfigDict()  # free-form knobs of plug-in methods (--config.rl.args.<key>=<value>)

    c.teacher = mlc.ConfigDict()  # who scores the teacher views (rl.config.TeacherConfig; what a privileged view shows: the privileged.* section)
    c.teacher.weights = "reference"  # reference (frozen initial policy; TurnSight) | policy (current, no gradient) | ema | external
    c.teacher.ema_decay = 0.99  # weights=ema: teacher <- decay * teacher + (1 - decay) * policy after every step
    c.teacher.checkpoint = ""  # weights=external: a Hugging Face Qwen3 folder with the policy's tokenizer | warm_start
    c.teacher.preset = ""  # weights=external: its architecture (a preset) for --dry-run where the folder is absent
    c.teacher.top_k = 20  # teacher tokens a top-K KL (a loss term reading the teacher's top K) is computed on


    c.loss = mlc.ConfigDict()  # the clipped surrogate (turnsight_jax.rl.losses)
    c.loss.clip_eps = 0.2  # ratio clipped below at 1 - clip_eps (paper silent)
    c.loss.clip_eps_high = 0.28  # ... and above at 1 + clip_eps_high (paper silent)
    c.loss.clip_ratio_c = None  # dual clip: for A < 0 the token loss is capped at -A * c (released code: 3.0); None: off
    c.loss.entropy_coef = 0.0  # entropy bonus: loss -= coef * aggregated token entropy (released MatchTIR: 0.001)
    c.loss.kl_coef = 0.0  # KL to the reference (paper: 0)
    c.loss.kl_estimator = "low_var_kl"  # k1 | k3 | low_var_kl
    c.loss.kl_clip = 10.0  # low_var_kl is clipped to [-kl_clip, kl_clip]
    c.loss.aggregation = "seq_mean_token_mean"  # token-mean per trajectory, mean over trajectories (paper)
    # Sampler/trainer mismatch correction (truncated importance sampling, verl's rollout correction):
    # a float C > 0 (e.g. 2.0) makes the ratio's π_old the trainer's own log-probs at the step-start
    # parameters and weights each token's surrogate loss by min(exp(π_old_trainer - π_sampler), C);
    # δ keeps the sampler's log-probs (docs/spec.md §1.9).
    c.loss.tis_threshold = None  # None: off, π_old is the sampler's recorded log-probs (the paper)

    c.optim = mlc.ConfigDict()  # AdamW after linear warm-up
    c.optim.lr = 1e-6  # peak learning rate (paper: 1e-6)
    c.optim.schedule = "constant"  # constant | cosine
    c.optim.warmup_steps = 0  # linear warm-up steps
    c.optim.min_lr_ratio = 0.0  # cosine: the final lr as a fraction of lr
    c.optim.b1 = 0.9  # AdamW first-moment decay (paper silent)
    c.optim.b2 = 0.999  # AdamW second-moment decay (paper silent)
    c.optim.weight_decay = 0.01  # AdamW weight decay (paper silent)
    c.optim.max_grad_norm = 1.0  # global gradient-norm clip



    c.train = mlc.ConfigDict()  # the RL loop and the split of a step's batch
    # The released verl trainer drops each epoch's last partial batch (drop_last=True) and runs len(loader) x epochs steps:
    c.train.steps = 207  # RL steps: 3 epochs x floor(2215 FTRL training tasks / 32) = 3 x 69 (paper: 3 epochs)
    c.train.prompts_per_step = 32  # prompts per step (paper: 32)
    c.train.group_size = 16  # rollouts per prompt, G (paper: 16)
    c.train.micro_batches = 1  # gradient accumulation inside one mini-batch (memory only)
    c.train.mini_batches = 1  # optimizer updates per epoch over the step's batch (paper: one mini-batch)
    c.train.ppo_epochs = 1  # passes over the step's batch
    c.train.teacher_micro_batches = 1  # micro-batches of the teacher's hindsight forward passes (memory only)
    c.train.logprob_chunk = 1024  # rows per vocabulary-projection chunk of the update (memory/speed only)
    c.train.score_chunk = 0  # rows per projection chunk of the no-gradient forwards (teacher, reference, π_old); 0: logprob_chunk
    c.train.length_classes = 1  # forwards run the rows in this many length groups, each padded to its own width (speed only)
    c.train.pack_rows = False  # forwards run several trajectories (teacher: hindsight rows) per row, by segment ids (speed only)
    c.train.pack_width = 0  # with pack_rows: packed rows at least this many tokens wide (0: the batch's bucketed width)
    c.train.teacher_pack_width = 0  # with pack_rows: the teacher's packed hindsight rows at least this wide (0: pack_width); its rows are longer than the student's
    c.train.micro_batch_groups = 1  # > 1: the micro-batches ordered by length, in this many groups each padded to its own width (speed only; rl.micro_groups)
    c.train.shapes = "grow"  # a batch's padded widths: "grow" (the largest so far: few compiles) or "batch" (its own buckets, or a shape used before within shape_reuse; turnsight_jax.batch_shapes)
    c.train.shape_reuse = 0.1  # with shapes="batch": a shape used before is taken when its executed update FLOPs are at most this fraction above the batch's own
    c.train.max_skipped_steps = 3  # non-finite loss/gradient: the update is skipped; this many in a row stop the run

    c.eval = mlc.ConfigDict()  # held-out evaluation (turnsight_jax.eval.heldout)
    c.eval.every = 5  # RL steps between evaluations (paper: 5); 0: only before and after RL
    c.eval.max_turns = 10  # assistant turns per held-out task
    c.eval.batch_size = 64  # rollouts per batch
    c.eval.temperature = 0.0  # 0: greedy; > 0: the sampled policy's expected Solve-F1 (what RL maximises)
    c.eval.samples = 1  # rollouts per held-out task when sampling (per-task F1 = their mean)
    c.eval.top_k = 0  # sampling filters when eval.temperature > 0 (0 / 1.0: off)
    c.eval.top_p = 1.0  # (1.0: off)

    c.sft = mlc.ConfigDict()  # supervised warm-start on gold built-in trajectories (see sft.py); the paper has none
    c.sft.curriculum_steps = 0  # stage 1: short rows, softmax over the task vocabulary (0: skipped)
    c.sft.curriculum_lr = 1e-5  # stage 1's learning rate
    c.sft.steps = 0  # stage 2: full rows, full vocabulary (0: skipped)
    c.sft.lr = 1e-5  # stage 2's learning rate
    c.sft.batch_size = 16  # rows per SFT step
    c.sft.num_tasks = 1024  # built-in tasks the demonstrations are drawn from
    c.sft.wrong_call_rate = 0.0  # stage 2: share of demonstrations with one wasted call to a wrong tool

    c.checkpoint = mlc.ConfigDict()  # <workdir>/checkpoints: resumed from automatically
    c.checkpoint.every = 5  # RL steps between checkpoints (paper: 5); 0: only at the end
    c.checkpoint.keep = 3  # checkpoints kept
    c.checkpoint.export_at_end = True  # write the trained policy as a Hugging Face folder

    c.mesh = mlc.ConfigDict()  # device mesh data x fsdp x tensor; -1: the remaining devices
    c.mesh.data = 1  # data-parallel replicas
    c.mesh.fsdp = -1  # parameter/optimizer sharding (every device by default)
    c.mesh.tensor = 1  # tensor parallelism

    c.plan = mlc.ConfigDict()  # --dry-run: the worst-case geometry and the device budget
    c.plan.packed_factor = 2.0  # packed teacher row length / trajectory length
    c.plan.distinct_factor = 3.0  # distinct teacher predictors / policy tokens
    c.plan.device_memory_gib = 80.0  # per-device memory the plan is checked against (paper: 80 GB GPUs)

    c.log = mlc.ConfigDict()  # run logs (metrics.jsonl is always written)
    c.log.tensorboard = True  # TensorBoard event files next to metrics.jsonl
    c.log.progress = True  # progress lines on stderr
    # Weights & Biases (runlog.WandbRun; `pip install -e '.[wandb]'`): the resolved config, every
    # step's numeric metrics and the held-out summary, its files in WORKDIR/wandb, one W&B run per
    # run folder (its id in WORKDIR/wandb_run.json, so a resumed run continues it)
    c.log.wandb = False  # True: log to Weights & Biases too
    c.log.wandb_project = "turnsight_jax"  # the W&B project (the entity: W&B's own WANDB_ENTITY or login default)
    c.log.wandb_mode = "online"  # "online" (needs `wandb login`) | "offline" (local; `wandb sync WORKDIR/wandb/offline-run-*`)
    # trajectory records (turnsight_jax.records, docs/records.md; `python -m turnsight_jax.viewer RUN`)
    c.log.records_every = 5  # every N steps, RUN/records/step_<step>.jsonl.gz (0: none)
    c.log.records_max_kib = 8192  # bound per step and process: whole prompt groups while the JSON fits
    c.log.records_text_chars = 4000  # each text (policy turn, observation, prompt) cut to this many characters
    # The studies' per-step turn records (rl.turn_outcomes): each turn's outcome, faults, chosen depth,
    # weight and advantage, and the teacher's and the sampler's log-probs of the sampled tokens (the
    # step's own arrays: no extra forward), in <workdir>/turn_records/; read by
    # `python -m turnsight_jax.calibration` (docs/experiments.md).
    c.log.turn_records = False  # True: write <workdir>/turn_records/step_*.npz (the calibration report reads them)

    # Noisy, slow and unavailable tools (envs.faults): injected into the training rollouts'
    # environment (the held-out evaluation stays clean); all rates 0: not wrapped at all.
    c.faults = mlc.ConfigDict()  # envs.faults.FaultConfig; docs/experiments.md
    c.faults.wrong_rate = 0.0  # a call's result replaced by a plausible wrong value (another gold or earlier value)
    c.faults.unavailable_rate = 0.0  # a call finds its tool down: answered "temporarily unavailable; call it again"
    c.faults.unavailable_attempts = 1  # identical attempts answered unavailable per outage; the next one runs
    c.faults.delay_rate = 0.0  # a call takes faults.delay_s longer (a batch waits for its slowest once)
    c.faults.delay_s = 0.0  # seconds a delayed call adds
    c.faults.seed = 0  # salt of the fault draws (with each episode's seed and each call's index)
    # each method's own section `<name>.*`, generated from the dataclass it registered
    # (rl.config.CONFIG_SECTIONS: its fields are the keys and their defaults; registered when
    # turnsight_jax.methods is imported, as every entry point does)
    for section in CONFIG_SECTIONS.values():
        c[section.name] = mlc.ConfigDict(dataclasses.asdict(section.schema()))
    return c


# ---- layers ----

# Keys a model layer fixes: the architecture. Everything else a model layer sets (dtypes, remat,
# attention chunk) is a memory/precision knob and stays overridable.
ARCHITECTURE_KEYS = ("model.preset",)
_LAYER_ATTR = "_turnsight_model_layer"  # hidden (not a key): (model layer name, {key: value it fixed})


@dataclasses.dataclass(frozen=True)
class ModelLayer:
    """A model layer: `model.*` keys (without the prefix) and where they come from."""

    name: str  # for messages: the model file's path, or the embedded layer's name
    keys: Mapping[str, Any]


def model_file(config_file: str | pathlib.Path, model: str) -> ModelLayer:
    """The model layer `<config_file's folder>/models/<model>.py` (its `get_model()`)."""
    path = pathlib.Path(config_file).resolve().parent / "models" / f"{model}.py"
    module = _load_module(path)
    if not hasattr(module, "get_model"):
        raise ConfigError(f"model file {path} defines no get_model()")
    keys = module.get_model()
    if not isinstance(keys, Mapping):
        raise ConfigError(f"{path}: get_model() returned {type(keys).__name__}, expected a dict of model keys")
    return ModelLayer(_display_path(path), dict(keys))


def layered(*, model: ModelLayer | None, experiment: Callable[[mlc.ConfigDict], Any] | Sequence | None = None,
            base: mlc.ConfigDict | None = None) -> mlc.ConfigDict:
    """base (default `base_config()`) + the model layer (model keys only; its architecture keys
    are fixed) + the experiment function(s), each applied in place in order."""
    c = base if base is not None else base_config()
    if model is not None:
        for key, value in model.keys.items():
            if key not in c.model:
                close = difflib.get_close_matches(key, sorted(c.model.keys()), n=3)
                hint = f"; did you mean {', '.join(close)}?" if close else ""
                raise ConfigError(f"model layer {model.name}: {key!r} is not a model.* key{hint}")
            c.model[key] = value
        fixed = {k: c.model[k.split(".", 1)[1]] for k in ARCHITECTURE_KEYS}
        object.__setattr__(c, _LAYER_ATTR, (model.name, fixed))
    steps = () if experiment is None else (experiment,) if callable(experiment) else tuple(experiment)
    for step in steps:
        step(c)
    for key, value in fixed_keys(c).items():  # an experiment runs any model
        if _get(c, key) != value:
            raise ConfigError(f"the experiment changed {key} from the model layer's {value!r} to {_get(c, key)!r}; "
                              f"an experiment must not set the architecture (layer another model file)")
    return c


def fixed_keys(cfg: mlc.ConfigDict) -> dict[str, Any]:
    """The keys the config's model layer fixed, with their values ({} without a model layer)."""
    layer = getattr(cfg, _LAYER_ATTR, None)
    return dict(layer[1]) if layer else {}


def model_layer_name(cfg: mlc.ConfigDict) -> str | None:
    layer = getattr(cfg, _LAYER_ATTR, None)
    return layer[0] if layer else None


def default_config() -> mlc.ConfigDict:
    """The embedded default: the tiny CPU experiment (turnsight_jax.embedded_default) on the
    tiny-default model: a tiny Qwen3 with the real tokenizer on built-in tasks, CPU, minutes."""
    from turnsight_jax import embedded_default

    model = ModelLayer("tiny_default (turnsight_jax.embedded_default)", embedded_default.TINY_DEFAULT_MODEL)
    return layered(model=model, experiment=embedded_default.tiny_cpu)


def _get(cfg: mlc.ConfigDict, key: str) -> Any:
    node = cfg
    for part in key.split("."):
        node = node[part]
    return node


def _display_path(path: pathlib.Path) -> str:
    try:
        return str(path.relative_to(pathlib.Path.cwd()))
    except ValueError:
        return str(path)


def _load_module(path: pathlib.Path):
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    spec = importlib.util.spec_from_file_location(f"turnsight_config_{path.parent.name}_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    # registered while it runs, as an import does: a dataclass defined in the file (a plug-in
    # method's config section) resolves its annotations through sys.modules[its __module__]
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)  # a config file is the user's own Python, like absl's config_flags
    except ConfigError:
        sys.modules.pop(spec.name, None)
        raise
    except Exception as e:  # noqa: BLE001 - report any failure of the user's file in one line
        sys.modules.pop(spec.name, None)
        raise ConfigError(f"config file {path} failed to load: {type(e).__name__}: {e}") from e
    return module


def load_config_module(path: str | pathlib.Path):
    """A config file as a module (to reuse its experiment function from another config file)."""
    return _load_module(pathlib.Path(path))


def load_config_file(path: str | pathlib.Path) -> mlc.ConfigDict:
    path = pathlib.Path(path)
    module = _load_module(path)
    if not hasattr(module, "get_config"):
        raise ConfigError(f"config file {path} defines no get_config()")
    try:
        cfg = module.get_config()
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - report any failure of the user's file in one line
        raise ConfigError(f"config file {path}: get_config() failed: {type(e).__name__}: {e}") from e
    if not isinstance(cfg, mlc.ConfigDict):
        raise ConfigError(f"{path}: get_config() returned {type(cfg).__name__}, expected ml_collections.ConfigDict")
    missing = _missing_keys(cfg, base_config())
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise ConfigError(f"config file {path}: get_config() lacks {', '.join(missing[:3])}{more}; "
                          f"start from turnsight_jax.config.base_config() or default_config()")
    # A key the base config does not have (a typo, or a key that moved into a method's own
    # section) would be read by nothing, so the run would silently ignore it.
    unknown = [k.split(" ", 1)[1].strip("'") for k in _missing_keys(base_config(), cfg)]
    if unknown:
        flat = sorted(_flat_keys(base_config()))
        close = difflib.get_close_matches(unknown[0], flat, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        more = f" (and {len(unknown) - 1} more: {', '.join(unknown[1:4])})" if len(unknown) > 1 else ""
        raise ConfigError(f"config file {path}: get_config() sets {unknown[0]!r}, which is no config key{hint}{more}")
    return cfg


def _missing_keys(cfg: mlc.ConfigDict, schema: mlc.ConfigDict, prefix: str = "") -> list[str]:
    """Sections and keys of `schema` absent from `cfg`, as dotted paths (a missing section is
    named once; `rl.args` is free-form)."""
    out = []
    for key, value in schema.items():
        path = prefix + key
        if path == "rl.args":
            continue
        if key not in cfg:
            out.append(f"section {path!r}" if isinstance(value, mlc.ConfigDict) else f"key {path!r}")
        elif isinstance(value, mlc.ConfigDict) and isinstance(cfg[key], mlc.ConfigDict):
            out += _missing_keys(cfg[key], value, path + ".")
    return out


def _parse_value(text: str, old: Any, key: str) -> Any:
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        value = text  # a bare word: a string
    if isinstance(old, bool):
        if isinstance(value, str) and value.lower() in ("true", "false"):
            value = value.lower() == "true"
        if not isinstance(value, bool):
            raise ConfigError(f"--config.{key}: expected a bool, got {text!r}")
        return value
    if isinstance(old, float) and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(old, tuple) and isinstance(value, (list, tuple)):
        return tuple(value)
    if isinstance(old, tuple) and isinstance(value, int):
        return (value,)
    if value is None and key in NULLABLE_KEYS:  # an off switch (loss.clip_ratio_c=None)
        return None
    if old is not None and not isinstance(value, type(old)) and not (isinstance(old, str) and value is None):
        # `selection` may be a depth index or a mode name
        if not (key.endswith("selection") and isinstance(value, (int, str))):
            raise ConfigError(f"--config.{key}: expected {type(old).__name__}, got {text!r}")
    return value


def apply_overrides(cfg: mlc.ConfigDict, overrides: Sequence[str]) -> mlc.ConfigDict:
    """Apply `key=value` overrides (dotted keys) in place; unknown keys are errors, and so is a
    change of a key the model layer fixed (the architecture). Keys under `rl.args` are free-form."""
    flat = set(_flat_keys(cfg))
    fixed = fixed_keys(cfg)
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep:
            raise ConfigError(f"override {item!r} must look like --config.key=value")
        free = key.startswith("rl.args.") and len(key) > len("rl.args.") and "rl" in cfg and "args" in cfg.rl
        if key not in flat and not free:
            close = difflib.get_close_matches(key, sorted(flat), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ConfigError(f"unknown config key {key!r}{hint}")
        *parents, leaf = key.split(".")
        node = cfg
        for p in parents:
            if free and p not in node:
                node[p] = mlc.ConfigDict()
            node = node[p]
        old = node[leaf] if leaf in node else None
        value = _parse_value(text, old, key)
        if key in fixed and value != fixed[key]:
            raise ConfigError(
                f"--config.{key}={text} conflicts with the model layer {model_layer_name(cfg)}, which fixes "
                f"{key}={fixed[key]!r}; use a config with that model instead (one layering configs/models/<model>.py)")
        with node.unlocked() if hasattr(node, "unlocked") else _null():
            if old is not None and not isinstance(value, type(old)) and leaf in node:
                del node[leaf]  # a key of two types (rl.selection: a mode or a depth index)
            node[leaf] = value
    return cfg


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _flat_keys(cfg: mlc.ConfigDict, prefix: str = ""):
    for k, v in cfg.items():
        if isinstance(v, mlc.ConfigDict):
            yield from _flat_keys(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}"


def load_run_config(path: str | None, overrides: list[str]) -> mlc.ConfigDict:
    """The config file (or the embedded default) with `--config.key=value` overrides applied."""
    cfg = load_config_file(path) if path else default_config()
    bad = [o for o in overrides if not o.startswith("--config.")]
    if bad:
        raise ConfigError(f"unknown argument {bad[0]!r} (overrides look like --config.rl.lam=0.3)")
    return apply_overrides(cfg, [o[len("--config."):] for o in overrides])


# ---- ConfigDict -> typed configs ----

def hindsight_template(node: mlc.ConfigDict) -> HindsightTemplate:
    """rl.hindsight_template -> HindsightTemplate; a piece it does not have is a ConfigError
    (the fields inside each piece are checked by StepConfig.validate)."""
    pieces = node.to_dict()
    unknown = sorted(set(pieces) - {f.name for f in dataclasses.fields(HindsightTemplate)})
    if unknown:
        raise ConfigError(f"rl.hindsight_template.{unknown[0]} is not a piece of the hindsight message; "
                          f"pieces: {', '.join(f.name for f in dataclasses.fields(HindsightTemplate))}")
    return HindsightTemplate(**pieces)


def method_sections(cfg: mlc.ConfigDict) -> tuple[tuple[str, Any], ...]:
    """The run config's method sections as (name, settings dataclass) pairs (rl.config.AlgoConfig.
    sections); a section the config lacks is left out (its dataclass's defaults then apply). Only
    the keys are checked here: a section's values are checked by its method's registered check
    when a stage runs the method (`validate`; e.g. a section's 0 that means the group size there)."""
    return tuple((s.name, section_settings(s.schema, cfg[s.name], s.name, f"a {s.name}", validate=False))
                 for s in CONFIG_SECTIONS.values() if s.name in cfg)


def step_config(cfg: mlc.ConfigDict) -> StepConfig:
    """The train step's typed config from a run config."""
    r, l, o, t, te = cfg.rl, cfg.loss, cfg.optim, cfg.train, cfg.teacher
    args = tuple(sorted(r.args.items())) if "args" in r else ()
    return StepConfig(
        algo=AlgoConfig(method=r.method, base=r.base, rollout=r.rollout, gamma=r.gamma, lam=r.lam, eps_w=r.eps_w,
                        selection=r.selection, horizon_tol=r.horizon_tol,
                        aggregation=r.aggregation, group_norm=r.group_norm, turns=r.turns,
                        depths=tuple(int(d) for d in r.depths), source=r.source, norm_pool=r.norm_pool,
                        uncovered_in_stats=r.uncovered_in_stats, empty_block_turns=r.empty_block_turns,
                        hindsight_template=hindsight_template(r.hindsight_template),
                        hindsight_budget=r.hindsight_budget, hindsight_filler=r.hindsight_filler,
                        student_sees_observations=r.student_sees_observations,
                        matchtir_matching=r.matchtir_matching, matchtir_semantics=r.matchtir_semantics,
                        matchtir_singleton=r.matchtir_singleton, toolrl_format=r.toolrl_format,
                        sections=method_sections(cfg), args=args),
        teacher=TeacherConfig(weights=te.weights, ema_decay=te.ema_decay, checkpoint=te.checkpoint,
                              top_k=te.top_k),
        loss=LossConfig(clip_eps=l.clip_eps, clip_eps_high=l.clip_eps_high, clip_ratio_c=l.clip_ratio_c,
                        entropy_coef=l.entropy_coef, kl_coef=l.kl_coef,
                        kl_estimator=l.kl_estimator, kl_clip=l.kl_clip, aggregation=l.aggregation,
                        temperature=cfg.rollout.temperature, tis_threshold=l.tis_threshold),
        optim=OptimConfig(lr=o.lr, schedule=o.schedule, warmup_steps=o.warmup_steps, total_steps=t.steps,
                          min_lr_ratio=o.min_lr_ratio, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay,
                          max_grad_norm=o.max_grad_norm),
        group_size=t.group_size, micro_batches=t.micro_batches, mini_batches=t.mini_batches, ppo_epochs=t.ppo_epochs,
        teacher_micro_batches=t.teacher_micro_batches, logprob_chunk=t.logprob_chunk,
        score_chunk=t.score_chunk, max_turns=cfg.rollout.max_turns,
        length_classes=t.length_classes, pack_rows=t.pack_rows, pack_width=t.pack_width,
        teacher_pack_width=t.teacher_pack_width, micro_batch_groups=t.micro_batch_groups,
        record_teacher=bool(cfg.log.turn_records),
    )


def fault_config(cfg: mlc.ConfigDict):
    """faults.* -> envs.faults.FaultConfig, validated (a ConfigError naming the key)."""
    from turnsight_jax.envs.faults import FaultConfig

    try:
        return FaultConfig(**cfg.faults.to_dict()).validate()
    except (TypeError, ValueError) as e:
        raise ConfigError(str(e)) from None


def rollout_config(cfg: mlc.ConfigDict, *, max_turns: int | None = None) -> RolloutConfig:
    r = cfg.rollout
    return RolloutConfig(max_turns=max_turns or r.max_turns, max_prompt_tokens=r.max_prompt_tokens,
                         max_response_tokens=r.max_response_tokens, max_turn_tokens=r.max_turn_tokens,
                         enable_thinking=r.enable_thinking, end_on_unparsable_turn=r.end_on_unparsable_turn,
                         calls_in_think=r.calls_in_think,
                         observation_template=r.get("observation_template", "project"))


def engine_config(cfg: mlc.ConfigDict) -> EngineConfig | None:
    """The paged engine's settings (rollout.engine == "paged"), else None."""
    r = cfg.rollout
    if r.engine == "lockstep":
        return None
    if r.engine != "paged":
        raise ConfigError(f"rollout.engine must be 'paged' or 'lockstep', got {r.engine!r}")
    try:
        return EngineConfig(slots=int(r.decode_slots), block_size=int(r.kv_block_size), decode_chunk=int(r.decode_chunk),
                            pool_blocks=int(r.kv_pool_blocks))
    except ValueError as e:
        raise ConfigError(str(e)) from None


def sampling_params(cfg: mlc.ConfigDict) -> SamplingParams:
    """The rollouts' sampling."""
    r = cfg.rollout
    return SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k)


def eval_sampling(cfg: mlc.ConfigDict, *, greedy: bool = False) -> SamplingParams:
    """The held-out evaluation's sampling: greedy when eval.temperature is 0 (or `greedy`); the
    tokens only (an evaluation reads no log-probs)."""
    e = cfg.eval
    if greedy or e.temperature <= 0:
        return SamplingParams(greedy=True, logprobs=False)
    return SamplingParams(temperature=e.temperature, top_k=int(e.top_k), top_p=float(e.top_p), logprobs=False)


def _check_wandb(log_cfg) -> None:
    """log.wandb*: the switch, the project and mode, and the package when asked for (before any step)."""
    on = log_cfg.wandb
    if not isinstance(on, bool):
        raise ConfigError(f"log.wandb must be True or False, got {on!r}")
    if not on:
        return
    mode, project = log_cfg.wandb_mode, log_cfg.wandb_project
    if mode not in ("online", "offline"):
        raise ConfigError(f"log.wandb_mode must be 'online' or 'offline', got {mode!r}")
    if not isinstance(project, str) or not project.strip():
        raise ConfigError(f"log.wandb_project must be a non-empty string, got {project!r}")
    import importlib.util

    if importlib.util.find_spec("wandb") is None:
        raise ConfigError("log.wandb=True needs the wandb package, not installed here: "
                          "pip install -e '.[wandb]' (or --config.log.wandb=False)")


def validate(cfg: mlc.ConfigDict, num_devices: int | None = None, *,
             check_data: bool = True) -> tuple[StepConfig, ResolvedMethod]:
    """Check a run config; raise ConfigError with one line naming the problem. Returns the step's
    typed config and the resolved method. `check_data=False` (the dry run) skips the data paths,
    which a memory plan does not need."""
    source = get_source(cfg.data.source, key="data.source", trainable=True)
    get_source(cfg.data.eval_source, key="data.eval_source", trainable=True)
    if check_data and source.needs_path and not cfg.data.path:
        raise ConfigError(f"data.source={cfg.data.source!r} needs data.path")
    if not cfg.model.preset and not cfg.model.hf_path:
        raise ConfigError("set model.preset or model.hf_path")
    for key in ("param_dtype", "compute_dtype", "ref_dtype"):
        if cfg.model[key] not in ("float32", "bfloat16"):
            raise ConfigError(f"model.{key} must be float32 or bfloat16, got {cfg.model[key]!r}")
    for key in ("attn_q_chunk", "vocab_block", "attn_row_group", "attn_key_block"):
        least = 1 if key == "attn_q_chunk" else 0
        if cfg.model[key] < least:
            raise ConfigError(f"model.{key} must be >= {least} (vocab_block 0: the whole vocabulary at once; "
                              f"attn_row_group 0: no padding skipped; attn_key_block 0: one key block per chunk), "
                              f"got {cfg.model[key]}")
    if cfg.model.attn_impl not in ATTENTION_IMPLS:
        raise ConfigError(f"model.attn_impl must be one of {ATTENTION_IMPLS}, got {cfg.model.attn_impl!r}")
    block = cfg.model.attn_block
    if not (isinstance(block, int) and block >= 16 and block & (block - 1) == 0):
        raise ConfigError(f"model.attn_block must be a power of two >= 16 (the fused kernel's tile side), got {block!r}")
    if cfg.model.attn_key_block and not cfg.model.attn_row_group:
        raise ConfigError(f"model.attn_key_block={cfg.model.attn_key_block} needs model.attn_row_group > 0 (key blocks "
                          "are skipped by the kernel that skips the padding), got attn_row_group=0")
    if cfg.train.steps < 0 or cfg.train.prompts_per_step < 1:
        raise ConfigError("train.steps must be >= 0 and train.prompts_per_step >= 1")
    if cfg.train.shapes not in ("grow", "batch"):
        raise ConfigError(f"train.shapes must be 'grow' or 'batch', got {cfg.train.shapes!r}")
    if not cfg.train.shape_reuse >= 0:
        raise ConfigError(f"train.shape_reuse must be a number >= 0, got {cfg.train.shape_reuse!r}")
    if cfg.train.max_skipped_steps < 1:
        raise ConfigError(f"train.max_skipped_steps must be >= 1, got {cfg.train.max_skipped_steps}")
    if cfg.checkpoint.keep < 1:
        raise ConfigError(f"checkpoint.keep must be >= 1 (0 would delete every save), got {cfg.checkpoint.keep}")
    for key, least in (("records_every", 0), ("records_max_kib", 1), ("records_text_chars", 16)):
        value = cfg.log[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ConfigError(f"log.{key} must be an int >= {least}, got {value!r}")
    fault_config(cfg)
    if not isinstance(cfg.log.turn_records, bool):
        raise ConfigError(f"log.turn_records must be True or False, got {cfg.log.turn_records!r}")
    _check_wandb(cfg.log)
    template = cfg.rollout.get("observation_template", "project")
    if template not in OBSERVATION_TEMPLATES:
        raise ConfigError(f"rollout.observation_template must be one of {', '.join(OBSERVATION_TEMPLATES)} "
                          f"(the text after a turn's tool calls), got {template!r}")
    cap = cfg.rollout.get("max_tool_output_chars", 16_384)
    if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
        raise ConfigError(f"rollout.max_tool_output_chars must be an int >= 1 (a tool result longer than that is cut), "
                          f"got {cap!r}")
    for name in {cfg.data.source, cfg.data.eval_source}:
        check_output_cap(name, cap)
    if "builtin" in (cfg.data.source, cfg.data.eval_source):
        from turnsight_jax.sources import synthetic_config

        try:
            synthetic_config(cfg).validate()
        except ValueError as e:
            raise ConfigError(f"data: {e}") from None
    if num_devices is not None:
        shape = [cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor]
        known = [s for s in shape if s != -1]
        prod = 1
        for s in known:
            prod *= s
        if shape.count(-1) > 1 or prod <= 0 or num_devices % prod or (-1 not in shape and prod != num_devices):
            raise ConfigError(
                f"mesh data={shape[0]} x fsdp={shape[1]} x tensor={shape[2]} does not divide {num_devices} devices"
            )
    for section in ("rollout", "eval"):  # the evaluation samples only when its temperature is > 0
        c = cfg[section]
        if section == "eval" and c.temperature <= 0:
            continue
        try:
            SamplingParams(temperature=c.temperature, top_k=int(c.top_k), top_p=float(c.top_p))
        except ValueError as e:
            raise ConfigError(f"{section}: {e}") from None
    sc = step_config(cfg)
    sc.validate()
    method = resolve_method(sc)
    # one rollout call's siblings of a prompt (a controller may sample fewer per call than the group)
    episodes_per_prompt = (cfg.train.group_size if method.rollout.episodes_per_call is None
                           else method.rollout.episodes_per_call(cfg))
    engine = engine_config(cfg)
    if method.rollout.engine_only and engine is None:
        raise ConfigError(f"rl.rollout={method.rollout.name!r} acts inside the paged engine's decode (rollout.control): "
                          f"set rollout.engine=paged (the lockstep sampler has no controller hooks)")
    if engine is not None and num_devices is not None:  # refuse before anything runs, with the numbers
        from turnsight_jax.rollout.engine import check_pool

        tensor = cfg.mesh.tensor if cfg.mesh.tensor > 0 else 1
        try:
            check_pool(engine, max(num_devices // tensor, 1), cfg.rollout.max_prompt_tokens,
                       cfg.rollout.max_response_tokens, episodes_per_prompt)
        except ValueError as e:
            raise ConfigError(f"rollout: {e}") from None
    # a controller that forms its own groups gives each prompt its own number of rows
    if method.rollout.rows_per_prompt is not None:
        sc = dataclasses.replace(sc, prompt_rows=method.rollout.prompt_rows(cfg, cfg.train.group_size))
    rows = cfg.train.prompts_per_step * sc.rows_per_prompt
    sc.validate(rows)
    if (sc.length_classes > 1 or sc.pack_rows) and num_devices is not None:  # whole cells on every row shard
        from turnsight_jax.models.sharding import mesh_shape
        from turnsight_jax.rl.batch import packing_modulus
        from turnsight_jax.rl.length_classes import cell_rows

        data, fsdp, _ = mesh_shape(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor, num_devices)
        if sc.pack_rows:
            packing_modulus(rows, data * fsdp, sc)
        else:
            cell_rows(rows, data * fsdp, sc)
    if method.uses_teacher and sc.teacher.weights == "external":  # architecture and vocabulary, before any load
        from turnsight_jax.models.config import Qwen3Config, get_preset, teacher_architecture

        try:
            policy = Qwen3Config.from_pretrained(cfg.model.hf_path) if cfg.model.hf_path else get_preset(cfg.model.preset)
            teacher_architecture(cfg.teacher.checkpoint, cfg.teacher.preset, policy)
        except (OSError, ValueError) as e:
            raise ConfigError(str(e)) from None
    # The rewards' inputs must exist for the training tasks (e.g. MatchTIR's gold calls).
    later = second_stage(cfg, sc, method)
    stages = [(sc, method)] + ([] if later is None else [(later.step_config, later.method)])
    for section in CONFIG_SECTIONS.values():  # each method's own section (its keys; what its run needs)
        if section.check is not None and section.name in cfg:
            section.check(cfg, stages, check_data)
    for check in CONFIG_CHECKS:  # the methods' other checks (e.g. the privileged teacher's skills file)
        check(cfg, stages, check_data)
    for sc_i, method_i in stages:
        who = f"rl.method={sc_i.algo.method!r}" + (f" over rl.base={sc_i.algo.base!r}" if method_i.base else "")
        for field in method_i.task_needs:
            check_provides(source, (field,), f"{who}: reward {', '.join(method_i.rewards_needing(field))}")
    return sc, method


@dataclasses.dataclass(frozen=True)
class SecondStage:
    """The second stage of a two-stage recipe: rl.switch_method from step `start` (0-based) on."""

    start: int
    step_config: StepConfig
    method: ResolvedMethod


def second_stage(cfg: mlc.ConfigDict, sc: StepConfig, method: ResolvedMethod) -> SecondStage | None:
    """The stage rl.switch_method runs from step rl.switch_step on (every other key as the first
    stage's), or None when rl.switch_step is 0. ConfigError when the two stages need different
    state: learned auxiliaries, or another teacher."""
    step, name = cfg.rl.switch_step, cfg.rl.switch_method
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ConfigError(f"rl.switch_step must be an int >= 0 (0: off), got {step!r}")
    if step == 0:
        if name:
            raise ConfigError(f"rl.switch_method={name!r} needs rl.switch_step > 0 (the step it takes over)")
        return None
    if not name:
        raise ConfigError(f"rl.switch_step={step} needs rl.switch_method (the method from that step on)")
    sc2 = dataclasses.replace(sc, algo=dataclasses.replace(sc.algo, method=name))
    method2 = resolve_method(sc2)
    if method2.rollout.prompt_rows(cfg, sc.group_size) != sc.rows_per_prompt:
        raise ConfigError(f"rl.switch_method={name!r}: its rollout controller {method2.rollout.name!r} gives another "
                          f"number of batch rows per prompt than {method.rollout.name!r}; the two stages share one "
                          f"batch geometry")
    if method2.aux != method.aux:
        raise ConfigError(f"rl.switch_method={name!r}: the two stages must train the same learned auxiliaries "
                          f"(rl.auxiliaries; {method.name}: {list(method.aux)}, {method2.name}: {list(method2.aux)})")
    # the teacher state the trainer keeps (an EMA or an external model) must serve both stages
    kept = lambda m: sc.teacher.weights if m.uses_teacher and sc.teacher.weights in ("ema", "external") else None  # noqa: E731
    if kept(method) != kept(method2):
        raise ConfigError(f"rl.switch_method={name!r}: one stage needs the {kept(method) or kept(method2)} teacher "
                          f"and the other none; both must score with it, or neither")
    return SecondStage(step, sc2, method2)
