#!/usr/bin/env bash
# The test suite, set-up included: ./run_tests.sh [pytest arguments]
set -euo pipefail
root=$(cd "$(dirname "$0")" && pwd)
py=$("$root/scripts/ensure_env.sh")
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
cd "$root"
# One pytest worker per core, at most four: most tests are one single-threaded process (a tiny model,
# Triton's interpreter) and leave the other cores idle. Test files stay whole on one worker, so the runs
# and compiled models a file's tests share are made once. `./run_tests.sh -n 0 ...` runs in this process.
workers=$(nproc 2>/dev/null || echo 1)
workers=$(( workers > 4 ? 4 : workers ))
parallel=()
# Files go to workers in the order tests/conftest.py gives them, the slowest first.
if [ "$workers" -gt 1 ]; then parallel=(-n "$workers" --dist loadfile --no-loadscope-reorder); fi
# The slowest tests close every run, so a slow newcomer shows in the CI log.
exec "$py" -m pytest -q --durations=25 ${parallel[@]+"${parallel[@]}"} "$@"
