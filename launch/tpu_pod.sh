#!/usr/bin/env bash
# Create (or reuse) a Cloud TPU VM slice, install turnsight_jax on every worker and run the same
# training command on all of them. Guide: docs/scaling.md.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=common.bash source-path=SCRIPTDIR
. "$HERE/common.bash"
PROG=tpu_pod.sh

usage() {
  cat <<'EOF'
Usage: launch/tpu_pod.sh MODE --name NAME --zone ZONE [options] [--config.KEY=VALUE ...] [-- ARGS...]

Modes:
  up      create the TPU VM slice (or reuse it when it exists), put the repository on every
          worker (~/turnsight_jax) and install it with jax[tpu] into ~/turnsight_venv (Python 3.11,
          via uv)
  run     start the same training command on all workers (TURNSIGHT_DISTRIBUTED=1) in the
          background and stream the log ~/turnsight_train.log; Ctrl-C stops only the streaming
  logs    stream the training log of every worker
  stop    stop the training process on every worker
  delete  delete the TPU VM slice

Options:
  --name NAME              TPU VM name (required)
  --zone ZONE              zone, e.g. us-east5-a (required)
  --project PROJECT        GCP project (default: gcloud's configured project)
  --accelerator-type TYPE  slice type, e.g. v5p-16, v5litepod-16, v6e-16 (required by up)
  --version RUNTIME        TPU software version (default from the type: v5p -> v2-alpha-tpuv5,
                           v5litepod -> v2-alpha-tpuv5-lite, v6e -> v2-alpha-tpuv6e)
  --repo URL|DIR           git URL to clone on the workers, or a local checkout to copy
                           (default: the checkout this script is in)
  --config FILE            training config (default: configs/qwen3_8b.py)
  --workdir DIR            checkpoint/log directory every worker can reach, e.g. gs://BUCKET/run1
                           (required by run)
  --config.KEY=VALUE       config override, passed to the trainer unchanged
  --dry-run                print every command, one per line prefixed with '+ ', and run none
  -h, --help               this help
Arguments after -- go to `python -m turnsight_jax.train` unchanged.
EOF
}

MODE="" NAME="" ZONE="" PROJECT="" ACCEL="" VERSION="" REPO="" WORKDIR="" DRY_RUN=0
CONFIG=configs/qwen3_8b.py
OVERRIDES=() EXTRA=()
while (($#)); do
  case $1 in
    --config.*) OVERRIDES+=("$1") ;;
    --*=*) set -- "${1%%=*}" "${1#*=}" "${@:2}"; continue ;;
    --name) need_value "$@"; NAME=$2; shift ;;
    --zone) need_value "$@"; ZONE=$2; shift ;;
    --project) need_value "$@"; PROJECT=$2; shift ;;
    --accelerator-type) need_value "$@"; ACCEL=$2; shift ;;
    --version) need_value "$@"; VERSION=$2; shift ;;
    --repo) need_value "$@"; REPO=$2; shift ;;
    --config) need_value "$@"; CONFIG=$2; shift ;;
    --workdir) need_value "$@"; WORKDIR=$2; shift ;;
    --dry-run) DRY_RUN=1 ;;
    -h | --help) usage; exit 0 ;;
    --) shift; EXTRA=("$@"); break ;;
    -*) usage_error "unknown flag: $1" ;;
    up | run | logs | stop | delete) [[ -z $MODE ]] || usage_error "more than one mode: $MODE, $1"; MODE=$1 ;;
    *) usage_error "unknown mode: $1 (expected up, run, logs, stop or delete)" ;;
  esac
  shift
done
[[ -n $MODE ]] || usage_error "missing mode (up, run, logs, stop or delete)"
[[ -n $NAME ]] || usage_error "missing --name"
[[ -n $ZONE ]] || usage_error "missing --zone"
if [[ $DRY_RUN == 0 ]] && ! command -v gcloud >/dev/null; then
  echo "$PROG: gcloud not found on PATH (install the Google Cloud CLI, or use --dry-run)" >&2
  exit 1
fi

# Paths on the workers; their shell expands the ~.
# shellcheck disable=SC2088
REMOTE_DIR='~/turnsight_jax' VENV='~/turnsight_venv'
# shellcheck disable=SC2088
LOG='~/turnsight_train.log' PIDFILE='~/turnsight_train.pid'
GC=(gcloud compute tpus tpu-vm)
WHERE=(--zone "$ZONE")
if [[ -n $PROJECT ]]; then WHERE+=(--project "$PROJECT"); fi

