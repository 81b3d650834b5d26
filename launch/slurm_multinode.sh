#!/usr/bin/env bash
# Multi-node GPU training under SLURM, one process per host, all GPUs of a host in its process.
# Guide: docs/scaling.md.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=common.bash source-path=SCRIPTDIR
. "$HERE/common.bash"
PROG=slurm_multinode.sh

usage() {
  cat <<'EOF'
Usage: launch/slurm_multinode.sh [MODE] [options] [--config.KEY=VALUE ...] [-- ARGS...]

Modes:
  submit  (default) sbatch launch/slurm_job.sbatch for --nodes hosts; the job runs `job` mode
  job     inside an allocation (the batch script, or salloc): take the first host of
          $SLURM_JOB_NODELIST as the coordinator and srun one `task` per node
  task    run by srun on every node: exec the trainer with JAX_PROCESS_ID=$SLURM_NODEID
Each process gets TURNSIGHT_DISTRIBUTED=1, JAX_COORDINATOR_ADDRESS=HOST:PORT,
JAX_NUM_PROCESSES=$SLURM_NNODES and JAX_PROCESS_ID=$SLURM_NODEID. Submit from the repository
root, in the environment where turnsight_jax is installed (sbatch and srun pass it on).

Options:
  --nodes N            hosts (required by submit; job uses $SLURM_NNODES)
  --gpus-per-node G    GPUs per host (default: 8)
  --time T             time limit, e.g. 24:00:00 (default: the partition's)
  --partition P        partition (default: the cluster's)
  --account A          account to charge (default: yours)
  --job-name NAME      job name (default: turnsight)
  --port PORT          coordinator port (default: 10000 + SLURM_JOB_ID % 50000; 12345 outside a job)
  --config FILE        training config (default: configs/qwen3_8b.py)
  --workdir DIR        checkpoint/log directory on a filesystem all nodes share (required)
  --mem-fraction F     XLA_PYTHON_CLIENT_MEM_FRACTION (default: $XLA_PYTHON_CLIENT_MEM_FRACTION, else 0.90)
  --config.KEY=VALUE   config override, passed to the trainer unchanged
  --dry-run            print the sbatch and srun command lines and, for every process, its
                       environment and command line (simulating --nodes hosts outside a job);
                       run nothing
  -h, --help           this help
Arguments after -- go to `python -m turnsight_jax.train` unchanged.
EOF
}

MODE="" NODES="" GPUS_PER_NODE=8 TIME="" PARTITION="" ACCOUNT="" JOB_NAME=turnsight PORT="" WORKDIR="" DRY_RUN=0
CONFIG=configs/qwen3_8b.py
MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.90}
OVERRIDES=() EXTRA=()
while (($#)); do
  case $1 in
    --config.*) OVERRIDES+=("$1") ;;
    --*=*) set -- "${1%%=*}" "${1#*=}" "${@:2}"; continue ;;
    --nodes) need_value "$@"; NODES=$2; shift ;;
    --gpus-per-node) need_value "$@"; GPUS_PER_NODE=$2; shift ;;
    --time) need_value "$@"; TIME=$2; shift ;;
    --partition) need_value "$@"; PARTITION=$2; shift ;;
    --account) need_value "$@"; ACCOUNT=$2; shift ;;
    --job-name) need_value "$@"; JOB_NAME=$2; shift ;;
    --port) need_value "$@"; PORT=$2; shift ;;
    --config) need_value "$@"; CONFIG=$2; shift ;;
    --workdir) need_value "$@"; WORKDIR=$2; shift ;;
    --mem-fraction) need_value "$@"; MEM_FRACTION=$2; shift ;;
    --dry-run) DRY_RUN=1 ;;
    -h | --help) usage; exit 0 ;;
    --) shift; EXTRA=("$@"); break ;;
    -*) usage_error "unknown flag: $1" ;;
    submit | job | task) [[ -z $MODE ]] || usage_error "more than one mode: $MODE, $1"; MODE=$1 ;;
    *) usage_error "unknown mode: $1 (expected submit, job or task)" ;;
  esac
  shift
done
MODE=${MODE:-submit}
[[ -n $WORKDIR ]] || usage_error "missing --workdir (a directory on a filesystem all nodes share)"
positive_int() { [[ -z $2 || $2 =~ ^[1-9][0-9]*$ ]] || usage_error "$1 expects a positive integer, got: $2"; }
positive_int --nodes "$NODES"
positive_int --gpus-per-node "$GPUS_PER_NODE"
positive_int --port "$PORT"
[[ $MEM_FRACTION =~ ^(0?\.[0-9]+|1(\.0*)?)$ ]] || usage_error "--mem-fraction expects a number in (0, 1], got: $MEM_FRACTION"

