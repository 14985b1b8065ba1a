#!/usr/bin/env bash
# The test command: creates the environment from nothing, lints, runs the test suite.
# Usage: bash scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
echo "test: ruff lint and format check, import layers (~10 s)"
ruff check .
ruff format --check .
lint-imports
echo "test: the pytest suite (several minutes on 2 cores)"
python -m pytest -q -p no:cacheprovider "$@"
