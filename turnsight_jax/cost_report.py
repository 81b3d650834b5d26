"""The cost table of a training run from its metrics (turnsight_jax.cost writes them every step):
where the wall-clock went, the teacher's FLOPs and their share, the tokens scored per view kind,
the peak memory; for two runs (TurnSight and its base) side by side with their ratio.
`python -m turnsight_jax.report RUN [--compare OTHER_RUN]` writes it as cost.md and cost.png
(turnsight_jax.report draws the plot; this module gives the numbers and the markdown).

Totals are sums over the run's logged steps (the XLA compilations of the first steps included:
`perf/step_compilations` counts them); the per-step column is the median over steps, which the
compiling steps barely move. Rows marked "est." are the fused step's time apportioned by the FLOP
counter and the optimizer probe (turnsight_jax.cost), not timed inside the program.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Sequence

# (label, metric) of the wall split, in the order the table and the plot show them
MEASURED_ROLLOUT = (("rollout: prefill", "perf/rollout_prefill_s"), ("rollout: decode", "perf/rollout_decode_s"),
                    ("rollout: tools", "perf/tool_s"))
STEP_FN_PARTS = (("update: student forward + backward (est.)", "perf/step_fn_student_s_est"),
                 ("update: extra student forwards (est.)", "perf/step_fn_student_forward_s_est"),
                 ("update: teacher (est.)", "perf/step_fn_teacher_s_est"),
                 ("update: critic (est.)", "perf/step_fn_critic_s_est"),
                 ("update: PRM (est.)", "perf/step_fn_prm_s_est"),
                 ("update: retrospective teacher (est.)", "perf/step_fn_retrospective_s_est"),
                 ("update: optimizer (est.)", "perf/step_fn_optimizer_s_est"))
AFTER = (("records", "perf/records_s"), ("held-out evaluation (in the loop)", "perf/eval_s"),
         ("checkpoint", "perf/checkpoint_s"))
TOKENS = (("student: trajectory tokens", "perf/student_tokens"),
          ("teacher: trajectory tokens", "perf/teacher_tokens_trajectory"),
          ("teacher: hindsight / privileged blocks", "perf/teacher_tokens_blocks"),
          ("teacher: turn copies", "perf/teacher_tokens_turn_copies"))
COST_KEYS = ("perf/step_fn_s", "perf/rollout_prefill_s")  # a run logged before the cost accounting has neither


@dataclasses.dataclass
class CostSummary:
    steps: int
    wall: list[tuple[str, float, float]]  # (label, total s, median s per step)
    teacher_flops: float | None
    teacher_share: float | None
    update_flops: float
    tokens: list[tuple[str, float]]
    device_peak_gib: float | None
    host_rss_peak_gib: float | None
    compilations: float | None


def _values(records: Sequence[dict], key: str) -> list[float]:
    return [float(r[key]) for r in records if isinstance(r.get(key), (int, float)) and not isinstance(r[key], bool)]


def has_costs(records: Sequence[dict]) -> bool:
    return any(all(k in r for k in COST_KEYS) for r in records)


def summarize(records: Sequence[dict]) -> CostSummary:
    """The cost summary of one run's metrics records (one dict per step)."""
    records = [r for r in records if all(k in r for k in COST_KEYS)]
    wall = []

    def row(label, values):
        if values:
            wall.append((label, sum(values), statistics.median(values)))

    for label, key in MEASURED_ROLLOUT:
        row(label, _values(records, key))
    rest = [r["perf/rollout_s"] - r.get("perf/rollout_prefill_s", 0.0) - r.get("perf/rollout_decode_s", 0.0)
            - r.get("perf/tool_s", 0.0) for r in records if "perf/rollout_s" in r]
    row("rollout: host (parsing, episodes; < 0: tools overlapped decoding)", rest)
    row("batch building (host)", _values(records, "perf/batch_s"))
    for label, key in STEP_FN_PARTS:
        row(label, _values(records, key))
    step_fn = _values(records, "perf/step_fn_s")
    parts = [sum(r.get(k, 0.0) for _, k in STEP_FN_PARTS) for r in records]
    row("update: not apportioned", [a - b for a, b in zip(step_fn, parts)] if any(abs(a - b) > 1e-6 for a, b in
                                                                                   zip(step_fn, parts)) else [])
    other = [r["perf/step_s"] - r["perf/rollout_s"] - r.get("perf/batch_s", 0.0) - r["perf/step_fn_s"] for r in records
             if "perf/step_s" in r]
    row("step: host bookkeeping", other)
    for label, key in AFTER:
        row(label, _values(records, key))
    totals = [r.get("perf/step_s", 0.0) + sum(r.get(k, 0.0) for _, k in AFTER) for r in records]
    row("total", totals)
    teacher = _values(records, "perf/teacher_flops_necessary")
    update = _values(records, "perf/update_flops_necessary")
    return CostSummary(
        steps=len(records), wall=wall, teacher_flops=sum(teacher) if teacher else None,
        teacher_share=sum(teacher) / sum(update) if teacher and sum(update) > 0 else None,
        update_flops=sum(update),
        tokens=[(label, sum(_values(records, key))) for label, key in TOKENS if _values(records, key)],
        device_peak_gib=max(_values(records, "perf/device_peak_gib"), default=None),
        host_rss_peak_gib=max(_values(records, "perf/host_rss_peak_gib"), default=None),
        compilations=max(_values(records, "perf/step_compilations"), default=None))


