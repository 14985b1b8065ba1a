#!/usr/bin/env bash
# The test command: creates the environment from nothing, lints, runs the test suite.
# Usage: bash scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
ruff check .
ruff format --check .
python -m pytest -q -p no:cacheprovider "$@"
