"""End-to-end training throughput: tokens/s and peak memory of recipes, side by side.

    python -m bench.train_throughput                       # nsa_125m vs dense_125m at seq 2k and 32k
    python -m bench.train_throughput --recipes recipes/nsa_125m.toml --seq-lens 2048 --steps 30

Each case trains on the synthetic source (so data never limits the speed) with the recipe's own
model, precision and compile settings, one process, checkpoints and validation off. With
--documents row (the default) every row is one document of seq_len tokens, so attention spans the
whole length, as in long-context training on long documents; --documents packed keeps the synthetic
source's 64-1024-token documents, packed and masked apart (attention then spans at most 1k tokens). The vocabulary
is a stand-in BPE file of --vocab-size entries (default GPT-2's 50257, the 125M recipes' tokenizer),
so the embedding and output layer cost what they cost in the real run, with no download. The result is
the median tokens/s over the steps after warmup (compilation and autotuning excluded), written as
JSON into bench/results/ with the GPU, library versions and the commit (rewritten after every case,
so a run cut short keeps the cases that ran). A case that runs out of memory
is run again with half the micro-batch and twice the gradient accumulation (the same tokens a step),
down to one row, unless --no-fit; the micro-batches that did not fit are recorded with it. --profile
runs two steps more after the timed ones, the profiler's warmup and one profiled step, and records where
that step's GPU time goes, kernel by kernel and by kind (bench.step_kernels).
"""

from __future__ import annotations

import argparse
import base64
import gc
import json
import math
import os
import statistics
import sys
import tempfile
import time

import torch

from bench import environment
from bench.arguments import VOCAB_SIZE_RANGE, non_negative_int, positive_int, recipe_problems, refuse_overrides
from bench.arguments import vocab_size as vocab_size_type
from bench.environment import describe_environment, write_report
from bench.step_kernels import summarize
from nsa_titan.training_faults import OUT_OF_MEMORY_EXIT, TrainingFault

DEFAULT_RECIPES = ["nsa_125m.toml", "dense_125m.toml"]  # the checkout's recipes/


def write_standin_bpe(path: str, vocab_size: int) -> None:
    """A .tiktoken file whose encoding has `vocab_size` ids (<|endoftext|> is the last): the 256
    bytes, then distinct two-byte tokens. Only its size matters; synthetic data encodes no text."""
    if not VOCAB_SIZE_RANGE[0] <= vocab_size <= VOCAB_SIZE_RANGE[1]:
        raise ValueError(f"--vocab-size must be in {list(VOCAB_SIZE_RANGE)}, got {vocab_size}")
    tokens = [bytes([i]) for i in range(256)] + [bytes(divmod(i, 256)) for i in range(vocab_size - 257)]
    with open(path, "w", encoding="ascii") as fh:
        fh.writelines(f"{base64.b64encode(t).decode()} {rank}\n" for rank, t in enumerate(tokens))


def synthetic_run_argv(recipe_path: str, seq_len: int, steps: int, local_batch: int, vocab_size: int, dump: str,
                       extra: list[str], one_document_per_row: bool = False, global_batch: int = 0) -> list[str]:
    """The recipe as a benchmark runs it: synthetic data over a stand-in vocabulary (written into
    dump), one data rank's micro-batches of local_batch rows, global_batch rows a step (default
    local_batch: no accumulation), nothing saved, every step logged.
    one_document_per_row: documents of seq_len - 1 tokens, each with its EOS exactly one row."""
    bpe = os.path.join(dump, "standin.tiktoken")
    write_standin_bpe(bpe, vocab_size)
    rows = [f"--data.synthetic.min_length={seq_len - 1}", f"--data.synthetic.max_length={seq_len - 1}"] \
        if one_document_per_row else []
    return [recipe_path, f"--training.seq_len={seq_len}", f"--model.max_seq_len={max(seq_len, 2048)}",
            f"--training.steps={steps}", f"--training.local_batch_size={local_batch}",
            f"--training.global_batch_size={global_batch or local_batch}", "--data.source=synthetic",
            "--data.tokenizer=tiktoken", f"--data.tiktoken.encoding={bpe}",
            f"--data.synthetic.vocab_size={vocab_size - 1}",
            "--data.num_workers=2", "--checkpoint.enable=false", "--validation.enable=false",
            "--metrics.log_freq=1", "--metrics.enable_tensorboard=false", "--metrics.telemetry_freq=0",
            "--lr_scheduler.warmup_steps=1", f"--job.dump_folder={dump}", *rows, *extra]


# The fields synthetic_run_argv sets, each with the option of this benchmark that sets it ('' for none): an
# override of one would run something other than what the result records.
OWNED_FIELDS = {"training.steps": "--steps", "training.seq_len": "--seq-lens",
                "training.local_batch_size": "--tokens-per-step", "training.global_batch_size": "--tokens-per-step",
                "data.source": "", "data.tokenizer": "", "data.tiktoken.encoding": "--vocab-size",
                "data.synthetic.vocab_size": "--vocab-size", "checkpoint.enable": "", "validation.enable": "",
                "metrics.log_freq": "", "job.dump_folder": "",  # each case trains in a temporary folder
                "profiling.enable": "--profile", "profiling.start_step": "--profile", "profiling.steps": "--profile",
                "profiling.folder": "--profile"}