is_git_url() { [[ $1 == *://* || $1 == git@* ]]; }

# Run a shell command line on every worker of the slice.
on_all_workers() { run "${GC[@]}" ssh "$NAME" "${WHERE[@]}" --worker=all --command "$1"; }

up() {
  [[ -n $ACCEL ]] || usage_error "up needs --accelerator-type"
  if [[ -z $VERSION ]]; then
    case $ACCEL in
      v5p-*) VERSION=v2-alpha-tpuv5 ;;
      v5litepod-*) VERSION=v2-alpha-tpuv5-lite ;;
      v6e-*) VERSION=v2-alpha-tpuv6e ;;
      *) usage_error "no default --version for $ACCEL; pass one (gcloud compute tpus tpu-vm versions list --zone $ZONE)" ;;
    esac
  fi
  local repo=${REPO:-$(dirname "$HERE")}
  if ! is_git_url "$repo" && [[ ! -d $repo ]]; then
    usage_error "--repo $repo is neither a git URL nor a directory"
  fi
  local create=("${GC[@]}" create "$NAME" "${WHERE[@]}" --accelerator-type "$ACCEL" --version "$VERSION")
  if [[ $DRY_RUN == 1 ]]; then
    echo "# the create command runs only when describe fails (no slice of that name yet)"
    show "${GC[@]}" describe "$NAME" "${WHERE[@]}"
    show "${create[@]}"
  elif "${GC[@]}" describe "$NAME" "${WHERE[@]}" >/dev/null 2>&1; then
    echo "$PROG: reusing the existing TPU VM $NAME" >&2
  else
    run "${create[@]}"
  fi

  local fetch
  if is_git_url "$repo"; then
    fetch="if [ -d $REMOTE_DIR/.git ]; then git -C $REMOTE_DIR pull --ff-only; else git clone $(quote "$repo") $REMOTE_DIR; fi"
  else
    local tarball=${TMPDIR:-/tmp}/turnsight_jax-$NAME.tar.gz
    run tar -C "$repo" --exclude=.git --exclude=.venv --exclude=__pycache__ --exclude='*.egg-info' \
      -czf "$tarball" .
    run "${GC[@]}" scp "$tarball" "$NAME:turnsight_jax.tar.gz" "${WHERE[@]}" --worker=all
    fetch="rm -rf $REMOTE_DIR && mkdir -p $REMOTE_DIR && tar -xzf turnsight_jax.tar.gz -C $REMOTE_DIR"
  fi
  # The TPU images' system Python may be older than the 3.11 turnsight_jax needs: uv fetches one.
  local uv="(python3 -m pip install --user --upgrade uv || python3 -m pip install --user --break-system-packages --upgrade uv)"
  on_all_workers "$fetch && $uv && python3 -m uv venv --allow-existing --python 3.11 $VENV && cd $REMOTE_DIR && python3 -m uv pip install --python $VENV/bin/python -e . \"jax[tpu]\""
}

train_on_all_workers() {
  [[ -n $WORKDIR ]] || usage_error "run needs --workdir (a directory every worker can reach, e.g. gs://BUCKET/run)"
  local train
  train=$(join_quoted python -m turnsight_jax.train --config "$CONFIG" --workdir "$WORKDIR" "${OVERRIDES[@]}" "${EXTRA[@]}")
  on_all_workers "cd $REMOTE_DIR && . $VENV/bin/activate && { nohup env TURNSIGHT_DISTRIBUTED=1 $train > $LOG 2>&1 < /dev/null & echo \$! > $PIDFILE; } && tail -n +1 --pid=\"\$(cat $PIDFILE)\" -f $LOG"
}

case $MODE in
  up) up ;;
  run) train_on_all_workers ;;
  logs) on_all_workers "tail -n 100 -F $LOG" ;;
  stop) on_all_workers "if [ -f $PIDFILE ]; then kill \"\$(cat $PIDFILE)\" 2>/dev/null || true; rm -f $PIDFILE; fi" ;;
  delete) run "${GC[@]}" delete "$NAME" "${WHERE[@]}" --quiet ;;
esac
