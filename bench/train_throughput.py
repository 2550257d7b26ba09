"""End-to-end training throughput: tokens/s and peak memory of recipes, side by side.

    python -m bench.train_throughput                       # nsa_125m vs dense_125m at seq 2k and 32k
    python -m bench.train_throughput --recipes recipes/nsa_125m.toml --seq-lens 2048 --steps 30

Each case trains on the synthetic source (so data never limits the speed) with the recipe's own
model, precision and compile settings, one process, checkpoints and validation off. The result is
the median tokens/s over the steps after warmup (compilation and autotuning excluded), written as
JSON into bench/results/ with the GPU, library versions and the commit.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

from bench.environment import describe_environment, results_path

DEFAULT_RECIPES = ["recipes/nsa_125m.toml", "recipes/dense_125m.toml"]


def run_case(recipe_path: str, seq_len: int, steps: int, warmup: int, local_batch: int, extra: list[str]) -> dict:
    from nsa_titan.config import resolve
    from nsa_titan.runtime import make_runtime
    from nsa_titan.trainer import Trainer

    with tempfile.TemporaryDirectory() as dump:
        argv = [recipe_path, f"--training.seq_len={seq_len}", f"--model.max_seq_len={max(seq_len, 2048)}",
                f"--training.steps={steps}", f"--training.local_batch_size={local_batch}",
                f"--training.global_batch_size={local_batch}", "--data.source=synthetic", "--data.tokenizer=byte",
                "--data.num_workers=2", "--checkpoint.enable=false", "--validation.enable=false",
                "--metrics.log_freq=1", "--metrics.enable_tensorboard=false", "--metrics.telemetry_freq=0",
                "--lr_scheduler.warmup_steps=1", f"--job.dump_folder={dump}", *extra]
        resolved = resolve(argv)
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
    steady = [r["tokens_per_second"] for r in records if r["step"] > warmup]
    return {
        "recipe": recipe_path,
        "seq_len": seq_len,
        "local_batch_size": local_batch,
        "steps": steps,
        "warmup_steps_excluded": warmup,
        "tokens_per_second": statistics.median(steady) if steady else None,
        "peak_memory_gib": (torch.cuda.max_memory_allocated() / 2**30) if runtime.device.type == "cuda" else None,
        "wall_seconds": wall,
        "parameters": trainer.num_params,
        "final_loss": records[-1]["loss"] if records else None,
        "overrides": extra,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", nargs="+", default=DEFAULT_RECIPES)
    parser.add_argument("--seq-lens", nargs="+", type=int, default=[2048, 32768])
    parser.add_argument("--tokens-per-step", type=int, default=65536, help="local batch = this / seq_len (>= 1)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--override", action="append", default=[], help="extra recipe override, repeatable")
    parser.add_argument("--allow-cpu", action="store_true", help="run on the CPU (a smoke test, not a benchmark)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() and not args.allow_cpu:
        print("error: no CUDA device: this benchmark measures GPU throughput. Fix: run it on a GPU machine "
              "(or pass --allow-cpu for a smoke test).", file=sys.stderr)
        return 2
    results = []
    for recipe in args.recipes:
        for seq_len in args.seq_lens:
            batch = max(1, args.tokens_per_step // seq_len)
            extra = list(args.override)
            if seq_len > 8192:
                extra.append("--activation_checkpoint.mode=full")
            try:
                result = run_case(recipe, seq_len, args.steps, args.warmup, batch, extra)
            except torch.OutOfMemoryError as exc:
                result = {"recipe": recipe, "seq_len": seq_len, "local_batch_size": batch, "error": f"OOM: {exc}"}
            print(json.dumps(result), flush=True)
            results.append(result)
    payload = {"benchmark": "train_throughput", "environment": describe_environment(), "results": results}
    path = results_path("train_throughput")
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(payload, fh, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
