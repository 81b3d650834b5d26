#!/usr/bin/env bash
# Train on the GPUs of one host: one process that sees all (or --gpus) devices. Guide: docs/scaling.md.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=common.bash source-path=SCRIPTDIR
. "$HERE/common.bash"
PROG=gpu_single_host.sh

usage() {
  cat <<'EOF'
Usage: launch/gpu_single_host.sh [options] [--config.KEY=VALUE ...] [-- ARGS...]

Runs `python -m turnsight_jax.train` once, on all GPUs of this host (or those of --gpus), with
the environment set for a single-process multi-GPU run. Run it from the repository root, in the
environment where turnsight_jax is installed (pip install -e . "jax[cuda12]").

Options:
  --gpus LIST          GPU indices to use, e.g. 0,1,2,3 (sets CUDA_VISIBLE_DEVICES; default: all)
  --config FILE        training config (default: configs/qwen3_8b.py)
  --workdir DIR        checkpoint/log directory (default: the trainer's)
  --mem-fraction F     XLA_PYTHON_CLIENT_MEM_FRACTION, the share of each GPU's memory JAX
                       preallocates (default: $XLA_PYTHON_CLIENT_MEM_FRACTION, else 0.90)
  --xla-flags FLAGS    appended to XLA_FLAGS (unknown XLA flags abort, so none are added by default)
  --config.KEY=VALUE   config override, passed to the trainer unchanged
  --dry-run            print the command (prefixed with '+ ') instead of running it
  -h, --help           this help
Arguments after -- go to the trainer unchanged.
EOF
}

GPUS="" WORKDIR="" XLA_EXTRA="" DRY_RUN=0
CONFIG=configs/qwen3_8b.py
MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.90}
OVERRIDES=() EXTRA=()
while (($#)); do
  case $1 in
    --config.*) OVERRIDES+=("$1") ;;
    --*=*) set -- "${1%%=*}" "${1#*=}" "${@:2}"; continue ;;
    --gpus) need_value "$@"; GPUS=$2; shift ;;
    --config) need_value "$@"; CONFIG=$2; shift ;;
    --workdir) need_value "$@"; WORKDIR=$2; shift ;;
    --mem-fraction) need_value "$@"; MEM_FRACTION=$2; shift ;;
    --xla-flags) [[ $# -ge 2 && -n $2 ]] || usage_error "missing value for $1"; XLA_EXTRA=$2; shift ;;
    --dry-run) DRY_RUN=1 ;;
    -h | --help) usage; exit 0 ;;
    --) shift; EXTRA=("$@"); break ;;
    -*) usage_error "unknown flag: $1" ;;
    *) usage_error "unexpected argument: $1" ;;
  esac
  shift
done
if [[ -n $GPUS && ! $GPUS =~ ^[0-9]+(,[0-9]+)*$ ]]; then
  usage_error "--gpus expects comma-separated GPU indices such as 0,1,2,3, got: $GPUS"
fi
[[ $MEM_FRACTION =~ ^(0?\.[0-9]+|1(\.0*)?)$ ]] || usage_error "--mem-fraction expects a number in (0, 1], got: $MEM_FRACTION"

ENV=()
if [[ -n $GPUS ]]; then ENV+=("CUDA_VISIBLE_DEVICES=$GPUS"); fi
ENV+=("XLA_PYTHON_CLIENT_MEM_FRACTION=$MEM_FRACTION")
if [[ -n $XLA_EXTRA ]]; then ENV+=("XLA_FLAGS=${XLA_FLAGS:+$XLA_FLAGS }$XLA_EXTRA"); fi

TRAIN=(python -m turnsight_jax.train --config "$CONFIG")
if [[ -n $WORKDIR ]]; then TRAIN+=(--workdir "$WORKDIR"); fi
run env "${ENV[@]}" "${TRAIN[@]}" "${OVERRIDES[@]}" "${EXTRA[@]}"
