"""Who owns which logical shard, and loader state as one entry per logical shard.

The corpus is split into `logical_shards` (S) streams, fixed for the life of a run. Data-parallel
rank r of world size W (W divides S) owns shards r, r + W, r + 2W, ...; DataLoader worker k of n
owns the rank's shards k, k + n, ... (in that list). A worker interleaves its shards one window at
a time: the next window comes from the live shard in the earliest epoch (a shard that has given all
its documents waits for the others), then with the fewest windows emitted in that epoch, ties going
to the lowest shard id. With equal counts that is plain round robin in ascending shard order, and
since it depends only on per-shard positions, it is also the rule after resharding: a rank built
from a merged per-shard state first serves the shards that are behind, then round robin.

Per-shard state (see packing.ShardPacker) is a stream position that any rank can pick up, so a
checkpoint taken at world size W can be redistributed to another world size W' (W' divides S):
gather `loader_state_by_logical_shard(state)` from every rank, `merge_shard_states(...)`, and pass
the result as `shard_states` to build_dataloader for each new rank.
"""

from __future__ import annotations

from typing import Any

from components.errors import UserError

# Key under which the dataset's state sits in each DataLoader worker snapshot.
_DATASET_STATE = "dataset_state"


def validate_layout(dp_rank: int, dp_world_size: int, logical_shards: int, num_workers: int) -> None:
    if logical_shards < 1:
        raise UserError(f"logical_shards must be >= 1 (got {logical_shards}); 64 suits most runs")
    if dp_world_size < 1 or not 0 <= dp_rank < dp_world_size:
        raise UserError(
            f"data-parallel rank {dp_rank} is outside world size {dp_world_size}; pass 0 <= dp_rank < dp_world_size"
        )
    if logical_shards % dp_world_size:
        divisors = [d for d in range(1, logical_shards + 1) if logical_shards % d == 0]
        raise UserError(
            f"data-parallel world size {dp_world_size} does not divide logical_shards={logical_shards}, so ranks "
            f"would own unequal data; use a world size in {divisors} or set logical_shards to a multiple of "
            f"{dp_world_size} (it must stay fixed for a run to be resumed)"
        )
    per_rank = logical_shards // dp_world_size
    if num_workers > per_rank:
        raise UserError(
            f"num_workers={num_workers} exceeds the {per_rank} logical shards each rank owns "
            f"(logical_shards={logical_shards} / world size {dp_world_size}); set num_workers <= {per_rank}"
        )


def shards_of_rank(dp_rank: int, dp_world_size: int, logical_shards: int) -> list[int]:
    return list(range(dp_rank, logical_shards, dp_world_size))


def shards_of_worker(rank_shards: list[int], worker_id: int, num_workers: int) -> list[int]:
    return rank_shards[worker_id::num_workers]


def next_shard(positions: dict[int, tuple[int, int]]) -> int:
    """The interleave rule over {shard: (epoch, windows emitted in that epoch)}: the earliest epoch first (a
    shard that finished its epoch waits for the others), then the fewest windows, then the lowest shard id."""
    return min(positions, key=lambda s: (positions[s], s))


def _dataset_states(loader_state: dict) -> list[dict]:
    if "_snapshot" in loader_state:  # DataLoader with worker processes
        if loader_state.get("_steps_since_snapshot", 0):
            raise UserError(
                "the loader state was taken between snapshots (snapshot_every_n_steps > 1); build the loader "
                "with build_dataloader, which snapshots every step"
            )
        workers = loader_state["_snapshot"]["_worker_snapshots"]
        return [w[_DATASET_STATE] for w in workers.values() if w and w.get(_DATASET_STATE)]
    if loader_state.get(_DATASET_STATE):
        return [loader_state[_DATASET_STATE]]
    if "shards" in loader_state:  # a dataset state given directly
        return [loader_state]
    raise UserError(
        "this is not a state of a loader made by build_dataloader (no dataset state in it); pass "
        "StatefulDataLoader.state_dict() of such a loader"
    )


def loader_state_by_logical_shard(loader_state: dict) -> dict[int, dict]:
    """{logical shard id: its stream state} from a StatefulDataLoader.state_dict() of one rank."""
    out: dict[int, dict] = {}
    for ds in _dataset_states(loader_state):
        for key, shard_state in ds["shards"].items():
            out[int(key)] = {**shard_state, "stream": ds["stream"]}
    return out


def merge_shard_states(*per_rank: dict[int, Any]) -> dict[int, dict]:
    """One mapping from the per-shard states of several ranks; a shard given twice is an error."""
    merged: dict[int, dict] = {}
    for mapping in per_rank:
        for shard, state in mapping.items():
            if int(shard) in merged:
                raise UserError(
                    f"logical shard {shard} appears in the data state of two ranks; merge the states of one "
                    "checkpoint only"
                )
            merged[int(shard)] = state
    return merged
