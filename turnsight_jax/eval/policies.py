"""Where policy turns come from: a model (training run or Hugging Face folder) or a replay.

Everything after the policy is shared: the evaluation loop asks a `PolicySource` for the
`TurnPolicy` of one batch of tasks and hands it to the same rollout driver, environments,
scoring and tables. `ModelSource` returns a `ModelPolicy` per batch (greedy or sampled, seeded
as the runner says); `ReplaySource` a `ReplayPolicy` over the batch's scripts (each repeated
group-size times).

Model loading is split in two: `ModelSource.inspect` reads only config.json and the tokenizer
(architecture and vocabulary checks, fast, before any heavy work), `ModelSource.load` then reads
the weights.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any, Protocol, Sequence

from turnsight_jax.chat.types import Task
from turnsight_jax.eval import scripts as script_lib
from turnsight_jax.eval.errors import EvalError
from turnsight_jax.rollout.driver import ModelPolicy, ReplayPolicy, RolloutConfig, TurnPolicy
from turnsight_jax.rollout.sampler import SamplingParams


class PolicySource(Protocol):
    label: str
    tokenizer: Any

    def describe(self) -> dict:
        """What produced the turns (for results.json)."""

    def check(self, benchmark: str, tasks: Sequence[Task]) -> None:
        """Raise EvalError when the source cannot serve these tasks (before any rollout)."""

    def policy_for(self, benchmark: str, tasks: Sequence[Task], config: RolloutConfig, *,
                   group_size: int, seed: int) -> TurnPolicy:
        """The policy for one batch of tasks, `group_size` rollouts each, seeded `seed`."""

    def completer_for(self, benchmark: str, step_tokens: int, *, seed: int):
        """Replies for BFCL's own loop (`eval.bfcl_harness`): a completer keyed by (task, sample)."""


# ---------------------------------------------------------------------------------------------
# Replay
# ---------------------------------------------------------------------------------------------
class ReplaySource:
    """Fixed turn texts: the ground truth (`mode="gold"`) or a script file."""

    def __init__(self, mode: str, tokenizer, label: str | None = None):
        self.tokenizer = tokenizer
        self.mode = mode
        self._file = None if mode == "gold" else script_lib.load_script_file(mode)
        self.label = label or ("replay: gold" if mode == "gold" else f"replay: {pathlib.Path(mode).name}")

    def describe(self) -> dict:
        return {"kind": "replay", "script": self.mode}

    def script(self, benchmark: str, task: Task) -> list[str]:
        if self._file is None:
            return script_lib.gold_script(benchmark, task)
        return script_lib.file_script(self._file, benchmark, task)

    def check(self, benchmark, tasks):
        if self._file is None:
            script_lib.check_gold_supported([benchmark])
        missing = [t.task_id for t in tasks if self._missing(benchmark, t)]
        if missing:
            raise EvalError(
                f"--replay {self.mode}: no script for {len(missing)} of {len(tasks)} {benchmark} tasks "
                f"(first: {', '.join(map(repr, missing[:3]))})"
            )

    def _missing(self, benchmark, task) -> bool:
        try:
            self.script(benchmark, task)
        except EvalError:
            return True
        return False

    def policy_for(self, benchmark, tasks, config, *, group_size, seed):
        return ReplayPolicy(self.tokenizer, [self.script(benchmark, t) for t in tasks for _ in range(group_size)])

    def completer_for(self, benchmark, step_tokens, *, seed):
        from turnsight_jax.eval.bfcl_harness import ScriptCompleter

        def script_of(key):
            task, _ = key
            if task.extra.get("bfcl_answers", ()) is None and self._missing(benchmark, task):
                return []  # a Memory prerequisite without a script: every user turn ends at once
            return self.script(benchmark, task)

        return ScriptCompleter(script_of, self.tokenizer)


# ---------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------
def tokenizer_from(folder) -> Any:
    """Loads a tokenizer folder; the bundled Qwen3 tokenizer is loaded once per process."""
    from turnsight_jax.assets import default_tokenizer, default_tokenizer_dir
    from turnsight_jax.chat.tokenizer import load_tokenizer

    if folder is None or pathlib.Path(folder) == default_tokenizer_dir():
        return default_tokenizer()
    return load_tokenizer(folder)


@dataclasses.dataclass
class ModelSpec:
    """What `inspect` found: the model folder, its config, the tokenizer folder."""

    kind: str  # "checkpoint" or "hf"
    path: pathlib.Path
    step: int | None
    config: Any
    tokenizer_dir: pathlib.Path


