#!/usr/bin/env bash
# Runs `PYTHON -m pip install -q ARGS...` for the venv scripts: prints pip's output
# without its "... is ignored" notices and fails with pip's exit status, so a broken
# install (no disk space, an unreachable index) stops the caller instead of being
# stamped as done.
#
#   bash launch/pip_install.sh VENV_PYTHON ARGS...
set -uo pipefail
python="$1"
shift
log="$(mktemp)"
"$python" -m pip install -q "$@" > "$log" 2>&1
status=$?
grep -v "is ignored" "$log" || true
rm -f "$log"
if [ "$status" -ne 0 ]; then
  echo "[venv] pip install $* failed (exit $status)" >&2
fi
exit "$status"
