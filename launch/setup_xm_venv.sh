#!/usr/bin/env bash
# Creates or refreshes .venv-xm: cursor_rl with the `xm` extra (XManager), pinned by
# launch/constraints-xm.txt. A venv of its own because xmanager 0.8.5.post1 needs
# protobuf<7 while constraints.txt pins protobuf 7 for the main .venv.
#
#   bash launch/setup_xm_venv.sh          # idempotent: reinstalls only when the pins change
#   .venv-xm/bin/python launch/xm_launch.py --config=configs/tiny.py ...
#
# Environment: CURSOR_RL_XM_VENV (default .venv-xm), PYTHON (default python3, >= 3.11).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="${CURSOR_RL_XM_VENV:-$root/.venv-xm}"
python="${PYTHON:-python3}"
constraints="$root/launch/constraints-xm.txt"
stamp_want="$(cat "$root/setup.py" "$constraints" | sha256sum | cut -c1-16)-[xm]"
if [ ! -x "$venv/bin/python" ]; then
  echo "[xm venv] creating $venv"
  "$python" -m venv "$venv"
fi
if [ "$(cat "$venv/.cursor_rl_stamp" 2>/dev/null || true)" != "$stamp_want" ]; then
  echo "[xm venv] installing cursor_rl[xm] into $venv"
  start=$SECONDS
  bash "$root/launch/pip_install.sh" "$venv/bin/python" --upgrade "pip>=24"
  bash "$root/launch/pip_install.sh" "$venv/bin/python" -c "$constraints" -e "${root}[xm]"
  "$venv/bin/python" -c "import cursor_rl, xmanager" \
    || { echo "[xm venv] install failed" >&2; exit 1; }
  echo "$stamp_want" > "$venv/.cursor_rl_stamp"
  echo "[xm venv] installed in $((SECONDS - start))s"
fi
