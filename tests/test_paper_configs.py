"""configs/paper/: every row resolves and validates, each ablation changes exactly its one
thing from the main row, the released conventions are set, docs/reproducing.md lists every
file and number, and the main row compiles its step for 8 devices (the others share its geometry
or differ only in the depth set; all were dry-run once by hand, BENCHMARKS.md)."""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys

import pytest

from conftest import SUBPROCESS_XLA_FLAGS
from turnsight_jax import config as C

REPO = pathlib.Path(__file__).resolve().parents[1]
PAPER = REPO / "configs" / "paper"
FILES = sorted(p for p in PAPER.glob("*.py") if not p.name.startswith("_"))
DATA = ["--config.data.path=/data/ftrl/train.parquet", "--config.data.eval_path=/data/ftrl/test.parquet"]

# Each ablation's one change from table1_turnsight_8b (the run's name aside).
ABLATIONS = {
    "table2_no_turn_aggregation": {"rl.aggregation": "token"},
    "table2_no_group_norm": {"rl.group_norm": False},
    "table2_no_multi_teacher": {"rl.depths": (1,)},
    "table2_depth_1": {"rl.depths": (1,)},
    "table2_depth_2": {"rl.depths": (2,)},
    "table2_depth_3": {"rl.depths": (3,)},
    "table2_fusion": {"rl.selection": "mean"},
    "table2_source_tool_answer": {"rl.source": "tool_results_answer"},
    "table2_source_answer": {"rl.source": "answer"},
    "table2_first_5": {"rl.turns": "first:5"},
    "table2_last_5": {"rl.turns": "last:5"},
    **{f"figure_lambda_{v.replace('.', '')}": {"rl.lam": float(v)} for v in ("0.1", "0.3", "0.7", "0.9")},
    **{f"figure_eps_w_{v.replace('.', '')}": {"rl.eps_w": float(v)} for v in ("0.1", "0.3", "0.7", "0.9")},
}
# The self-distillation baselines (docs/baselines.md): method, advantage, loss terms, teacher
# (weights, source, placement).
BASELINES = {
    "rlsd": ("rlsd", "rlsd", ["clipped_surrogate"], ("policy", "gold_answer", "prompt")),
    "sdpo": ("sdpo", "base", ["clipped_surrogate", "sdpo_kl"], ("policy", "sibling", "prompt")),
    "sdar": ("sdar", "base", ["clipped_surrogate", "sdar"], ("policy", "skill", "prompt")),
    "sod": ("sod", "base", ["clipped_surrogate", "sod"], ("external", "none", "prompt")),
}
# Table 2's numbers (docs/spec.md §1), which each file's docstring must carry.
TABLE2 = {"table2_no_turn_aggregation": "43.23", "table2_no_group_norm": "43.65", "table2_no_multi_teacher": "45.62",
          "table2_depth_1": "45.62", "table2_depth_2": "44.83", "table2_depth_3": "42.30", "table2_fusion": "45.70",
          "table2_source_tool_answer": "40.89", "table2_source_answer": "42.80", "table2_first_5": "44.56",
          "table2_last_5": "43.04", "table1_turnsight_8b": "46.92", "table1_vanilla_8b": "46.5"}


def _flat(d, prefix=""):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = tuple(v) if isinstance(v, list) else v
    return out


def _load(path):
    return C.load_run_config(str(path), DATA)


def test_the_rows_are_the_papers():
    stems = {p.stem for p in FILES}
    table1 = {f"table1_{m}_{s}" for m in ("vanilla", "grpo", "toolrl", "matchtir", "turnsight", *BASELINES)
              for s in ("4b", "8b")}
    assert stems == table1 | set(ABLATIONS)


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_every_row_resolves_and_validates(path):
    c = _load(path)
    step_cfg, method = C.validate(c, 8)
    # the released code's conventions (configs/paper/_paper.py), in every row
    a, loss = step_cfg.algo, step_cfg.loss
    assert (a.matchtir_matching, a.matchtir_semantics, a.matchtir_singleton) == ("greedy", "released", "raw")
    assert (loss.clip_ratio_c, loss.clip_eps, loss.clip_eps_high) == (3.0, 0.2, 0.2)
    assert a.student_sees_observations is False and a.toolrl_format is False
    assert c.rollout.end_on_unparsable_turn and c.rollout.calls_in_think and c.rollout.enable_thinking
    assert (c.eval.temperature, c.eval.max_turns, c.rollout.max_turns) == (0.0, 10, 10)
    # the paper's scale (docs/spec.md §2)
    assert (c.train.prompts_per_step, c.train.group_size, c.optim.lr) == (32, 16, 1e-6)
    assert c.model.preset == ("qwen3-4b" if path.stem.endswith("_4b") else "qwen3-8b")
    doc = ast.get_docstring(ast.parse(path.read_text()))
    assert "Paper" in doc and f"--config configs/paper/{path.name}" in doc
    if path.stem in TABLE2:
        assert TABLE2[path.stem] in doc, path.stem


