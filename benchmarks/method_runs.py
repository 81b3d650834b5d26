"""Methods whose cost lies outside the train step (SLIM's audits and skill writing, the model
judge's decoding, MM-GRPO's refill rollouts and re-prefills, the rollout controllers BAR and AKBE),
against GRPO, as whole trainer steps: `python -m turnsight_jax.train` runs of each method's tiny config at the same sizes, from
the same random tiny-default policy (or, with --warm-start, the same supervised warm-start).

    python benchmarks/method_runs.py [--steps 4] [--methods grpo,slim,judge,mm_grpo,bar,akbe] [--warm-start DIR]

A method entry may carry overrides after '@', '+'-separated, e.g. `mm_grpo@mm_grpo.refill_rounds=0`
(MM-GRPO's window alone) or `mm_grpo@mm_grpo.window=0` (its dynamic sampling alone).

Each run: 2 prompts x 4 samples per step, no warm-start, no held-out evaluation. The per-step
cost is perf/step_s (rollout + update) plus slim/audit_s (SLIM's leave-one-out audit and its
writer run after the step, outside perf/step_s), the median over the steps after the first (the
first compiles). The judge is a random tiny-default model written to a folder here: it never
closes its output, so it decodes its full `judge.max_new_tokens` (48 in the tiny config) for
every trajectory, the worst case. MM-GRPO (rl.rollout=mm_grpo): a random policy solves nothing, so
every group has zero variance and is refilled for all of mm_grpo.refill_rounds (the worst case),
and it calls no tool, so nothing is elided; from a warm-start (--warm-start: a completed `sft/`
folder, e.g. the one tests/_train_runs.py builds) its policy calls tools and solves some tasks.
The note gives its median refill rollouts, elided observations and re-prefilled tokens per step.
BAR (configs/methods/bar.py: 2 rollouts a round, up to 8) and AKBE (a no-tool group as large as the
with-tool one) sample another number of episodes than GRPO's 2 x 4: every row gives its episodes
and decoded tokens per step (rollout/episodes, rollout/decoded_tokens) and their ratio to GRPO's.
T2PO and APPO run in the paged engine (their hooks live in its decode), T2PO with thinking on:
give their like-for-like baselines as entries, `grpo@rollout.engine=paged` and
`grpo@rollout.engine=paged+rollout.enable_thinking=True`; each controller's note then gives its
step and decoded tokens against that baseline, with what the controller did: T2PO's TTI triggers
and TDS re-samples and the tokens it decoded then dropped, APPO's branches, the tokens they
sampled past their branch points, the prefix tokens they reused without prefill (the prefill
stays the prompts': rollout/prefill_tokens) and the seconds of pi_old's teacher-forced scoring.

    python benchmarks/method_runs.py --warm-start DIR --methods grpo,grpo@rollout.engine=paged,\
        grpo@rollout.engine=paged+rollout.enable_thinking=True,t2po,appo

Prints a table with the ratio to GRPO's step."""

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


# T2PO's and APPO's like-for-like baselines: GRPO in the paged engine (thinking on, for T2PO)
PAGED = "grpo@rollout.engine=paged"
PAGED_THINKING = "grpo@rollout.engine=paged+rollout.enable_thinking=True"


