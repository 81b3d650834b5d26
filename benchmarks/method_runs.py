"""Methods whose cost lies outside the train step (SLIM's audits and skill writing, the model
judge's decoding, the rollout controllers BAR, AKBE, T2PO and APPO), against GRPO, as whole trainer steps:
`python -m turnsight_jax.train` runs of each method's tiny config at the same sizes, from the
same random tiny-default policy (or, with --warm_start, from one supervised warm-start shared by
every run: a controller that reacts to successes, BAR, needs a policy that succeeds sometimes).

    python benchmarks/method_runs.py [--steps 4] [--methods grpo,slim,judge,bar,akbe] [--warm_start]
    python benchmarks/method_runs.py --warm_start --methods grpo,grpo_paged,grpo_thinking,t2po,appo

Each run: 2 prompts x 4 samples per step, no warm-start, no held-out evaluation. The per-step
cost is perf/step_s (rollout + update) plus slim/audit_s (SLIM's leave-one-out audit and its
writer run after the step, outside perf/step_s), the median over the steps after the first (the
first compiles). The judge is a random tiny-default model written to a folder here: it never
closes its output, so it decodes its full `judge.max_new_tokens` (48 in the tiny config) for
every trajectory, the worst case. BAR (configs/methods/bar.py: 2 rollouts a round, up to 8) and
AKBE (a no-tool group as large as the with-tool one) sample a different number of episodes than
GRPO's 2 x 4: the table gives each run's episodes and tokens per step (rollout/episodes,
rollout/decoded_tokens) and their ratio to GRPO's. T2PO and APPO run in the paged engine (their
hooks live in its decode) and T2PO with thinking on: `grpo_paged` (GRPO on the paged engine) and
`grpo_thinking` (the same, thinking on) are their like-for-like baselines, their ratio to which is
in the note with what the controller did: T2PO's TTI triggers and TDS re-samples and the tokens it
decoded then dropped, APPO's branches, the tokens they sampled past their branch points and the
prefix tokens they reused without prefill (rollout/prefill_tokens stays the prompts'). Prints a
table with the ratio to GRPO's step."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from common import machine, table  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
SIZES = ["--config.model.allow_random_init=True", "--config.sft.steps=0", "--config.sft.curriculum_steps=0",
         "--config.data.num_eval=0", "--config.train.prompts_per_step=2", "--config.train.group_size=4",
         "--config.checkpoint.every=0", "--config.log.tensorboard=False", "--config.checkpoint.export_at_end=False"]


def random_judge(folder: pathlib.Path) -> pathlib.Path:
    """A random tiny-default Qwen3 as a Hugging Face folder with the bundled tokenizer."""
    import shutil

    from turnsight_jax.assets import default_tokenizer_dir
    from turnsight_jax.models.config import get_preset
    from turnsight_jax.models.qwen3 import init_model
    from turnsight_jax.models.weights import save_pretrained

    save_pretrained(init_model(get_preset("tiny-default"), seed=7), folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(default_tokenizer_dir() / name, folder / name)
    return folder


# GRPO on the embedded default (the lockstep sampler), and the paged engine's runs T2PO and APPO compare with.
BASELINES = {"grpo": ["--config.rl.method=grpo"],
             "grpo_paged": ["--config.rl.method=grpo", "--config.rollout.engine=paged"],
             "grpo_thinking": ["--config.rl.method=grpo", "--config.rollout.engine=paged",
                               "--config.rollout.enable_thinking=True"]}
# each controller's like-for-like baseline (same engine, same thinking mode)
PAGED_BASELINE = {"t2po": "grpo_thinking", "appo": "grpo_paged"}


# The warm-start of --warm_start (tests/_train_runs.py's: gold demonstrations, 200 + 60 steps of 4 rows).
WARM_START = ["--config.sft.curriculum_steps=200", "--config.sft.steps=60", "--config.sft.batch_size=4",
              "--config.sft.num_tasks=128", "--config.sft.wrong_call_rate=0.0"]


def warm_start(folder: pathlib.Path) -> pathlib.Path:
    """`python -m turnsight_jax.sft` at WARM_START -> folder/sft (copied into every run folder)."""
    args = [sys.executable, "-m", "turnsight_jax.sft", "--workdir", str(folder), *WARM_START]
    proc = subprocess.run(args, cwd=REPO, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"warm-start: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return folder / "sft"


def run(method: str, workdir: pathlib.Path, steps: int, judge: pathlib.Path, sft: pathlib.Path | None = None) -> list[dict]:
    import shutil

    config = [] if method in BASELINES else ["--config", str(REPO / "configs" / "methods" / f"{method}.py")]
    more = list(BASELINES.get(method, []))
    if method == "judge":
        more.append(f"--config.judge.checkpoint={judge}")
    sizes = SIZES
    if sft is not None:  # the shared warm-start: the trainer reuses a completed sft/ folder
        shutil.copytree(sft, workdir / "sft")
        sizes = [a for a in SIZES if not a.startswith("--config.sft.")] + WARM_START
    args = [sys.executable, "-m", "turnsight_jax.train", *config, "--workdir", str(workdir), *sizes,
            f"--config.train.steps={steps}", *more]
    proc = subprocess.run(args, cwd=REPO, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{method}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--methods", default="grpo,slim,judge")
    ap.add_argument("--warm_start", action="store_true", help="every run from one shared supervised warm-start")
    args = ap.parse_args()
    names = args.methods.split(",")
    if "grpo" not in names:
        names.insert(0, "grpo")
    rows, cost, sampled = [], {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        judge = random_judge(pathlib.Path(tmp) / "judge_model") if "judge" in names else pathlib.Path(tmp)
        sft = warm_start(pathlib.Path(tmp) / "warm") if args.warm_start else None
        for name in names:
            recs = run(name, pathlib.Path(tmp) / name, args.steps, judge, sft)[1:]
            step = statistics.median(r["perf/step_s"] for r in recs)
            audit = statistics.median(r.get("slim/audit_s", 0.0) for r in recs)
            rollout = statistics.median(r["perf/rollout_s"] for r in recs)
            cost[name] = step + audit
            sampled[name] = (statistics.mean(r["rollout/episodes"] for r in recs),
                             statistics.mean(r["rollout/decoded_tokens"] for r in recs))
            extra = ""
            if name == "judge":
                extra = f"{statistics.median(r['judge/generated_tokens'] for r in recs):.0f} judge tokens"
            elif name == "slim":
                extra = f"{recs[-1]['slim/library_size']:.0f} skills"
            elif name == "bar":
                n = sum(r["bar/prompts"] for r in recs)
                extra = (f"groups of {statistics.mean(r['bar/group_size_mean'] for r in recs):.1f} on average; "
                         f"{sum(r['bar/early_stops'] for r in recs) / n:.0%} of prompts stopped early, "
                         f"{sum(r['bar/fallbacks'] for r in recs) / n:.0%} fell back at the cap")
            elif name == "t2po":
                extra = (f"{sum(r['t2po/tti_triggers'] for r in recs) / len(recs):.1f} TTI triggers, "
                         f"{sum(r['t2po/tds_resamples'] for r in recs) / len(recs):.1f} TDS re-samples, "
                         f"{statistics.mean(r['t2po/discarded_tokens'] for r in recs):.0f} tokens decoded then dropped, "
                         f"{statistics.mean(r['t2po/recompute_tokens'] for r in recs):.0f} recomputed per step")
            elif name == "appo":
                extra = (f"{statistics.mean(r['appo/branches'] for r in recs):.0f} branches, "
                         f"{statistics.mean(r['appo/branch_tokens'] for r in recs):.0f} tokens past their branch points, "
                         f"{statistics.mean(r['appo/shared_prefix_tokens'] for r in recs):.0f} prefix tokens shared, "
                         f"{statistics.mean(r['rollout/prefill_tokens'] for r in recs):.0f} prefilled (the prompts') "
                         f"per step")
            elif name == "akbe":
                q = {k: sum(r[f"akbe/q{k}"] for r in recs) for k in ("11", "10", "01", "00")}
                extra = (f"quadrants 11/10/01/00 {q['11']:.0f}/{q['10']:.0f}/{q['01']:.0f}/{q['00']:.0f}; "
                         f"{statistics.mean(r['akbe/no_tool_tokens'] for r in recs):.0f} no-tool tokens per step")
            rows.append([name, f"{rollout:.2f}", f"{step - rollout:.2f}", f"{audit:.2f}", f"{cost[name]:.2f}", None,
                         f"{sampled[name][0]:.1f}", None, f"{sampled[name][1]:.0f}", None, extra])
            print(f"{name}: {cost[name]:.2f} s/step", file=sys.stderr)
    for r in rows:
        if r[0] in PAGED_BASELINE and PAGED_BASELINE[r[0]] in cost:
            base = PAGED_BASELINE[r[0]]
            r[10] = (f"{cost[r[0]] / cost[base]:.2f}x {base}'s step, {sampled[r[0]][1] / max(sampled[base][1], 1.0):.2f}x "
                     f"its decoded tokens; " + r[10])
        r[5] = f"{cost[r[0]] / cost['grpo']:.2f}"
        r[7] = f"{sampled[r[0]][0] / sampled['grpo'][0]:.2f}"
        r[9] = f"{sampled[r[0]][1] / max(sampled['grpo'][1], 1.0):.2f}"
    start = "one shared warm-start" if args.warm_start else "a random policy"
    print(f"# whole trainer steps per method ({args.steps} steps from {start}, median after the first), {machine()}")
    print(table(rows, ["method", "rollout s", "update s", "audit + writer s", "s/step", "vs GRPO", "episodes/step",
                       "vs GRPO", "decoded tokens/step", "vs GRPO", "note"]))


if __name__ == "__main__":
    main()
