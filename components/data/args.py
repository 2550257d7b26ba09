"""Recipe arguments of the data loader (the source and tokenizer have their own)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LoaderArgs:
    """How the token stream is cut, sharded and prefetched."""

    logical_shards: int = field(
        default=64,
        metadata={
            "doc": "fixed number of data streams; data-parallel world sizes that divide it can resume each other",
            "ge": 1,
        },
    )
    num_workers: int = field(
        default=2, metadata={"doc": "DataLoader worker processes per rank (tokenize and pack ahead)", "ge": 0}
    )
    prefetch_factor: int = field(default=4, metadata={"doc": "batches each worker prepares ahead", "ge": 1})
    pin_memory: bool = field(default=True, metadata={"doc": "page-lock batches for faster copies (CUDA only)"})
    add_bos: bool = field(default=False, metadata={"doc": "start every document with the tokenizer's BOS token"})
    seed: int = field(default=0, metadata={"doc": "seed of the document order (per shard and epoch)", "ge": 0})
