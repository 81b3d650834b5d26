"""The launch scripts (launch/*.sh, launch/slurm_job.sbatch, helpers in launch/common.bash):
shellcheck, dry runs parsed back into argument lists, real runs against fake gcloud, srun,
scontrol and python executables, and the local multi-process mode running real JAX processes.

Dry runs get a PATH holding only `bash` and `dirname`, which proves they execute nothing else
(no gcloud, sbatch, srun or python needed).
"""

from __future__ import annotations

import json
import os
import pathlib
import shlex
import shutil
import subprocess
import sys

import pytest

from conftest import SUBPROCESS_XLA_FLAGS

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
LAUNCH = REPO_ROOT / "launch"
SCRIPTS = sorted(LAUNCH.glob("*.sh"))
SHELL_FILES = SCRIPTS + sorted(LAUNCH.glob("*.bash")) + sorted(LAUNCH.glob("*.sbatch"))
TRAIN = ["python", "-m", "turnsight_jax.train"]
# A config override with a space and both quote kinds, to check quoting end to end.
AWKWARD = """--config.run_name=it's a "test" $HOME"""

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="bash not on PATH")


def clean_env(**extra: str) -> dict[str, str]:
    """The test process's environment minus anything the scripts read (SLURM, XLA, CUDA, JAX);
    TMPDIR stays the test run's own folder (tests/conftest.py), so nothing lands in /tmp."""
    drop = ("SLURM_", "XLA_", "JAX_", "TURNSIGHT_", "CUDA_VISIBLE_DEVICES")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update(extra)
    return env


def job_env() -> dict[str, str]:
    """clean_env() plus the test run's compilation cache and its subprocesses' XLA flags
    (tests/conftest.py), for the real JAX jobs: the launcher puts its device count after them."""
    return clean_env(XLA_FLAGS=SUBPROCESS_XLA_FLAGS, **{k: v for k, v in os.environ.items()
                                                         if k.startswith("JAX_PERSISTENT_CACHE")
                                                         or k == "JAX_COMPILATION_CACHE_DIR"})


@pytest.fixture(scope="module")
def bare_path(tmp_path_factory) -> str:
    """A PATH with only bash and dirname on it."""
    d = tmp_path_factory.mktemp("bare_bin")
    for tool in ("bash", "dirname"):
        (d / tool).symlink_to(shutil.which(tool))
    return str(d)


