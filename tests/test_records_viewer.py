"""Trajectory records (turnsight_jax.records, rl.turn_records) and the viewer
(`python -m turnsight_jax.viewer`), on one fused TurnSight step over a replayed batch.

The batch: 4 built-in tasks x 2 replayed siblings, one gold and one that goes wrong in its own way
(a call to a tool that does not exist, a call that does not parse, a wasted call to a real tool
outside the gold chain, an early answer), so rewards, base advantages and tool outcomes differ; a
random small-vocabulary policy and another random reference as the teacher, so the hindsight gaps
differ between depths. The step runs once with records and once without: the update is the same,
and the records equal the step's numbers (its metrics, and the formula applied to the recorded
gaps). The viewer built from them is opened in a real headless Chromium (tests/_browser.py)."""

from __future__ import annotations

import decimal
import gzip
import io
import json
import math
import random

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from turnsight_jax import viewer
from turnsight_jax import records
from turnsight_jax.envs.synthetic import SyntheticConfig, generate_task, gold_turn_texts
from turnsight_jax.models.config import Qwen3Config
from turnsight_jax.models.qwen3 import init_model
from turnsight_jax.rl.batch import batch_row_order, make_train_batch
from turnsight_jax.rl.config import AlgoConfig, LossConfig, StepConfig
from turnsight_jax.rl.methods import resolve_method
from turnsight_jax.rl.step import make_train_step, teacher_and_ref_logprobs

from _browser import Browser, find_browser
from _replayed import replayed
from _vocab import SMALL_VOCAB, fold_batch

CFG = Qwen3Config(vocab_size=SMALL_VOCAB, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, tie_word_embeddings=False)
G = 2
STEP_CFG = StepConfig(algo=AlgoConfig(method="turnsight", base="grpo"), loss=LossConfig(), group_size=G, max_turns=5,
                      logprob_chunk=64)
STEP = 7  # the step number the records are written under


def _call(tool, arguments):
    return "<tool_call>\n" + json.dumps({"name": tool, "arguments": arguments}) + "\n</tool_call>"