class ModelSource:
    """A Qwen3 from a training run (`--checkpoint`) or an HF folder (`--hf`), decoding with
    `sampling` (greedy by default). `options`: the model's runtime options (a run's own, so its
    numerics match the training-time evaluation)."""

    def __init__(self, spec: ModelSpec, tokenizer, *, dtype: str = "float32",
                 sampling: SamplingParams = SamplingParams(greedy=True), options=None, label: str | None = None):
        self.spec = spec
        self.tokenizer = tokenizer
        self.dtype = dtype
        self.sampling = sampling
        self.options = options
        self._named = label is not None
        self.label = label or spec.path.name
        self.graphdef = self.state = None

    @staticmethod
    def inspect(kind: str, path: str, *, step: int | None = None, tokenizer_dir: str | None = None) -> "ModelSpec":
        """Architecture and tokenizer checks from config.json alone; raises EvalError."""
        from turnsight_jax.model_setup import tokenizer_folder
        from turnsight_jax.models.config import Qwen3Config

        folder = pathlib.Path(path)
        flag = "--checkpoint" if kind == "checkpoint" else "--hf"
        if not folder.is_dir():
            raise EvalError(f"{flag} {folder}: no such folder")
        if kind == "checkpoint":
            model_dir = folder / "model"
            if not (model_dir / "config.json").is_file():
                from turnsight_jax.checkpointing import read_run_config

                try:  # a Hugging Face folder (a run's export): the run-config reader names it, with --hf
                    read_run_config(folder)
                    hint = ""
                except ValueError as e:
                    hint = f": {e}"
                raise EvalError(f"{flag} {folder}: not a turnsight_jax run folder (no model/config.json){hint}")
            default_tok = folder / "tokenizer"
        else:
            model_dir = folder
            if not (model_dir / "config.json").is_file():
                raise EvalError(f"{flag} {folder}: no config.json (expected a Hugging Face Qwen3 model folder)")
            default_tok = tokenizer_folder(None, folder)  # the folder's own, else the bundled one
        try:
            cfg = Qwen3Config.from_pretrained(model_dir)
        except (ValueError, FileNotFoundError) as e:
            raise EvalError(str(e)) from None
        tok_dir = pathlib.Path(tokenizer_dir) if tokenizer_dir else default_tok
        return ModelSpec(kind, folder, step, cfg, tok_dir)

    @staticmethod
    def load_tokenizer(spec: ModelSpec):
        """The tokenizer, checked against the model's vocabulary; raises EvalError."""
        from turnsight_jax.chat.tokenizer import check_vocab_fits

        try:
            tok = tokenizer_from(spec.tokenizer_dir)
            check_vocab_fits(tok, spec.config.vocab_size)
        except (ValueError, FileNotFoundError, TypeError) as e:
            raise EvalError(f"{spec.path}: {e}") from None
        return tok

    def load(self) -> None:
        """Reads the weights (the heavy part)."""
        from flax import nnx

        from turnsight_jax.model_setup import DTYPES
        from turnsight_jax.models.qwen3 import RuntimeOptions

        dtype = DTYPES[self.dtype]
        options = self.options or RuntimeOptions()
        try:
            if self.spec.kind == "checkpoint":
                from turnsight_jax.checkpointing import load_policy_from_run

                model, _, step = load_policy_from_run(self.spec.path, step=self.spec.step, options=options)
                self.spec.step = step
                if not self._named:
                    self.label = f"{self.spec.path.name}@{step}"
                if self.dtype != "float32":
                    model = nnx.merge(*_cast(nnx.split(model), dtype))
            else:
                from turnsight_jax.models.weights import load_pretrained

                model = load_pretrained(self.spec.path, dtype=dtype, options=options)
        except (ValueError, FileNotFoundError) as e:
            raise EvalError(str(e)) from None
        self.graphdef, self.state = nnx.split(model)
        self._cache_dtype = dtype

    def describe(self) -> dict:
        return {"kind": self.spec.kind, "path": str(self.spec.path), "step": self.spec.step,
                "tokenizer": str(self.spec.tokenizer_dir), "dtype": self.dtype}

    def check(self, benchmark, tasks):
        pass

    def policy_for(self, benchmark, tasks, config, *, group_size, seed):
        if self.graphdef is None:
            raise RuntimeError("ModelSource.load() must run before policy_for()")
        return ModelPolicy(self.graphdef, self.state, self.tokenizer, sampling=self.sampling, config=config,
                           seed=seed, cache_dtype=self._cache_dtype)

    def completer_for(self, benchmark, step_tokens, *, seed):
        from turnsight_jax.eval.bfcl_harness import ModelCompleter

        if self.graphdef is None:
            raise RuntimeError("ModelSource.load() must run before completer_for()")
        # Each step prefills its prompt anew: the cache needs the prompt plus one step's tokens.
        config = RolloutConfig(max_turns=1, max_response_tokens=step_tokens, max_turn_tokens=step_tokens)
        return ModelCompleter(lambda: ModelPolicy(self.graphdef, self.state, self.tokenizer, sampling=self.sampling,
                                                  config=config, seed=seed, cache_dtype=self._cache_dtype),
                              self.tokenizer)


def _cast(split: tuple, dtype) -> tuple:
    import jax

    graphdef, state = split
    return graphdef, jax.tree_util.tree_map(
        lambda x: x.astype(dtype) if hasattr(x, "dtype") and x.dtype.kind == "f" else x, state)