ROW_FIELDS = {"data.synthetic.min_length": "--documents", "data.synthetic.max_length": "--documents"}


def check_arguments(args) -> str | None:
    """What is wrong with the command line, before any case runs (one line, or the recipe's problems), or None."""
    if args.warmup >= args.steps:
        return (f"--warmup {args.warmup} leaves no step to time out of --steps {args.steps}. Fix: pass --warmup "
                f"below --steps (e.g. --steps {args.warmup + 3}).")
    every = math.lcm(*args.seq_lens)
    for seq_len in args.seq_lens:
        if args.tokens_per_step < seq_len or args.tokens_per_step % seq_len:
            return (f"--tokens-per-step {args.tokens_per_step} is not a whole number of rows of {seq_len} tokens "
                    f"(--seq-lens). Fix: pass a multiple of every length, e.g. --tokens-per-step "
                    f"{every * max(1, args.tokens_per_step // every)}.")
    owned = {**OWNED_FIELDS, **(ROW_FIELDS if args.documents == "row" else {})}
    refused = refuse_overrides(args.override, owned)
    if refused:
        return refused
    with tempfile.TemporaryDirectory() as dump:
        for recipe in args.recipes:
            for seq_len in args.seq_lens:
                rows = args.tokens_per_step // seq_len
                argv = synthetic_run_argv(recipe, seq_len, args.steps, rows, args.vocab_size, dump,
                                          case_overrides(args.override, seq_len),
                                          one_document_per_row=args.documents == "row")
                problems = recipe_problems(argv, training=True)
                if problems:
                    return f"{recipe} at {seq_len} tokens: {problems.removeprefix('error: ')}"
    return None


def case_overrides(overrides: list[str], seq_len: int) -> list[str]:
    extra = list(overrides)
    if seq_len > 8192:
        extra.append("--activation_checkpoint.mode=full")
    return extra


# --profile: after the timed steps, one warmup step of the profiler and one step profiled, both left out of the median.
PROFILE_STEPS = 2
PROFILE_FOLDER = "profile"  # inside the case's temporary dump folder


def profile_overrides(steps: int) -> list[str]:
    """The trainer's [profiling] for the step after the timed ones and the profiler's warmup step."""
    return ["--profiling.enable=true", f"--profiling.start_step={steps + PROFILE_STEPS}", "--profiling.steps=1",
            f"--profiling.folder={PROFILE_FOLDER}"]


def profile_of(trace: str) -> dict:
    """bench.step_kernels' summary of the profiled step, or why there is none (the run ended before it)."""
    if not os.path.exists(trace):
        return {"error": "no trace written: the run ended before its profiled step"}
    return summarize(trace)


def run_case(recipe_path: str, seq_len: int, steps: int, warmup: int, local_batch: int, vocab_size: int,
             extra: list[str], documents: str = "row", global_batch: int = 0, profile: bool = False) -> dict:
    from nsa_titan.config import resolve
    from nsa_titan.runtime import make_runtime
    from nsa_titan.trainer import Trainer

    run_steps = steps + PROFILE_STEPS if profile else steps
    with tempfile.TemporaryDirectory() as dump:
        resolved = resolve(synthetic_run_argv(recipe_path, seq_len, run_steps, local_batch, vocab_size, dump,
                                              [*extra, *(profile_overrides(steps) if profile else [])],
                                              one_document_per_row=documents == "row", global_batch=global_batch),
                           training=True)
        runtime = make_runtime(resolved.recipe.training.device, resolved.recipe.training.dtype)
        if runtime.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        trainer = Trainer(resolved, runtime)
        start = time.perf_counter()
        try:
            trainer.run()
        finally:
            trainer.close()
        wall = time.perf_counter() - start
        with open(os.path.join(dump, "metrics.jsonl"), encoding="utf-8") as fh:
            records = [json.loads(line) for line in fh if '"loss"' in line]
        step_profile = profile_of(os.path.join(dump, PROFILE_FOLDER, "trace_rank0.json.gz")) if profile else None
    timed = [r for r in records if warmup < r["step"] <= steps]
    steady = [r["tokens_per_second"] for r in timed]
    result = {
        "recipe": recipe_path,
        "seq_len": seq_len,
        "documents": "one per row" if documents == "row" else "packed (synthetic 64-1024 tokens)",
        "local_batch_size": local_batch,
        "gradient_accumulation": trainer.grad_accum,
        "steps": steps,
        "warmup_steps_excluded": warmup,
        "tokens_per_second": statistics.median(steady) if steady else None,
        "timed_steps": [r["step"] for r in timed],
        "peak_memory_gib": (torch.cuda.max_memory_allocated() / 2**30) if runtime.device.type == "cuda" else None,
        "wall_seconds": wall,
        "parameters": trainer.num_params,
        "vocab_size": vocab_size,
        "final_loss": next((r["loss"] for r in reversed(records) if r["step"] <= steps), None),
        "overrides": extra,
    }
    if step_profile is not None:
        result["step_profile"] = step_profile
    return result


