# Creates or refreshes the project's virtualenv; sourced by the other launch scripts.
#
#   source launch/venv.sh EXTRAS     # e.g. "hf,test"; activates .venv afterwards
#
# Idempotent: the install runs again only when setup.py, constraints.txt or the
# requested extras change (a stamp file records what was installed).
set -euo pipefail
_extras="${1:-}"
_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_venv="${CURSOR_RL_VENV:-$_root/.venv}"
_python="${PYTHON:-python3}"
_stamp_want="$(cat "$_root/setup.py" "$_root/constraints.txt" | sha256sum | cut -c1-16)-[$_extras]"
if [ ! -x "$_venv/bin/python" ]; then
  echo "[venv] creating $_venv"
  "$_python" -m venv "$_venv"
fi
if [ "$(cat "$_venv/.cursor_rl_stamp" 2>/dev/null || true)" != "$_stamp_want" ]; then
  echo "[venv] installing cursor_rl[${_extras}] into $_venv"
  bash "$_root/launch/pip_install.sh" "$_venv/bin/python" --upgrade "pip>=24" || exit 1
  _spec="$_root"
  [ -n "$_extras" ] && _spec="$_root[$_extras]"
  bash "$_root/launch/pip_install.sh" "$_venv/bin/python" -c "$_root/constraints.txt" -e "$_spec" || exit 1
  "$_venv/bin/python" -c "import cursor_rl" || { echo "[venv] install failed" >&2; exit 1; }
  echo "$_stamp_want" > "$_venv/.cursor_rl_stamp"
fi
# shellcheck disable=SC1091
source "$_venv/bin/activate"
set +euo pipefail