def run(entry: str, workdir: pathlib.Path, steps: int, judge: pathlib.Path,
        warm_start: pathlib.Path | None = None) -> list[dict]:
    method, _, overrides = entry.partition("@")
    config = [] if method == "grpo" else ["--config", str(REPO / "configs" / "methods" / f"{method}.py")]
    more = ["--config.rl.method=grpo"] if method == "grpo" else []
    more += [f"--config.{o}" for o in overrides.split("+") if o]
    if method == "judge":
        more.append(f"--config.judge.checkpoint={judge}")
    if warm_start is not None:  # any sft step count > 0: the trainer reuses the completed folder copied here
        import shutil

        shutil.copytree(warm_start, workdir / "sft")
        more.append("--config.sft.steps=1")
    args = [sys.executable, "-m", "turnsight_jax.train", *config, "--workdir", str(workdir), *SIZES,
            f"--config.train.steps={steps}", *more]
    proc = subprocess.run(args, cwd=REPO, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{method}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--methods", default="grpo,slim,judge")
    ap.add_argument("--warm-start", type=pathlib.Path, default=None,
                    help="a completed supervised warm-start folder (sft/) every run starts from")
    args = ap.parse_args()
    names = args.methods.split(",")
    if "grpo" not in names:
        names.insert(0, "grpo")
    rows, cost, sampled = [], {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        judge = random_judge(pathlib.Path(tmp) / "judge_model") if "judge" in names else pathlib.Path(tmp)
        for name in names:
            recs = run(name, pathlib.Path(tmp) / name.replace("@", "_").replace("=", "_"), args.steps, judge,
                       args.warm_start)[1:]
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
            elif name.partition("@")[0] == "mm_grpo":
                med = {k: statistics.median(r[f"mm_grpo/{k}"] for r in recs)
                       for k in ("extra_rollouts", "elided_observations", "reprefill_tokens")}
                extra = (f"+{med['extra_rollouts']:.0f} rollouts, {med['elided_observations']:.0f} elided, "
                         f"{med['reprefill_tokens']:.0f} re-prefilled tokens")
            elif name.partition("@")[0] == "bar":
                n = sum(r["bar/prompts"] for r in recs)
                extra = (f"groups of {statistics.mean(r['bar/group_size_mean'] for r in recs):.1f} on average; "
                         f"{sum(r['bar/early_stops'] for r in recs) / n:.0%} of prompts stopped early, "
                         f"{sum(r['bar/fallbacks'] for r in recs) / n:.0%} fell back at the cap")
            elif name == "t2po":
                extra = (f"{statistics.mean(r['t2po/tti_triggers'] for r in recs):.1f} TTI triggers, "
                         f"{statistics.mean(r['t2po/tds_resamples'] for r in recs):.1f} TDS re-samples, "
                         f"{statistics.mean(r['t2po/discarded_tokens'] for r in recs):.0f} tokens decoded then dropped, "
                         f"{statistics.mean(r['t2po/recompute_tokens'] for r in recs):.0f} recomputed per step")
            elif name == "appo":
                extra = (f"{statistics.mean(r['appo/branches'] for r in recs):.0f} branches, "
                         f"{statistics.mean(r['appo/branch_tokens'] for r in recs):.0f} tokens past their branch points, "
                         f"{statistics.mean(r['appo/shared_prefix_tokens'] for r in recs):.0f} prefix tokens shared, "
                         f"{statistics.mean(r['rollout/prefill_tokens'] for r in recs):.0f} prefilled (the prompts'), "
                         f"{statistics.median(r['appo/old_policy_s'] for r in recs):.2f} s scoring pi_old per step")
            elif name.partition("@")[0] == "akbe":
                q = {k: sum(r[f"akbe/q{k}"] for r in recs) for k in ("11", "10", "01", "00")}
                extra = (f"quadrants 11/10/01/00 {q['11']:.0f}/{q['10']:.0f}/{q['01']:.0f}/{q['00']:.0f}; "
                         f"{statistics.mean(r['akbe/no_tool_tokens'] for r in recs):.0f} no-tool tokens per step")
            rows.append([name, f"{rollout:.2f}", f"{step - rollout:.2f}", f"{audit:.2f}", f"{cost[name]:.2f}", None,
                         f"{sampled[name][0]:.1f}", None, f"{sampled[name][1]:.0f}", None, extra])
            print(f"{name}: {cost[name]:.2f} s/step", file=sys.stderr)
    for r in rows:  # T2PO and APPO against GRPO on the paged engine (thinking on for T2PO), when measured
        base = {"t2po": PAGED_THINKING, "appo": PAGED}.get(r[0])
        if base in cost:
            r[10] = (f"{cost[r[0]] / cost[base]:.2f}x {base}'s step, {sampled[r[0]][1] / max(sampled[base][1], 1.0):.2f}x "
                     f"its decoded tokens; " + r[10])
        r[5] = f"{cost[r[0]] / cost['grpo']:.2f}"
        r[7] = f"{sampled[r[0]][0] / sampled['grpo'][0]:.2f}"
        r[9] = f"{sampled[r[0]][1] / max(sampled['grpo'][1], 1.0):.2f}"
    start = f"from the warm-start {args.warm_start}" if args.warm_start else "from a random policy"
    print(f"# whole trainer steps per method ({args.steps} steps, median after the first, {start}), {machine()}")
    print(table(rows, ["method", "rollout s", "update s", "audit + writer s", "s/step", "vs GRPO", "episodes/step",
                       "vs GRPO", "decoded tokens/step", "vs GRPO", "note"]))


if __name__ == "__main__":
    main()
