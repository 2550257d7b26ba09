"""Context parallelism: peak memory and step time per rank at cp = 1, 2, 4, and the work balance of the split.

    python -m bench.context_parallel                                  # nsa_125m, one 32k sequence a step, GPUs
    python -m bench.context_parallel --seq-len 8192 --allow-cpu       # the same on the CPU over gloo

Memory and time: for each cp size, one torchrun launch of cp processes trains the recipe on synthetic
data, one sequence (one document) of --seq-len tokens a step, split over the cp ranks (FSDP2 shards the model over
them too). Every rank reports its peak memory (CUDA: the allocator's peak; CPU: the process's peak
resident set, the model and Python included) and its median step time after the first step. On the
CPU every rank gets one thread, whatever cp is: ranks beyond the machine's cores share them, which
shows in their step times.

Balance (--balance-seq-len, one process): the NSA op's forward + backward timed on each rank's
queries against every key they need, for the head-tail split the trainer uses (rank r holds chunks r
and 2cp-1-r of 2cp) and for plain contiguous chunks. Imbalance = the slowest rank over the mean.
Results go to bench/results/context_parallel-<device>-<time>.json with the machine, versions and commit. A
cp size whose launch failed is recorded with its ranks' error lines, and the exit status is 1.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import signal
import subprocess
import sys
import tempfile
import time

import torch

from bench.arguments import VOCAB_SIZE_RANGE, non_negative_int, positive_int, recipe_problems, refuse_overrides
from bench.arguments import vocab_size as vocab_size_type
from bench.environment import describe_environment, shipped_recipe, write_report

DEFAULT_RECIPE = "nsa_125m.toml"  # the checkout's recipes/
LAUNCH_TIMEOUT_SECONDS = 1800  # one cp size's launch: a hung rank is recorded, not waited on for ever


# ---- memory and step time: one torchrun launch per cp size ------------------------------------------
def _worker(args) -> int:
    """One rank of a launch: train, then write this rank's peak memory and step times."""
    from bench.train_throughput import synthetic_run_argv
    from nsa_titan.config import resolve
    from nsa_titan.parallel.distributed import barrier, destroy_process_group
    from nsa_titan.runtime import make_runtime
    from nsa_titan.trainer import Trainer

    cp = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    extra = [f"--parallelism.context_parallel_degree={cp}", *args.override]
    dump = os.path.join(args.worker, "run")
    os.makedirs(dump, exist_ok=True)
    resolved = resolve(synthetic_run_argv(args.recipe, args.seq_len, args.steps, 1, args.vocab_size, dump, extra,
                                          one_document_per_row=True), world_size=cp, training=True)
    runtime = make_runtime(resolved.recipe.training.device, resolved.recipe.training.dtype)
    trainer = Trainer(resolved, runtime)
    times = []
    try:
        iterator = iter(trainer.train_loader)
        for _ in range(args.steps):
            start = time.perf_counter()
            loss, *_ = trainer.train_step(iterator)
            loss.item()
            if runtime.device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    finally:
        trainer.close()
    cuda = runtime.device.type == "cuda"
    record = {"rank": rank, "cp": cp, "step_seconds": times,
              "median_step_seconds": statistics.median(times[1:] or times),
              "peak_memory_gib": (torch.cuda.max_memory_allocated() if cuda else
                                  resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) / 2**30,
              "memory_kind": "cuda max allocated" if cuda else "process peak resident set"}
    with open(os.path.join(args.worker, f"rank-{rank}.json"), "w", encoding="utf-8") as fh:
        json.dump(record, fh)
    # As the trainer's own exit does: the ranks meet before gloo or NCCL is torn down (a rank whose
    # communicator still frees a collective's tensors while the interpreter shuts down aborts).
    barrier()
    destroy_process_group()
    return 0


# A line of a rank's stderr as torchrun passes it on ("[rank1]: TypeError: ..."), and the last line of a traceback.
RANK_LINE = re.compile(r"\[(?:rank|default)(\d+)\]: ?(.*)")
EXCEPTION_LINE = re.compile(r"[A-Za-z_][\w.]*(?:Error|Exception|Fault|Interrupt)\b:?")


