"""Per-token cost of cached decoding (what `sample` and eval's passkey probe run) by context length, on the CPU.

    python -m bench.decode [RECIPE] [--contexts 64 1000 4000 8000] [--steps 16] [--repeats 5] [--threads 1]
                           [--override=--SECTION.FIELD=VALUE ...] [--out FILE]

The recipe's model (default recipes/debug.toml, max_seq_len raised to hold the longest run), weights drawn from
the recipe's seed, batch 1, fp32. For each context length a cache is filled with that many random tokens in one
forward_step (as generate prefills a prompt), then --steps tokens are decoded one at a time, 1 + --repeats times
(the first a warm-up; each goes on from the last). Per length: the median over the repeats of the per-token thread
CPU time (the least disturbed by other processes on a shared machine) and of the wall time. JSON goes to
bench/results/.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from bench.arguments import positive_int, refuse_overrides
from bench.environment import describe_environment, shipped_recipe, write_report


def build_model(recipe):
    """The recipe's model with its weights drawn from the recipe's seed, on the CPU, and its vocabulary size."""
    from nsa_titan.assemble import build_model_on_meta, build_tokenizer

    vocab = build_tokenizer(recipe).vocab_size
    model = build_model_on_meta(recipe, vocab).to_empty(device="cpu")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe.job.seed)
        model.init_weights()
    return model.eval(), vocab


@torch.no_grad()
def measure(model, vocab: int, context: int, steps: int, repeats: int) -> dict:
    tokens = torch.randint(0, vocab, (1, context + steps * (repeats + 1)), generator=torch.Generator().manual_seed(0))
    cache = model.new_kv_cache(1, capacity=tokens.shape[1])
    model.forward_step(tokens[:, :context], cache)
    cpu, wall = [], []
    position = context
    for _ in range(repeats + 1):
        cpu_start, wall_start = time.thread_time(), time.perf_counter()
        for _ in range(steps):
            model.forward_step(tokens[:, position:position + 1], cache)
            position += 1
        cpu.append((time.thread_time() - cpu_start) / steps * 1e3)
        wall.append((time.perf_counter() - wall_start) / steps * 1e3)
    cpu, wall = cpu[1:], wall[1:]  # the first run warms up
    return {"context": context, "cpu_ms_per_token": statistics.median(cpu),
            "wall_ms_per_token": statistics.median(wall), "cpu_ms_runs": cpu, "wall_ms_runs": wall}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe", nargs="?", default=shipped_recipe("debug.toml"))
    p.add_argument("--contexts", type=positive_int, nargs="+", default=[64, 1000, 4000, 8000])
    p.add_argument("--steps", type=positive_int, default=16, help="tokens decoded per timed run")
    p.add_argument("--repeats", type=positive_int, default=5, help="timed runs per context (after one warm-up)")
    p.add_argument("--threads", type=positive_int, default=1)
    p.add_argument("--override", action="append", default=[], metavar="--SECTION.FIELD=VALUE",
                   help="a recipe override, as the train command takes it (repeatable)")
    p.add_argument("--out", help="output JSON path (default bench/results/decode-cpu-<time>.json)")
    args = p.parse_args(argv)
    refused = refuse_overrides(args.override, {"model.max_seq_len": "--contexts"})
    if refused:
        print(f"error: {refused}", file=sys.stderr)
        return 2

    from components.errors import UserError
    from components.models.generate import check_decodes
    from nsa_titan.config import RecipeError, resolve

    longest = max(args.contexts) + args.steps * (args.repeats + 1)
    torch.set_num_threads(args.threads)
    try:
        recipe = resolve([args.recipe, *args.override]).recipe
        # Never below the recipe's own, which its training.seq_len may need.
        longest = max(longest, getattr(recipe.model.args, "max_seq_len", 0))
        model, vocab = build_model(resolve([args.recipe, *args.override, f"--model.max_seq_len={longest}"]).recipe)
        check_decodes(model)
        results = []
        for context in args.contexts:
            results.append(measure(model, vocab, context, args.steps, args.repeats))
            r = results[-1]
            print(f"context {context:>6}: {r['cpu_ms_per_token']:.2f} ms/token CPU, {r['wall_ms_per_token']:.2f} wall",
                  flush=True)
    except RecipeError as exc:
        print(exc.render(), file=sys.stderr)
        return 2
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    report = {"benchmark": "decode", "environment": describe_environment(), "recipe": args.recipe,
              "overrides": args.override, "vocab_size": vocab, "threads": args.threads, "steps": args.steps,
              "repeats": args.repeats, "results": results}
    write_report(report, "decode", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
