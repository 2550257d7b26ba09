"""Time the data a recipe trains on in one reader (a loader worker's work, here in this process): tokens a second
from the source's raw text to the batches the trainer gets (reading, tokenizing, packing into rows with their
document starts), and a resume after the timed batches from the loader state a checkpoint saves: the seconds to
its first batch and whether that batch is the one the uninterrupted loader gives. Prints one JSON object.

    python bench/data_throughput.py [RECIPE] [--batches 200] [--override=--data.text_files.paths='["c.jsonl"]']

The recipe's data settings are used as the trainer uses them (source, tokenizer, seq_len, local_batch_size,
logical_shards of data-parallel rank 0 of one), but for data.num_workers: the rate of one reader is timed, which
a rank's workers multiply.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.arguments import positive_int, say_refusal  # noqa: E402
from bench.environment import describe_environment, shipped_recipe, write_report  # noqa: E402


def loader_factory(recipe):
    """A function that builds rank 0's training loader (no worker processes) over one source and tokenizer."""
    from components.data import build_dataloader
    from nsa_titan import assemble

    source, tokenizer = assemble.build_source(recipe), assemble.build_tokenizer(recipe)
    data, training = recipe.data, recipe.training

    def build():
        return build_dataloader(source, tokenizer, seq_len=training.seq_len, batch_size=training.local_batch_size,
                                logical_shards=data.logical_shards, seed=recipe.job.seed, num_workers=0,
                                add_bos=data.add_bos, min_document_tokens=data.min_document_tokens,
                                check_source=False)

    return build, type(source).__name__, tokenizer.name


def same_batch(a: dict, b: dict) -> bool:
    return all(a[key].equal(b[key]) for key in ("input", "target", "document_starts"))


def measure(build, batches: int) -> dict:
    start = time.perf_counter()
    loader = build()
    iterator = iter(loader)
    first = next(iterator)
    first_seconds = time.perf_counter() - start
    start = time.perf_counter()
    tokens = 0
    for _ in range(batches):
        tokens += next(iterator)["input"].numel()
    seconds = time.perf_counter() - start
    state = loader.state_dict()
    expected = next(iterator)
    start = time.perf_counter()
    resumed = build()
    resumed.load_state_dict(state)
    got = next(iter(resumed))
    resume_seconds = time.perf_counter() - start
    return {"rows_per_batch": first["input"].shape[0], "seq_len": first["input"].shape[1],
            "seconds_to_first_batch": round(first_seconds, 3), "batches_timed": batches, "tokens_timed": tokens,
            "tokens_per_second": round(tokens / max(seconds, 1e-9)),
            "resume": {"after_tokens": tokens + first["input"].numel(),
                       "seconds_to_first_batch": round(resume_seconds, 3), "same_batch": same_batch(got, expected)}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", nargs="?", default=shipped_recipe("debug.toml"))
    parser.add_argument("--batches", type=positive_int, default=200, help="batches timed after the first")
    parser.add_argument("--override", action="append", default=[], metavar="--SECTION.FIELD=VALUE",
                        help="a recipe override, as the train command takes it (repeatable)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    from components.errors import UserError
    from nsa_titan.config import RecipeError, resolve

    try:
        resolved = resolve([args.recipe, *args.override])
        for note in resolved.notes:  # what the recipe sets that this run does not use, as training says it
            print(f"note: {note}", file=sys.stderr)
        recipe = resolved.recipe
        build, source, tokenizer = loader_factory(recipe)
        measured = measure(build, args.batches)
    except (RecipeError, UserError) as exc:
        return say_refusal(exc)
    report = {"benchmark": "data_throughput", "environment": describe_environment(), "recipe": args.recipe,
              "overrides": args.override, "source": source, "tokenizer": tokenizer,
              "logical_shards": recipe.data.logical_shards, **measured}
    write_report(report, "data_throughput", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
