"""Per-token cost of cached decoding (what `sample` and eval's passkey probe run) by context length, on the CPU.

    python -m bench.decode [RECIPE] [--contexts 64 1000 4000 8000] [--steps 16] [--repeats 5] [--threads 1]
                           [--hf] [--override=--SECTION.FIELD=VALUE ...] [--out FILE]

The recipe's model (default recipes/debug.toml, max_seq_len raised to hold the longest run), weights drawn from
the recipe's seed, batch 1, fp32. For each context length a cache is filled with that many random tokens in one
forward_step (as generate prefills a prompt), then --steps tokens are decoded one at a time, 1 + --repeats times
(the first a warm-up; each goes on from the last). Per length: the median over the repeats of the per-token thread
CPU time (the least disturbed by other processes on a shared machine) and of the wall time. With --hf, the same
model and weights as an `export --format hf` folder runs them: the model part's modeling file through transformers,
prefilled and stepped with its own cache as generate() calls it. Per length also the bytes the cache's tensors
take once the last token is in (`cache_mib`): what a longer context costs in memory. JSON goes to bench/results/.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from bench.arguments import positive_int, refuse_overrides, say_refusal
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


def package_decoder(model):
    """(prefill, step, held) of cached decoding as sample runs it: prefill(tokens, capacity) fills a new cache of room
    for `capacity` tokens, step(token) goes on, held() is the bytes its tensors take."""
    cache = []

    def prefill(tokens, capacity: int):
        cache[:] = [model.new_kv_cache(1, capacity=capacity)]
        model.forward_step(tokens, cache[0])

    return prefill, lambda token: model.forward_step(token, cache[0]), lambda: cache[0].nbytes()


def hf_decoder(recipe, model, vocab: int):
    """(prefill, step, held) of the model as its `export --format hf` folder computes it, with the same weights: the
    part's modeling file through transformers, forwards with its cache as generate() makes them."""
    import importlib.util

    from components.errors import UserError
    from nsa_titan import registry

    part = registry.get("model", recipe.model.name)
    if part.hf_format is None:
        raise UserError(f"model {recipe.model.name!r} has no Hugging Face form (no hf_format hook): run without --hf")
    fmt = part.hf_format(recipe.model.args, vocab)
    spec = importlib.util.spec_from_file_location("bench_decode_modeling", fmt.modeling_file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config_class, model_class = (getattr(module, fmt.auto_map[name].rsplit(".", 1)[1])
                                 for name in ("AutoConfig", "AutoModelForCausalLM"))
    hf = model_class(config_class(**fmt.config)).eval()
    missing, unexpected = hf.load_state_dict(fmt.to_hf(model.state_dict()), strict=False)
    unloaded = set(missing) & {name for name, _ in hf.named_parameters()}
    if unexpected or unloaded:
        raise RuntimeError(f"the modeling file's model does not take these weights: {sorted(unexpected)}, "
                           f"{sorted(unloaded)} unloaded")
    cache = []

    def forward(tokens):
        out = hf(input_ids=tokens, past_key_values=cache[0] if cache else None, use_cache=True)
        cache[:] = [out[1]]  # the output's cache, whatever this transformers names its field

    def prefill(tokens, capacity: int):  # the modeling file's cache makes its own room
        cache.clear()
        forward(tokens)

    def held() -> int:  # every layer's buffers (one cache: the batch of one row has no per-row caches)
        return sum(x.numel() * x.element_size() for layer in cache[0].layers for x in layer.buffers.values())

    return prefill, forward, held


@torch.no_grad()
def measure(decoder, vocab: int, context: int, steps: int, repeats: int) -> dict:
    prefill, step, held = decoder
    tokens = torch.randint(0, vocab, (1, context + steps * (repeats + 1)), generator=torch.Generator().manual_seed(0))
    prefill(tokens[:, :context], tokens.shape[1])
    cpu, wall = [], []
    position = context
    for _ in range(repeats + 1):
        cpu_start, wall_start = time.thread_time(), time.perf_counter()
        for _ in range(steps):
            step(tokens[:, position:position + 1])
            position += 1
        cpu.append((time.thread_time() - cpu_start) / steps * 1e3)
        wall.append((time.perf_counter() - wall_start) / steps * 1e3)
    cpu, wall = cpu[1:], wall[1:]  # the first run warms up
    return {"context": context, "cache_mib": held() / 2**20, "cpu_ms_per_token": statistics.median(cpu),
            "wall_ms_per_token": statistics.median(wall), "cpu_ms_runs": cpu, "wall_ms_runs": wall}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe", nargs="?", default=shipped_recipe("debug.toml"))
    p.add_argument("--contexts", type=positive_int, nargs="+", default=[64, 1000, 4000, 8000])
    p.add_argument("--steps", type=positive_int, default=16, help="tokens decoded per timed run")
    p.add_argument("--repeats", type=positive_int, default=5, help="timed runs per context (after one warm-up)")
    p.add_argument("--threads", type=positive_int, default=1)
    p.add_argument("--hf", action="store_true", help="time the model as an export --format hf folder runs it")
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
        recipe = resolve([args.recipe, *args.override, f"--model.max_seq_len={longest}"]).recipe
        model, vocab = build_model(recipe)
        check_decodes(model)
        decoder = hf_decoder(recipe, model, vocab) if args.hf else package_decoder(model)
        results = []
        for context in args.contexts:
            results.append(measure(decoder, vocab, context, args.steps, args.repeats))
            r = results[-1]
            print(f"context {context:>6}: {r['cpu_ms_per_token']:.2f} ms/token CPU, {r['wall_ms_per_token']:.2f} wall, "
                  f"cache {r['cache_mib']:.1f} MiB", flush=True)
    except (RecipeError, UserError) as exc:
        return say_refusal(exc)
    report = {"benchmark": "decode", "environment": describe_environment(), "recipe": args.recipe,
              "overrides": args.override, "form": "hf" if args.hf else "package", "vocab_size": vocab,
              "threads": args.threads, "steps": args.steps, "repeats": args.repeats, "results": results}
    write_report(report, "decode", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