@pytest.fixture(scope="module")
def replay(tok):
    categories = ["multi_hop", "single_hop", "parallel_single_hop", "multi_hop"]
    tasks = [generate_task(c, s, SyntheticConfig(hops=2)) for s, c in enumerate(categories)]
    scripts = []
    for i, t in enumerate(tasks):
        gold = gold_turn_texts(t)
        first = t.gold_calls[0][0]
        distractor = next(x["function"]["name"] for x in t.tools
                          if x["function"]["name"] not in {c["name"] for step in t.gold_calls for c in step})
        scripts += [gold, [
            [_call("nope", {"x": 1}), "<answer>no</answer>"],  # a tool that does not exist: an error observation
            ["<tool_call>\n{\"name\": oops}\n</tool_call>", "<answer>no</answer>"],  # does not parse
            [_call(distractor, first["arguments"])] + gold,  # a wasted call to a real tool, then the gold chain
            [gold[0], "<answer>no</answer>"],  # the first hop, then a wrong early answer
        ][i]]
    trajs = replayed(tok, tasks, scripts, G)
    return trajs, [tasks[i // G] for i in range(len(trajs))]


@pytest.fixture(scope="module")
def models():
    return nnx.split(init_model(CFG, seed=0)), nnx.split(init_model(CFG, seed=1))[1]


def _with_teacher_mean_old_logprobs(tok, replay, models, method):
    """The batch with each policy token's old log-prob set to the mean of the teacher's over the
    three depths (+ a little noise): a random teacher barely depends on its context, so the gaps
    δ^(d) = teacher_d - old then differ in sign between depths, as a trained one's do."""
    trajs, row_tasks = replay
    batch, _ = make_train_batch(trajs, row_tasks, tok, STEP_CFG, method)
    (graphdef, _), ref_params = models
    score = jax.jit(lambda p, b: teacher_and_ref_logprobs(nnx.merge(graphdef, p), None, b, STEP_CFG, method)[0])
    teacher = np.asarray(score(ref_params, jax.tree.map(jnp.asarray, fold_batch(batch))))
    old = teacher.mean(axis=0) + np.random.default_rng(0).normal(0, 2e-5, teacher.shape[1:])
    for i, t in enumerate(trajs):
        n = int(batch.pol_valid[i].sum())
        t.old_logprobs = np.zeros(t.length, np.float32)
        t.old_logprobs[batch.pol_pos[i, :n]] = old[i, :n]
    return make_train_batch(trajs, row_tasks, tok, STEP_CFG, method)[0]


@pytest.fixture(scope="module")
def stepped(tok, replay, models):
    """The step with and without records on the same batch: {"with", "without": (new params,
    metrics), "batch": the host batch, "arrays": the records' arrays, "lines": the records file}."""
    method = resolve_method(STEP_CFG)
    batch = _with_teacher_mean_old_logprobs(tok, replay, models, method)
    device_batch = jax.tree.map(jnp.asarray, fold_batch(batch))
    (graphdef, params), ref_params = models
    opt = optax.adam(1e-3)
    out = {}
    for with_records in (True, False):
        step = make_train_step(graphdef, STEP_CFG, opt, method, records=with_records)
        p = jax.tree.map(jnp.copy, params)
        new, _, metrics = step(p, opt.init(p), ref_params, device_batch)
        out[with_records] = (jax.tree.map(np.asarray, new), jax.device_get(metrics))
    arrays = out[True][1].pop("records")
    return {"with": out[True], "without": out[False], "batch": batch, "arrays": arrays,
            "lines": _lines(replay, batch, arrays, 1 << 20)}


def _lines(replay, batch, arrays, max_bytes):
    trajs, row_tasks = replay
    return records.build_step_records(STEP, trajs, row_tasks, batch, arrays, resolve_method(STEP_CFG), STEP_CFG,
                                      rows=range(len(trajs)), order=batch_row_order(trajs, STEP_CFG),
                                      text_chars=4000, max_bytes=max_bytes)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, stepped):
    """A run folder: the step's records and metrics line, and a records file cut short by a kill."""
    metrics, lines = stepped["with"][1], stepped["lines"]
    run = tmp_path_factory.mktemp("run")
    records.write_records(records.records_path(run, STEP), lines)
    data = gzip.compress("\n".join(lines).encode())
    (run / "records" / "step_000009.jsonl.gz").write_bytes(data[: len(data) // 2])
    (run / "metrics.jsonl").write_text(json.dumps({"step": STEP, **{f"turnsight/{k}": np.asarray(v).tolist()
                                                                   for k, v in metrics.items()
                                                                   if k in ("agreement_rate", "depth_histogram")}}) + "\n")
    return run


def _turns(lines):
    return [(json.loads(line), t) for line in lines[1:] for t in json.loads(line)["turns"]]


def test_records_leave_the_update_unchanged(stepped):
    (p_rec, m_rec), (p_plain, m_plain) = stepped["with"], stepped["without"]
    assert jax.tree.all(jax.tree.map(np.array_equal, p_rec, p_plain))
    assert m_rec.keys() == m_plain.keys()
    for k in m_plain:
        np.testing.assert_array_equal(m_rec[k], m_plain[k], err_msg=k)


def test_records_hold_the_steps_numbers(stepped):
    """Every recorded turn against the step's metrics (exactly where the metric is a count) and
    against TurnSight's formula applied to the recorded gaps: d* by the vote, δ̄* = δ̄^(d*) bitwise,
    μ_g and σ_g token-weighted over the group, δ̂, w = 1 + ε_w tanh(sign(A) δ̂), Ã = A((1-λ) + λw),
    A = GRPO's of the recorded rewards."""
    metrics, batch, lines = stepped["with"][1], stepped["batch"], stepped["lines"]
    header = json.loads(lines[0])
    assert header["trajectories"] == 8 and header["dropped"] == 0 and header["depths"] == [1, 2, 3]
    turns = _turns(lines)
    a = STEP_CFG.algo
    hist = np.zeros(3, int)
    for traj, t in turns:
        d = np.asarray(t["delta"])
        signs = np.where(d >= 0, 1, -1)
        assert t["signs"] == signs.tolist() and t["agree"] == (len(set(t["signs"])) == 1)
        v = 1 if signs.sum() > 0 else -1  # D = 3: no tie
        d_star = int(np.argmax(np.where(signs == v, np.abs(d), -np.inf)))
        assert (t["depth_index"], t["depth"], t["vote"]) == (d_star, d_star + 1, v)
        assert t["delta_star"] == t["delta"][d_star]  # the same float32 value
        hist[d_star] += 1
    np.testing.assert_array_equal(hist, metrics["depth_histogram"])
    agree = np.mean([t["agree"] for _, t in turns])
    assert agree == pytest.approx(float(metrics["agreement_rate"]), abs=1e-7)
    # group statistics over the group's policy tokens, from the recorded turn values and token counts
    for g in range(4):
        members = [(traj, t) for traj, t in turns if traj["group"] == g]
        x = np.concatenate([np.full(t["tokens"], t["delta_star"]) for _, t in members])
        assert members[0][0]["group_mean"] == pytest.approx(x.mean(), abs=1e-6)
        assert members[0][0]["group_std"] == pytest.approx(x.std(), rel=1e-4, abs=1e-6)
    rewards = {traj["row"]: traj["reward"] for traj, _ in turns}
    n_tokens = sum(t["tokens"] for _, t in turns)
    assert n_tokens == int(np.asarray(batch.pol_valid).sum())
    w_mean = adv_mean = 0.0
    for traj, t in turns:
        sib = [rewards[r] for r in rewards if r // G == traj["row"] // G]
        base = (traj["reward"] - np.mean(sib)) / (np.std(sib, ddof=1) + a.eps)
        assert t["base_adv"] == pytest.approx(base, abs=1e-5)
        d_hat = (t["delta_star"] - traj["group_mean"]) / (traj["group_std"] + a.eps)
        assert t["delta_hat"] == pytest.approx(d_hat, rel=1e-3, abs=1e-3)
        w = 1 + a.eps_w * math.tanh(np.sign(t["base_adv"]) * t["delta_hat"])
        assert t["weight"] == pytest.approx(w, abs=1e-6)
        assert t["adv"] == pytest.approx(t["base_adv"] * ((1 - a.lam) + a.lam * t["weight"]), abs=1e-6)
        w_mean += t["weight"] * t["tokens"]
        adv_mean += t["adv"] * t["tokens"]
        assert isinstance(t["terms"]["ratio"], (float, dict)) and "pg_loss" in t["terms"]
    assert w_mean / n_tokens == pytest.approx(float(metrics["weight_mean"]), abs=1e-6)
    assert adv_mean / n_tokens == pytest.approx(float(metrics["adv_mean"]), abs=1e-6)
    assert any(t["weight"] > 1 for _, t in turns) and any(t["weight"] < 1 for _, t in turns)
    assert not all(t["agree"] for _, t in turns) and len(set(hist.nonzero()[0])) > 1


def test_records_hold_the_turns_and_where_they_went_wrong(stepped, replay):
    trajs, row_tasks = replay
    recs = [json.loads(line) for line in stepped["lines"][1:]]
    for rec, traj, task in zip(recs, trajs, row_tasks):
        assert (rec["row"], rec["category"], rec["reward"]) == (recs.index(rec), task.category, traj.reward)
        assert [t["text"] for t in rec["turns"]] == [t.text for t in traj.turns]
        assert [t["observations"] for t in rec["turns"]] == [t.results for t in traj.turns]
        assert rec["signals"]["rewards"] == pytest.approx(traj.reward)
    gold = [recs[i] for i in range(0, 8, 2)]
    for rec in gold:  # the gold chain: every tool turn matches its step, the answer turn has none
        assert [t["gold_match"] for t in rec["turns"]] == [True] * (rec["num_turns"] - 1) + [None]
        assert [t["outcome"] for t in rec["turns"]] == ["ok"] * (rec["num_turns"] - 1) + ["none"]
    nope, unparsed, wasted, early = (recs[i] for i in range(1, 8, 2))
    assert nope["turns"][0]["outcome"] == "error" and nope["turns"][0]["calls"][0]["failed"] is True
    assert nope["turns"][0]["observations"][0].startswith("an error occured when call nope")
    assert unparsed["turns"][0]["outcome"] == "error" and "error" in unparsed["turns"][0]["calls"][0]
    assert wasted["turns"][0]["outcome"] == "wrong" and wasted["turns"][0]["calls"][0]["in_gold"] is False
    assert wasted["turns"][0]["calls"][0]["failed"] is False and wasted["turns"][0]["gold_match"] is False
    assert early["turns"][0]["gold_match"] is True and early["turns"][1]["gold_match"] is False


def test_the_size_bound_keeps_whole_groups_and_reading_names_bad_files(tmp_path, stepped, replay):
    lines = stepped["lines"]
    sizes = [len(line) + 1 for line in lines[1:]]
    bound = sizes[0] + sizes[1] + sizes[2] + sizes[3] + 10  # two groups and a bit
    path = records.write_records(tmp_path / "records" / "step_000001.jsonl.gz", lines)
    header, got = records.read_records(path)
    assert header == json.loads(lines[0]) and got == [json.loads(line) for line in lines[1:]]
    assert not list((tmp_path / "records").glob("*.tmp"))
    # the bound keeps whole groups, in batch order, while they fit
    kept = _lines(replay, stepped["batch"], stepped["arrays"], bound)
    assert json.loads(kept[0])["trajectories"] == 4 and json.loads(kept[0])["dropped"] == 4
    assert [json.loads(line)["group"] for line in kept[1:]] == [0, 0, 1, 1]
    data = path.read_bytes()
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(records.RecordsError, match=r"cut\.jsonl\.gz: not a complete gzip file"):
        records.read_records(cut)
    bad = tmp_path / "bad.jsonl.gz"
    bad.write_bytes(gzip.compress((lines[0] + "\n{not json\n").encode()))
    with pytest.raises(records.RecordsError, match=r"bad\.jsonl\.gz: line 2: invalid JSON"):
        records.read_records(bad)
    old = tmp_path / "old.jsonl.gz"
    old.write_bytes(gzip.compress(json.dumps({**json.loads(lines[0]), "schema": 0}).encode()))
    with pytest.raises(records.RecordsError, match=r"old\.jsonl\.gz: schema 0, this version reads schema 1"):
        records.read_records(old)


# ---- the viewer ----

@pytest.fixture(scope="module")
def browser():
    binary = find_browser()
    if binary is None:
        pytest.skip("no headless Chromium (apt-get install chromium-headless-shell; .ci/run installs it)")
    with Browser(binary) as b:
        yield b


def test_inspect_without_records_is_an_error(tmp_path, capsys):
    assert viewer.main([str(tmp_path)]) == 2
    assert "no trajectory records" in capsys.readouterr().err


def test_the_viewer_shows_the_records_in_a_real_browser(run_dir, stepped, browser, capsys):
    """`python -m turnsight_jax.viewer RUN`, opened in headless Chromium: no console error, the
    cut-off file named with its reason, and the weight and chosen depth of three turns picked at
    random, the depth histogram, the agreement and the filters equal the records."""
    assert viewer.main([str(run_dir)]) == 0
    out = capsys.readouterr()
    assert "records/step_000009.jsonl.gz: not a complete gzip file" in out.err
    page = run_dir / "viewer.html"
    assert "http://" not in page.read_text().replace("http://www.w3.org/2000/svg", "")  # nothing fetched
    browser.open(page.as_uri())
    assert browser.eval("document.body.dataset.ready") == "1"
    assert browser.errors == []
    problems = browser.eval("[...document.querySelectorAll('.problem')].map(e => e.textContent)")
    assert len(problems) == 1 and problems[0].startswith("records/step_000009.jsonl.gz: not a complete gzip file")
    turns = _turns(stepped["lines"])
    for traj, t in random.Random(26).sample(turns, 3):
        sel = f"#turn-{STEP}-{traj['row']}-{t['k']}"
        got = browser.eval(f"""(() => {{ const r = document.querySelector('{sel}');
            const cell = f => r.querySelector('[data-field="' + f + '"]');
            return ['weight', 'depth', 'adv', 'delta_hat'].map(f => [cell(f).dataset.value, cell(f).textContent]); }})()""")
        for (value, shown), field in zip(got, ("weight", "depth", "adv", "delta_hat")):
            assert float(value) == t[field], (sel, field)  # the exact number
            want = str(t[field]) if field == "depth" else _shown(t[field])
            assert shown == want, (sel, field, shown, want)
    hist = browser.eval("[...document.querySelectorAll('#depth-histogram rect[data-depth]')]"
                        ".map(r => [Number(r.dataset.depth), Number(r.dataset.count)])")
    assert hist == [[d, sum(t["depth"] == d for _, t in turns)] for d in (1, 2, 3)]
    assert float(browser.eval("document.getElementById('agg-agreement').dataset.value")) == pytest.approx(
        np.mean([t["agree"] for _, t in turns]))
    assert browser.eval("document.querySelectorAll('tr.turn').length") == len(turns)
    assert browser.eval("document.querySelectorAll('tr.group-head').length") == 4
    browser.eval("window.viewer.setFilter('disagree', true)")
    assert browser.eval("document.querySelectorAll('tr.turn').length") == sum(not t["agree"] for _, t in turns)
    browser.eval("window.viewer.setFilter('disagree', false); window.viewer.setFilter('outcome', 'error')")
    assert browser.eval("document.querySelectorAll('tr.turn').length") == sum(t["outcome"] == "error" for _, t in turns)
    browser.eval("window.viewer.setFilter('outcome', ''); window.viewer.setFilter('category', 'multi_hop')")
    assert browser.eval("document.querySelectorAll('tr.turn').length") == sum(
        traj["category"] == "multi_hop" for traj, _ in turns)
    browser.eval("window.viewer.setFilter('category', ''); window.viewer.setFilter('opposes', true)")
    opposes = [(traj["row"], t["k"]) for traj, t in turns if _opposes(t)]
    assert browser.eval("[...document.querySelectorAll('tr.turn')].map(r => [Number(r.dataset.row), "
                        "Number(r.dataset.k)])") == [list(x) for x in opposes]
    browser.eval("window.viewer.setFilter('opposes', false); window.viewer.setSort('weight-desc')")
    weights = browser.eval("[...document.querySelectorAll('tr.turn td[data-field=weight]')].map(c => Number(c.dataset.value))")
    assert weights == sorted((t["weight"] for _, t in turns), reverse=True)
    browser.eval("window.viewer.setSort('order'); document.querySelector('tr.turn').click()")
    assert "Turn 0: policy text" in browser.eval("document.querySelector('tr.details').textContent")
    assert browser.errors == []


def _shown(v: float) -> str:
    """The viewer's number format (viewer.js fmt: JavaScript's toFixed(3) / toExponential(2), which
    round the exact binary value half away from zero)."""
    if float(v).is_integer() and abs(v) < 1e6:
        return str(int(v))
    with decimal.localcontext() as ctx:
        ctx.rounding = decimal.ROUND_HALF_UP
        exact = decimal.Decimal(v)
        return format(exact, ".3f") if v == 0 or abs(v) >= 1e-3 else format(exact, ".2e")


def _opposes(t) -> bool:
    shift = t["adv"] - t["base_adv"]
    return (shift > 0 and t["outcome"] in ("error", "wrong")) or (shift < 0 and t["outcome"] == "ok")


def test_a_script_error_on_the_page_is_caught(run_dir, browser, tmp_path):
    """The harness sees what a broken viewer would do: an uncaught exception and console.error."""
    page = (run_dir / "viewer.html").read_text()
    broken = tmp_path / "broken.html"
    broken.write_text(page.replace("init();\n})();", "init();\nconsole.error('deliberate'); undefinedFunction();\n})();"))
    browser.errors.clear()
    browser.open(broken.as_uri())
    assert any("deliberate" in e for e in browser.errors), browser.errors
    assert any("undefinedFunction is not defined" in e for e in browser.errors), browser.errors
    browser.errors.clear()


def test_the_viewer_layout_renders(run_dir, browser, tmp_path):
    """A screenshot of the page at 1400 x 1000: the panels and the turn table are drawn (many
    distinct colours in the table's region: row tints by weight, sign bars, text)."""
    page = tmp_path / "viewer.html"  # its own page: no test depends on another's having run first
    assert viewer.main([str(run_dir), "--out", str(page)]) == 0
    browser.open(page.as_uri())
    png = browser.screenshot()
    (tmp_path / "viewer.png").write_bytes(png)
    width, height, pixels = _decode_png(png)
    assert (width, height) == (1400, 1000)
    box = browser.eval("(() => { const r = document.getElementById('turns').getBoundingClientRect(); "
                       "return [r.left, r.top, r.right, Math.min(r.bottom, innerHeight)].map(Math.round); })()")
    left, top, right, bottom = box
    assert right - left > 1000 and bottom - top > 100
    region = pixels[top:bottom, left:right].reshape(-1, pixels.shape[-1])
    colours = {tuple(p) for p in region[:: 7]}
    assert len(colours) > 50, len(colours)
    panels = browser.eval("[...document.querySelectorAll('.panel')].map(p => p.getBoundingClientRect().height)")
    assert len(panels) == 4 and min(panels) > 80


def _decode_png(data: bytes):
    """(width, height, pixels [H, W, C] uint8) of a PNG (Pillow, matplotlib's dependency)."""
    from PIL import Image

    img = Image.open(io.BytesIO(data))
    return img.width, img.height, np.asarray(img.convert("RGB"))


def test_a_resumed_run_clears_its_records_of_the_steps_it_redoes(tmp_path):
    """records.clear_from (the trainer calls it after restoring a checkpoint): this process's files
    of the redone steps and any file a killed write left under its temporary name go; other
    processes' files and earlier steps stay."""
    names = ["step_000001.jsonl.gz", "step_000002.jsonl.gz", "step_000003.jsonl.gz", "step_000002.p1.jsonl.gz",
             "step_000004.jsonl.gz.tmp", "step_000004.p1.jsonl.gz.tmp"]
    (tmp_path / "records").mkdir()
    for name in names:
        (tmp_path / "records" / name).write_bytes(b"x")
    records.clear_from(tmp_path, 2, 0)
    assert sorted(p.name for p in (tmp_path / "records").iterdir()) == [
        "step_000001.jsonl.gz", "step_000002.p1.jsonl.gz", "step_000004.p1.jsonl.gz.tmp"]
    assert [records.file_step(p) for p in records.run_record_files(tmp_path)] == [1, 2]
    # files that are not ours (a non-ASCII digit, no number, a copy) are neither listed nor removed,
    # and do not stop a resume (int("²") raised here before)
    strays = ["step_00000².jsonl.gz", "step_000002.p².jsonl.gz", "step_abc.jsonl.gz", "step_000002 (copy).jsonl.gz",
              "step_000009.p².jsonl.gz.tmp"]
    for name in strays:
        (tmp_path / "records" / name).write_bytes(b"x")
    records.clear_from(tmp_path, 0, 0)
    assert sorted(p.name for p in (tmp_path / "records").iterdir()) == sorted(strays + [
        "step_000002.p1.jsonl.gz", "step_000004.p1.jsonl.gz.tmp"])
    assert [(records.file_step(p), records.file_process(p)) for p in records.run_record_files(tmp_path)] == [(2, 1)]
    with pytest.raises(records.RecordsError, match="not a records file name"):
        records.file_step(tmp_path / "records" / strays[0])


def test_the_viewer_of_a_method_without_turnsight_numbers(stepped, browser, tmp_path):
    """Records of a method without hindsight views (GRPO's: no gaps, depths or weights): the page
    shows what there is, says what is not there, and raises no error."""
    lines = stepped["lines"]
    header = {**json.loads(lines[0]), "method": "grpo", "advantage": "grpo", "base": None, "teacher": None}
    turnsight = ("delta", "signs", "agree", "vote", "depth_index", "depth", "delta_star", "delta_hat", "weight")
    trajs = []
    for line in lines[1:]:
        rec = {k: v for k, v in json.loads(line).items() if k not in ("group_mean", "group_std")}
        rec["turns"] = [{k: v for k, v in t.items() if k not in turnsight} for t in rec["turns"]]
        trajs.append(json.dumps(rec))
    records.write_records(records.records_path(tmp_path, 0), [json.dumps(header), *trajs])
    out, _ = viewer.write_viewer(tmp_path)
    browser.errors.clear()
    browser.open(out.as_uri())
    assert browser.eval("document.body.dataset.ready") == "1" and browser.errors == []
    assert browser.eval("document.getElementById('depth-histogram').textContent") == "no chosen depths in these records"
    heads = browser.eval("[...document.querySelectorAll('#turns-head th')].map(t => t.textContent)")
    assert "w" not in heads and "d*" not in heads and "Ã" in heads and "A_base" in heads
    assert browser.eval("document.querySelectorAll('tr.turn').length") == sum(
        len(json.loads(t)["turns"]) for t in trajs)


def test_a_turn_value_constant_to_float32_rounding_is_one_number():
    """records.turn_value: min == max gives that float; a spread of one ulp (one token's copy of a
    per-turn product computed a last bit apart) the mean, one float; a real spread the summary."""
    from turnsight_jax.records import turn_value

    x = np.float32(0.61750719)
    up = np.nextafter(x, np.float32(1))
    summary = lambda lo, hi, total: {"min": np.array([[lo]]), "max": np.array([[hi]]), "sum": np.array([[total]])}  # noqa: E731
    assert turn_value(summary(x, x, 4 * float(x)), 0, 0, 4.0) == float(x)
    one = turn_value(summary(x, up, 3 * float(x) + float(up)), 0, 0, 4.0)
    assert isinstance(one, float) and float(x) <= one <= float(up)
    assert turn_value(summary(x, x + np.float32(1e-4), 4 * float(x)), 0, 0, 4.0) == {
        "mean": pytest.approx(float(x)), "min": float(x), "max": float(x + np.float32(1e-4))}
    assert turn_value(summary(x, x, 0.0), 0, 0, 0.0) is None
