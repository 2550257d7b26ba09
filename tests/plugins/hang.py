"""A data source that blocks forever after a set number of batches: a hung rank, for the watchdog.

Load it and name it in a recipe (one micro-batch per step, num_workers = 0):

    --job.plugins=tests.plugins.hang --data.source=hang_after
    --data.hang_after.after_batches=3 --data.hang_after.batch_size=<training.local_batch_size>
    --data.hang_after.seq_len=<training.seq_len>

Steps 1..after_batches train; reading the next batch never returns, so step after_batches + 1
hangs inside the data loader (the stack shows `_blocked_forever`). Every document is synthetic
and exactly seq_len tokens long with its EOS, so window k of a logical shard needs that shard's
document k + 1: each document after a shard's first starts one window, and the source counts
those per process. The count restarts with the process (so a resumed run trains after_batches
more batches), and with data.num_workers > 0 every worker counts its own shards.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

from components.data.sources.synthetic import SyntheticArgs, SyntheticSource
from nsa_titan.registry import register


@dataclass
class HangAfterArgs:
    after_batches: int = field(default=3, metadata={"doc": "batches delivered before the source blocks", "ge": 0})
    batch_size: int = field(default=8, metadata={"doc": "samples per batch (training.local_batch_size)", "ge": 1})
    seq_len: int = field(default=256, metadata={"doc": "tokens per sample (training.seq_len)", "ge": 2})
    vocab_size: int = field(default=256, metadata={"doc": "token ids drawn from [0, vocab_size)", "ge": 1})


def _blocked_forever(batches: int) -> None:
    print(f"hang_after: blocking the data source after {batches} batch(es)", file=sys.stderr, flush=True)
    while True:
        time.sleep(3600)


class HangAfterSource:
    def __init__(self, args: HangAfterArgs):
        self.args = args
        length = args.seq_len - 1  # + EOS = seq_len tokens: one window per document
        self.inner = SyntheticSource(SyntheticArgs(min_length=length, max_length=length, vocab_size=args.vocab_size))
        self._documents_per_shard: dict[int, int] = {}
        self._windows_started = 0

    def check(self) -> None:
        self.inner.check()

    def check_tokenizer(self, tokenizer) -> None:
        self.inner.check_tokenizer(tokenizer)

    def fingerprint(self) -> str:
        return f"hang_after({self.args.after_batches})/{self.inner.fingerprint()}"

    def documents(self, shard, num_shards, split, seed, epoch, cursor):
        for item in self.inner.documents(shard, num_shards, split, seed, epoch, cursor):
            if split == "train":
                seen = self._documents_per_shard.get(shard, 0)
                if seen >= 1:
                    if self._windows_started >= self.args.after_batches * self.args.batch_size:
                        _blocked_forever(self.args.after_batches)
                    self._windows_started += 1
                self._documents_per_shard[shard] = seen + 1
            yield item


register("data_source", "hang_after", HangAfterSource, args=HangAfterArgs, replace=True,
         doc="test only: synthetic documents, then blocks forever after N batches")
