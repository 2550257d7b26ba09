#!/usr/bin/env bash
# The test suite, set-up included: ./run_tests.sh [pytest arguments]
set -euo pipefail
root=$(cd "$(dirname "$0")" && pwd)
py=$("$root/scripts/ensure_env.sh")
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
cd "$root"
# The slowest tests close every run, so a slow newcomer shows in the CI log.
exec "$py" -m pytest -q --durations=25 "$@"
