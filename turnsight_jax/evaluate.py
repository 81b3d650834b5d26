"""Evaluate a policy on FTRL, BFCL v4 (multi-turn, Memory, Web Search), ToolHop and the built-in tasks.

    python -m turnsight_jax.evaluate --hf HF_DIR --benchmarks ftrl,bfcl,toolhop,builtin \\
        --ftrl ftrl_test.jsonl --toolhop toolhop.json --out results/qwen3-8b
    python -m turnsight_jax.evaluate --checkpoint RUN_DIR [--step N] --benchmarks builtin
    python -m turnsight_jax.evaluate --replay gold --benchmarks bfcl,builtin      # no model

Defaults are the released MatchTIR evaluation's: greedy decoding, 10 policy turns for FTRL, 9
for ToolHop (its tool scenarios; the default `--toolhop-scenario direct` is one generation), no
per-turn token cap (only the response budget), Qwen3 thinking on for a post-trained Qwen3 (see
`thinking_default`), every BFCL subset of the paper's average (`--bfcl-categories`; Web Search
needs `--bfcl-search-backend`); the printed header states each. `--temperature T --samples N
[--top-k K] [--top-p P]` samples N rollouts per task and averages each task's metrics over them. Rollouts go in batches of
--batch-size episodes (batch_size // N tasks), the batch starting at task i with a policy seeded
--seed + i: the seeding of the training-time held-out evaluation. With `--checkpoint RUN` and
`--benchmarks builtin`, a run folder that has its config.json (written by training) evaluates the
run's own held-out built-in tasks (data.num_eval tasks of the run's held-out seed stream, in the
run's order) with the run's budgets (rollout.*, eval.max_turns), batch size (eval.batch_size),
seed and model runtime options, so that `--temperature 1 --top-k 20 --samples 4` (the run's eval.*
sampling) reproduces the run's held-out evaluation exactly (results.json's `heldout` = its
summary.json entry: the paper's FTRL metrics `ftrl`, the same function as the tables, and the
task-pooled `task_mean_*`); giving --builtin-per-category or
--builtin-seed evaluates the generic built-in suite instead. Prints the sampling mode and the
tables (Markdown) and writes results.json (scores, settings, timing) and examples.jsonl (one
line per task: ids, category, decoded trajectory, turns with calls and results, metrics) into
--out. Input errors (unknown benchmark, missing data, wrong model architecture, tokenizer larger
than the vocabulary, missing replay scripts) print one line and exit with status 2 before any
weights load. See docs/evaluation.md for the metric definitions.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import time
from typing import Sequence

import turnsight_jax.methods  # noqa: F401  (the composition root: the built-in methods register themselves)
from turnsight_jax.eval import suites as suite_lib
from turnsight_jax.eval.errors import EvalError

EXIT_USAGE = 2
# Flags whose unset value (None) means: the run's value for a run's held-out tasks, else this.
# max_turns None: each benchmark's default (eval/suites.py DEFAULT_MAX_TURNS, ToolHop per scenario);
# max_new_tokens None: no per-turn cap (the response budget alone; BFCL: its 4096 per step).
DEFAULTS = dict(max_turns=None, batch_size=32, max_new_tokens=None, max_prompt_tokens=10_000,
                max_response_tokens=13_000, builtin_per_category=50, builtin_seed=1000, seed=0)


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except None (those flags state their default in their help) and on/off
    switches (a store_false switch's own default, True, is not the option's)."""

    def _get_help_string(self, action):
        return action.help if action.default is None or action.nargs == 0 else super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m turnsight_jax.evaluate",
                                description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n")[2].split(" Prints the sampling mode")[0],
                                formatter_class=_Formatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", metavar="RUN_DIR", help="a turnsight_jax training run folder")
    src.add_argument("--hf", metavar="HF_DIR", help="a Hugging Face Qwen3 folder (config.json + safetensors)")
    src.add_argument("--replay", metavar="gold|FILE.jsonl",
                     help="replay fixed turns: the ground truth, or {task_id, turns} lines from a file")
    p.add_argument("--run", metavar="RUN_DIR", default=None,
                   help="with --benchmarks builtin: evaluate on this training run's held-out tasks with its rollout "
                        "settings (default: the run of --checkpoint, or the run a --hf export came from)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer folder (default: the run's / HF folder's, else the bundled Qwen3 one)")
    p.add_argument("--benchmarks", default="builtin", help=f"comma-separated: {','.join(suite_lib.BENCHMARKS)}")
    p.add_argument("--ftrl", default=None, help="FTRL test file (.jsonl/.parquet or a folder)")
    p.add_argument("--toolhop", default=None, help="ToolHop file (.json list or .jsonl)")
    p.add_argument("--bfcl-limit", type=int, default=None, help="first N entries of every selected BFCL category (Memory: N questions per backend, "
                        "plus every prerequisite conversation of their scenarios)")
    p.add_argument("--limit", type=int, default=None, help="first N tasks per category, every benchmark")
    p.add_argument("--builtin-per-category", type=int, default=None,
                   help=f"built-in tasks per category (default {DEFAULTS['builtin_per_category']}; given: the "
                        "generic built-in suite even for a run folder)")
    p.add_argument("--builtin-seed", type=int, default=None,
                   help=f"seed of the built-in tasks (default {DEFAULTS['builtin_seed']}; given: as above)")
    p.add_argument("--out", default=None, help="output folder for results.json, results.md and examples.jsonl "
                                               "(without it nothing is written: the tables go to stdout)")
    p.add_argument("--name", default=None, help="model name in the tables")
    p.add_argument("--max-turns", type=int, default=None,
                   help="policy turns per episode, every benchmark but BFCL (default: the released evaluation's, "
                        "FTRL and built-in 10, ToolHop 9 or 1 for --toolhop-scenario direct; a run's held-out "
                        "tasks: its eval.max_turns)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="episodes decoded together (default 32; a run's held-out tasks: its eval.batch_size)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="per-turn token cap (default: off, only the response budget applies; BFCL: its own 4096 "
                        "per step; a run's held-out tasks: its rollout.max_turn_tokens, 0 = off)")
    p.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="longer prompts are an error (default 10000; a run's: rollout.max_prompt_tokens)")
    p.add_argument("--max-response-tokens", type=int, default=None,
                   help="policy + observation tokens per episode, FTRL, ToolHop, built-in (default 13000; "
                        "a run's: rollout.max_response_tokens)")
    p.add_argument("--bfcl-max-response-tokens", type=int, default=32_768,
                   help="policy + observation tokens per BFCL episode")
    p.add_argument("--bfcl-memory-embedding-model", metavar="DIR", default=None,
                   help="local sentence-transformers model folder (BFCL uses all-MiniLM-L6-v2): runs the vector "
                        "Memory backend (needs sentence-transformers, faiss-cpu); default: that backend is not run")
    p.add_argument("--bfcl-categories", metavar="NAMES", default=None,
                   help="comma-separated bfcl-eval categories to run: "
                        f"{', '.join(suite_lib.BFCL_SUBSET_CATEGORIES)}, or the groups "
                        f"{', '.join(suite_lib.BFCL_CATEGORY_GROUPS)} (default: all, the paper's six subsets)")
    p.add_argument("--bfcl-search-backend", metavar="SPEC", default=None,
                   help="Web Search backend: corpus:PATH (offline pages, a JSONL of {url, title, text}) or "
                        "module:attr (your importable backend, see turnsight_jax/envs/web_search.py); default: Web "
                        "Search is not run")
    think = p.add_mutually_exclusive_group()
    think.add_argument("--enable-thinking", action="store_true", default=None,
                       help="Qwen3 thinking mode on (default: on for a post-trained Qwen3, see docs/evaluation.md)")
    think.add_argument("--no-thinking", dest="enable_thinking", action="store_false",
                       help="Qwen3 thinking mode off (an empty think block opens every turn)")
    p.add_argument("--toolhop-scenario", choices=("direct", "mandatory", "free"), default="direct",
                   help="ToolHop paper's scenario: direct (no tools, one generation: the released evaluation's "
                        "default), mandatory (tools, must call them), free (tools, may call them)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="weights and KV cache")
    p.add_argument("--workers", type=int, default=2, help="tool executor worker processes")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0: greedy")
    p.add_argument("--samples", type=int, default=1,
                   help="rollouts per task when sampling (each task's metrics: their mean)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens; 0: off")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass; 1.0: off")
    p.add_argument("--seed", type=int, default=None,
                   help="sampler / environment seed (default 0; a run's held-out tasks: the run's seed)")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    return p


def run_config_for(args, benchmarks: Sequence[str]):
    """The run's config when `--benchmarks builtin` evaluates a training run's held-out tasks: the
    run of `--run`, of `--checkpoint`, or the one a `--hf` export came from (its
    turnsight_run.json), when that run's held-out source is builtin and neither
    --builtin-per-category nor --builtin-seed asks for the generic suite; else None."""
    from turnsight_jax.checkpointing import read_export_run_config, read_run_config

    if "builtin" not in benchmarks:
        if args.run:
            raise EvalError("--run evaluates a run's held-out tasks: it needs --benchmarks builtin")
        return None
    try:
        if args.run:
            cfg = read_run_config(args.run)
            if cfg is None:
                raise EvalError(f"--run {args.run}: not a turnsight_jax run folder (no config.json)")
        elif args.checkpoint:
            cfg = read_run_config(args.checkpoint)
        elif args.hf:
            cfg = read_export_run_config(args.hf)
        else:
            cfg = None
    except ValueError as e:
        raise EvalError(str(e)) from None
    if cfg is None or cfg.data.eval_source != "builtin":
        return None
    if args.builtin_per_category is not None or args.builtin_seed is not None:
        print(f"warning: --builtin-per-category / --builtin-seed: the generic built-in suite, not the task family "
              f"this model's run trained on (data.vocab_size={cfg.data.vocab_size}, num_relations="
              f"{cfg.data.num_relations}); its scores are not comparable with the run's held-out numbers",
              file=sys.stderr)
        return None
    return cfg


def settings_from_args(args, run_cfg=None) -> suite_lib.EvalSettings:
    """EvalSettings from the flags; unset flags take the run's values (held-out mode) or DEFAULTS."""
    from turnsight_jax.rollout.sampler import SamplingParams

    run = {} if run_cfg is None else dict(
        max_turns=run_cfg.eval.max_turns, batch_size=run_cfg.eval.batch_size,
        max_new_tokens=run_cfg.rollout.max_turn_tokens or None, max_prompt_tokens=run_cfg.rollout.max_prompt_tokens,
        max_response_tokens=run_cfg.rollout.max_response_tokens, seed=run_cfg.seed)
    values = {k: getattr(args, k) if getattr(args, k) is not None else run.get(k, d) for k, d in DEFAULTS.items()}
    for name in ("max_turns", "batch_size", "max_new_tokens", "max_prompt_tokens", "max_response_tokens",
                 "builtin_per_category", "samples"):
        value = values.get(name, getattr(args, name, None))
        if value is not None and value <= 0:
            raise EvalError(f"--{name.replace('_', '-')} must be positive, got {value}")
    for name in ("bfcl_max_response_tokens", "workers"):
        if getattr(args, name) <= 0:
            raise EvalError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    for name in ("limit", "bfcl_limit"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            raise EvalError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.temperature < 0:
        raise EvalError(f"--temperature must be >= 0, got {args.temperature:g}")
    if args.temperature > 0:
        try:
            SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
        except ValueError as e:
            raise EvalError(f"--temperature/--top-k/--top-p: {e}") from None
    elif args.samples != 1:
        raise EvalError(f"--samples {args.samples} needs --temperature > 0 (greedy rollouts are all the same)")
    categories = (suite_lib.BFCL_SUBSET_CATEGORIES if args.bfcl_categories is None
                  else suite_lib.parse_bfcl_categories(args.bfcl_categories))
    return suite_lib.EvalSettings(
        bfcl_categories=categories, max_prompt_tokens=values["max_prompt_tokens"],
        bfcl_max_response_tokens=args.bfcl_max_response_tokens,
        enable_thinking=bool(args.enable_thinking), toolhop_scenario=args.toolhop_scenario, limit=args.limit,
        bfcl_memory_embedding_model=args.bfcl_memory_embedding_model, bfcl_search_backend=args.bfcl_search_backend,
        bfcl_limit=args.bfcl_limit, workers=args.workers,
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, samples=args.samples,
        **{k: values[k] for k in ("max_turns", "batch_size", "max_new_tokens", "max_response_tokens",
                                  "builtin_per_category", "builtin_seed", "seed")},
    )


def thinking_default(args, run_cfg=None, tokenizer=None) -> tuple[bool, str]:
    """(thinking on?, why) when neither --enable-thinking nor --no-thinking is given.

    The rule: a training run's folder: the run's rollout.enable_thinking (how it was trained and
    evaluated); an HF folder: on for a post-trained Qwen3 (the paper configs' starting point),
    i.e. unless the folder's name ends in "-Base" (Qwen's name for the pre-trained checkpoints)
    or its tokenizer's chat template has no `enable_thinking` switch; a replay: off (no model).
    """
    if run_cfg is not None or args.checkpoint:
        on = bool(run_cfg.rollout.enable_thinking) if run_cfg is not None else _run_thinking(args.checkpoint)
        return on, "the run's rollout.enable_thinking"
    if args.hf:
        name = pathlib.Path(args.hf).resolve().name
        if name.lower().endswith("-base"):
            return False, f"a pre-trained Qwen3 ({name})"
        template = getattr(tokenizer, "chat_template", None) or ""
        if tokenizer is not None and "enable_thinking" not in template:
            return False, "its chat template has no thinking switch"
        return True, "a post-trained Qwen3"
    return False, "replay"


def _run_thinking(run_dir) -> bool:
    from turnsight_jax.checkpointing import read_run_config

    try:
        cfg = read_run_config(run_dir)
    except ValueError:
        return False
    return bool(cfg is not None and cfg.rollout.enable_thinking)


def describe_settings(settings: suite_lib.EvalSettings, benchmarks: Sequence[str]) -> str:
    """The header lines: decoding, turns, token budgets, thinking (what the tables were run with)."""
    turns = []
    for b in benchmarks:
        if b == "bfcl":
            turns.append("BFCL up to 20 steps per user turn (its force-quit limit)")
        elif b == "toolhop":
            turns.append(f"ToolHop {settings.turns_for(b)} ({settings.toolhop_scenario} scenario)")
        else:
            turns.append(f"{suite_lib.TITLES[b]} {settings.turns_for(b)}")
    per_turn = "off" if settings.max_new_tokens is None else str(settings.max_new_tokens)
    budget = (f"{settings.max_response_tokens} response tokens per episode"
              + (f" (BFCL {settings.bfcl_max_response_tokens})" if "bfcl" in benchmarks else "")
              + f", per-turn cap {per_turn}"
              + (f" (BFCL {settings.max_new_tokens or suite_lib.BFCL_STEP_TOKENS} per step)" if "bfcl" in benchmarks
                 else "")
              + f", prompts up to {settings.max_prompt_tokens}")
    subsets = f"BFCL categories: {', '.join(settings.bfcl_categories)}.\n" if "bfcl" in benchmarks else ""
    return (f"Decoding: {sampling_mode(settings)}.\nTurns: {'; '.join(turns)}.\nToken budget: {budget}.\n"
            f"Thinking: {'on' if settings.enable_thinking else 'off'} ({settings.thinking_rule}).\n{subsets}")


def sampling_mode(settings: suite_lib.EvalSettings) -> str:
    from turnsight_jax.eval.runner import describe_sampling

    return describe_sampling(settings.temperature, settings.group_size, settings.top_k, settings.top_p)


def prepare(args):
    """Every check that needs no weights, then the weights: (source, suites, settings)."""
    from turnsight_jax.eval.policies import ModelSource, ReplaySource, tokenizer_from
    from turnsight_jax.eval.scripts import check_gold_supported
    from turnsight_jax.rollout.sampler import SamplingParams

    benchmarks = suite_lib.parse_benchmarks(args.benchmarks)
    run_cfg = run_config_for(args, benchmarks)
    settings = settings_from_args(args, run_cfg)
    if args.step is not None and not args.checkpoint:
        raise EvalError("--step applies to --checkpoint only")
    suite_lib.check_inputs(benchmarks, args.ftrl, args.toolhop)
    if "bfcl" in benchmarks:
        suite_lib.check_bfcl_options(settings)
    if args.replay == "gold":
        check_gold_supported(benchmarks)
    if args.replay:
        try:
            tokenizer = tokenizer_from(args.tokenizer)
        except (OSError, ValueError, TypeError) as e:
            raise EvalError(f"--tokenizer: {e}") from None
        source = ReplaySource(args.replay, tokenizer, label=args.name)
    else:
        kind, path = ("checkpoint", args.checkpoint) if args.checkpoint else ("hf", args.hf)
        spec = ModelSource.inspect(kind, path, step=args.step, tokenizer_dir=args.tokenizer)
        tokenizer = ModelSource.load_tokenizer(spec)
        sampling = SamplingParams(greedy=True) if settings.greedy else SamplingParams(
            temperature=settings.temperature, top_k=settings.top_k, top_p=settings.top_p)
        options = None
        if run_cfg is not None:
            from turnsight_jax.model_setup import runtime_options

            options = runtime_options(run_cfg)
        source = ModelSource(spec, tokenizer, dtype=args.dtype, sampling=sampling, options=options, label=args.name)
    if args.enable_thinking is None:
        on, why = thinking_default(args, run_cfg, tokenizer)
    else:
        on, why = bool(args.enable_thinking), ("--enable-thinking" if args.enable_thinking else "--no-thinking")
    settings = dataclasses.replace(settings, enable_thinking=on, thinking_rule=why)
    suites = [suite_lib.run_heldout_suite(run_cfg, settings) if b == "builtin" and run_cfg is not None else
              suite_lib.load_suite(b, settings, ftrl_path=args.ftrl, toolhop_path=args.toolhop) for b in benchmarks]
    for suite in suites:
        source.check(suite.benchmark, suite.tasks)
    if isinstance(source, ModelSource):
        source.load()
    return source, suites, settings


def write_outputs(out: pathlib.Path, evaluation: dict) -> None:
    """results.json, results.md (the tables) and examples.jsonl under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(evaluation["results"], indent=2) + "\n")
    (out / "results.md").write_text(evaluation["markdown"])
    with open(out / "examples.jsonl", "w", encoding="utf-8") as f:
        for e in evaluation["examples"]:
            f.write(json.dumps(e.to_json(), ensure_ascii=False) + "\n")


def evaluate(args) -> dict:
    """Runs the evaluation described by parsed `args`: {"results", "markdown", "examples"}."""
    from turnsight_jax.eval.heldout import summarise_tasks
    from turnsight_jax.eval.runner import run_suites
    from turnsight_jax.eval.scoring import markdown, summarise
    from turnsight_jax.rollout.progress import ProgressLine

    t0 = time.monotonic()
    source, suites, settings = prepare(args)
    setup_s = time.monotonic() - t0
    mode = sampling_mode(settings)
    header = describe_settings(settings, [s.benchmark for s in suites])
    if not args.quiet:  # what is about to run, before the (possibly long) decoding
        print(f"evaluating {source.label}" + (" on its run's held-out tasks, with the run's rollout settings"
                                               if any(s.heldout for s in suites) else "") + f":\n{header}",
              file=sys.stderr, flush=True)
    progress = ProgressLine(sum(len(s) for s in suites) * settings.group_size, quiet=args.quiet)
    examples, stats = run_suites(source, suites, settings, progress=progress)
    summary = summarise(suites, examples)
    results = {
        "model": source.label,
        "source": source.describe(),
        "settings": {**vars(settings), "benchmarks": [s.benchmark for s in suites], "greedy": settings.greedy,
                     "sampling": mode, "ftrl_path": args.ftrl, "toolhop_path": args.toolhop},
        **summary,
        "timing": {"setup_s": setup_s, "total_s": time.monotonic() - t0, "benchmarks": stats},
    }
    held = [s for s in suites if s.heldout]
    if held:
        # The training run's own held-out evaluation, as summary.json holds it: the paper's FTRL
        # metrics (`ftrl`, the same numbers as the builtin table) and the task-pooled means.
        held_examples = [e for e in examples if e.benchmark == held[0].benchmark]
        ho = summarise_tasks([e.metrics for e in held_examples], mode, [e.category for e in held_examples])
        results["heldout"] = ho
        header += (f"Run held-out tasks ({ho['n']} tasks of the run's held-out stream): FTRL Avg "
                   f"{ho['ftrl']['avg']:.4f} (category averages as in the table below; summary.json "
                   f"eval_after_rl.ftrl.avg); task-mean Solve-F1 {ho.get('task_mean_solve_f1', float('nan')):.4f} ± "
                   f"{ho.get('task_mean_solve_f1_se', 0.0):.4f} (mean over tasks).\n")
    return {"results": results, "markdown": header + "\n" + markdown(source.label, summary), "examples": examples}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        out = evaluate(args)
    except EvalError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    print(out["markdown"])
    if args.out:
        write_outputs(pathlib.Path(args.out), out)
        print(f"wrote {pathlib.Path(args.out) / 'results.json'} and examples.jsonl ({len(out['examples'])} lines)",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
