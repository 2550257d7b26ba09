#!/usr/bin/env bash
# The checks and benchmarks that need a CUDA GPU, in one go, within a time budget:
#
#   ./bench/gpu_suite.sh [--budget SECONDS] [--pack FILE] [--tiles FILE] [PHASE ...]
#
#   check      the GPU tests (Triton kernels in bf16 at 2k-32k against the reference, determinism,
#              compile, FlexAttention over documents), `doctor` on the 125M recipe, `inspect
#              --fail-on-break` and a 200-step run of the debug model with the Triton backend,
#              compiled, in bf16 (profiling steps 100-102 with a memory snapshot), 50 steps of it as
#              FSDP2 on a mesh of this one GPU (NCCL), then 20 with the Muon optimizer. Six groups
#              run side by side: they check results, they time nothing.
#   attention  python -m bench.attention: NSA (Triton) vs SDPA, 2k to 64k tokens, 125M and paper heads
#              (125M also as packed rows of 1k-8k token documents), and python -m bench.attention_stages:
#              where the NSA op's time goes, the selected branch's two layouts side by side, and whether
#              the host's launches set the op's pace (2k, 8k, 64k); both again for 32 rows of 2k tokens
#              (nsa_125m's training shape). First, python -m bench.selected_flex: the selected branch as
#              FlexAttention over a block mask against the op's kernels (32 rows of 2k; 64k)
#   train      python -m bench.train_throughput: nsa_125m vs dense_125m, bf16 + compile, at 2k and 32k, with
#              one step of each profiled (where its GPU time goes, by kernel and kind);
#              python -m bench.loss_memory at 65,536 tokens; nsa_125m at 2k with CUDA graphs
#              (compile.mode = reduce-overhead)
#   tiles      python -m bench.tile_variants: launch shapes against the shipped ones, each kernel's a few
#              candidates and its neighbours (time, determinism, result against the shipped shape's and the exact
#              one): at 64k with the paper's heads the interval backward, then the selected branch's kernels and
#              the selection; at 32 rows of 2k with the 125M heads the interval kernels (there also the selected
#              branch's, in its masked layout) and the selection. Steps capped at 190, 140 and 140 s, each
#              compiling its shapes' kernels first in eight processes. Only when named.
#   tuned      python -m bench.tile_choice on this run's tiles results (name tiles before it): the fastest shape
#              of each kernel that is deterministic, within 5e-3 of the exact result and 1.5x the shipped shape's
#              own distance from it, and in the shipped selected layout, where it gains 3% or more; then, where a
#              shape changed and time is left, the op's forward + backward (bench.attention, no SDPA) with the
#              shipped shapes and with the chosen ones, one after the other, for 32 rows of 2k and for the paper's
#              heads at 32k and 64k. Only when named. With `tiles` in 540 s the comparison has little time left.
#
# --tiles FILE: the launch shapes file (bench/launch_shapes.py) the check and attention phases' GPU tests and
# benchmarks launch with instead of the shipped shapes (the training runs keep the shipped ones: a shape ships
# in tile_configs.py); the tuned phase writes its choice there. Without it, phases after tuned use its choice.
# A GPU machine kept between two runs keeps the file, e.g. `--tiles /tmp/tiles.json tiles tuned`, then
# `--tiles /tmp/tiles.json check`.
#
# No phase named: check, attention and train. Timed steps run one after another. Every step has a time cap, cut to
# what is left of --budget (default 540 s, counted from the start, set-up included), so a run cut
# short still keeps the steps that ran; a step with no time left is skipped and says so. The caps
# add up to more than 540 s: within a 10-minute limit run one or two phases, e.g. `check`, then
# `attention train` in a second run. JSON results go to bench/results/, each step's log
# to bench/results/logs/<step>.log, one line per step to bench/results/logs/summary.txt and the
# tables of this run's results (bench.report) to bench/results/logs/report.md. --pack FILE writes
# all of that (and this run's JSON) into one .tgz after every step, so a run killed mid-step still
# leaves an archive of the steps before. Exit status: the number of steps that failed or were skipped; 2 before
# any step runs for a bad argument or a machine without a CUDA GPU.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
budget=540 pack="" tiles=""
while [ $# -gt 0 ]; do
  case "$1" in
    --budget|--pack|--tiles)
      if [ $# -lt 2 ]; then echo "error: $1 needs a value" >&2; exit 2; fi
      case "$1" in
        --budget) budget=$2 ;;
        --pack) pack=$(realpath -m -- "$2") ;;
        --tiles) tiles=$(realpath -m -- "$2") ;;
      esac
      shift 2 ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    -*) echo "error: unknown option '$1'; usage: $0 [--budget SECONDS] [--pack FILE] [--tiles FILE]" \
             "[check attention train tiles tuned]" >&2
        exit 2 ;;
    *) break ;;
  esac
