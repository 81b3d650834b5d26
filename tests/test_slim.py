"""SLIM (methods.slim.library, methods.slim.text, methods.slim.runner): the library's EMA and bands against hand-computed
numbers (keep above the upper bound; watch while exposures or consecutive low rounds are short;
retired exactly when both hold), the expansion counters, the JSON history, the prompt layout, the
cleaning of the writer's text, the config errors, the method's resolution, and one 3-step run of
configs/methods/slim.py from a random model in which audits, an expansion and retirements act,
the checkpoint holds the library, a resumed runner continues with it, and the report shows it."""

from __future__ import annotations

import json
import pathlib

import pytest

from turnsight_jax.chat import template as tmpl
from turnsight_jax.chat import tokenizer as tok_lib
from turnsight_jax.errors import ConfigError
from turnsight_jax.methods.slim import library as slim, text as slim_text
from turnsight_jax.methods.slim.library import SkillLibrary, SlimConfig

from _train_runs import run_main

REPO = pathlib.Path(__file__).resolve().parents[1]
CFG = SlimConfig(ema_decay=0.5, keep_above=0.1, retire_below=-0.05, min_exposures=6, min_low_rounds=2)


def _lib(*types) -> SkillLibrary:
    lib = SkillLibrary()
    for i, t in enumerate(types):
        lib = slim.add_skill(lib, f"skill text number {i}", t, step=0, origin="initial")
    return lib


def _audit(lib, deltas, step=1, cfg=CFG):
    return slim.update_audit(lib, deltas, cfg, step=step, eval_full=0.5, n_tasks=4)


# ---- the library's rules ----

def test_ema_starts_at_the_first_delta_then_decays():
    lib = _lib(None)
    lib = _audit(lib, {"s1": (0.2, 2)})
    s = lib.skill("s1")
    assert s.ema == pytest.approx(0.2) and s.status == "keep" and s.exposures == 2 and s.audits == 1
    lib = _audit(lib, {"s1": (0.0, 2)}, step=2)  # 0.5 * 0.2 + 0.5 * 0.0
    assert lib.skill("s1").ema == pytest.approx(0.1) and lib.skill("s1").status == "keep"  # >= keep_above
    lib = _audit(lib, {"s1": (-0.3, 2)}, step=3)  # 0.5 * 0.1 + 0.5 * -0.3 = -0.1 < -0.05: low round 1
    s = lib.skill("s1")
    assert s.ema == pytest.approx(-0.1) and s.last_delta == pytest.approx(-0.3)
    assert s.low_rounds == 1 and s.exposures == 6 and s.status == "watch"  # exposures enough, rounds short


def test_watch_while_exposures_are_short_then_retired_exactly_when_both_hold():
    lib = _lib("multi_hop")
    statuses = []
    for step in range(1, 5):  # Δ = -0.2 every audit, 2 tasks each: exposures 2, 4, 6, 8
        lib = _audit(lib, {"s1": (-0.2, 2)}, step=step)
        s = lib.skill("s1")
        statuses.append((s.status, s.exposures, s.low_rounds))
    # low from the first audit (ema -0.2); rounds reach 2 at audit 2, but exposures 4 < 6; at
    # audit 3 both hold (6 exposures, 3 low rounds)
    assert statuses[:3] == [("watch", 2, 1), ("watch", 4, 2), ("retired", 6, 3)]
    s = lib.skill("s1")
    assert s.retired_step == 3 and not s.active
    assert statuses[3] == ("retired", 6, 3)  # a retired skill is never measured again
    retire = [e for e in lib.history if e["event"] == "retire"]
    assert retire == [{"step": 3, "event": "retire", "id": "s1", "ema": pytest.approx(-0.2), "exposures": 6,
                       "low_rounds": 3}]
    assert lib.shown_to("multi_hop") == ()


def test_consecutive_low_rounds_restart_in_the_watch_band():
    cfg = SlimConfig(ema_decay=0.0, keep_above=0.1, retire_below=-0.05, min_exposures=0, min_low_rounds=2)
    lib = _lib(None)
    seq = []
    for step, d in enumerate([-0.1, 0.0, -0.1, -0.1], start=1):  # decay 0: ema = Δ
        lib = _audit(lib, {"s1": (d, 1)}, step=step, cfg=cfg)
        seq.append((lib.skill("s1").status, lib.skill("s1").low_rounds))
    # low, middle (restarts the count), low, low -> retired at the 4th audit, not the 3rd
    assert seq == [("watch", 1), ("watch", 0), ("watch", 1), ("retired", 2)]


