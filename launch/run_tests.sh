#!/usr/bin/env bash
# Installs (idempotently, into .venv) and runs the test suite and the linter.
#   bash launch/run_tests.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/venv.sh "hf,test"
set -euo pipefail
ruff check .
ruff format --check .
python -m pytest -q "$@"
