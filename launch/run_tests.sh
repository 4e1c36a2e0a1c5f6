#!/usr/bin/env bash
# Installs what the tests need (idempotently) and runs the linter and the test suite:
# the Debian packages of the sandbox (as root), .venv with the hf and test extras,
# .venv-xm for the XManager tests and .venv-seqio for the seqio bridge.
#   bash launch/run_tests.sh [pytest args...]
# With pytest args only the main suite runs (e.g. `bash launch/run_tests.sh tests/test_model.py`).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" = 0 ]; then
  bash launch/install_system_deps.sh
else
  echo "[tests] not root: the sandbox and red-team tests will skip" >&2
fi
if [ $# -eq 0 ]; then
  bash launch/setup_xm_venv.sh
  export CURSOR_RL_REQUIRE_XM=1
  # seqio pulls TensorFlow (~3 GB): a venv of its own keeps it out of .venv.
  (CURSOR_RL_VENV="$PWD/.venv-seqio" && source launch/venv.sh "seqio,test" \
    && CURSOR_RL_REQUIRE_SEQIO=1 python -m pytest -q -p no:cacheprovider tests/test_data_seqio.py)
fi
source launch/venv.sh "hf,test"
set -euo pipefail
ruff check .
ruff format --check .
python -m pytest -q "$@"
