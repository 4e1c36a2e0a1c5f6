# shellcheck shell=bash
# Starts `python -m cursor_rl.main` as one process of a multi-host job; sourced by
# run_tpu.sh and run_gpu.sh so TPU workers, GPU hosts and the CPU "pod" test share one path.
#
#   source launch/main_command.sh
#   cursor_rl_main EXTRAS [MAIN_FLAGS...]    # EXTRAS: "tpu" or "gpu"; does not return
#
# Environment:
#   CURSOR_RL_MULTIHOST     1 (default): call jax.distributed.initialize; 0: a single process
#   CURSOR_RL_PYTHON        an interpreter that already has cursor_rl (skips the virtualenv;
#                           tests and custom images use it)
#   CURSOR_RL_COORDINATOR   host:port of process 0; with CURSOR_RL_NUM_PROCESSES and
#   CURSOR_RL_NUM_PROCESSES CURSOR_RL_PROCESS_ID it is passed to jax.distributed.initialize.
#   CURSOR_RL_PROCESS_ID    Unset on TPU VMs (and under SLURM), where JAX finds its peers.
#   DRY_RUN=1               print the command instead of running it

cursor_rl_main() {
  local extras="$1"
  shift
  local root
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  local python="${CURSOR_RL_PYTHON:-}"
  if [ -z "$python" ]; then
    if [ "${DRY_RUN:-0}" = "1" ]; then
      python="$root/.venv/bin/python"
    else
      # venv.sh leaves errexit off for interactive shells; this script wants it back.
      # shellcheck disable=SC1091
      source "$root/launch/venv.sh" "$extras"
      set -euo pipefail
      python="$(command -v python)"
    fi
  fi
  local cmd=("$python" -m cursor_rl.main)
  [ "${CURSOR_RL_MULTIHOST:-1}" = "1" ] && cmd+=(--multihost)
  if [ -n "${CURSOR_RL_COORDINATOR:-}" ]; then
    cmd+=(
      "--coordinator_address=$CURSOR_RL_COORDINATOR"
      "--num_processes=${CURSOR_RL_NUM_PROCESSES:?CURSOR_RL_NUM_PROCESSES is required with a coordinator}"
      "--process_id=${CURSOR_RL_PROCESS_ID:?CURSOR_RL_PROCESS_ID is required with a coordinator}"
    )
  fi
  cmd+=("$@")
  if [ "${DRY_RUN:-0}" = "1" ]; then
    printf '%q ' "${cmd[@]}"
    printf '\n'
    exit 0
  fi
  cd "$root"
  export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
  exec "${cmd[@]}"
}
