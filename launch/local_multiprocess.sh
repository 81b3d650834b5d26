#!/usr/bin/env bash
# N JAX processes on this machine (CPU, loopback coordinator): the multi-host code paths without a
# cluster. Each process gets the environment the cluster launchers set. Guide: docs/scaling.md.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=common.bash source-path=SCRIPTDIR
. "$HERE/common.bash"
PROG=local_multiprocess.sh

usage() {
  cat <<'EOF'
Usage: launch/local_multiprocess.sh N [options] [-- COMMAND...]

Starts N processes of COMMAND (default: python -m turnsight_jax.train) on this machine, on the
CPU backend, each with M fake devices, joined into one JAX job through a coordinator on
127.0.0.1 (cross-process collectives over gloo). Every process gets
  TURNSIGHT_DISTRIBUTED=1 JAX_COORDINATOR_ADDRESS=127.0.0.1:PORT JAX_NUM_PROCESSES=N
  JAX_PROCESS_ID=i JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=M
(after the caller's own XLA_FLAGS, if any). Output lines are prefixed with [p<i>]. If one process fails the others are stopped; the exit
status is the first failure's (0 when all succeed). SIGTERM or SIGINT to the launcher is passed
to every process, and the launcher waits for them (trainers checkpoint, then exit 0).

Options:
  --devices M    fake CPU devices per process (default: 4)
  --port P       coordinator port (default: 12321)
  --dry-run      print each process's command line (prefixed with '+ ') instead of running it
  -h, --help     this help
Example: launch/local_multiprocess.sh 2 --devices 4 -- python -m turnsight_jax.distributed
EOF
}

N="" DEVICES=4 PORT=12321 DRY_RUN=0 CMD=()
while (($#)); do
  case $1 in
    --*=*) set -- "${1%%=*}" "${1#*=}" "${@:2}"; continue ;;
    --devices) need_value "$@"; DEVICES=$2; shift ;;
    --port) need_value "$@"; PORT=$2; shift ;;
    --dry-run) DRY_RUN=1 ;;
    -h | --help) usage; exit 0 ;;
    --) shift; CMD=("$@"); break ;;
    -*) usage_error "unknown flag: $1" ;;
    *) [[ -z $N ]] || usage_error "unexpected argument: $1"; N=$1 ;;
  esac
  shift
done
[[ -n $N ]] || usage_error "missing N, the number of processes"
[[ $N =~ ^[1-9][0-9]*$ ]] || usage_error "N must be a positive integer, got: $N"
[[ $DEVICES =~ ^[1-9][0-9]*$ ]] || usage_error "--devices expects a positive integer, got: $DEVICES"
if ! [[ $PORT =~ ^[0-9]{1,5}$ ]] || ((PORT < 1 || PORT > 65535)); then
  usage_error "--port expects 1..65535, got: $PORT"
fi
((${#CMD[@]})) || CMD=(python -m turnsight_jax.train)

env_of() {  # the environment of process $1
  printf '%s\n' TURNSIGHT_DISTRIBUTED=1 "JAX_COORDINATOR_ADDRESS=127.0.0.1:$PORT" "JAX_NUM_PROCESSES=$N" \
    "JAX_PROCESS_ID=$1" JAX_PLATFORMS=cpu "XLA_FLAGS=${XLA_FLAGS:+$XLA_FLAGS }--xla_force_host_platform_device_count=$DEVICES"
}

if [[ $DRY_RUN == 1 ]]; then
  for ((i = 0; i < N; i++)); do
    mapfile -t ENV < <(env_of "$i")
    show env "${ENV[@]}" "${CMD[@]}"
  done
  exit 0
fi

PIDS=()
stop_all() { for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null || true; done; }
# A TERM/INT to the launcher goes to every process, and the launcher waits for them: trainers
# checkpoint after their current step and exit, as on a cluster's preemption.
trap 'echo "$PROG: signal received; passing SIGTERM to every process" >&2; stop_all' TERM INT
for ((i = 0; i < N; i++)); do
  mapfile -t ENV < <(env_of "$i")
  show env "${ENV[@]}" "${CMD[@]}" >&2
  # each process's output, line by line, prefixed with its index
  env "${ENV[@]}" "${CMD[@]}" > >(sed -u "s/^/[p$i] /") 2> >(sed -u "s/^/[p$i] /" >&2) &
  PIDS+=($!)
done
STATUS=0 RUNNING=("${PIDS[@]}")
while ((${#RUNNING[@]})); do
  rc=0 DONE=""
  wait -n -p DONE "${RUNNING[@]}" || rc=$?  # bash >= 5.1: whichever process ends first
  if [[ -z ${DONE:-} ]]; then
    ((rc > 128)) && continue  # a trapped signal interrupted the wait: keep waiting for the processes
    break
  fi
  REST=()
  for p in "${RUNNING[@]}"; do [[ $p == "$DONE" ]] || REST+=("$p"); done
  RUNNING=("${REST[@]}")
  if ((rc != 0 && STATUS == 0)); then
    STATUS=$rc
    for ((i = 0; i < N; i++)); do
      if [[ ${PIDS[$i]} == "$DONE" ]]; then echo "$PROG: process $i exited with status $rc; stopping the others" >&2; fi
    done
    stop_all
  fi
done
wait  # the output filters
exit "$STATUS"