def launch(script: str, *args: str, env: dict[str, str] | None = None, cwd=REPO_ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([str(LAUNCH / script), *args], capture_output=True, text=True, env=env or clean_env(),
                          cwd=cwd, timeout=60)


def dry_run(script: str, *args: str, bare_path: str, **env: str) -> list[list[str]]:
    """Run `script --dry-run args` with nothing but bash on PATH; the `+ ` lines as argv lists."""
    proc = launch(script, "--dry-run", *args, env=clean_env(PATH=bare_path, **env))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    lines = proc.stdout.splitlines()
    assert all(line.startswith(("+ ", "# ")) for line in lines), proc.stdout
    return [shlex.split(line[2:]) for line in lines if line.startswith("+ ")]


def shell_words(command: str) -> list[str]:
    """Words and operators (&&, ;, >, &, ...) of a shell command line."""
    lex = shlex.shlex(command, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    return list(lex)


def contains(seq: list[str], sub: list[str]) -> bool:
    return any(seq[i:i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


def write_fake(bin_dir: pathlib.Path, name: str, body: str) -> None:
    """An executable Python script `name` in bin_dir (the interpreter path is absolute)."""
    path = bin_dir / name
    path.write_text(f"#!{sys.executable}\nimport json, os, subprocess, sys\n{body}")
    path.chmod(0o755)


# A fake `python` that records its argv and the distributed-run environment, one JSON per line.
FAKE_PYTHON = """
keys = ["TURNSIGHT_DISTRIBUTED", "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID",
        "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_FLAGS", "CUDA_VISIBLE_DEVICES"]
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(json.dumps({"argv": sys.argv[1:], "env": {k: os.environ.get(k) for k in keys}}) + "\\n")
"""


def read_log(path: pathlib.Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines()]


# ---------------------------------------------------------------------------------------------
# (a) shellcheck


@pytest.mark.parametrize("script", SHELL_FILES, ids=lambda p: p.name)
def test_shellcheck(script: pathlib.Path):
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck not on PATH (Debian/Ubuntu: apt-get install -y shellcheck)")
    proc = subprocess.run(["shellcheck", "-x", str(script.relative_to(REPO_ROOT))], cwd=REPO_ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_scripts_are_executable_bash_with_strict_mode():
    for script in SCRIPTS + sorted(LAUNCH.glob("*.sbatch")):
        text = script.read_text()
        assert text.startswith("#!/usr/bin/env bash\n"), script
        assert "set -euo pipefail" in text, script
        assert os.access(script, os.X_OK), f"{script} is not executable"


# ---------------------------------------------------------------------------------------------
# (b) TPU pod slice. v5p-16 = 16 TensorCores = 8 chips on 2 hosts (4 chips per host): 2 workers.

TPU = ["--name", "ts-v5p", "--zone", "us-east5-a", "--project", "my-proj"]
GCLOUD_TPU = ["gcloud", "compute", "tpus", "tpu-vm"]
WHERE = ["--zone", "us-east5-a", "--project", "my-proj"]


def ssh_command(argv: list[str]) -> str:
    """The --command of `gcloud compute tpus tpu-vm ssh NAME --zone Z --project P --worker=all`."""
    assert argv[:6] == GCLOUD_TPU + ["ssh", "ts-v5p"], argv
    assert argv[6:] == WHERE + ["--worker=all", "--command", argv[-1]], argv
    return argv[-1]


def test_tpu_up_dry_run_local_repo(bare_path, tmp_path):
    cmds = dry_run("tpu_pod.sh", "up", *TPU, "--accelerator-type", "v5p-16", bare_path=bare_path,
                   TMPDIR=str(tmp_path))
    tarball = f"{tmp_path}/turnsight_jax-ts-v5p.tar.gz"
    assert cmds[0] == GCLOUD_TPU + ["describe", "ts-v5p"] + WHERE
    assert cmds[1] == GCLOUD_TPU + ["create", "ts-v5p"] + WHERE + [
        "--accelerator-type", "v5p-16", "--version", "v2-alpha-tpuv5"]
    assert cmds[2][:3] == ["tar", "-C", str(REPO_ROOT)] and cmds[2][-3:] == ["-czf", tarball, "."]
    assert cmds[3] == GCLOUD_TPU + ["scp", tarball, "ts-v5p:turnsight_jax.tar.gz"] + WHERE + ["--worker=all"]
    install = shell_words(ssh_command(cmds[4]))
    assert contains(install, ["tar", "-xzf", "turnsight_jax.tar.gz", "-C", "~/turnsight_jax"])
    assert contains(install, ["python3", "-m", "uv", "venv", "--allow-existing", "--python", "3.11", "~/turnsight_venv"])
    assert contains(install, ["python3", "-m", "uv", "pip", "install", "--python", "~/turnsight_venv/bin/python",
                              "-e", ".", "jax[tpu]"])
    assert len(cmds) == 5
    assert not (tmp_path / "turnsight_jax-ts-v5p.tar.gz").exists()  # a dry run writes nothing


@pytest.mark.parametrize("accel, version", [("v5litepod-16", "v2-alpha-tpuv5-lite"), ("v6e-16", "v2-alpha-tpuv6e")])
def test_tpu_up_default_versions_and_git_repo(bare_path, accel, version):
    url = "https://github.com/example/turnsight_jax.git"
    cmds = dry_run("tpu_pod.sh", "up", *TPU, "--accelerator-type", accel, "--repo", url, bare_path=bare_path)
    assert cmds[1] == GCLOUD_TPU + ["create", "ts-v5p"] + WHERE + ["--accelerator-type", accel, "--version", version]
    assert len(cmds) == 3  # describe, create, install (no tar/scp for a git URL)
    install = shell_words(ssh_command(cmds[2]))
    assert contains(install, ["git", "clone", url, "~/turnsight_jax"])
    assert contains(install, ["-e", ".", "jax[tpu]"])


def test_tpu_run_dry_run(bare_path):
    cmds = dry_run("tpu_pod.sh", "run", *TPU, "--config", "configs/qwen3_8b.py", "--workdir", "gs://bucket/run1",
                   "--config.mesh.fsdp=8", AWKWARD, "--", "--dry_run", bare_path=bare_path)
    assert len(cmds) == 1
    words = shell_words(ssh_command(cmds[0]))
    start = words.index("nohup")
    end = words.index(">", start)
    assert words[start:end] == ["nohup", "env", "TURNSIGHT_DISTRIBUTED=1", *TRAIN, "--config", "configs/qwen3_8b.py",
                                "--workdir", "gs://bucket/run1", "--config.mesh.fsdp=8", AWKWARD, "--dry_run"]
    assert words[end:end + 2] == [">", "~/turnsight_train.log"]
    assert words[:5] == ["cd", "~/turnsight_jax", "&&", ".", "~/turnsight_venv/bin/activate"]
    assert "tail" in words


@pytest.mark.parametrize("mode, expected", [
    ("logs", ["tail", "-n", "100", "-F", "~/turnsight_train.log"]),
    ("stop", ["kill"]),
])
def test_tpu_logs_and_stop_dry_run(bare_path, mode, expected):
    (cmd,) = dry_run("tpu_pod.sh", mode, *TPU, bare_path=bare_path)
    assert contains(shell_words(ssh_command(cmd)), expected)


def test_tpu_delete_dry_run(bare_path):
    assert dry_run("tpu_pod.sh", "delete", *TPU, bare_path=bare_path) == [
        GCLOUD_TPU + ["delete", "ts-v5p"] + WHERE + ["--quiet"]]


def test_tpu_real_run_executes_what_the_dry_run_prints(bare_path, tmp_path):
    """With a fake gcloud (the slice does not exist yet: describe fails) the commands run are the
    printed ones, and the local checkout is really packed into a tarball."""
    repo = tmp_path / "repo"
    (repo / "turnsight_jax").mkdir(parents=True)
    (repo / "turnsight_jax" / "__init__.py").write_text("")
    (repo / ".venv").mkdir()
    (repo / ".venv" / "big").write_text("x")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    write_fake(bin_dir, "gcloud", """
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
sys.exit(1 if "describe" in sys.argv else 0)
""")
    log = tmp_path / "gcloud.jsonl"
    up = [*TPU, "--accelerator-type", "v5p-16", "--repo", str(repo)]
    run = [*TPU, "--workdir", "gs://b/r", AWKWARD]
    env = clean_env(PATH=f"{bin_dir}:{os.environ['PATH']}", FAKE_LOG=str(log), TMPDIR=str(tmp_path))
    for mode, args in (("up", up), ("run", run), ("stop", TPU), ("delete", TPU)):
        proc = launch("tpu_pod.sh", mode, *args, env=env)
        assert proc.returncode == 0, proc.stderr
    printed = [cmd for mode, args in (("up", up), ("run", run), ("stop", TPU), ("delete", TPU))
               for cmd in dry_run("tpu_pod.sh", mode, *args, bare_path=bare_path, TMPDIR=str(tmp_path))]
    gcloud_printed = [cmd[1:] for cmd in printed if cmd[0] == "gcloud"]
    assert read_log(log) == gcloud_printed
    listing = subprocess.run(["tar", "-tzf", str(tmp_path / "turnsight_jax-ts-v5p.tar.gz")], capture_output=True,
                             text=True, check=True).stdout.split()
    assert "./turnsight_jax/__init__.py" in listing and not any(".venv" in p for p in listing)


# ---------------------------------------------------------------------------------------------
# (c) SLURM, 2 nodes


def parse_env_command(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """`env K=V ... cmd args` -> ({K: V}, [cmd, args...])."""
    assert argv[0] == "env", argv
    i = 1
    while "=" in argv[i] and not argv[i].startswith("-"):
        i += 1
    return dict(a.split("=", 1) for a in argv[1:i]), argv[i:]


def test_slurm_dry_run_two_nodes(bare_path):
    cmds = dry_run("slurm_multinode.sh", "--nodes", "2", "--gpus-per-node", "8", "--time", "12:00:00",
                   "--partition", "gpu", "--account", "proj", "--config", "configs/qwen3_8b.py",
                   "--workdir", "/shared/runs/q8", "--config.mesh.fsdp=16", AWKWARD, bare_path=bare_path)
    forwarded = ["--config", "configs/qwen3_8b.py", "--workdir", "/shared/runs/q8", "--mem-fraction", "0.90",
                 "--config.mesh.fsdp=16", AWKWARD, "--"]
    assert cmds[0] == ["sbatch", "--nodes", "2", "--ntasks-per-node", "1", "--gpus-per-node", "8",
                       "--job-name", "turnsight", "--time", "12:00:00", "--partition", "gpu", "--account", "proj",
                       "--chdir", str(REPO_ROOT), str(LAUNCH / "slurm_job.sbatch"), *forwarded]
    env, srun = parse_env_command(cmds[1])
    assert env == {"TURNSIGHT_DISTRIBUTED": "1", "JAX_COORDINATOR_ADDRESS": "sim-node-0:12345", "JAX_NUM_PROCESSES": "2"}
    assert srun == ["srun", "--nodes", "2", "--ntasks-per-node", "1", "--kill-on-bad-exit=1",
                    str(LAUNCH / "slurm_multinode.sh"), "task", *forwarded]
    assert len(cmds) == 4
    train = [*TRAIN, "--config", "configs/qwen3_8b.py", "--workdir", "/shared/runs/q8", "--config.mesh.fsdp=16", AWKWARD]
    for pid, cmd in enumerate(cmds[2:]):
        env, argv = parse_env_command(cmd)
        assert env == {"TURNSIGHT_DISTRIBUTED": "1", "JAX_COORDINATOR_ADDRESS": "sim-node-0:12345",
                       "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": str(pid), "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.90"}
        assert argv == train


def test_slurm_port_and_extra_args(bare_path):
    cmds = dry_run("slurm_multinode.sh", "submit", "--nodes=3", "--workdir=/w", "--port=23456", "--", "--dry_run",
                   bare_path=bare_path)
    assert cmds[0][-4:] == ["--port", "23456", "--", "--dry_run"]
    assert len(cmds) == 5
    for pid, cmd in enumerate(cmds[2:]):
        env, argv = parse_env_command(cmd)
        assert (env["JAX_COORDINATOR_ADDRESS"], env["JAX_PROCESS_ID"], env["JAX_NUM_PROCESSES"]) == (
            "sim-node-0:23456", str(pid), "3")
        assert argv == [*TRAIN, "--config", "configs/qwen3_8b.py", "--workdir", "/w", "--dry_run"]


def test_slurm_job_runs_one_trainer_per_node(tmp_path):
    """The batch script inside a (fake) 2-node allocation: scontrol names the hosts, srun starts the
    task on each node with its SLURM_NODEID, each task execs the (fake) trainer."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    write_fake(bin_dir, "scontrol", """
assert sys.argv[1:] == ["show", "hostnames", "gpu[07-08]"], sys.argv
print("gpu07\\ngpu08")
""")
    write_fake(bin_dir, "srun", """
args = sys.argv[1:]
assert args[:5] == ["--nodes", "2", "--ntasks-per-node", "1", "--kill-on-bad-exit=1"], args
for node in range(2):
    subprocess.run(args[5:], env={**os.environ, "SLURM_NODEID": str(node), "SLURM_PROCID": str(node)}, check=True)
""")
    write_fake(bin_dir, "python", FAKE_PYTHON)
    log = tmp_path / "python.jsonl"
    env = clean_env(PATH=f"{bin_dir}:{os.environ['PATH']}", FAKE_LOG=str(log), SLURM_JOB_NODELIST="gpu[07-08]",
                    SLURM_NNODES="2", SLURM_JOB_ID="4242")
    proc = subprocess.run([str(LAUNCH / "slurm_job.sbatch"), "--config", "configs/qwen3_4b.py", "--workdir", "/w",
                           "--mem-fraction", "0.8", AWKWARD, "--"], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    runs = read_log(log)
    assert [r["env"]["JAX_PROCESS_ID"] for r in runs] == ["0", "1"]
    for r in runs:
        assert r["argv"] == ["-m", "turnsight_jax.train", "--config", "configs/qwen3_4b.py", "--workdir", "/w", AWKWARD]
        assert r["env"]["JAX_COORDINATOR_ADDRESS"] == f"gpu07:{10000 + 4242 % 50000}"
        assert r["env"]["JAX_NUM_PROCESSES"] == "2"
        assert r["env"]["TURNSIGHT_DISTRIBUTED"] == "1"
        assert r["env"]["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.8"


def test_slurm_job_mode_outside_an_allocation_fails():
    proc = launch("slurm_multinode.sh", "job", "--workdir", "/w")
    assert proc.returncode == 1 and "SLURM_JOB_NODELIST" in proc.stderr


# ---------------------------------------------------------------------------------------------
# (d) single GPU host


def test_gpu_single_host_dry_run(bare_path):
    (cmd,) = dry_run("gpu_single_host.sh", "--gpus", "0,1,2,3", "--config", "configs/qwen3_8b.py",
                     "--workdir", "/tmp/run", "--config.mesh.fsdp=4", AWKWARD, bare_path=bare_path)
    assert cmd == ["env", "CUDA_VISIBLE_DEVICES=0,1,2,3", "XLA_PYTHON_CLIENT_MEM_FRACTION=0.90", *TRAIN,
                   "--config", "configs/qwen3_8b.py", "--workdir", "/tmp/run", "--config.mesh.fsdp=4", AWKWARD]


def test_gpu_single_host_defaults_and_xla_flags(bare_path):
    (cmd,) = dry_run("gpu_single_host.sh", "--mem-fraction=0.75", "--xla-flags", "--xla_b=1", "--", "--dry_run",
                     bare_path=bare_path, XLA_FLAGS="--xla_a=0")
    assert cmd == ["env", "XLA_PYTHON_CLIENT_MEM_FRACTION=0.75", "XLA_FLAGS=--xla_a=0 --xla_b=1", *TRAIN,
                   "--config", "configs/qwen3_8b.py", "--dry_run"]


def test_gpu_single_host_real_run(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    write_fake(bin_dir, "python", FAKE_PYTHON)
    log = tmp_path / "python.jsonl"
    env = clean_env(PATH=f"{bin_dir}:{os.environ['PATH']}", FAKE_LOG=str(log))
    proc = launch("gpu_single_host.sh", "--gpus", "1,3", "--config", "configs/tiny_cpu.py", AWKWARD, env=env)
    assert proc.returncode == 0, proc.stderr
    (r,) = read_log(log)
    assert r["argv"] == ["-m", "turnsight_jax.train", "--config", "configs/tiny_cpu.py", AWKWARD]
    assert r["env"]["CUDA_VISIBLE_DEVICES"] == "1,3"
    assert r["env"]["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.90"
    assert r["env"]["TURNSIGHT_DISTRIBUTED"] is None


# ---------------------------------------------------------------------------------------------
# (e) command-line errors: exit status 2 and a message naming the problem

MINIMAL = {
    "tpu_pod.sh": ["run", "--name", "n", "--zone", "z", "--workdir", "gs://b/r"],
    "slurm_multinode.sh": ["--nodes", "2", "--workdir", "/w"],
    "gpu_single_host.sh": [],
}


@pytest.mark.parametrize("script", sorted(MINIMAL))
def test_unknown_flag_exits_2(script):
    proc = launch(script, *MINIMAL[script], "--frobnicate", "--dry-run")
    assert proc.returncode == 2
    assert "unknown flag: --frobnicate" in proc.stderr
    assert proc.stdout == ""


@pytest.mark.parametrize("script", sorted(MINIMAL))
def test_missing_value_exits_2(script):
    for args in ([*MINIMAL[script], "--dry-run", "--config"], [*MINIMAL[script], "--config", "--dry-run"]):
        proc = launch(script, *args)
        assert proc.returncode == 2, args
        assert "missing value for --config" in proc.stderr


@pytest.mark.parametrize("script", sorted(MINIMAL))
def test_help(script):
    proc = launch(script, "--help")
    assert proc.returncode == 0 and proc.stdout.startswith("Usage: launch/" + script)


@pytest.mark.parametrize("script, args, message", [
    ("tpu_pod.sh", ["--name", "n", "--zone", "z"], "missing mode"),
    ("tpu_pod.sh", ["launch", "--name", "n", "--zone", "z"], "unknown mode: launch"),
    ("tpu_pod.sh", ["up", "--zone", "z"], "missing --name"),
    ("tpu_pod.sh", ["up", "--name", "n", "--zone", "z"], "up needs --accelerator-type"),
    ("tpu_pod.sh", ["up", "--name", "n", "--zone", "z", "--accelerator-type", "v9-8"], "no default --version"),
    ("tpu_pod.sh", ["run", "--name", "n", "--zone", "z"], "run needs --workdir"),
    ("slurm_multinode.sh", ["--workdir", "/w"], "submit needs --nodes"),
    ("slurm_multinode.sh", ["--nodes", "2"], "missing --workdir"),
    ("slurm_multinode.sh", ["--nodes", "two", "--workdir", "/w"], "--nodes expects a positive integer"),
    ("gpu_single_host.sh", ["--gpus", "all"], "--gpus expects comma-separated GPU indices"),
    ("gpu_single_host.sh", ["--mem-fraction", "90"], "--mem-fraction expects a number in (0, 1]"),
    ("gpu_single_host.sh", ["stray"], "unexpected argument: stray"),
])
def test_usage_errors_exit_2(script, args, message):
    proc = launch(script, *args, "--dry-run")
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr


# ---------------------------------------------------------------------------------------------
# (e) local multi-process mode: N JAX processes on this machine, loopback coordinator


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_local_multiprocess_dry_run(bare_path):
    got = dry_run("local_multiprocess.sh", "2", "--devices", "3", "--port", "12400", bare_path=bare_path)
    assert got == [["env", "TURNSIGHT_DISTRIBUTED=1", "JAX_COORDINATOR_ADDRESS=127.0.0.1:12400", "JAX_NUM_PROCESSES=2",
                    f"JAX_PROCESS_ID={i}", "JAX_PLATFORMS=cpu", "XLA_FLAGS=--xla_force_host_platform_device_count=3",
                    *TRAIN] for i in range(2)]
    # the caller's own XLA flags are kept, the device count after them
    got = dry_run("local_multiprocess.sh", "1", "--devices", "3", bare_path=bare_path, XLA_FLAGS="--xla_a=0")
    assert "XLA_FLAGS=--xla_a=0 --xla_force_host_platform_device_count=3" in got[0]


def test_local_mode_sets_the_cluster_scripts_per_process_environment(bare_path):
    """What makes a process part of a job (the launcher flag, the coordinator, the process count
    and index) is set alike by the SLURM launcher's dry run and the local mode's; the local mode
    adds only the CPU platform and its device count, the SLURM one only the GPU memory fraction."""
    slurm = [parse_env_command(c)[0] for c in dry_run("slurm_multinode.sh", "--nodes", "2", "--port", "12400",
                                                     "--workdir", "/w", bare_path=bare_path)[2:]]
    local = [parse_env_command(c)[0] for c in dry_run("local_multiprocess.sh", "2", "--port", "12400",
                                                     bare_path=bare_path)]
    assert len(slurm) == len(local) == 2
    job = ("TURNSIGHT_DISTRIBUTED", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
    for pid, (a, b) in enumerate(zip(slurm, local)):
        assert {k: a[k] for k in job} == {k: b[k] for k in job} == {
            "TURNSIGHT_DISTRIBUTED": "1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": str(pid)}
        # the same port on the first node / on loopback
        assert a["JAX_COORDINATOR_ADDRESS"].endswith(":12400") and b["JAX_COORDINATOR_ADDRESS"] == "127.0.0.1:12400"
        assert set(a) - set(job) - {"JAX_COORDINATOR_ADDRESS"} == {"XLA_PYTHON_CLIENT_MEM_FRACTION"}
        assert set(b) - set(job) - {"JAX_COORDINATOR_ADDRESS"} == {"JAX_PLATFORMS", "XLA_FLAGS"}


def test_local_multiprocess_forms_one_jax_job():
    """2 processes x 4 CPU devices join one 8-device job; an all-reduce spans both processes."""
    proc = launch("local_multiprocess.sh", "2", "--devices", "4", "--port", str(_free_port()), "--",
                  sys.executable, "-m", "turnsight_jax.distributed", env=job_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for i in range(2):
        assert f"[p{i}] process {i} of 2: 4 local of 8 cpu devices; all-reduce 12 (expected 12) ok" in proc.stdout
    assert proc.stderr.count("+ env TURNSIGHT_DISTRIBUTED=1") == 2  # what ran is echoed, as the dry run prints it


def test_split_rollout_pieces_on_two_processes():
    """The split of a step's rollouts on a real 2 x 4 job (tests/_split_check.py): whole groups per
    process, the policy's local copy, the global batch from each process's rows, the agreements."""
    proc = launch("local_multiprocess.sh", "2", "--devices", "4", "--port", str(_free_port()), "--",
                  sys.executable, str(REPO_ROOT / "tests" / "_split_check.py"), env=job_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for i in range(2):
        for check in ("rollout_share ok", "local_replica ok (1 device(s))", "assemble_rows ok",
                      "any_process and gather ok"):
            assert f"[p{i}] process {i}: {check}" in proc.stdout, proc.stdout + proc.stderr


def test_local_multiprocess_stops_the_others_when_one_fails():
    import time

    script = ("import os, sys, time\n"
              "if os.environ['JAX_PROCESS_ID'] == '1': sys.exit(3)\n"
              "time.sleep(50)\n")
    t0 = time.perf_counter()
    proc = launch("local_multiprocess.sh", "2", "--", sys.executable, "-c", script)
    assert proc.returncode == 3
    assert "process 1 exited with status 3; stopping the others" in proc.stderr
    assert time.perf_counter() - t0 < 30  # process 0 was stopped, not waited for


def test_local_multiprocess_passes_sigterm_on_and_waits():
    """A preemption of the job (SIGTERM to the launcher) reaches every process; the launcher waits
    for them to finish (a trainer checkpoints first) and exits with their status."""
    import signal
    import time

    script = ("import signal, sys, time\n"
              "def stop(*_):\n"
              "    time.sleep(1.0)  # a checkpoint being written\n"
              "    print('stopped cleanly', flush=True)\n"
              "    sys.exit(0)\n"
              "signal.signal(signal.SIGTERM, stop)\n"
              "print('ready', flush=True)\n"
              "time.sleep(50)\n")
    proc = subprocess.Popen([str(LAUNCH / "local_multiprocess.sh"), "2", "--", sys.executable, "-c", script],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env(), cwd=REPO_ROOT)
    ready = 0
    while ready < 2:
        line = proc.stdout.readline()
        assert line, "the processes did not start"
        ready += line.endswith("ready\n")
    t0 = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert out.count("stopped cleanly") == 2 and "[p0] stopped cleanly" in out and "[p1] stopped cleanly" in out
    assert "signal received; passing SIGTERM to every process" in err
    assert 0.9 < time.perf_counter() - t0 < 20  # it waited for the handlers, not for the sleeps


@pytest.mark.parametrize("args, message", [
    ([], "missing N"),
    (["two"], "N must be a positive integer"),
    (["2", "3"], "unexpected argument: 3"),
    (["2", "--devices", "0"], "--devices expects a positive integer"),
    (["2", "--port", "99999"], "--port expects 1..65535"),
    (["2", "--frobnicate"], "unknown flag: --frobnicate"),
])
def test_local_multiprocess_usage_errors(args, message):
    proc = launch("local_multiprocess.sh", *args, "--dry-run")
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert launch("local_multiprocess.sh", "--help").stdout.startswith("Usage: launch/local_multiprocess.sh")


@pytest.mark.parametrize("env, message", [
    ({"JAX_NUM_PROCESSES": "two"}, "JAX_NUM_PROCESSES must be an integer, got 'two'"),
    ({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2"}, "JAX_PROCESS_ID=2 is outside 0..1"),
])
def test_distributed_start_up_refuses_a_bad_layout(monkeypatch, env, message):
    from turnsight_jax.distributed import maybe_initialize_distributed

    monkeypatch.setenv("TURNSIGHT_DISTRIBUTED", "1")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match=message):
        maybe_initialize_distributed()


def test_the_warm_start_on_two_processes_writes_one_folder(tmp_path):
    """A 2 x 2 job whose run starts with the supervised warm-start: process 0 alone writes the
    shared workdir's `sft` folder and the other waits for it (each process clearing and renaming
    `sft.tmp` failed the run, on one process or the other), then both build the model from it."""
    work = tmp_path / "run"
    proc = subprocess.run([str(LAUNCH / "local_multiprocess.sh"), "2", "--devices", "2", "--port", str(_free_port()),
                           "--", sys.executable, "-m", "turnsight_jax.train", "--config", "tests/configs/tiny_random.py",
                           "--config.sft.steps=2", "--config.sft.curriculum_steps=0", "--config.train.steps=0",
                           # 16 demonstrations and tasks, not 2 x 1,024 and 2,000 (the data, not the folder, took 26 s)
                           "--config.sft.num_tasks=16", "--config.data.num_train=16",
                           "--config.data.num_eval=2", "--config.eval.samples=1", "--workdir", str(work)],
                          capture_output=True, text=True, env=job_env(), cwd=REPO_ROOT, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    sft = work / "sft"
    assert (sft / "SFT_DONE").is_file() and (sft / "config.json").is_file() and (sft / "tokenizer.json").is_file()
    assert not (work / "sft.tmp").exists()
    assert "[p0] sft: done in" in proc.stdout + proc.stderr
    # no RL step ran: the held-out evaluation before RL is reused as the one after it, on both
    # processes (process 1 taking the other branch would leave process 0's collectives hanging)
    assert "[p0] held-out after RL: no RL step ran (train.steps=0)" in proc.stdout + proc.stderr
    summary = json.loads((work / "summary.json").read_text())
    assert summary["eval_after_rl"] == summary["eval_before_rl"] and summary["improvement"]["mean"] == 0.0