def failure_summary(stderr: str, limit: int = 2000) -> str:
    """The failing ranks' own error lines from a launch's stderr: "error: ..." lines (with the "  - " lines of a
    list after them) and the last line of each traceback, each once, with the ranks that printed it; torchrun's
    own report of which child failed is left out. With none of those, the end of stderr from a line start."""
    ranks_of: dict[str, list[str]] = {}
    last: dict[str | None, str] = {}
    for raw in stderr.splitlines():
        match = RANK_LINE.match(raw)
        rank, line = (match.group(1), match.group(2)) if match else (None, raw)
        if line.startswith("error:") or (EXCEPTION_LINE.match(line) and "ChildFailedError" not in line):
            last[rank] = line
            ranks_of.setdefault(line, [])
        elif line.startswith("  - ") and rank in last:  # a problem of the list an error line began
            ranks_of.pop(last[rank], None)
            last[rank] = f"{last[rank]}\n{line}"
            ranks_of.setdefault(last[rank], [])
        else:
            continue
        if rank is not None and rank not in ranks_of[last[rank]]:
            ranks_of[last[rank]].append(rank)
    if not ranks_of:
        tail = stderr[-limit:]
        return tail if len(stderr) <= limit else tail[tail.find("\n") + 1:] if "\n" in tail else tail
    lines = [(f"rank {', '.join(sorted(ranks, key=int))}: " if ranks else "") + message
             for message, ranks in ranks_of.items()]
    return "\n".join(lines)


def measure_cp(recipe: str, cp: int, seq_len: int, steps: int, vocab_size: int, overrides: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={cp}",
                   "-m", "bench.context_parallel",
                   "--worker", folder, "--recipe", recipe, "--seq-len", str(seq_len), "--steps", str(steps),
                   "--vocab-size", str(vocab_size), *(f"--override={o}" for o in overrides)]
        # One thread per rank on the CPU at every cp size, so that cp = 1 is not given more cores.
        env = dict(os.environ, OMP_NUM_THREADS="1") if not torch.cuda.is_available() else None
        # A session of its own, so that a launch that hangs is stopped with every rank it started.
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                start_new_session=True)
        try:
            _, stderr = proc.communicate(timeout=LAUNCH_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            _, stderr = proc.communicate()
            return {"cp": cp, "seq_len": seq_len,
                    "error": f"no result within {LAUNCH_TIMEOUT_SECONDS} s (stopped): {failure_summary(stderr)}"}
        if proc.returncode:
            return {"cp": cp, "seq_len": seq_len, "error": failure_summary(stderr)}
        ranks = [json.load(open(os.path.join(folder, f"rank-{r}.json"), encoding="utf-8")) for r in range(cp)]
    return {"cp": cp, "seq_len": seq_len, "tokens_per_rank": seq_len // cp, "ranks": ranks,
            "max_peak_memory_gib": max(r["peak_memory_gib"] for r in ranks),
            "max_median_step_seconds": max(r["median_step_seconds"] for r in ranks)}


# ---- balance: the op on each rank's queries ---------------------------------------------------------
def _rank_queries(split: str, cp: int, rank: int, seq_len: int) -> list[tuple[int, int]]:
    if split == "contiguous":
        size = seq_len // cp
        return [(rank * size, (rank + 1) * size)]
    from components.sequence_shard import SequenceShard

    return list(SequenceShard(None, rank, cp, seq_len).chunks())


def _time_queries(ranges, seq_len: int, args, device, repeats: int) -> float:
    """Forward + backward of the NSA op for the queries in `ranges` (each against keys 0 .. its end),
    one op call per range as the model makes them; the median of `repeats` runs after one untimed."""
    from components.nsa import nsa_attention, num_compressed_blocks

    nsa = args.nsa
    hyper = dict(block_size=nsa.block_size, block_stride=nsa.block_stride, sel_block_size=nsa.sel_block_size,
                 num_selected=nsa.num_selected, window_size=nsa.window_size)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device, dtype).requires_grad_()

    H, Hkv, D = args.n_heads, args.n_kv_heads, args.head_dim
    calls = []
    for start, end in ranges:
        tc = num_compressed_blocks(end, nsa.block_size, nsa.block_stride)
        tensors = [rand(1, end - start, H, D), rand(1, tc, Hkv, D), rand(1, tc, Hkv, D),
                   *(rand(1, end, Hkv, D) for _ in range(4)),
                   torch.rand(1, end - start, H, 3, generator=gen).to(device, dtype).requires_grad_()]
        cu = torch.tensor([0, end], device=device), torch.tensor([0, end - start], device=device)
        calls.append((tensors, cu))
    times = []
    for _ in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for tensors, (cu_k, cu_q) in calls:
            out = nsa_attention(*tensors, **hyper, backend=nsa.backend, cu_seqlens=cu_k, cu_seqlens_q=cu_q)
            out.float().sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def measure_balance(recipe: str, seq_len: int, cps: list[int], overrides: list[str], repeats: int) -> list[dict]:
    from nsa_titan.config import resolve

    resolved = resolve([recipe, f"--training.seq_len={seq_len}", f"--model.max_seq_len={max(seq_len, 2048)}",
                        *overrides], world_size=None)
    args = resolved.recipe.model.args
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out = []
    for cp in cps:
        if cp == 1:
            continue
        for split in ("head-tail", "contiguous"):
            seconds = [_time_queries(_rank_queries(split, cp, r, seq_len), seq_len, args, device, repeats)
                       for r in range(cp)]
            out.append({"cp": cp, "split": split, "seq_len": seq_len, "backend": args.nsa.backend,
                        "rank_seconds": seconds, "imbalance": max(seconds) / statistics.mean(seconds)})
            print(json.dumps(out[-1]), flush=True)
    return out


