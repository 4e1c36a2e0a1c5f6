#!/usr/bin/env bash
# The whole recipe on this machine, on the built-in tiny default: installs what it
# needs (idempotently: Debian packages for the sandbox, .venv), prints the model
# summary, then runs pretrain -> long-context -> SFT -> RL -> eval on the embedded
# standard-library corpus and the tiny task family.
#   bash launch/run_cpu.sh [WORKDIR] [--config.x=y ...]
# WORKDIR defaults to workdirs/tiny-<timestamp>; an existing one is resumed. It may be
# relative, absolute, start with ~ or be a gs:// URL (resolved by cursor_rl.main).
#
# CURSOR_RL_SMOKE=1: a smoke run (what CI runs): the same pipeline with the step, task
# and episode counts of launch/smoke.flags (flags given here still win), then
# launch/check_run.py checks that every stage left its checkpoints and report.md.
#
# CURSOR_RL_WATCH=1: the run goes under the watchdog (python -m cursor_rl.ops.watch),
# which restarts it when it crashes or stalls, rewinds it after a NaN loss and alerts
# the Slack-compatible webhook in $CURSOR_RL_ALERT_WEBHOOK (README: "Runs that look
# after themselves"); $CURSOR_RL_WATCH_FLAGS adds watchdog flags.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/install_system_deps.sh
source launch/venv.sh "hf,test"
set -euo pipefail
workdir="workdirs/tiny-$(date +%Y%m%d-%H%M%S)"
if [ $# -gt 0 ] && [[ "$1" != --* ]]; then
  workdir="$1"
  shift
fi
smoke=()
if [ "${CURSOR_RL_SMOKE:-0}" = "1" ]; then
  # One flag per line; blank lines and # comments skipped.
  mapfile -t smoke < <(sed -e 's/#.*//' -e 's/[[:space:]]*$//' launch/smoke.flags | grep -v '^$')
  echo "[smoke] ${smoke[*]}"
fi
export JAX_PLATFORMS=cpu
python -m cursor_rl.tools.model_summary --config=configs/tiny.py | grep -v "^  \['"
main=(python -m cursor_rl.main --config=configs/tiny.py --workdir="$workdir")
if [ "${CURSOR_RL_WATCH:-0}" = "1" ]; then
  # shellcheck disable=SC2086  # the flags are words
  python -m cursor_rl.ops.watch --workdir="$workdir" ${CURSOR_RL_WATCH_FLAGS:-} -- \
    "${main[@]}" ${smoke[@]+"${smoke[@]}"} "$@"
else
  "${main[@]}" ${smoke[@]+"${smoke[@]}"} "$@"
fi
echo "workdir: $workdir (report: $workdir/report.md)"
if [ "${CURSOR_RL_SMOKE:-0}" = "1" ]; then
  python -m launch.check_run "$workdir"
fi
