"""One sequence over several ranks (context parallelism): which tokens a rank holds, and the
differentiable all-gather that gives every rank the whole sequence.

Each row of T tokens is cut into 2 * size equal chunks; rank r holds chunks r and 2 * size - 1 - r
(the head-tail split). Causal attention costs more per query the later the query, roughly linearly
for NSA's compressed branch and for dense attention; pairing an early chunk with a late one gives
every rank the same total (bench/context_parallel.py measures it). A rank's local row is its two
chunks one after the other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class SequenceShard:
    group: dist.ProcessGroup | None  # the ranks sharing the sequences (None: one process, tests)
    rank: int  # this rank's place in the group
    size: int  # ranks in the group
    seq_len: int  # T, the full rows' length

    def __post_init__(self):
        if self.seq_len % (2 * self.size):
            raise ValueError(f"a row of {self.seq_len} tokens cannot be cut into 2 x {self.size} equal chunks")

    @property
    def chunk_len(self) -> int:
        return self.seq_len // (2 * self.size)

    @property
    def local_len(self) -> int:
        return 2 * self.chunk_len

    def chunks(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """[start, end) of this rank's two chunks in a row, in local order."""
        c, r = self.chunk_len, self.rank
        late = 2 * self.size - 1 - r
        return (r * c, (r + 1) * c), (late * c, (late + 1) * c)

    def positions(self) -> torch.Tensor:
        """int64 [local_len]: the row position of each local token."""
        return torch.cat([torch.arange(a, b) for a, b in self.chunks()])

    def split(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of x [B, T, ...] along dim 1: [B, local_len, ...]."""
        if x.shape[1] != self.seq_len:
            raise ValueError(f"rows of {x.shape[1]} tokens, but the shard is for {self.seq_len}")
        (a0, a1), (b0, b1) = self.chunks()
        return torch.cat([x[:, a0:a1], x[:, b0:b1]], dim=1)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """The whole rows [B, T, ...] in row order from every rank's x [B, local_len, ...]. Differentiable:
        backward reduce-scatters (sums) the gradient, so each rank gets what every rank's loss owes its
        tokens."""
        if self.size == 1:
            return x
        from torch.distributed._functional_collectives import all_gather_single_autograd

        pieces = all_gather_single_autograd(x.contiguous(), 0, self.group).chunk(self.size, dim=0)
        c = self.chunk_len
        early = [p[:, :c] for p in pieces]
        late = [p[:, c:] for p in reversed(pieces)]
        return torch.cat(early + late, dim=1)