def test_methods_of_table1():
    kinds = {}
    for path in FILES:
        if path.stem.startswith("table1_"):
            step_cfg, method = C.validate(_load(path), 8)
            kinds[path.stem.split("_")[1]] = (step_cfg.algo.method, method.advantage.name,
                                              [t.name for t in method.loss_terms], _load(path).train.steps)
    assert kinds["vanilla"][3] == 0 and all(k[3] == 208 for m, k in kinds.items() if m != "vanilla")
    assert kinds["grpo"][:2] == ("grpo", "grpo") and kinds["toolrl"][:2] == ("toolrl", "grpo")
    assert kinds["matchtir"][:3] == ("matchtir", "matchtir", ["clipped_surrogate", "kl", "entropy"])
    assert kinds["turnsight"][:3] == ("turnsight", "turnsight", ["clipped_surrogate"])  # no KL, no entropy
    m = _load(PAPER / "table1_matchtir_8b.py").loss
    assert (m.kl_coef, m.kl_estimator, m.entropy_coef) == (0.001, "low_var_kl", 0.001)
    for name, (meth, adv, terms, teacher) in BASELINES.items():
        for size in ("4b", "8b"):
            step_cfg, method = C.validate(_load(PAPER / f"table1_{name}_{size}.py"), 8)
            assert (step_cfg.algo.method, method.advantage.name, [t.name for t in method.loss_terms]) == (meth, adv, terms)
            te = step_cfg.teacher
            assert (te.weights, te.source, te.placement) == teacher and method.teacher == "privileged"
    assert C.validate(_load(PAPER / "table1_rlsd_8b.py"), 8)[1].base.name == "matchtir"  # as the paper runs RLSD


@pytest.mark.parametrize("stem", sorted(ABLATIONS))
def test_each_ablation_changes_one_thing(stem):
    main = _flat(_load(PAPER / "table1_turnsight_8b.py").to_dict())
    row = _flat(_load(PAPER / f"{stem}.py").to_dict())
    diff = {k: row[k] for k in row if row[k] != main[k] and k != "name"}
    assert diff == ABLATIONS[stem]


def test_reproducing_doc_lists_every_row():
    text = (REPO / "docs" / "reproducing.md").read_text()
    for path in FILES:
        assert path.name in text, path.name
    for number in set(TABLE2.values()):
        assert number in text, number


def test_the_main_row_compiles_for_eight_devices(tmp_path):
    env = dict(os.environ, XLA_FLAGS=SUBPROCESS_XLA_FLAGS, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "turnsight_jax.train", "--config", str(PAPER / "table1_turnsight_8b.py"),
                           "--dry_run", "--fake_devices", "8", "--workdir", str(tmp_path / "run")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Memory plan" in proc.stdout and "fits in 80.0 GiB per device" in proc.stdout, proc.stdout[-2000:]


def test_the_clean_side_is_one_override_away():
    """docs/reproducing.md's overrides turn each released convention back (None turns dual clip off)."""
    c = C.load_run_config(str(PAPER / "table1_turnsight_8b.py"), DATA + [
        "--config.loss.clip_ratio_c=None", "--config.loss.clip_eps_high=0.28", "--config.rl.matchtir_semantics=clean",
        "--config.rl.matchtir_matching=assignment", "--config.rl.matchtir_singleton=zero",
        "--config.rl.student_sees_observations=True"])
    step_cfg, _ = C.validate(c, 8)
    assert step_cfg.loss.clip_ratio_c is None and step_cfg.loss.clip_eps_high == 0.28
    assert (step_cfg.algo.matchtir_semantics, step_cfg.algo.matchtir_matching) == ("clean", "assignment")
