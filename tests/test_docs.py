"""Doc-test: every command in the ```bash blocks of README.md and docs/*.md runs, so none can rot.

A *command* is a non-comment line of a ```bash block, joined across trailing `\\` continuations
and split at `&&` and `;`. Each command is one test case, id `FILE:LINE:what`, run from the
repository root with this interpreter (`python` / `python3` -> sys.executable), XLA_FLAGS set to
tests/conftest.py's SUBPROCESS_XLA_FLAGS (one CPU device unless the command sets it), and a JAX
compilation cache shared by the session.
Independent commands run two at a time (`TURNSIGHT_DOC_TEST_JOBS`), started when the first case
runs; each case waits for its own. A failure shows the command as run and the tail of its stderr
and stdout.

Rules:

* Not run here, because they are exactly what `.ci/run` runs before this test (make a venv,
  activate it, install the package, run pytest): commands beginning with `pip install`,
  `python3 -m venv`, `. .venv/bin/activate`, `source`, `git clone`, `cd `, and
  `python -m pytest` / `pytest`.
* Markers, on comment lines right above a command (no blank line in between):
  - `# doc-test: covered-by tests/test_x.py` for a command that an existing test runs in full
    (e.g. the BFCL self-check, benchmark scripts, real launch runs against fake executables):
    the named test file must exist and mention the command's module or script name;
  - `# doc-test: external <why>` for a command of a program that is not part of this
    repository (e.g. `gcloud`): it must not be a python, `launch/` or repository script.
* `python -m turnsight_jax.train` without `--dry-run`: the short-run overrides `SHORT_TRAIN` are
  appended (later overrides win) and `--workdir` becomes a fresh temp folder (added when absent;
  the doc's folder, or the default `runs/<config name>`, is remembered for later commands of the
  same file). Identical resolved configs are trained once per session and the run reused.
  With `--dry-run` it runs as written plus the small geometry `SHORT_DRY_RUN`, so compiling even
  the 8B step takes well under two minutes.
* Placeholder paths (`/path/to/...`, `/models/...`, `data/...`) become test fixtures by name:
  `ftrl` -> the FTRL sample rows (`ftrl_sample_path`; in train/sft commands the 4 rows with the
  shortest prompts; such commands skip cleanly when ../shared is absent), `toolhop` -> a small
  ToolHop file, `qwen` -> a tiny random Hugging Face Qwen3 folder (vocabulary 151,936, the
  bundled tokenizer). A `--replay FILE` that does not exist becomes a
  script file with one answer turn per FTRL/ToolHop fixture task.
* `python -m turnsight_jax.evaluate` / `report` / `sft` get small limits (`--limit 2`,
  `--bfcl-limit 1 --bfcl-categories multi_turn_base`: EVAL_LIMITS; with a model also short turns
  and budgets) and temp output folders. A run
  folder they read (`--checkpoint DIR`, report's `RUN_DIR`) is the one a train command of the
  same file wrote to that path (train -> evaluate -> report chain on one run folder per file);
  a folder no train command of the file produces is a session run of the embedded default.
* `launch/*.sh` commands must carry `--dry-run` (then they run as written and must print the
  commands they would run, `+ ...` lines), unless marked
  `# doc-test: covered-by tests/test_launch.py`.
* Other `python -m turnsight_jax.*` modules and `python <repository script>` run as written.
  Anything else fails: give it a rule or a marker.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys

import pytest
from conftest import SUBPROCESS_XLA_FLAGS

REPO = pathlib.Path(__file__).resolve().parents[1]
DOC_FILES = [p for p in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))] if p.is_file()]

SETUP_PREFIXES = ("pip install", "python3 -m venv", ". .venv/bin/activate", "source ", "git clone", "cd ",
                  "python -m pytest", "python3 -m pytest", "pytest")
MARKER = re.compile(r"#\s*doc-test:\s*(covered-by|external)\b\s*(.*)")

# The short run (also the notebook's QUICK setting, so the two share compiled programs).
SHORT_TRAIN = [
    "--config.sft.steps=0", "--config.sft.curriculum_steps=0", "--config.train.steps=1",
    "--config.train.prompts_per_step=2",
    "--config.train.group_size=2", "--config.train.micro_batches=1", "--config.train.mini_batches=1",
    "--config.train.teacher_micro_batches=1", "--config.train.micro_batch_groups=1", "--config.data.num_eval=2", "--config.eval.max_turns=2",
    "--config.eval.temperature=0",
    "--config.rollout.max_turns=2", "--config.rollout.max_turn_tokens=12", "--config.rollout.max_response_tokens=64",
    "--config.train.logprob_chunk=256", "--config.log.tensorboard=False",
]
SHORT_DRY_RUN = [
    "--config.train.prompts_per_step=8", "--config.rollout.max_prompt_tokens=1024",
    "--config.rollout.max_response_tokens=1024", "--config.train.micro_batches=8",
    "--config.train.teacher_micro_batches=8",
]
# BFCL in doc commands: one entry of its base category (the prefill of its ~4k-token prompts
# dominates). Memory's prerequisite conversations (10 per backend even for one question) and the
# other subsets have their own tests (tests/test_evaluate.py, tests/test_eval_bfcl_harness.py,
# tests/test_eval_web_search.py).
EVAL_LIMITS = {"--limit": "1", "--bfcl-limit": "1", "--bfcl-categories": "multi_turn_base"}
EVAL_MODEL_LIMITS = {"--max-turns": "2", "--max-new-tokens": "16", "--max-response-tokens": "128",
                     "--bfcl-max-response-tokens": "128", "--workers": "1"}
TIMEOUT_S = 600
PARALLEL = int(os.environ.get("TURNSIGHT_DOC_TEST_JOBS", "2"))  # commands run at once
FTRL_TRAIN_ROWS = 4

TOOLHOP_ROWS = [
    {"id": "doc-q0", "question": "Who directed Heat?", "answer": "Michael Mann",
     "tools": {"director_of": {"name": "director_of", "description": "The director of a movie.",
                               "parameters": {"type": "object", "properties": {"movie": {"type": "string"}},
                                              "required": ["movie"]}}},
     "functions": {"director_of": "def director_of(movie):\n    return {'director': 'Michael Mann'}\n"}},
]


# ---------------------------------------------------------------------------------------------
# Extraction
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class DocCommand:
    file: str  # relative to the repository root
    line: int  # 1-based line of the command's first line
    text: str  # the joined command
    argv: list[str]
    marker: tuple[str, str] | None = None

    @property
    def id(self) -> str:
        return f"{self.file}:{self.line}:{_slug(self.argv)}"


def _split_commands(text: str) -> list[list[str]]:
    """shell words of `text` (comments dropped), split at `&&` and `;`."""
    lex = shlex.shlex(text, posix=True, punctuation_chars=";&|<>()")
    lex.whitespace_split = True
    lex.commenters = "#"
    parts: list[list[str]] = [[]]
    for word in lex:
        if word in ("&&", ";"):
            parts.append([])
        else:
            parts[-1].append(word)
    return [p for p in parts if p]


def extract_commands(path: pathlib.Path) -> list[DocCommand]:
    rel = str(path.relative_to(REPO))
    lines = path.read_text(encoding="utf-8").splitlines()
    out: list[DocCommand] = []
    fence = None
    marker = None
    i = 0
    while i < len(lines):
        stripped = lines[i].strip()
        if stripped.startswith("```"):
            fence = None if fence is not None else stripped[3:].strip()
            marker = None
            i += 1
            continue
        if fence != "bash":
            i += 1
            continue
        if not stripped:
            marker = None
            i += 1
            continue
        if stripped.startswith("#"):
            m = MARKER.match(stripped)
            if m:
                marker = (m.group(1), m.group(2).strip())
            i += 1
            continue
        start = i
        text = lines[i]
        while text.rstrip().endswith("\\") and i + 1 < len(lines):
            i += 1
            text = text.rstrip()[:-1] + " " + lines[i].strip()
        for argv in _split_commands(text):
            joined = shlex.join(argv)
            if not any(joined == p.strip() or joined.startswith(p) for p in SETUP_PREFIXES):
                out.append(DocCommand(rel, start + 1, joined, argv, marker))
        marker = None
        i += 1
    return out


def _program(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """Leading VAR=value assignments and the rest of the command."""
    env, k = {}, 0
    while k < len(argv) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", argv[k]):
        name, _, value = argv[k].partition("=")
        env[name] = value
        k += 1
    return env, argv[k:]


def _kind(argv: list[str]) -> str:
    _, cmd = _program(argv)
    if cmd and cmd[0] in ("python", "python3"):
        if len(cmd) > 2 and cmd[1] == "-m":
            mod = cmd[2]
            return {"turnsight_jax.train": "train", "turnsight_jax.sft": "sft", "turnsight_jax.evaluate": "evaluate",
                    "turnsight_jax.report": "report"}.get(mod, "module" if mod.startswith("turnsight_jax") else "other")
        if len(cmd) > 1 and (REPO / cmd[1]).is_file():
            return "script"
        return "other"
    if cmd and re.fullmatch(r"(\./)?launch/[\w.-]+\.sh", cmd[0]):
        return "launch"
    return "other"


def _slug(argv: list[str]) -> str:
    _, cmd = _program(argv)
    kind = _kind(argv)
    if kind in ("train", "sft", "evaluate", "report", "module"):
        name = cmd[2].rsplit(".", 1)[-1]
        extra = [a for a in cmd[3:] if a in ("--dry-run", "--hf", "--checkpoint", "--replay")]
        if "--config" in cmd:
            extra.insert(0, pathlib.Path(cmd[cmd.index("--config") + 1]).stem)
        return "-".join([name, *(e.lstrip("-") for e in extra)])
    if kind == "script":
        return pathlib.Path(cmd[1]).stem + ("".join(f" {a}" for a in cmd[2:] if a.startswith("--")))
    if kind == "launch":
        mode = cmd[1] if len(cmd) > 1 and not cmd[1].startswith("-") else ""
        return " ".join(w for w in (pathlib.Path(cmd[0]).name, mode, "--dry-run" if "--dry-run" in cmd else "") if w)
    return re.sub(r"\s+", " ", " ".join(cmd[:3]))[:40]


COMMANDS = [c for path in DOC_FILES for c in extract_commands(path)]


# ---------------------------------------------------------------------------------------------
# Fixtures and per-file state
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> pathlib.Path:
    return tmp_path_factory.mktemp("doc_commands")


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory) -> pathlib.Path:
    """The test run's persistent JAX compilation cache (tests/conftest.py), for every subprocess."""
    path = pathlib.Path(os.environ["JAX_COMPILATION_CACHE_DIR"])  # the run's cache (tests/conftest.py)
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="module")
def tiny_hf_dir(tmp_path_factory) -> pathlib.Path:
    """A tiny random Qwen3 in Hugging Face layout with the real vocabulary and tokenizer."""
    from turnsight_jax.assets import default_tokenizer_dir
    from turnsight_jax.models.config import Qwen3Config
    from turnsight_jax.models.qwen3 import init_model
    from turnsight_jax.models.weights import save_pretrained

    path = tmp_path_factory.mktemp("tiny_qwen3_hf")
    cfg = Qwen3Config(vocab_size=151936, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=16)
    save_pretrained(init_model(cfg, seed=7), path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(default_tokenizer_dir() / name, path / name)
    return path


@pytest.fixture(scope="module")
def ftrl_train_path(tmp_path_factory) -> pathlib.Path:
    """FTRL training rows in the layout of MatchTIR's release (with `ground_truth`, which the
    paper's MatchTIR-based methods require), built here (tests/_ftrl_rows.py): short prompts, so
    the documented FTRL training command runs in seconds and on a fresh clone."""
    from _ftrl_rows import GT_CALLS, gt_row

    path = tmp_path_factory.mktemp("ftrl_train") / "ftrl_train_short.jsonl"
    rows = [gt_row(i, json.dumps(GT_CALLS[i % 2])) for i in range(FTRL_TRAIN_ROWS)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def toolhop_path(tmp_path_factory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("toolhop") / "toolhop.json"
    path.write_text(json.dumps(TOOLHOP_ROWS))
    return path


class Session:
    """Plans documented commands (in the test thread: fixtures, placeholders, run folders) and runs
    them in a small pool of worker threads, each a subprocess. At setup it submits every selected
    command that depends on no other, so that PARALLEL of them run at once while the tests wait
    for their own results in order. Remembers run folders per doc file and trained configs."""

    def __init__(self, request, workspace: pathlib.Path, cache: pathlib.Path):
        self.request = request
        self.workspace = workspace
        self.cache = cache
        self.count = 0
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=PARALLEL, thread_name_prefix="doc-test")
        self.jobs: dict[tuple, concurrent.futures.Future] = {}
        self.runs_by_file: dict[str, dict[str, concurrent.futures.Future]] = {}
        self.trained: dict[str, concurrent.futures.Future] = {}  # resolved config -> run folder

    def fresh(self, stem: str) -> pathlib.Path:
        self.count += 1
        return self.workspace / f"{self.count:02d}_{stem}"

    def fixture(self, name: str):
        return self.request.getfixturevalue(name)

    # -- placeholders --
    def placeholder(self, value: str, *, training: bool = False) -> str:
        if not value.startswith(("/path/to/", "/models/", "data/")):
            return value
        low = value.lower()
        if "ftrl" in low:
            return str(self.fixture("ftrl_train_path" if training else "ftrl_sample_path"))
        if "toolhop" in low:
            return str(self.fixture("toolhop_path"))
        if "qwen" in low:
            return str(self.fixture("tiny_hf_dir"))
        pytest.fail(f"no doc-test fixture for the placeholder path {value!r}: add a rule in tests/test_docs.py")

    def substitute(self, args: list[str], *, training: bool = False) -> list[str]:
        out = []
        for a in args:
            if a.startswith("--") and "=" in a:
                key, _, value = a.partition("=")
                out.append(f"{key}={self.placeholder(value, training=training)}")
            else:
                out.append(self.placeholder(a, training=training))
        return out

    def replay_scripts(self) -> pathlib.Path:
        path = self.fresh("replay").with_suffix(".jsonl")
        lines = []
        ftrl = self.fixture("ftrl_sample_path")
        rows = [r for r in ftrl.read_text().splitlines() if r.strip()]
        lines += [{"task_id": str(json.loads(r).get("id", f"{ftrl.stem}:{i}")), "turns": ["<answer>?</answer>"]}
                  for i, r in enumerate(rows)]
        lines += [{"task_id": r["id"], "turns": ["<answer>?</answer>"]} for r in TOOLHOP_ROWS]
        path.write_text("".join(json.dumps(x) + "\n" for x in lines))
        return path

    # -- execution --
    def env(self, extra: dict[str, str]) -> dict[str, str]:
        env = dict(os.environ)
        env["XLA_FLAGS"] = SUBPROCESS_XLA_FLAGS  # not the session's 8 fake devices; a command may set its own
        env.update({"JAX_COMPILATION_CACHE_DIR": str(self.cache), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1", "PYTHONUNBUFFERED": "1"})
        env.update(extra)
        return env

    def run(self, cmd: DocCommand, argv: list[str], extra_env: dict[str, str] | None = None):
        """Run one subprocess (in a worker thread); pytest.fail with the command and its output."""
        argv = [sys.executable if k == 0 and a in ("python", "python3") else a for k, a in enumerate(argv)]
        if argv and argv[0].startswith("launch/"):
            argv[0] = str(REPO / argv[0])
        try:
            proc = subprocess.run(argv, cwd=REPO, env=self.env(extra_env or {}), capture_output=True, text=True,
                                  timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired as e:
            err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
            pytest.fail(f"{cmd.file}:{cmd.line}: timed out after {TIMEOUT_S}s\n  documented: {cmd.text}\n"
                        f"  ran: {shlex.join(argv)}\n--- stderr (tail) ---\n{err[-3000:]}")
        if proc.returncode != 0:
            pytest.fail(f"{cmd.file}:{cmd.line}: exit status {proc.returncode}\n  documented: {cmd.text}\n"
                        f"  ran: {shlex.join(argv)}\n--- stderr (tail) ---\n{proc.stderr[-3000:]}\n"
                        f"--- stdout (tail) ---\n{proc.stdout[-1500:]}")
        return proc

    def submit(self, cmd: DocCommand, argv: list[str], env: dict[str, str], check=None) -> concurrent.futures.Future:
        def job():
            proc = self.run(cmd, argv, env)
            return check(proc) if check else proc

        return self.pool.submit(job)

    def job(self, cmd: DocCommand) -> concurrent.futures.Future:
        """The (memoised) future of a documented command; planning happens here, in this thread."""
        key = (cmd.file, cmd.line, cmd.text)
        if key not in self.jobs:
            self.jobs[key] = self.plan(cmd)
        return self.jobs[key]

    def prefetch(self, commands) -> None:
        """Submit the commands that need no other command's output (not evaluate --checkpoint or
        report); a planning error (a skip, a missing fixture) is left for the test to report."""
        for cmd in commands:
            kind = _kind(cmd.argv)
            if cmd.marker or kind in ("other", "report") or (kind == "evaluate" and "--checkpoint" in cmd.argv) \
                    or (kind == "launch" and "--dry-run" not in cmd.argv):
                continue
            try:
                self.job(cmd)
            except BaseException:  # noqa: BLE001 - pytest's skip/fail outcomes included
                pass

    def plan(self, cmd: DocCommand) -> concurrent.futures.Future:
        kind = _kind(cmd.argv)
        env, prog = _program(cmd.argv)
        if kind == "launch":
            def printed(proc):
                assert any(line.startswith("+ ") for line in proc.stdout.splitlines()), proc.stdout[-2000:]
            return self.submit(cmd, prog, env, printed)

        if kind == "train":
            args = prog[3:]
            if "--dry-run" not in args:
                return self.train(cmd)

            def planned(proc):
                assert "Memory plan" in proc.stdout and "peak estimate" in proc.stdout, proc.stdout[-2000:]
            argv = ["python", "-m", "turnsight_jax.train", *self.substitute(args, training=True), *SHORT_DRY_RUN]
            return self.submit(cmd, argv, env, planned)

        if kind == "evaluate":
            args = self.substitute(prog[3:])
            replay = _flag_value(args, "--replay")
            if replay is not None and replay != "gold" and not (REPO / replay).is_file():
                args = _set_flag(args, "--replay", str(self.replay_scripts()))
            ckpt = _flag_value(args, "--checkpoint")
            if ckpt is not None:
                args = _set_flag(args, "--checkpoint", str(self.run_folder(cmd.file, ckpt)))
            for flag, value in EVAL_LIMITS.items():
                args = _set_flag(args, flag, value)
            if replay is None:
                for flag, value in EVAL_MODEL_LIMITS.items():
                    args = _set_flag(args, flag, value)
            out = self.fresh("eval")
            args = _set_flag(args, "--out", str(out))

            def evaluated(proc):
                results = json.loads((out / "results.json").read_text())
                assert results["benchmarks"], results
            return self.submit(cmd, ["python", "-m", "turnsight_jax.evaluate", *args], env, evaluated)

        if kind == "report":
            args = list(prog[3:])
            positional = [k for k, a in enumerate(args) if not a.startswith("-") and (k == 0 or args[k - 1] != "--out")]
            assert positional, f"{cmd.file}:{cmd.line}: report needs RUN_DIR"
            args[positional[0]] = str(self.run_folder(cmd.file, args[positional[0]]))
            out = self.fresh("report")
            args = _set_flag(args, "--out", str(out))

            def plotted(proc):
                assert sorted(out.glob("*.png")), f"no plots in {out}"
            return self.submit(cmd, ["python", "-m", "turnsight_jax.report", *args], env, plotted)

        if kind == "sft":
            folder = self.fresh("sft")
            args = _set_flag(self.substitute(prog[3:], training=True), "--workdir", str(folder))
            args += ["--config.sft.curriculum_steps=2", "--config.sft.steps=2", "--config.sft.batch_size=2",
                     "--config.sft.num_tasks=8"]

            def warm(proc):
                assert (folder / "sft" / "SFT_DONE").is_file()
            return self.submit(cmd, ["python", "-m", "turnsight_jax.sft", *args], env, warm)

        if kind in ("module", "script"):
            return self.submit(cmd, [prog[0], *self.substitute(prog[1:])], env)
        raise AssertionError(f"{cmd.file}:{cmd.line}: no plan for a {kind!r} command")

    # -- run folders --
    def runs(self, file: str) -> dict[str, concurrent.futures.Future]:
        return self.runs_by_file.setdefault(file, {})

    def run_folder(self, file: str, doc_path: str) -> pathlib.Path:
        """The run folder a train command of `file` wrote to `doc_path` (waiting for it, running it
        if needed), else a session run of the embedded default."""
        key = os.path.normpath(doc_path)
        runs = self.runs(file)
        if key not in runs:
            producer = next((c for c in COMMANDS if c.file == file and _kind(c.argv) == "train"
                             and "--dry-run" not in c.argv and self.doc_workdir(c) == key), None)
            if producer is not None:
                self.job(producer)
            else:
                runs[key] = self.train_argv(DocCommand(file, 0, "python -m turnsight_jax.train",
                                                       ["python", "-m", "turnsight_jax.train"]), [])
        return runs[key].result()

    def doc_workdir(self, cmd: DocCommand) -> str:
        _, prog = _program(cmd.argv)
        args = prog[3:]
        if "--workdir" in args:
            return os.path.normpath(args[args.index("--workdir") + 1])
        for a in args:
            if a.startswith("--workdir="):
                return os.path.normpath(a.split("=", 1)[1])
        return os.path.normpath(f"runs/{self.resolved(args).name}")

    def resolved(self, args: list[str]):
        """The config a train command resolves to (placeholders substituted, shortened)."""
        from turnsight_jax.train import load_run_config

        config, overrides, k = None, [], 0
        while k < len(args):
            a = args[k]
            if a in ("--config", "--workdir", "--fake-devices"):
                config = args[k + 1] if a == "--config" else config
                k += 2
                continue
            if a.startswith(("--workdir=", "--fake-devices=")) or a == "--dry-run":
                k += 1
                continue
            if a.startswith("--config="):
                config = a.split("=", 1)[1]
            else:
                overrides.append(a)
            k += 1
        return load_run_config(str(REPO / config) if config else None,
                               self.substitute(overrides, training=True) + SHORT_TRAIN)

    def train(self, cmd: DocCommand) -> concurrent.futures.Future:
        env, prog = _program(cmd.argv)
        key = self.doc_workdir(cmd)
        future = self.train_argv(cmd, prog[3:], env)
        self.runs(cmd.file)[key] = future
        return future

    def train_argv(self, cmd: DocCommand, args: list[str], env: dict[str, str] | None = None):
        """Future of the run folder of the shortened train command (one run per resolved config)."""
        args = list(args)
        for k, a in enumerate(args):  # drop the doc's workdir
            if a == "--workdir":
                del args[k:k + 2]
                break
            if a.startswith("--workdir="):
                del args[k]
                break
        config_key = str(self.resolved(args)) + json.dumps(env or {}, sort_keys=True)
        if config_key not in self.trained:
            folder = self.fresh("run")
            argv = ["python", "-m", "turnsight_jax.train", *self.substitute(args, training=True), *SHORT_TRAIN,
                    "--workdir", str(folder)]

            def trained(proc):
                lines = (folder / "metrics.jsonl").read_text().splitlines()
                assert len(lines) >= 1 and json.loads(lines[-1])["step"] == 0, lines
                assert (folder / "export" / "config.json").is_file() and (folder / "checkpoints").is_dir()
                return folder
            self.trained[config_key] = self.submit(cmd, argv, env or {}, trained)
        return self.trained[config_key]


@pytest.fixture(scope="module")
def session(request, workspace, compile_cache):
    s = Session(request, workspace, compile_cache)
    here = pathlib.Path(__file__).resolve()
    selected = [item.callspec.params["cmd"] for item in request.session.items
                if pathlib.Path(str(item.fspath)).resolve() == here and hasattr(item, "callspec")
                and "cmd" in item.callspec.params]
    s.prefetch(selected)
    yield s
    s.pool.shutdown(wait=True, cancel_futures=True)


def _set_flag(args: list[str], flag: str, value: str) -> list[str]:
    """Replace `flag VALUE` / `flag=VALUE` or append it."""
    out, k, done = [], 0, False
    while k < len(args):
        if args[k] == flag:
            out += [flag, value]
            k += 2
            done = True
            continue
        if args[k].startswith(flag + "="):
            out.append(f"{flag}={value}")
            done = True
        else:
            out.append(args[k])
        k += 1
    return out if done else out + [flag, value]


def _flag_value(args: list[str], flag: str) -> str | None:
    for k, a in enumerate(args):
        if a == flag and k + 1 < len(args):
            return args[k + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def _mentions(test_file: pathlib.Path, argv: list[str]) -> list[str]:
    """Names by which a test file may refer to the command: module, its last part, script."""
    _, cmd = _program(argv)
    if len(cmd) > 2 and cmd[0] in ("python", "python3") and cmd[1] == "-m":
        return [cmd[2], cmd[2].rsplit(".", 1)[-1]]
    if len(cmd) > 1 and cmd[0] in ("python", "python3"):
        return [cmd[1], pathlib.Path(cmd[1]).name]
    return [cmd[0], pathlib.Path(cmd[0]).name]


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------
def test_docs_have_commands():
    """The extraction finds the documented commands (guards against a parser that finds none)."""
    files = {c.file for c in COMMANDS}
    assert "docs/evaluation.md" in files and "docs/scaling.md" in files, files
    for path in DOC_FILES:
        text = path.read_text(encoding="utf-8")
        assert text.count("```") % 2 == 0, f"{path}: unbalanced code fences"


@pytest.mark.parametrize("cmd", COMMANDS, ids=[c.id for c in COMMANDS])
def test_documented_command(cmd: DocCommand, session: Session):
    kind = _kind(cmd.argv)
    env, prog = _program(cmd.argv)
    if cmd.marker and cmd.marker[0] == "covered-by":
        target = cmd.marker[1].split()[0] if cmd.marker[1] else ""
        path = REPO / target
        assert target and path.is_file(), f"{cmd.file}:{cmd.line}: covered-by names no existing test file: {target!r}"
        names = _mentions(path, cmd.argv)
        assert any(n in path.read_text(encoding="utf-8") for n in names), \
            f"{cmd.file}:{cmd.line}: {target} does not mention {names[-1]!r}"
        return
    if cmd.marker and cmd.marker[0] == "external":
        assert kind == "other" and prog and prog[0] not in ("python", "python3") and not (REPO / prog[0]).exists(), \
            f"{cmd.file}:{cmd.line}: '# doc-test: external' is only for programs outside this repository: {cmd.text}"
        assert cmd.marker[1], f"{cmd.file}:{cmd.line}: say why the command is external"
        return
    if kind == "launch" and "--dry-run" not in prog:
        pytest.fail(f"{cmd.file}:{cmd.line}: a documented launch command must carry --dry-run or be marked "
                    f"'# doc-test: covered-by tests/test_launch.py': {cmd.text}")
    if kind == "other":
        pytest.fail(f"{cmd.file}:{cmd.line}: no doc-test rule runs this command: {cmd.text}\n"
                    f"(give it a rule in tests/test_docs.py, or mark it '# doc-test: covered-by tests/...' or "
                    f"'# doc-test: external <why>')")
    session.job(cmd).result()
