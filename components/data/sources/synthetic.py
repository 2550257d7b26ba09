"""Deterministic random token documents: a corpus for speed tests that never touches the disk."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from components.errors import UserError
from components.data.sources.base import order_rng
from components.problems import Problem, problem, raise_problems

# Separate content streams for the two splits: validation documents are drawn from other seeds.
_SPLIT_STREAM = {"train": 0, "validation": 1}


@dataclass
class SyntheticArgs:
    """Random documents of random lengths; document i of a split is a pure function of (seed, i)."""

    num_documents: int = field(default=4096, metadata={"doc": "training documents in the corpus", "ge": 1})
    validation_documents: int = field(
        default=256, metadata={"doc": "validation documents (drawn from a different seed stream)", "ge": 1}
    )
    min_length: int = field(default=64, metadata={"doc": "shortest document, in tokens", "ge": 1})
    max_length: int = field(default=1024, metadata={"doc": "longest document, in tokens", "ge": 1})
    vocab_size: int = field(
        default=256,
        metadata={"doc": "token ids are drawn from [0, vocab_size); keep it below the tokenizer's BOS/EOS", "ge": 1},
    )
    seed: int = field(default=0, metadata={"doc": "seed of the document contents", "ge": 0})

    def check(self) -> list[Problem]:
        if self.min_length > self.max_length:
            return [problem("min_length", self.min_length, f"exceeds max_length ({self.max_length})", "lower it")]
        return []


class SyntheticSource:
    """Document i of a split belongs to logical shard i % num_shards."""

    table = "data.synthetic"  # where a recipe sets the arguments, which the fixes name (a mixture's: its own table)

    def __init__(self, args: SyntheticArgs | None = None):
        self.args = args or SyntheticArgs()

    def check(self) -> None:
        raise_problems("data source synthetic", self.args.check())

    def check_tokenizer(self, tokenizer) -> None:
        limit = min(tokenizer.bos_id, tokenizer.eos_id)
        if self.args.vocab_size > limit:
            raise UserError(
                f"data source synthetic: vocab_size {self.args.vocab_size} reaches the special ids of "
                f"tokenizer {tokenizer.name} (ordinary ids are below {limit}). Fix: set {self.table}.vocab_size "
                f"<= {limit}, or use a tokenizer with a larger vocabulary"
            )

    def fingerprint(self) -> str:
        a = self.args
        return (
            f"synthetic(n={a.num_documents},val={a.validation_documents},len={a.min_length}-{a.max_length},"
            f"vocab={a.vocab_size},seed={a.seed})"
        )

    def document(self, split: str, index: int) -> np.ndarray:
        a = self.args
        rng = order_rng(a.seed, _SPLIT_STREAM[split], index)
        length = int(rng.integers(a.min_length, a.max_length + 1))
        return rng.integers(0, a.vocab_size, size=length, dtype=np.int64)

    def documents(self, shard, num_shards, split, seed, epoch, cursor):
        total = self.args.num_documents if split == "train" else self.args.validation_documents
        members = np.arange(shard, total, num_shards)
        order = members[order_rng(seed, shard, epoch).permutation(len(members))]
        start = 0 if cursor is None else int(cursor)
        for position in range(start, len(order)):
            yield self.document(split, int(order[position])), position + 1


def build_synthetic_source(args: SyntheticArgs) -> SyntheticSource:
    return SyntheticSource(args)