# The fields each launch sets (bench.train_throughput.synthetic_run_argv and the cp degree), with the option of
# this benchmark that sets it ('' for none).
OWNED_FIELDS = {"training.steps": "--steps", "training.seq_len": "--seq-len", "training.local_batch_size": "",
                "training.global_batch_size": "", "parallelism.context_parallel_degree": "--cp", "data.source": "",
                "data.tokenizer": "", "data.tiktoken.encoding": "--vocab-size",
                "data.synthetic.vocab_size": "--vocab-size", "data.synthetic.min_length": "--seq-len",
                "data.synthetic.max_length": "--seq-len", "checkpoint.enable": "", "validation.enable": "",
                "metrics.log_freq": "", "job.dump_folder": ""}


def check_arguments(args, overrides: list[str]) -> str | None:
    """What would fail every launch (an override of a field the benchmark sets, the recipe's problems at each cp
    size), said before the first one, or None."""
    from bench.train_throughput import synthetic_run_argv

    refused = refuse_overrides(args.override, OWNED_FIELDS)
    if refused:
        return f"error: {refused}"
    with tempfile.TemporaryDirectory() as dump:
        for cp in args.cp:
            argv = synthetic_run_argv(args.recipe, args.seq_len, args.steps, 1, args.vocab_size, dump,
                                      [f"--parallelism.context_parallel_degree={cp}", *overrides],
                                      one_document_per_row=True)
            problems = recipe_problems(argv, world_size=cp, training=True)
            if problems:
                return f"error: {args.recipe} at cp = {cp}: {problems.removeprefix('error: ')}"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default=shipped_recipe(DEFAULT_RECIPE))
    parser.add_argument("--cp", nargs="+", type=positive_int, default=[1, 2, 4])
    parser.add_argument("--seq-len", type=positive_int, default=32768)
    parser.add_argument("--steps", type=positive_int, default=3)
    parser.add_argument("--balance-seq-len", type=non_negative_int, default=None,
                        help="default: --seq-len; 0 skips the balance")
    parser.add_argument("--repeats", type=positive_int, default=3, help="timed runs per rank in the balance part")
    parser.add_argument("--vocab-size", type=vocab_size_type, default=50257,
                        help=f"stand-in vocabulary size, {VOCAB_SIZE_RANGE[0]} to {VOCAB_SIZE_RANGE[1]} "
                             f"(GPT-2: 50257)")
    parser.add_argument("--override", action="append", default=[], help="extra recipe override, repeatable")
    parser.add_argument("--allow-cpu", action="store_true", help="run on the CPU: gloo, one process per rank")
    parser.add_argument("--out", default=None, help="output JSON path (default bench/results/context_parallel-<device>-"
                                                    "<time>.json)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return _worker(args)
    cuda = torch.cuda.is_available()
    if not cuda and not args.allow_cpu:
        print("error: no CUDA device: this benchmark measures GPUs. Fix: run it on a GPU machine, or pass "
              "--allow-cpu to measure the CPU.", file=sys.stderr)
        return 2
    if cuda and max(args.cp) > torch.cuda.device_count():
        print(f"error: cp up to {max(args.cp)} needs as many GPUs, this machine has {torch.cuda.device_count()}. "
              f"Fix: pass --cp with at most that many.", file=sys.stderr)
        return 2
    overrides = list(args.override) + ([] if cuda else ["--training.device=cpu"])
    problem = check_arguments(args, overrides)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    runs = []
    for cp in args.cp:
        runs.append(measure_cp(args.recipe, cp, args.seq_len, args.steps, args.vocab_size, overrides))
        print(json.dumps(runs[-1]), flush=True)
    balance_len = args.seq_len if args.balance_seq_len is None else args.balance_seq_len
    balance = measure_balance(args.recipe, balance_len, args.cp, overrides, args.repeats) if balance_len else []
    payload = {"benchmark": "context_parallel", "environment": describe_environment(), "recipe": args.recipe,
               "overrides": overrides, "memory_and_time": runs, "balance": balance}
    write_report(payload, "context_parallel", args.out)
    failed = [run for run in runs if "error" in run]
    for run in failed:
        print(f"error: cp = {run['cp']} failed: {run['error']}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