done
case "$budget" in ''|*[!0-9]*) echo "error: --budget takes whole seconds, got '$budget'" >&2; exit 2 ;; esac
phases=("$@")
[ ${#phases[@]} -gt 0 ] || phases=(check attention train)
for phase in "${phases[@]}"; do
  case "$phase" in
    check|attention|train|tiles|tuned) ;;
    *) echo "error: unknown phase '$phase'; choose from: check attention train tiles tuned" >&2; exit 2 ;;
  esac
done
if [ -n "$tiles" ] && [ ! -f "$tiles" ] && [[ " ${phases[*]} " != *" tuned "* ]]; then
  echo "error: --tiles $tiles: no such file. Fix: give the file bench.tile_choice wrote, or name the tuned phase" \
       "(with tiles before it), which writes it." >&2
  exit 2
fi
cd "$root"
# A GPU image that already holds the core packages (bench/gpu_wheels.sh carries the ones it lacks) runs
# as it is; elsewhere the project's environment is set up.
if python3 -c "import torch, torchdata, datasets, tiktoken, pytest" >/dev/null 2>&1; then
  py=python3
elif command -v nvidia-smi >/dev/null 2>&1; then
  # A GPU machine short of a package: say which (setting up an environment needs a network it may lack).
  python3 -c "import torch, torchdata, datasets, tiktoken, pytest" 2>&1 | tail -1 >&2
  echo "error: this GPU machine's python3 lacks a package the suite needs. Fix: install the wheels" \
       "./bench/gpu_wheels.sh fetches (see its header), or run ./scripts/ensure_env.sh where a network is." >&2
  exit 2
else
  py=$("$root/scripts/ensure_env.sh") || exit 1
fi
# Every phase needs a CUDA GPU: without one each step would run until it failed, one after another.
if ! "$py" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
  echo "error: no CUDA GPU here (torch.cuda.is_available() is false), and every phase of this suite needs one." \
       "Fix: run it on a GPU machine (the CPU checks are the test suite: python -m pytest)." >&2
  exit 2
fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# The GPU tests spend most of their time compiling kernels on the host: where pytest-xdist is there (the GPU
# image holds it), each test step runs four workers (--dist load: tests dealt out in small batches).
xdist=()
if "$py" -c "import xdist" >/dev/null 2>&1; then xdist=(-n 4 --dist load); fi
logs="$root/bench/results/logs"
mkdir -p "$logs"
rm -f "$logs"/*.log "$logs/report.md"  # an earlier run's logs would be packed as this one's
: > "$logs/summary.txt"
dump=$(mktemp -d)  # the steps' own runs and pytest folders: what is kept is in bench/results
stamp=$(mktemp)  # results newer than this are this run's
trap 'rm -rf -- "$dump" "$stamp"' EXIT

fresh_results() { find bench/results -maxdepth 1 -name '*.json' -newer "$stamp" | sort; }

# One archive at a time (the check phase's groups finish steps side by side); a log another group is
# still writing is packed as far as it goes (tar's exit status 1).
pack_results() {
  [ -n "$pack" ] || return 0
  (
    flock 9
    tmp="$pack.tmp"
    # shellcheck disable=SC2046
    tar czf "$tmp" --warning=no-file-changed -C "$root" bench/results/logs $(fresh_results) 2>/dev/null
    if [ $? -le 1 ]; then mv "$tmp" "$pack"; else rm -f "$tmp"; fi
  ) 9> "$dump/pack.lock"
}

# step NAME CAP COMMAND...: run COMMAND for at most CAP seconds, less if the budget (counted from this
# script's start: SECONDS) has less left, keeping back KILL_GRACE for a command that ignores the stop
# signal (STEP_SIGNAL, default TERM; INT lets pytest print its summary of what failed so far).
KILL_GRACE=5
step() {
  local name=$1 cap=$2 left rc start verdict="ok"
  shift 2
  left=$((budget - SECONDS - KILL_GRACE - 5))
  [ "$cap" -lt "$left" ] || cap=$left
  if [ "$cap" -le 5 ]; then
    echo "$name: SKIPPED (no time left of --budget $budget)" | tee -a "$logs/summary.txt"
    return 1
  fi
  start=$SECONDS
  timeout -s "${STEP_SIGNAL:-TERM}" -k "$KILL_GRACE" "$cap" "$@" > "$logs/$name.log" 2>&1
  rc=$?
  case $rc in
    0) ;;
    124|137) verdict="FAILED (cut at $cap s)" ;;
    *) verdict="FAILED (exit $rc)" ;;
  esac
  echo "$name: $verdict in $((SECONDS - start)) s (log: bench/results/logs/$name.log)" | tee -a "$logs/summary.txt"
  pack_results
  return $rc
}

debug_run=("$py" -m nsa_titan.cli train recipes/debug.toml --training.device=cuda --model.nsa.backend=triton)

# The GPU tests in three steps side by side (each with xdist's workers where it is there): most of their time is
# Triton compiling each test's kernels on the host (one process took 380 s on an H200, past the step's cap). Each
# has its own temporary folder: pytest's shared one prunes other sessions' folders when it starts.
gpu_tests() {  # gpu_tests NAME FILE...
  local name=$1
  shift
  STEP_SIGNAL=INT step "gpu_tests_$name" 240 "$py" -m pytest -v -rfE --durations=10 -p no:cacheprovider \
    --basetemp="$dump/pytest_$name" ${xdist[@]+"${xdist[@]}"} ${tiles_pytest[@]+"${tiles_pytest[@]}"} "$@"
}
check_group_tests_kernels() {
  gpu_tests kernels tests/test_nsa_triton_gpu.py
}
check_group_tests_op() {
  gpu_tests op tests/test_nsa_triton.py tests/test_nsa_triton_masked.py
}
check_group_tests_more() {
  gpu_tests more tests/test_nsa_triton_compile.py tests/test_nsa_triton_block_major.py tests/test_nsa_triton_gating.py \
    tests/test_dense_documents_gpu.py tests/test_nsa_packed.py tests/test_bitonic_sort.py tests/test_loss_kernels.py \
    tests/test_output_head.py tests/test_nsa_triton_packing_kept.py tests/test_nsa_query_offsets.py \
    tests/test_nsa_opcheck.py
}
check_group_train() {
  step train_200_steps 240 "${debug_run[@]}" --compile.enable=true --training.steps=200 \
    --job.dump_folder="$dump/train" --profiling.enable=true --profiling.start_step=100 \
    --profiling.memory_snapshot=true &&
  ls -l "$dump/train/profile" >> "$logs/train_200_steps.log"
}
check_group_fsdp() {
  step fsdp_single_gpu 150 "${debug_run[@]}" --compile.enable=true --training.steps=50 \
    --parallelism.fsdp_single_process=true --job.dump_folder="$dump/fsdp"
  step muon_single_gpu 90 "${debug_run[@]}" --training.steps=20 --parallelism.fsdp_single_process=true \
    --optimizer.name=muon --job.dump_folder="$dump/muon"
}
check_group_tools() {
  step doctor 200 "$py" -m nsa_titan.cli doctor recipes/nsa_125m.toml --data.source=synthetic --data.tokenizer=byte
  step inspect 150 "$py" -m nsa_titan.cli inspect recipes/debug.toml --training.device=cuda \
    --model.nsa.backend=triton --compile.enable=true --job.dump_folder="$dump/inspect" --fail-on-break
}

# tiles_pytest / tiles_bench: the options that hand --tiles FILE to the GPU tests / the op's benchmarks (none
# without it). False, said in the summary, when FILE is named but missing (the tuned phase wrote none).
tile_args() {
  tiles_pytest=() tiles_bench=()
  [ -n "$tiles" ] || return 0
  if [ ! -f "$tiles" ]; then
    echo "$1: SKIPPED (--tiles $tiles does not exist: the tuned phase wrote no choice)" | tee -a "$logs/summary.txt"
    return 1
  fi
  tiles_pytest=(--nsa-tiles "$tiles") tiles_bench=(--tiles "$tiles")
}

phase_check() {
  tile_args check || return 1
  check_group_tests_kernels & check_group_tests_op & check_group_tests_more &
  check_group_train & check_group_fsdp & check_group_tools &
  wait
}
phase_attention() {
  tile_args attention || return 1
  local shapes=(${tiles_bench[@]+"${tiles_bench[@]}"})
  # First: the other steps' numbers were measured before (README); FlexAttention compiles fwd + bwd per length.
  step selected_flex_32_rows 150 "$py" -m bench.selected_flex --batch 32 --seq-lens 2048 ${shapes[@]+"${shapes[@]}"}
  step selected_flex_64k 150 "$py" -m bench.selected_flex --seq-lens 65536 ${shapes[@]+"${shapes[@]}"}
  step attention_125m 150 "$py" -m bench.attention --seq-lens 2048 4096 8192 16384 32768 65536 --packed 1024 8192 \
    ${shapes[@]+"${shapes[@]}"}
  step attention_stages 60 "$py" -m bench.attention_stages --seq-lens 2048 8192 65536 ${shapes[@]+"${shapes[@]}"}
  step attention_paper 120 "$py" -m bench.attention --preset paper --seq-lens 2048 8192 32768 65536 \
    ${shapes[@]+"${shapes[@]}"}
  step attention_stages_paper 60 "$py" -m bench.attention_stages --preset paper --seq-lens 8192 65536 \
    ${shapes[@]+"${shapes[@]}"}
  # nsa_125m's training shape at 2k (32 rows a step), where it trails dense_125m most.
  step attention_32_rows 60 "$py" -m bench.attention --batch 32 --seq-lens 2048 ${shapes[@]+"${shapes[@]}"}
  step attention_stages_32_rows 60 "$py" -m bench.attention_stages --batch 32 --seq-lens 2048 \
    ${shapes[@]+"${shapes[@]}"}
}
phase_train() {
  step train_throughput 240 "$py" -m bench.train_throughput --seq-lens 2048 32768 --profile
  step loss_memory 60 "$py" -m bench.loss_memory --tokens 65536
  step train_reduce_overhead 150 "$py" -m bench.train_throughput --seq-lens 2048 --recipes recipes/nsa_125m.toml \
    --override=--compile.mode=reduce-overhead
}
# Beside each shipped shape's neighbours, candidates two fields away that compile for sm_90 without spills
# (bench.kernel_resources --tiles). The costliest kernels first: a step cut at its cap loses the others. Eight
# processes compile every shape's kernels first (bench.tile_warmup): compiling, one kernel after another, was
# most of such a step's time.
phase_tiles() {
  local variants=("$py" -m bench.tile_variants --rep-ms 100 --precompile-workers 8)
  step tiles_paper 190 "${variants[@]}" --preset paper --seq-lens 65536 --kernels interval_dkdv interval_dq \
    --candidates interval_dkdv=64,64,8,2 interval_dkdv=32,128,8,2 interval_dq=128,64,8,2 interval_dq=64,64,4,3
  # The paper's group of 16 runs the selected branch query-major (tile_configs.selected_layout).
  step tiles_paper_selected 140 "${variants[@]}" --preset paper --seq-lens 65536 \
    --kernels selected_dkdv selected_dq selected_fwd selection
  # Calls of a few milliseconds: compiling is most of this step; the last kernels go first if it is cut. Rows of
  # 2k run the selected branch in its masked layout, on the interval kernels (their workloads include it).
  step tiles_125m_32_rows 140 "${variants[@]}" --batch 32 --seq-lens 2048 \
    --kernels interval_dkdv interval_dq interval_fwd selection \
    --candidates interval_dkdv=64,64,8,3 interval_dkdv=64,64,4,2 interval_dq=128,64,8,3 interval_fwd=128,64,4,2
}

# The choice from this run's tile_variants results, then the op timed with the shipped shapes and with the chosen
# ones, one after the other, where nsa_125m's training shape (32 rows of 2k) and the paper's heads (32k, 64k) run.
phase_tuned() {
  local variants chosen
  [ -z "$tiles" ] || rm -f -- "$tiles"  # an earlier run's choice must not pass for this one's
  mapfile -t variants < <(fresh_results | grep '/tile_variants-')
  if [ ${#variants[@]} -eq 0 ]; then
    echo "tile_choice: SKIPPED (no tile_variants results from this run: name the tiles phase before tuned)" |
      tee -a "$logs/summary.txt"
    return 1
  fi
  step tile_choice 30 "$py" -m bench.tile_choice "${variants[@]}" || return 1
  chosen=$(fresh_results | grep '/tile_choice-' | tail -n 1)
  if [ -z "$chosen" ]; then
    echo "attention_tuned: SKIPPED (bench.tile_choice wrote no file)" | tee -a "$logs/summary.txt"
    return 1
  fi
  if [ -n "$tiles" ]; then mkdir -p "$(dirname "$tiles")" && cp "$chosen" "$tiles"; else tiles=$chosen; fi
  local changed
  if ! changed=$("$py" -c 'import json, sys; print(len(json.load(open(sys.argv[1]))["shapes"]))' "$chosen"); then
    echo "attention_tuned: FAILED (cannot read $chosen)" | tee -a "$logs/summary.txt"
    return 1
  fi
  if [ "$changed" = 0 ]; then
    echo "attention_tuned: ok in 0 s (no shape changed: nothing to compare)" | tee -a "$logs/summary.txt"
    return 0
  fi
  # The op alone, forward + backward, without SDPA: the comparison is shipped against chosen.
  local op=("$py" -m bench.attention --no-sdpa --modes fwd+bwd)
  step attention_32_rows_shipped 60 "${op[@]}" --batch 32 --seq-lens 2048
  step attention_32_rows_tuned 60 "${op[@]}" --batch 32 --seq-lens 2048 --tiles "$tiles"
  step attention_paper_shipped 90 "${op[@]}" --preset paper --seq-lens 32768 65536
  step attention_paper_tuned 90 "${op[@]}" --preset paper --seq-lens 32768 65536 --tiles "$tiles"
}

for phase in "${phases[@]}"; do
  echo "== $phase ($(date -u +%H:%M:%S), $((budget - SECONDS)) s of the budget left)"
  "phase_$phase"
done
mapfile -t fresh < <(fresh_results)
if [ ${#fresh[@]} -gt 0 ]; then
  "$py" -m bench.report "${fresh[@]}" > "$logs/report.md"
fi
pack_results
echo "== summary"
cat "$logs/summary.txt"
[ ! -s "$logs/report.md" ] || tail -c 6000 "$logs/report.md"
exit "$(grep -c -v ': ok in' "$logs/summary.txt")"