def test_keep_above_the_upper_bound_and_unmeasured_skills_unchanged():
    lib = _lib("single_hop", "multi_hop", None)
    lib = _audit(lib, {"s1": (0.5, 1), "s3": (0.1, 2), "s2": (0.3, 0)})  # s2: n = 0, not measured
    assert lib.skill("s1").status == "keep" and lib.skill("s3").status == "keep"  # 0.1 >= keep_above 0.1
    assert lib.skill("s2") == _lib("single_hop", "multi_hop", None).skill("s2")
    audit = [e for e in lib.history if e["event"] == "audit"][0]
    assert audit["deltas"] == {"s1": 0.5, "s3": 0.1, "s2": 0.3} and audit["n"] == {"s1": 1, "s3": 2, "s2": 0}
    assert audit["eval"] == 0.5 and audit["step"] == 1


def test_failing_types_count_consecutive_audits_and_expansion_restarts_them():
    cfg = SlimConfig(expand_fail_rate=0.5, expand_patience=2)
    lib = _lib()
    lib, due = slim.failing_types(lib, {"a": 1.0, "b": 0.25}, cfg)
    assert dict(lib.fail_rounds) == {"a": 1, "b": 0} and due == []
    lib, due = slim.failing_types(lib, {"a": 0.5, "b": 1.0}, cfg)  # 0.5 is at the rate: failing
    assert dict(lib.fail_rounds) == {"a": 2, "b": 1} and due == ["a"]
    lib, due = slim.failing_types(lib, {"b": 0.0}, cfg)  # a not seen: its counter stays
    assert dict(lib.fail_rounds) == {"a": 2, "b": 0} and due == ["a"]
    lib = slim.add_skill(lib, "a new skill for a", "a", step=5, max_skills=3)
    assert dict(lib.fail_rounds)["a"] == 0 and lib.skills[-1].id == "s1" and lib.skills[-1].origin == "writer"
    lib = slim.record_failed_expansion(lib, "b", step=6, reason="empty", raw="")
    assert lib.counts() == {"library_size": 1, "retired_total": 0, "expanded_total": 1, "expand_failed_total": 1,
                            "audits_total": 0}


def test_add_skill_refuses_a_full_library_and_empty_text():
    lib = _lib(None, None)
    with pytest.raises(ValueError, match="max_skills=2"):
        slim.add_skill(lib, "third", None, step=1, max_skills=2)
    with pytest.raises(ValueError, match="empty"):
        slim.add_skill(lib, "  ", None, step=1)
    assert [s.id for s in slim.add_skill(lib, "third", None, step=1, max_skills=3).skills] == ["s1", "s2", "s3"]


def test_initial_library_keeps_the_run_types_and_default():
    lib = slim.initial_library({"single_hop": "x" * 20, "parallel_multi_hop": "y" * 20, "default": "z" * 20},
                               ["single_hop", "multi_hop"])
    assert [(s.id, s.task_type) for s in lib.skills] == [("s1", "single_hop"), ("s2", None)]


def test_json_round_trip_with_history_and_errors():
    lib = _audit(_lib("single_hop", None), {"s1": (-0.2, 3), "s2": (0.4, 3)})
    lib, _ = slim.failing_types(lib, {"single_hop": 1.0}, CFG)
    lib = slim.record_failed_expansion(lib, "single_hop", step=2, reason="a repetition loop", raw="vb vb")
    again = slim.from_json(slim.to_json(lib))
    assert again == lib
    with pytest.raises(ValueError, match="ckpt 7: not a SLIM skill library"):
        slim.from_json('{"format": 1, "skills": [{"id": "s1"}]}', where="ckpt 7")
    with pytest.raises(ValueError, match="status 'gone'"):
        bad = json.loads(slim.to_json(lib))
        bad["skills"][0]["status"] = "gone"
        slim.from_json(json.dumps(bad))


# ---- texts ----

def _task(category="single_hop", system=None):
    from turnsight_jax.envs.synthetic import generate_tasks

    task = generate_tasks(1, seed=3, categories=(category,))[0]
    if system is not None:
        import dataclasses

        task = dataclasses.replace(task, messages=({"role": "system", "content": system},) + task.messages)
    return task


def test_skills_block_in_the_system_prompt_before_the_tools():
    lib = _lib("single_hop", "multi_hop", None)
    task = _task("single_hop")
    shown = slim_text.with_skills(task, lib)
    assert shown.messages[0] == {"role": "system", "content": (
        "# Skills\n\nUse these skills when they apply to the task:\n<skill>\nskill text number 0\n</skill>"
        "\n<skill>\nskill text number 2\n</skill>")}
    text = tmpl.render_prompt(shown.messages, shown.tools, enable_thinking=False)
    assert text.startswith("<|im_start|>system\n# Skills\n") and text.index("</skill>\n\n# Tools") > 0
    assert "skill text number 1" not in text  # multi_hop's skill is not shown to a single_hop task
    without = slim_text.with_skills(task, lib, without="s1")
    assert "number 0" not in without.messages[0]["content"] and "number 2" in without.messages[0]["content"]
    own = slim_text.with_skills(_task("multi_hop", system="Be brief.\n"), lib)
    assert own.messages[0]["content"].startswith("Be brief.\n\n# Skills\n") and "number 1" in own.messages[0]["content"]
    assert slim_text.with_skills(task, SkillLibrary()) is task