def _s(x: float | None) -> str:
    return "—" if x is None else f"{x:.1f}" if abs(x) >= 10 else f"{x:.2f}"


def _big(x: float | None) -> str:
    return "—" if x is None else f"{x:.3g}"


def cost_markdown(names: Sequence[str], summaries: Sequence[CostSummary]) -> list[str]:
    """The cost table (markdown lines) of one or more runs, one column pair per run (total over
    the run, median per step); with two runs a ratio column (first / second, totals)."""
    two = len(summaries) == 2
    head = "| | " + " | ".join(f"{n}: total | {n}: per step (median)" for n in names) + (" | ratio |" if two else " |")
    lines = [head, "|---" * (1 + 2 * len(names) + int(two)) + "|"]
    labels = list(dict.fromkeys(label for s in summaries for label, _, _ in s.wall))

    def ratio(a, b):
        return f"{a / b:.2f}x" if a is not None and b not in (None, 0) else "—"

    for label in labels:
        cells, tot = [], []
        for s in summaries:
            hit = next(((t, m) for lab, t, m in s.wall if lab == label), None)
            cells += ["—", "—"] if hit is None else [f"{_s(hit[0])} s", f"{_s(hit[1])} s"]
            tot.append(None if hit is None else hit[0])
        name = f"**{label}**" if label == "total" else label
        lines.append(f"| {name} | " + " | ".join(cells) + (f" | {ratio(*tot)} |" if two else " |"))

    def single(label, values, fmt):
        cells = []
        for v in values:
            cells += [fmt(v), ""]
        extra = f" | {ratio(*values)} |" if two and all(isinstance(v, (int, float)) for v in values) else (
            " | — |" if two else " |")
        lines.append(f"| {label} | " + " | ".join(cells) + extra)

    single("steps logged", [s.steps for s in summaries], str)
    single("step compilations (programs)", [s.compilations for s in summaries], _big)
    single("update FLOPs (necessary)", [s.update_flops for s in summaries], _big)
    single("teacher FLOPs (necessary)", [s.teacher_flops for s in summaries], _big)
    single("teacher share of the update's FLOPs", [s.teacher_share for s in summaries],
           lambda v: "—" if v is None else f"{100 * v:.1f}%")
    for label in dict.fromkeys(label for s in summaries for label, _ in s.tokens):
        single(f"tokens scored, {label}", [dict(s.tokens).get(label) for s in summaries], _big)
    single("peak device memory", [s.device_peak_gib for s in summaries],
           lambda v: "unavailable (no device memory stats: CPU backend)" if v is None else f"{v:.2f} GiB")
    single("peak host RSS of the process", [s.host_rss_peak_gib for s in summaries],
           lambda v: "—" if v is None else f"{v:.2f} GiB")
    return lines