def release_device_memory() -> None:
    """What a case that ran out of memory left behind (its model, optimizer and activations, held by
    the exception's frames until collected), given back before the next case."""
    torch._dynamo.reset()  # compiled graphs, and with CUDA graphs (reduce-overhead) their memory pool
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_or_record_oom(recipe: str, seq_len: int, args, micro: int, batch: int, extra: list[str]) -> dict:
    """One case, or its out-of-memory error as the case's record."""
    try:
        return run_case(recipe, seq_len, args.steps, args.warmup, micro, args.vocab_size, extra, args.documents,
                        global_batch=batch, profile=args.profile)
    except (torch.OutOfMemoryError, TrainingFault) as exc:
        # The trainer ends a step, or a model build, that runs out of memory with a TrainingFault (the
        # allocator's own error may still escape elsewhere). Either way the case is recorded and the next runs.
        if isinstance(exc, TrainingFault) and exc.exit_code != OUT_OF_MEMORY_EXIT:
            raise
        return {"recipe": recipe, "seq_len": seq_len, "local_batch_size": micro, "error": f"OOM: {exc}"}


def fit_case(recipe: str, seq_len: int, args, batch: int, extra: list[str]) -> dict:
    """The case at `batch` rows a step, its micro-batch halved (to the largest divisor of batch at most
    half of it) after each out-of-memory until it fits or one row does not (--no-fit: the first try only)."""
    micro, did_not_fit = batch, []
    while True:
        result = run_or_record_oom(recipe, seq_len, args, micro, batch, extra)
        if "error" not in result:
            break
        release_device_memory()  # outside the except block, whose exception holds the case's frames
        if args.no_fit or micro == 1:
            break
        did_not_fit.append(micro)
        smaller = max(d for d in range(1, micro // 2 + 1) if batch % d == 0)  # it must divide the step's rows
        print(f"{recipe} at {seq_len} tokens: micro-batch {micro} ran out of memory; trying {smaller}", flush=True)
        micro = smaller
    if did_not_fit:
        result["out_of_memory_micro_batches"] = did_not_fit
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", nargs="+", default=[environment.shipped_recipe(r) for r in DEFAULT_RECIPES])
    parser.add_argument("--seq-lens", nargs="+", type=positive_int, default=[2048, 32768])
    parser.add_argument("--tokens-per-step", type=positive_int, default=65536,
                        help="rows a step = this / seq_len: a multiple of every --seq-lens")
    parser.add_argument("--steps", type=positive_int, default=20)
    parser.add_argument("--warmup", type=non_negative_int, default=5, help="first steps left out of the median "
                                                                          "(below --steps)")
    parser.add_argument("--vocab-size", type=vocab_size_type, default=50257,
                        help=f"stand-in vocabulary size, {VOCAB_SIZE_RANGE[0]} to {VOCAB_SIZE_RANGE[1]} "
                             f"(GPT-2: 50257)")
    parser.add_argument("--documents", choices=("row", "packed"), default="row",
                        help="row: every row one seq_len-token document; packed: short documents, masked apart")
    parser.add_argument("--override", action="append", default=[], help="extra recipe override, repeatable")
    parser.add_argument("--profile", action="store_true",
                        help="profile one step after the timed ones and record where its GPU time goes, by kernel "
                             "and kind (bench.step_kernels)")
    parser.add_argument("--no-fit", action="store_true",
                        help="record an out-of-memory case as it is instead of halving its micro-batch")
    parser.add_argument("--allow-cpu", action="store_true", help="run on the CPU (a smoke test, not a benchmark)")
    parser.add_argument("--out", default=None, help="output JSON path (default bench/results/train_throughput-<device>-"
                                                    "<time>.json)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() and not args.allow_cpu:
        print("error: no CUDA device: this benchmark measures GPU throughput. Fix: run it on a GPU machine "
              "(or pass --allow-cpu for a smoke test).", file=sys.stderr)
        return 2
    problem = check_arguments(args)
    if problem:
        print(problem if problem.startswith("error:") else f"error: {problem}", file=sys.stderr)
        return 2
    results = []
    payload = {"benchmark": "train_throughput", "environment": describe_environment(), "results": results}
    path = args.out or environment.results_path("train_throughput")  # on the module: tests point it elsewhere
    for recipe in args.recipes:
        for seq_len in args.seq_lens:
            result = fit_case(recipe, seq_len, args, args.tokens_per_step // seq_len,
                              case_overrides(args.override, seq_len))
            print(json.dumps(result), flush=True)
            results.append(result)
            write_report(payload, "train_throughput", path)  # after every case: a run cut short keeps what ran
    return 0


if __name__ == "__main__":
    sys.exit(main())
