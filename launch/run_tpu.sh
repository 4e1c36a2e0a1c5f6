#!/usr/bin/env bash
# Cloud TPU VM slices (and multi-slice pods): create, copy this checkout, run
# `python -m cursor_rl.main` on every worker, delete. See launch/README.md.
#
#   bash launch/run_tpu.sh create NAME
#   bash launch/run_tpu.sh copy   NAME
#   bash launch/run_tpu.sh run    NAME -- --config=configs/small.py --workdir=gs://BUCKET/run [--config.x=y]
#   bash launch/run_tpu.sh delete NAME
#   bash launch/run_tpu.sh worker -- MAIN_FLAGS      # what `run` starts on each worker
#
# Environment (defaults in brackets):
#   ZONE [europe-west4-b]  ACCELERATOR [v5p-8]  RUNTIME [v2-alpha-tpuv5]  PROJECT [gcloud's]
#   NUM_SLICES [1]  > 1 makes `create` a queued resource with that many slices, and `copy`/`run`
#                   address all of them (set --config.mesh.dcn.data=NUM_SLICES in MAIN_FLAGS)
#   SPOT=1          spot capacity
#   REMOTE_PYTHON [python3]  the workers' interpreter for their venv (Python >= 3.11)
#   TOPOLOGY        e.g. v5p:2x2x1: `run` first compiles the config for it on this machine
#                   (launch/presubmit.py, needs libtpu: AOT_PYTHON [.venv-tpu/bin/python])
#                   and refuses to start a job that does not fit in HBM
#   DRY_RUN=1       print the gcloud commands (and the worker command) instead of running them
#   Worker only: CURSOR_RL_PYTHON, CURSOR_RL_COORDINATOR/NUM_PROCESSES/PROCESS_ID (see
#   launch/main_command.sh; TPU workers need none of them, JAX finds its peers).
set -euo pipefail

usage() {
  sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' >&2
  exit 2
}

root="$(cd "$(dirname "$0")/.." && pwd)"
ZONE="${ZONE:-europe-west4-b}"
ACCELERATOR="${ACCELERATOR:-v5p-8}"
RUNTIME="${RUNTIME:-v2-alpha-tpuv5}"
NUM_SLICES="${NUM_SLICES:-1}"
# The interpreter the workers build their venv with (cursor_rl needs Python >= 3.11).
REMOTE_PYTHON="${REMOTE_PYTHON:-python3}"
# Where the code lives on each worker (relative to the login user's home).
REMOTE_DIR="cursor_rl"

gcloud_cmd() {
  local cmd=(gcloud)
  [ -n "${PROJECT:-}" ] && cmd+=("--project=$PROJECT")
  cmd+=("$@")
  if [ "${DRY_RUN:-0}" = "1" ]; then
    printf '%q ' "${cmd[@]}"
    printf '\n'
  else
    "${cmd[@]}"
  fi
}

# One slice is a TPU VM; several are a queued resource whose nodes share its name.
tpu_ssh() {
  local name="$1" command="$2"
  if [ "$NUM_SLICES" -gt 1 ]; then
    gcloud_cmd compute tpus queued-resources ssh "$name" "--zone=$ZONE" --node=all --worker=all \
      "--command=$command"
  else
    gcloud_cmd compute tpus tpu-vm ssh "$name" "--zone=$ZONE" --worker=all "--command=$command"
  fi
}

tpu_scp() {
  local name="$1" file="$2"
  if [ "$NUM_SLICES" -gt 1 ]; then
    gcloud_cmd compute tpus queued-resources scp "$file" "$name:~/" "--zone=$ZONE" --node=all \
      --worker=all
  else
    gcloud_cmd compute tpus tpu-vm scp "$file" "$name:~/" "--zone=$ZONE" --worker=all
  fi
}

cmd_create() {
  local name="$1"
  local spot=()
  [ "${SPOT:-0}" = "1" ] && spot=(--spot)
  if [ "$NUM_SLICES" -gt 1 ]; then
    gcloud_cmd compute tpus queued-resources create "$name" "--zone=$ZONE" \
      "--accelerator-type=$ACCELERATOR" "--runtime-version=$RUNTIME" \
      "--node-count=$NUM_SLICES" "--node-prefix=$name" "${spot[@]}"
  else
    gcloud_cmd compute tpus tpu-vm create "$name" "--zone=$ZONE" \
      "--accelerator-type=$ACCELERATOR" "--version=$RUNTIME" "${spot[@]}"
  fi
}

cmd_copy() {
  local name="$1"
  # The files git knows (committed or not, ignored ones excluded): no venvs, no workdirs.
  local archive="cursor_rl.tar.gz"
  if [ "${DRY_RUN:-0}" != "1" ]; then
    tmp_dir="$(mktemp -d)"
    trap 'rm -rf "$tmp_dir"' EXIT
    archive="$tmp_dir/cursor_rl.tar.gz"
    (cd "$root" && git ls-files -z --cached --others --exclude-standard \
      | tar --null --ignore-failed-read -T - -czf "$archive")
  fi
  tpu_scp "$name" "$archive"
  tpu_ssh "$name" "mkdir -p ~/$REMOTE_DIR && tar -xzf ~/cursor_rl.tar.gz -C ~/$REMOTE_DIR"
}

cmd_run() {
  local name="$1"
  shift
  [ "${1:-}" = "--" ] && shift
  [ "$#" -gt 0 ] || usage
  if [ -n "${TOPOLOGY:-}" ]; then
    local aot_python="${AOT_PYTHON:-$root/.venv-tpu/bin/python}"
    (cd "$root" && JAX_PLATFORMS=cpu TPU_WORKER_HOSTNAMES=localhost PYTHONPATH="$root" \
      "$aot_python" -m launch.presubmit "--topology=$TOPOLOGY" "$@")
  fi
  local quoted
  quoted="$(printf '%q ' "$@")"
  # Every worker runs the same command; the first start installs the venv (idempotent).
  tpu_ssh "$name" "cd ~/$REMOTE_DIR && PYTHON=$(printf '%q' "$REMOTE_PYTHON") \
bash launch/run_tpu.sh worker -- $quoted"
}

cmd_delete() {
  local name="$1"
  if [ "$NUM_SLICES" -gt 1 ]; then
    gcloud_cmd compute tpus queued-resources delete "$name" "--zone=$ZONE" --force --quiet
  else
    gcloud_cmd compute tpus tpu-vm delete "$name" "--zone=$ZONE" --quiet
  fi
}

cmd_worker() {
  [ "${1:-}" = "--" ] && shift
  # shellcheck source=launch/main_command.sh
  source "$root/launch/main_command.sh"
  cursor_rl_main tpu "$@"
}

[ "$#" -ge 1 ] || usage
action="$1"
shift
case "$action" in
  create | copy | delete)
    [ "$#" -eq 1 ] || usage
    "cmd_$action" "$1"
    ;;
  run)
    [ "$#" -ge 2 ] || usage
    cmd_run "$@"
    ;;
  worker) cmd_worker "$@" ;;
  *) usage ;;
esac
