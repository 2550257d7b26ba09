#!/usr/bin/env bash
# The checks and benchmarks that need a CUDA GPU, in one go: ./bench/gpu_suite.sh [PHASE ...]
#
#   check      the GPU tests (Triton kernels in bf16 at 2k-32k against the reference, and under
#              compile), `doctor` on the 125M recipe, `inspect --fail-on-break` and a 200-step
#              run of the debug model with the Triton backend, compiled, in bf16 (profiling steps
#              100-102 with a memory snapshot), and 50 steps of it as FSDP2 on a mesh of this one GPU (NCCL),
#              then 20 with the Muon optimizer (its gather of sharded matrices on NCCL); dense attention's
#              FlexAttention over packed documents
#   attention  python -m bench.attention: NSA (Triton) vs SDPA, 2k to 64k tokens, 125M and paper heads
#              (125M also as packed rows of 1k-8k token documents), and python -m bench.attention_stages:
#              where the NSA op's time goes, and the selected branch's two layouts side by side
#   train      python -m bench.train_throughput: nsa_125m vs dense_125m, bf16 + compile, at 2k and 32k;
#              nsa_125m at 2k again with CUDA graphs (compile.mode = reduce-overhead); python -m bench.loss_memory:
#              the loss's peak memory at 65,536 tokens a step
#
# No phase named: all three. JSON results go to bench/results/, each phase's log to
# bench/results/logs/<phase>.log, and the tables of this run's results (bench.report) to
# bench/results/logs/report.md. Exit status: the number of phases that failed.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
# A GPU image that already holds the core packages (bench/gpu_wheels.sh carries the ones it lacks) runs
# as it is; elsewhere the project's environment is set up.
if python3 -c "import torch, torchdata, datasets, tiktoken, pytest" >/dev/null 2>&1; then
  py=python3
else
  py=$("$root/scripts/ensure_env.sh") || exit 1
fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
logs="$root/bench/results/logs"
mkdir -p "$logs"

phase_check() {
  local dump
  dump=$(mktemp -d)
  "$py" -m pytest -q -x tests/test_nsa_triton_gpu.py tests/test_nsa_triton.py tests/test_nsa_triton_compile.py \
    tests/test_nsa_triton_block_major.py tests/test_dense_documents_gpu.py &&
  "$py" -m nsa_titan.cli doctor recipes/nsa_125m.toml --data.source=synthetic --data.tokenizer=byte &&
  "$py" -m nsa_titan.cli inspect recipes/debug.toml --training.device=cuda --model.nsa.backend=triton \
    --compile.enable=true --job.dump_folder="$dump/inspect" --fail-on-break &&
  "$py" -m nsa_titan.cli train recipes/debug.toml --training.device=cuda --model.nsa.backend=triton \
    --compile.enable=true --training.steps=200 --job.dump_folder="$dump/train" \
    --profiling.enable=true --profiling.start_step=100 --profiling.memory_snapshot=true &&
  ls -l "$dump/train/profile" &&
  "$py" -m nsa_titan.cli train recipes/debug.toml --training.device=cuda --model.nsa.backend=triton \
    --compile.enable=true --training.steps=50 --parallelism.fsdp_single_process=true --job.dump_folder="$dump/fsdp" &&
  "$py" -m nsa_titan.cli train recipes/debug.toml --training.device=cuda --model.nsa.backend=triton \
    --training.steps=20 --parallelism.fsdp_single_process=true --optimizer.name=muon --job.dump_folder="$dump/muon"
}
phase_attention() {
  "$py" -m bench.attention --seq-lens 2048 4096 8192 16384 32768 65536 --packed 1024 8192 &&
  "$py" -m bench.attention --preset paper --seq-lens 2048 4096 8192 16384 32768 65536 &&
  "$py" -m bench.attention_stages --seq-lens 8192 65536 &&
  "$py" -m bench.attention_stages --preset paper --seq-lens 8192 65536
}
phase_train() {
  "$py" -m bench.train_throughput --seq-lens 2048 32768 &&
  "$py" -m bench.train_throughput --seq-lens 2048 --recipes recipes/nsa_125m.toml --override=--compile.mode=reduce-overhead &&
  "$py" -m bench.loss_memory --tokens 65536
}

phases=("$@")
[ ${#phases[@]} -gt 0 ] || phases=(check attention train)
failed=0
stamp=$(mktemp)  # results newer than this are this run's
for phase in "${phases[@]}"; do
  if ! declare -F "phase_$phase" >/dev/null; then
    echo "error: unknown phase '$phase'; choose from: check attention train" >&2
    exit 2
  fi
  echo "== $phase ($(date -u +%H:%M:%S))"
  start=$SECONDS
  if "phase_$phase" 2>&1 | tee "$logs/$phase.log"; then
    echo "== $phase: ok in $((SECONDS - start)) s"
  else
    echo "== $phase: FAILED after $((SECONDS - start)) s (log: $logs/$phase.log)"
    failed=$((failed + 1))
  fi
done
mapfile -t fresh < <(find bench/results -maxdepth 1 -name '*.json' -newer "$stamp" | sort)
if [ ${#fresh[@]} -gt 0 ]; then
  "$py" -m bench.report "${fresh[@]}" | tee "$logs/report.md"
fi
exit "$failed"
