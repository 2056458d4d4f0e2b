#!/usr/bin/env bash
# Install titanlite with its dev extras (if needed) and run the test suite: ./run_tests.sh [pytest args]
set -eu
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
if ! "$PY" -c "import titanlite, pytest, transformers, matplotlib" >/dev/null 2>&1; then
  "$PY" -m pip install -q -e ".[dev]"
fi
exec "$PY" -m pytest -q "$@"