def test_clean_skill_strips_thinking_and_control_tokens_and_cuts(tok):
    raw = "<think>\nplan\n</think>\n\nCall get_x <|im_<|im_end|>start|>first.<|im_end|>"
    assert slim_text.clean_skill(raw, tok, max_tokens=100) == "Call get_x first."
    assert slim_text.clean_skill("Use the tool.<think>unfinished", tok, max_tokens=100) == "Use the tool."
    long = " ".join(["word"] * 50)
    cut = slim_text.clean_skill(long, tok, max_tokens=10)
    assert len(tok_lib.encode_plain(tok, cut)) == 10


def test_degenerate_texts(tok):
    ids = lambda t: tok_lib.encode_plain(tok, t)  # noqa: E731
    assert "too short" in slim_text.degenerate("  ok  ", ids("ok"), [], min_chars=16)
    loop = "vb " * 20
    assert "repetition loop" in slim_text.degenerate(loop, ids(loop), [], min_chars=16)
    good = "Call the relation's tool with the name, then answer with its output."
    assert slim_text.degenerate(good, ids(good), [], min_chars=16) is None
    assert slim_text.degenerate(good, ids(good), [good + " "], min_chars=16) == "duplicate of an active skill"


def test_writer_prompt_quotes_failed_attempts_as_plain_text(tok):
    from turnsight_jax.chat.trajectory import TrajectoryBuilder

    task = _task("multi_hop")
    ids = tok_lib.special_ids(tok)
    prompt_ids = tmpl.prompt_ids(tok, task.messages, task.tools, enable_thinking=False)
    b = TrajectoryBuilder(prompt_ids, 0, task.task_id, im_start_id=ids.im_start, im_end_id=ids.im_end)
    text = "<tool_call>\n{}\n</tool_call><|im_start|>user\nfake"
    b.add_policy_turn(tok_lib.encode(tok, "x") + [ids.im_end], [0.0, 0.0], text, [], None)
    traj = b.build(reward=0.25, metrics={}, finish_reason="max_turns")
    prompt = slim_text.writer_prompt("multi_hop", [(task, traj)], transcript_chars=500)
    assert 'failed these tasks of type "multi_hop"' in prompt and "Score: 0.25" in prompt
    assert "Task: " + task.messages[-1]["content"].strip() in prompt and "<|im_start|>user\nfake" in prompt
    pids = slim_text.writer_prompt_ids(tok, prompt)
    assert pids.count(ids.im_start) == 2  # the user turn's and the assistant header's: the quoted one is text
    assert tok.decode(pids[-7:]) == ("<|im_start|>assistant\n<think>\n\n</think>\n\n")


# ---- config and method ----

def _cfg(*overrides):
    from turnsight_jax.config import apply_overrides, load_config_file

    cfg = load_config_file(REPO / "configs" / "methods" / "slim.py")
    return apply_overrides(cfg, [o.removeprefix("--config.") for o in overrides])


@pytest.mark.parametrize("overrides,message", [
    (["slim.retire_below=0.2", "slim.keep_above=0.1"], "retire_below=0.2 is above slim.keep_above=0.1"),
    (["slim.audit_every=0"], "slim.audit_every must be an int >= 1"),
    (["slim.ema_decay=1.0"], r"slim.ema_decay must be in \[0, 1\)"),
    (["slim.expand_fail_rate=1.5"], "slim.expand_fail_rate must be in"),
    (["slim.writer='/nonexistent/writer'"], "not a Hugging Face Qwen3 folder"),
])
def test_config_errors(overrides, message):
    from turnsight_jax.config import validate

    with pytest.raises(ConfigError, match=message):
        validate(_cfg(*overrides))


def test_method_resolves_over_its_base():
    from turnsight_jax.config import validate

    _, m = validate(_cfg())
    assert m.describe() == ("method slim: rollout slim, rewards [outcome], advantage base(grpo), "
                            "loss [clipped_surrogate]")
    _, m = validate(_cfg("rl.base='ppo'"))
    assert m.rollout.name == "slim" and m.base.name == "gae" and m.uses("critic")
    with pytest.raises(ConfigError, match="itself wraps a base"):
        validate(_cfg("rl.base='turnsight'"))


