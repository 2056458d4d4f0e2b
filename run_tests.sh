#!/usr/bin/env bash
# Install what is missing (titanlite's dependencies as run_train.sh installs them, torch first, then the
# dev extras), check the import layers (pyproject.toml's import-linter contract) and run the test
# suite in two processes: ./run_tests.sh [pytest args]
set -eu
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
PYTHON="$PY" TITANLITE_INSTALL=only ./run_train.sh
if ! "$PY" -m titanlite.tools.missing_deps pyproject.toml dev >/dev/null; then
  "$PY" -m pip install -e ".[dev]"
fi
"$PY" -c 'from importlinter.cli import lint_imports_command; lint_imports_command()' --no-cache
# Two worker processes (pytest-xdist; conftest.py says how they share the tests and the cores): most
# tests wait on a single-threaded start-up, which leaves a second core idle in one process. -n 0 runs
# the suite in one process.
exec "$PY" -m pytest -q -n 2 --dist loadgroup "$@"
