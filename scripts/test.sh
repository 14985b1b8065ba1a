#!/usr/bin/env bash
# The test command: creates the environment from nothing, lints, builds the docs site,
# runs the test suite.
# Usage: bash scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
echo "test: ruff lint and format check, import layers (~10 s)"
ruff check .
ruff format --check .
lint-imports
echo "test: docs site, mkdocs build --strict (~10 s)"
_site="$(mktemp -d)"
NO_MKDOCS_2_WARNING=1 mkdocs build --strict --quiet --site-dir "$_site"
rm -rf "$_site"
echo "test: the pytest suite (several minutes on 2 cores)"
python -m pytest -q -p no:cacheprovider "$@"
