"""Time a huggingface-source resume late in an epoch: opening the stream at its saved state against
replaying it up to a count of documents (the cursor that checkpoints saved before chunks); prints one
JSON object.

    python bench/data_resume.py [--documents 200000] [--row-group 2000] [--at 0.9] [--shards 1]

The corpus is local parquet (written once into --folder), read through datasets' streaming
`parquet` builder, as a Hub dataset's parquet files are. Reported: seconds from the call to the
first document after the cursor, for both kinds of cursor at the same place in the epoch (the count
cursor resumes the old shuffle-buffer order; what is timed is how far each reads before yielding),
and the seconds the stream took to get there from the start.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.arguments import fraction, non_negative_int, positive_int  # noqa: E402
from bench.environment import describe_environment, write_report  # noqa: E402
from components.data.sources import HuggingFaceArgs, HuggingFaceSource  # noqa: E402


def write_corpus(folder: str, documents: int, row_group: int) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = os.path.join(folder, f"corpus-{documents}-{row_group}.parquet")
    if not os.path.exists(path):
        words = ["alpha", "beta", "gamma", "delta", "kappa", "sigma", "omega", "lambda"]
        texts = [f"document {i}: " + " ".join(words[(i * 7 + j) % 8] for j in range(60 + i % 200))
                 for i in range(documents)]
        pq.write_table(pa.table({"text": texts}), path, row_group_size=row_group)
    return path


class ShardTooSmall(Exception):
    """The first logical shard holds no document where the benchmark resumes: a line for the user."""


def first_after(source: HuggingFaceSource, shards: int, cursor) -> tuple[float, str]:
    start = time.perf_counter()
    first = next(iter(source.documents(0, shards, "train", 0, 0, cursor)), None)
    if first is None:
        raise ShardTooSmall(f"logical shard 0 of {shards} holds no document after the cursor. Fix: pass a smaller "
                            f"--at or --shards, or more --documents.")
    return time.perf_counter() - start, first[0]


def library_versions() -> dict:
    """The stream state a cursor saves is datasets' own (over pyarrow's parquet reader): how fast it resumes is
    theirs too."""
    import datasets
    import pyarrow

    return {"datasets": datasets.__version__, "pyarrow": pyarrow.__version__}


def measure(args, hf_args: HuggingFaceArgs) -> dict:
    target = int(args.at * args.documents / args.shards)
    walk_start = time.perf_counter()
    cursor, in_shard = None, 0  # --at 0 resumes at the start: no state, a count of 0
    if target:
        stream = HuggingFaceSource(hf_args).documents(0, args.shards, "train", 0, 0, None)
        for in_shard, (_, cursor) in enumerate(stream, start=1):
            if in_shard == target:
                break
        else:
            raise ShardTooSmall(f"logical shard 0 of {args.shards} holds {in_shard} documents, fewer than the "
                                f"{target} to resume after (--at {args.at} of --documents {args.documents} / "
                                f"--shards {args.shards}). Fix: pass fewer --shards or a smaller --at.")
    walk_seconds = time.perf_counter() - walk_start
    state_seconds, _ = first_after(HuggingFaceSource(hf_args), args.shards, cursor)
    replay_seconds, _ = first_after(HuggingFaceSource(hf_args), args.shards, in_shard)
    return {"resumed_after_documents": in_shard, "seconds_to_reach_cursor_from_start": round(walk_seconds, 3),
            "seconds_to_first_document": {"stream_state_cursor": round(state_seconds, 3),
                                          "count_cursor_replay": round(replay_seconds, 3)}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=positive_int, default=200_000)
    parser.add_argument("--row-group", type=positive_int, default=2000)
    parser.add_argument("--at", type=fraction, default=0.9, help="where in the shard's epoch to resume, in [0, 1)")
    parser.add_argument("--shards", type=positive_int, default=1, help="logical shards (the first one is read)")
    parser.add_argument("--shuffle-buffer", type=non_negative_int, default=512)
    parser.add_argument("--folder", default=os.path.join(tempfile.gettempdir(), "nsa_titan_bench_data_resume"))
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.shards > args.documents:
        parser.error(f"--shards {args.shards} is more than --documents {args.documents}: the first logical shard, "
                     f"the one read, would hold no document. Pass at most {args.documents} shards.")

    os.makedirs(args.folder, exist_ok=True)
    path = write_corpus(args.folder, args.documents, args.row_group)
    hf_args = HuggingFaceArgs(path="parquet", name="", data_files=[path], validation_fraction=0.0,
                              shuffle_buffer=args.shuffle_buffer)
    try:
        measured = measure(args, hf_args)
    except ShardTooSmall as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    report = {
        "benchmark": "data_resume", "environment": {**describe_environment(), **library_versions()},
        "documents": args.documents, "row_group": args.row_group, "shards": args.shards,
        "shuffle_buffer": args.shuffle_buffer, **measured,
    }
    write_report(report, "data_resume", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