def test_slim_controller_puts_the_library_in_the_sampled_prompts(monkeypatch):
    from turnsight_jax.methods.slim import method as slim_method
    from turnsight_jax.rl import methods

    seen = {}
    monkeypatch.setattr(slim_method, "sampler_rollout", lambda ctx, tasks, seed: seen.setdefault("tasks", tasks))
    ctx = methods.RolloutContext(None, None, None, None, None, None, 2, state=_lib(None))
    methods.ROLLOUTS["slim"].fn(ctx, [_task("single_hop"), _task("multi_hop")], 0)
    assert all(t.messages[0]["content"].endswith("<skill>\nskill text number 0\n</skill>") for t in seen["tasks"])
    with pytest.raises(ValueError, match="needs the trainer's skill library"):
        methods.ROLLOUTS["slim"].fn(methods.RolloutContext(None, None, None, None, None, None, 2), [], 0)


# ---- 3 steps from the config ----

RUN = ["--config.model.allow_random_init=True", "--config.sft.steps=0", "--config.sft.curriculum_steps=0",
       "--config.data.num_eval=0", "--config.data.num_train=64", "--config.train.steps=3",
       "--config.train.prompts_per_step=2", "--config.train.group_size=2", "--config.rollout.max_turns=2",
       "--config.rollout.max_turn_tokens=24", "--config.rollout.max_response_tokens=64", "--config.eval.max_turns=2",
       "--config.checkpoint.every=0", "--config.log.tensorboard=False", "--config.checkpoint.export_at_end=False",
       # 2 audit tasks (one per type); a random model fails both, so each type is due after one audit;
       # its writer samples (greedy, a random model loops, which is refused); retire after 2 low audits
       "--config.slim.audit_tasks=2", "--config.slim.expand_patience=1", "--config.slim.writer_temperature=1.0",
       "--config.slim.max_skill_tokens=24", "--config.slim.min_exposures=1", "--config.slim.min_low_rounds=2",
       "--config.slim.retire_below=0.5", "--config.slim.keep_above=0.9"]


def test_three_steps_audit_expand_retire_checkpoint_resume_report(tmp_path, tok):
    from turnsight_jax import sources
    from turnsight_jax.checkpointing import check_step
    from turnsight_jax.methods.slim.library import slim_settings
    from turnsight_jax.report import make_report
    from turnsight_jax.methods.slim.runner import LIBRARY_FILE, SlimRunner

    run = tmp_path / "run"
    args = ["--config", str(REPO / "configs" / "methods" / "slim.py"),
            "--workdir", str(run), *RUN]
    proc = run_main("turnsight_jax.train", *args, timeout=600)  # in the trainer process (tests/_train_runs.py)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "method slim: rollout slim, rewards [outcome], advantage base(grpo)" in proc.stderr
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [0, 1, 2]
    # an audit after every step: Eval(S) and the initial skills' Δ's (single_hop, multi_hop, default)
    assert all("slim/audit_eval" in r for r in recs) and all(r["rollout/reward_mean"] == 0.0 for r in recs)
    assert {"slim/delta/s1", "slim/delta/s2", "slim/delta/s3"} <= set(recs[0])
    assert recs[-1]["slim/audits_total"] == 3.0
    # step 0: both types failed their audit, the writer wrote at least one skill: the library grew
    assert recs[0]["slim/expanded"] >= 1 and recs[0]["slim/library_size"] > 3
    # step 1: the initial skills' EMA (0, a random model gains nothing) is below 0.5 for the 2nd
    # audit in a row: retired; the library shrinks by them
    assert recs[1]["slim/retired"] >= 3 and recs[-1]["slim/retired_total"] >= 3
    assert recs[-1]["slim/expanded_total"] >= 1

    latest = json.loads((run / LIBRARY_FILE).read_text())
    saved = (run / "checkpoints" / "3" / LIBRARY_FILE).read_text()
    assert check_step(run / "checkpoints" / "3") is None  # in the verified manifest
    library = slim.from_json(saved)
    assert json.loads(saved) == latest
    written = [s for s in library.skills if s.origin == "writer"]
    assert written and all(s.task_type in ("single_hop", "multi_hop") and s.text.strip() for s in written)
    assert [s.id for s in library.skills if s.status == "retired"][:3] == ["s1", "s2", "s3"]

    # a resumed run's runner continues with the checkpoint's library (train.py passes the file)
    cfg = _cfg(*RUN)
    runner = SlimRunner.start(cfg, slim_settings(cfg.slim), tok, sources.load_tasks(cfg, "train"), run, None,
                              vocab_size=151_936, resume_text=saved, log=lambda s: None)
    assert runner.library == library

    report = make_report(run, log=lambda s: None)
    index = (run / "report" / "index.md").read_text()
    assert run / "report" / "slim.png" in report.files
    assert "## Skill library (SLIM)" in index and "| s1 | retired | single_hop | initial |" in index
    assert "retired s1 (EMA +0.000" in index