# The flags that `job` and `task` need, passed down through sbatch and srun.
FORWARDED=(--config "$CONFIG" --workdir "$WORKDIR" --mem-fraction "$MEM_FRACTION")
if [[ -n $PORT ]]; then FORWARDED+=(--port "$PORT"); fi
FORWARDED+=("${OVERRIDES[@]}" -- "${EXTRA[@]}")

# CMD := what process $1 runs (environment + trainer); `task` execs it, a dry run prints it.
process_command() {
  CMD=(env TURNSIGHT_DISTRIBUTED=1 "JAX_COORDINATOR_ADDRESS=$JAX_COORDINATOR_ADDRESS"
    "JAX_NUM_PROCESSES=$JAX_NUM_PROCESSES" "JAX_PROCESS_ID=$1" "XLA_PYTHON_CLIENT_MEM_FRACTION=$MEM_FRACTION"
    python -m turnsight_jax.train --config "$CONFIG" --workdir "$WORKDIR" "${OVERRIDES[@]}" "${EXTRA[@]}")
}

submit() {
  [[ -n $NODES ]] || usage_error "submit needs --nodes"
  local sbatch=(sbatch --nodes "$NODES" --ntasks-per-node 1 --gpus-per-node "$GPUS_PER_NODE" --job-name "$JOB_NAME")
  if [[ -n $TIME ]]; then sbatch+=(--time "$TIME"); fi
  if [[ -n $PARTITION ]]; then sbatch+=(--partition "$PARTITION"); fi
  if [[ -n $ACCOUNT ]]; then sbatch+=(--account "$ACCOUNT"); fi
  run "${sbatch[@]}" --chdir "$(dirname "$HERE")" "$HERE/slurm_job.sbatch" "${FORWARDED[@]}"
}

# Inside an allocation: coordinator = first host; srun one task per node. `job simulate` (dry
# runs of submit, or of job outside an allocation) pretends to be a job of --nodes hosts.
job() {
  local hosts=() i
  if [[ ${1:-} == simulate || -z ${SLURM_JOB_NODELIST:-} ]]; then
    if [[ $DRY_RUN == 0 ]]; then
      echo "$PROG: job mode runs inside a SLURM allocation (SLURM_JOB_NODELIST is not set)" >&2
      exit 1
    fi
    [[ -n $NODES ]] || usage_error "a dry run outside a SLURM job needs --nodes"
    echo "# simulated job: $NODES nodes, sim-node-0 to sim-node-$((NODES - 1))"
    for ((i = 0; i < NODES; i++)); do hosts+=("sim-node-$i"); done
  else
    mapfile -t hosts < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
    if ((${#hosts[@]} == 0)); then
      echo "$PROG: scontrol show hostnames $SLURM_JOB_NODELIST gave no hosts" >&2
      exit 1
    fi
  fi
  local nnodes=${#hosts[@]}
  if [[ -z $PORT ]]; then
    if [[ -n ${SLURM_JOB_ID:-} && ${1:-} != simulate ]]; then PORT=$((10000 + SLURM_JOB_ID % 50000)); else PORT=12345; fi
  fi
  export TURNSIGHT_DISTRIBUTED=1 JAX_COORDINATOR_ADDRESS="${hosts[0]}:$PORT" JAX_NUM_PROCESSES=$nnodes
  run env TURNSIGHT_DISTRIBUTED=1 "JAX_COORDINATOR_ADDRESS=$JAX_COORDINATOR_ADDRESS" "JAX_NUM_PROCESSES=$nnodes" \
    srun --nodes "$nnodes" --ntasks-per-node 1 --kill-on-bad-exit=1 "$HERE/slurm_multinode.sh" task "${FORWARDED[@]}"
  if [[ $DRY_RUN == 1 ]]; then
    for ((i = 0; i < nnodes; i++)); do
      echo "# process $i on ${hosts[i]} (SLURM_NODEID=$i)"
      process_command "$i"
      show "${CMD[@]}"
    done
  fi
}

task() {
  : "${SLURM_NODEID:?task mode runs under srun}" "${JAX_COORDINATOR_ADDRESS:?set by job mode}" "${JAX_NUM_PROCESSES:?set by job mode}"
  process_command "$SLURM_NODEID"
  if [[ $DRY_RUN == 1 ]]; then show "${CMD[@]}"; else exec "${CMD[@]}"; fi
}

case $MODE in
  submit)
    submit
    if [[ $DRY_RUN == 1 ]]; then echo "# inside the job:"; job simulate; fi
    ;;
  job) job ;;
  task) task ;;
esac
