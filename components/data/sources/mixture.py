"""A weighted mixture of document sources, e.g. web text with code.

Each logical shard of the mixture is the same logical shard of every source, interleaved: the k-th
document of a shard comes from source i with probability weight_i / sum(weights), drawn from a
stable hash of (seed, shard, epoch, k), so the choice needs no state beyond k. The proportions hold
by documents (not tokens). A source that runs out of documents starts its next epoch on its own (a
small source is repeated, a large one is not exhausted); one whose shard holds no documents at all
drops out of that shard. The mixture's cursor is k and every source's (epoch, cursor): a resumed run
continues each source where it stopped. Weights are not part of the stream's identity, so they may
change on resume: the new weights apply from the next document on.

The sources are built by a `build_source(name, args)` the engine provides (so plugin sources mix too).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from components.data.sources.base import digest, unit_hash
from components.problems import Problem, problem, raise_problems

MIXTURE = "mixture"


@dataclass
class MixtureEntry:
    """One source of a mixture: its weight, its registered name and that source's own arguments."""

    weight: float = field(metadata={"doc": "relative share of the mixture's documents", "gt": 0.0})
    source: str = field(metadata={"doc": "registered document source", "component": "data_source",
                                  "exclude": {MIXTURE: "a mixture cannot hold a mixture: list the inner one's "
                                                       "sources here, with their weights multiplied"}})
    args: Any = field(default=None, metadata={"doc": "the chosen source's arguments, beside weight and source",
                                              "args_for": "source", "placement": "inline"})


@dataclass
class MixtureArgs:
    """Named sources, each in its own table: [data.mixture.sources.NAME] with weight, source and the
    source's arguments."""

    sources: dict[str, MixtureEntry] = field(
        default_factory=dict,
        metadata={"doc": "the mixed sources by name, e.g. [data.mixture.sources.web] weight = 0.7, "
                         "source = \"text_files\", paths = [...]"},
    )

    def check(self) -> list[Problem]:
        found = []
        if len(self.sources) < 2:
            found.append(problem("sources", sorted(self.sources), "a mixture needs at least two sources",
                                 "add tables [data.mixture.sources.NAME] with weight and source, or choose "
                                 "the one source as data.source"))
        for name, entry in self.sources.items():
            if entry.source == MIXTURE:
                found.append(problem(f"sources.{name}.source", MIXTURE, "a mixture cannot hold a mixture",
                                     "list the inner mixture's sources here, with their weights multiplied"))
        return found


class MixtureSource:
    def __init__(self, names: list[str], weights: list[float], sources: list):
        self.names, self.weights, self.sources = names, weights, sources

    def check(self) -> None:
        for source in self.sources:
            check = getattr(source, "check", None)
            if callable(check):
                check()

    def check_tokenizer(self, tokenizer) -> None:
        for source in self.sources:
            check = getattr(source, "check_tokenizer", None)
            if callable(check):
                check(tokenizer)

    def _has(self, i: int, split: str) -> bool:
        has_split = getattr(self.sources[i], "has_split", None)
        return has_split(split) if callable(has_split) else True

    def has_split(self, split: str) -> bool:
        return any(self._has(i, split) for i in range(len(self.sources)))

    def fingerprint(self) -> str:
        parts = ",".join(f"{n}={s.fingerprint()}" for n, s in zip(self.names, self.sources))
        return f"mixture({digest(parts)}:{','.join(self.names)})"

    def documents(self, shard: int, num_shards: int, split: str, seed: int, epoch: int,
                  cursor: Any) -> Iterator[tuple[Any, Any]]:
        # cursor: [k, [[epoch, cursor, alive] per source]]
        k, states = cursor if cursor is not None else (0, [[0, None, self._has(i, split)]
                                                          for i in range(len(self.sources))])
        states = [list(s) for s in states]
        readers: dict[int, Iterator] = {}
        while True:
            alive = [i for i, s in enumerate(states) if s[2]]
            if not alive:
                return
            i = self._choose(alive, unit_hash(f"mixture/{seed}/{shard}/{epoch}/{k}"))
            state = states[i]
            if i not in readers:
                readers[i] = iter(self.sources[i].documents(shard, num_shards, split, seed, state[0], state[1]))
            item = next(readers[i], None)
            if item is None:
                del readers[i]
                if state[1] is None:  # a whole epoch without one document: this shard of it is empty
                    state[2] = False
                else:
                    state[0], state[1] = state[0] + 1, None
                continue  # the same k draws again among the sources left
            document, state[1] = item
            k += 1
            yield document, [k, [list(s) for s in states]]

    def _choose(self, alive: list[int], u: float) -> int:
        total = sum(self.weights[i] for i in alive)
        edge = 0.0
        for i in alive:
            edge += self.weights[i] / total
            if u < edge:
                return i
        return alive[-1]  # u within rounding of 1


def build_mixture_source(args: MixtureArgs, build_source: Callable[[str, Any], Any]) -> MixtureSource:
    raise_problems("data source mixture", args.check())
    names = list(args.sources)
    entries = [args.sources[n] for n in names]
    return MixtureSource(names, [e.weight for e in entries], [build_source(e.source, e.args) for e in entries])
