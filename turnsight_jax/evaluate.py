"""Evaluate a policy on FTRL, BFCL v4 multi-turn, ToolHop and the built-in tasks.

    python -m turnsight_jax.evaluate --hf HF_DIR --benchmarks ftrl,bfcl,toolhop,builtin \\
        --ftrl ftrl_test.jsonl --toolhop toolhop.json --out results/qwen3-8b
    python -m turnsight_jax.evaluate --checkpoint RUN_DIR [--step N] --benchmarks builtin
    python -m turnsight_jax.evaluate --replay gold --benchmarks bfcl,builtin      # no model

Greedy decoding, group size 1, rows in batches of --batch-size through one policy. Prints the
tables (Markdown) and writes results.json (scores, settings, timing) and examples.jsonl (one
line per task: ids, category, decoded trajectory, turns with calls and results, metrics) into
--out. Input errors (unknown benchmark, missing data, wrong model architecture, tokenizer larger
than the vocabulary, missing replay scripts) print one line and exit with status 2 before any
weights load. See docs/evaluation.md for the metric definitions.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
from typing import Sequence

from turnsight_jax.eval import suites as suite_lib
from turnsight_jax.eval.errors import EvalError
from turnsight_jax.eval.progress import Progress

EXIT_USAGE = 2


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m turnsight_jax.evaluate",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", metavar="RUN_DIR", help="a turnsight_jax training run folder")
    src.add_argument("--hf", metavar="HF_DIR", help="a Hugging Face Qwen3 folder (config.json + safetensors)")
    src.add_argument("--replay", metavar="gold|FILE.jsonl",
                     help="replay fixed turns: the ground truth, or {task_id, turns} lines from a file")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer folder (default: the run's / HF folder's, else the bundled Qwen3 one)")
    p.add_argument("--benchmarks", default="builtin", help=f"comma-separated: {','.join(suite_lib.BENCHMARKS)}")
    p.add_argument("--ftrl", default=None, help="FTRL test file (.jsonl/.parquet or a folder)")
    p.add_argument("--toolhop", default=None, help="ToolHop file (.json list or .jsonl)")
    p.add_argument("--bfcl-limit", type=int, default=None, help="first N BFCL entries per category")
    p.add_argument("--limit", type=int, default=None, help="first N tasks per category, every benchmark")
    p.add_argument("--builtin-per-category", type=int, default=50, help="built-in tasks per category")
    p.add_argument("--builtin-seed", type=int, default=1000, help="seed of the built-in tasks")
    p.add_argument("--out", default=None, help="output folder for results.json and examples.jsonl")
    p.add_argument("--name", default=None, help="model name in the tables")
    p.add_argument("--max-turns", type=int, default=20, help="policy turns per episode (FTRL's eval limit: 20)")
    p.add_argument("--batch-size", type=int, default=32, help="episodes decoded together")
    p.add_argument("--max-new-tokens", type=int, default=1024, help="tokens per policy turn")
    p.add_argument("--max-prompt-tokens", type=int, default=10_000, help="longer prompts are an error")
    p.add_argument("--max-response-tokens", type=int, default=13_000,
                   help="policy + observation tokens per episode (FTRL, ToolHop, built-in)")
    p.add_argument("--bfcl-max-response-tokens", type=int, default=32_768,
                   help="policy + observation tokens per BFCL episode")
    p.add_argument("--enable-thinking", action="store_true", help="Qwen3 thinking mode")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="weights and KV cache")
    p.add_argument("--workers", type=int, default=2, help="tool executor worker processes")
    p.add_argument("--seed", type=int, default=0, help="environment / sampler seed (greedy ignores it)")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    return p


def settings_from_args(args) -> suite_lib.EvalSettings:
    for name in ("max_turns", "batch_size", "max_new_tokens", "max_prompt_tokens", "max_response_tokens",
                 "bfcl_max_response_tokens", "builtin_per_category", "workers"):
        if getattr(args, name) <= 0:
            raise EvalError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    for name in ("limit", "bfcl_limit"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            raise EvalError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    return suite_lib.EvalSettings(
        max_turns=args.max_turns, max_new_tokens=args.max_new_tokens, max_prompt_tokens=args.max_prompt_tokens,
        max_response_tokens=args.max_response_tokens, bfcl_max_response_tokens=args.bfcl_max_response_tokens,
        enable_thinking=args.enable_thinking, batch_size=args.batch_size, limit=args.limit,
        bfcl_limit=args.bfcl_limit, builtin_per_category=args.builtin_per_category,
        builtin_seed=args.builtin_seed, workers=args.workers, seed=args.seed,
    )


def prepare(args):
    """Every check that needs no weights, then the weights: (source, suites, settings)."""
    from turnsight_jax.eval.policies import ModelSource, ReplaySource, tokenizer_from
    from turnsight_jax.eval.scripts import check_gold_supported

    benchmarks = suite_lib.parse_benchmarks(args.benchmarks)
    settings = settings_from_args(args)
    if args.step is not None and not args.checkpoint:
        raise EvalError("--step applies to --checkpoint only")
    suite_lib.check_inputs(benchmarks, args.ftrl, args.toolhop)
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
        source = ModelSource(spec, tokenizer, dtype=args.dtype, seed=args.seed, label=args.name)
    suites = [suite_lib.load_suite(b, settings, ftrl_path=args.ftrl, toolhop_path=args.toolhop) for b in benchmarks]
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
    from turnsight_jax.eval.runner import run_suites
    from turnsight_jax.eval.scoring import markdown, summarise

    t0 = time.monotonic()
    source, suites, settings = prepare(args)
    setup_s = time.monotonic() - t0
    progress = Progress(sum(len(s) for s in suites), stream=None if not args.quiet else _Null())
    examples, stats = run_suites(source, suites, settings, progress=progress)
    summary = summarise(suites, examples)
    results = {
        "model": source.label,
        "source": source.describe(),
        "settings": {**vars(settings), "benchmarks": [s.benchmark for s in suites], "greedy": True,
                     "ftrl_path": args.ftrl, "toolhop_path": args.toolhop},
        **summary,
        "timing": {"setup_s": setup_s, "total_s": time.monotonic() - t0, "benchmarks": stats},
    }
    return {"results": results, "markdown": markdown(source.label, summary), "examples": examples}


class _Null:
    def write(self, _):
        pass

    def flush(self):
        pass


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
