"""A weighted mixture of document sources, e.g. web text with code.

Each logical shard of the mixture is the same logical shard of every source, interleaved. The
weights share out either
  - tokens (by = "tokens"): the next document comes from the source whose tokens so far, over its
    weight, are the fewest, so each source's share of the tokens stays within one document of its
    weight's share (ties go to the names in turn from shard s's s-th name, so that the shards do not
    all open with one source: with long documents that was the first batches of a run); or
  - documents (by = "documents"): the k-th document comes from source i with probability
    weight_i / sum(weights), drawn from a stable hash of (seed, shard, epoch, k).
Both count the documents the loader keeps: one it skips (data.min_document_tokens) is replaced by
the next one of the same source. A source that runs out starts its next epoch on its own (a small
source repeats, a large one is not exhausted); one whose shard keeps no document in a whole epoch
drops out of that shard. Validation mixes the sources that hold a validation split.

The cursor holds k, every source's (epoch, cursor) and token count, the weights and `by`: a resumed
run continues each source where it stopped. Weights and `by` are not part of the stream's identity,
so they may change on resume. The first document a resumed stream reads is the one the loader was in
the middle of (it saves the position before that document), so the cursor's own weights and rule
choose it again; the new ones apply from the document after it, and the token shares count afresh
from the resume. Sources are ordered by name, not by the recipe's tables.

The sources are built by a `build_source(name, args)` the engine provides (so plugin sources mix too).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from components.errors import UserError
from components.data.sources.base import digest, unit_hash
from components.problems import Problem, problem, raise_problems

MIXTURE = "mixture"


@dataclass
class MixtureEntry:
    """One source of a mixture: its weight, its registered name and that source's own arguments."""

    weight: float = field(metadata={"doc": "relative share of the mixture: of its tokens or its documents, as "
                                           "data.mixture.by says", "gt": 0.0})
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
    by: str = field(default="tokens", metadata={
        "doc": "what the weights share out: tokens (the next document comes from the source furthest below "
               "its share of the tokens so far) or documents (drawn at random by weight)",
        "choices": ("tokens", "documents")})

    def check(self) -> list[Problem]:
        if len(self.sources) < 2:
            return [problem("sources", sorted(self.sources), "a mixture needs at least two sources",
                            "add tables [data.mixture.sources.NAME] with weight and source, or choose the one "
                            "source as data.source")]
        return []


class MixtureSource:
    prepares_documents = True  # documents() takes the loader's `prepare`: the weights count kept documents

    def __init__(self, names: list[str], weights: list[float], sources: list, by: str = "tokens"):
        self.names, self.weights, self.sources, self.by = names, weights, sources, by

    def check(self) -> None:
        for name, source in zip(self.names, self.sources):
            check = getattr(source, "check", None)
            if callable(check):
                try:
                    check()
                except UserError as exc:  # which of the mixture's sources, when several are of one kind
                    raise UserError(f"mixture source {name!r} ([data.mixture.sources.{name}]): {exc}") from None

    def scan(self) -> str:
        found = [f"{name}: {source.scan()}" for name, source in zip(self.names, self.sources)
                 if callable(getattr(source, "scan", None))]
        return "; ".join(found)

    def shard_notes(self, num_shards: int) -> list[str]:
        return [f"mixture source {name!r}: {note}" for name, source in zip(self.names, self.sources)
                if callable(getattr(source, "shard_notes", None)) for note in source.shard_notes(num_shards)
                ] + self._shard_reach_notes(num_shards)

    def _shard_reach_notes(self, num_shards: int) -> list[str]:
        """A source whose training documents lie in only some of the logical shards (fewer files or rows than
        shards) is missing from the others' mix, so it gets only that part of its weight's share: said, from
        the sources that know their shards' sizes without reading them."""
        notes = []
        for name, source in zip(self.names, self.sources):
            sizes = source.shard_sizes(num_shards) if callable(getattr(source, "shard_sizes", None)) else None
            reached = sum(1 for size in sizes or () if size > 0)
            if sizes and 0 < reached < num_shards:
                notes.append(f"mixture source {name!r} holds training documents in {reached} of the {num_shards} "
                             f"logical shards (data.logical_shards), and the other shards mix without it: it gets "
                             f"about {reached}/{num_shards} of its weight's share. Fix: fewer logical shards (at most "
                             f"{reached}, a multiple of the data-parallel size), or its documents in more files or "
                             f"lines (parquet: smaller row groups)")
        return notes

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

    def files_fingerprint(self) -> str | None:
        """The sources' own files fingerprints, by name; None when none has one."""
        parts = [(n, s.files_fingerprint()) for n, s in zip(self.names, self.sources)
                 if callable(getattr(s, "files_fingerprint", None))]
        named = ",".join(f"{n}={f}" for n, f in parts if f)
        return digest(named) if named else None

    def start_cursor(self, shard: int, split: str) -> list:
        """The cursor before a shard's first document, which None stands for, with the rule written in: the
        loader starts from it, so that a save in the middle of the first document keeps the rule that chose
        it (as every later cursor does)."""
        return [0, [[0, None, self._has(i, split), False, 0] for i in range(len(self.sources))], list(self.weights),
                self.by]

    def documents(self, shard: int, num_shards: int, split: str, seed: int, epoch: int, cursor: Any,
                  prepare: Callable[[Any], Any] = lambda document: document) -> Iterator[tuple[Any, Any]]:
        """The shard's mixed stream: prepare(document) of each source document, skipping those it
        returns None for (the loader's tokenization and length filter), so the weights hold for the
        documents kept and a source whose shard keeps none drops out of it."""
        # cursor: [k, per source [epoch, cursor, alive, kept a document this epoch, tokens kept], weights,
        # by] (cursors saved before `by` was kept have three parts: their rule is taken as unchanged)
        k, states, weights, *saved_by = cursor if cursor is not None else self.start_cursor(shard, split)
        states = [list(s) for s in states]
        rule = (list(weights), saved_by[0] if saved_by else self.by)
        # A changed rule still chooses the document the loader was in the middle of, as it did before.
        changed = rule != (list(self.weights), self.by)
        readers: dict[int, Iterator] = {}
        while True:
            alive = [i for i, s in enumerate(states) if s[2]]
            if not alive:
                return
            # Until a document is kept, the choice is the same: a skipped document is replaced by the
            # next one of the same source.
            rule_weights, rule_by = rule
            if rule_by == "tokens":
                n = len(states)
                i = min(alive, key=lambda j: (states[j][4] / rule_weights[j], (j - shard) % n))
            else:
                i = self._choose(alive, rule_weights, unit_hash(f"mixture/{seed}/{shard}/{epoch}/{k}"))
            state = states[i]
            if i not in readers:
                readers[i] = iter(self.sources[i].documents(shard, num_shards, split, seed, state[0], state[1]))
            item = next(readers[i], None)
            if item is None:
                del readers[i]
                if state[3]:  # the epoch kept a document: on to the next
                    state[0], state[1], state[3] = state[0] + 1, None, False
                else:  # a whole epoch without one kept document: this shard of the source holds none
                    state[2] = False
                continue
            document, state[1] = item
            del item
            prepared = prepare(document)
            del document  # the text is not kept beside its tokens while the loader draws their windows
            if prepared is None:
                continue
            if changed:  # the new rule from here on; its token shares count from the resume
                rule, changed = (list(self.weights), self.by), False
                for other in states:
                    other[4] = 0
            state[3] = True
            state[4] += len(prepared)
            k += 1
            yield prepared, [k, [list(s) for s in states], list(self.weights), self.by]

    @staticmethod
    def _choose(alive: list[int], weights: list[float], u: float) -> int:
        total = sum(weights[i] for i in alive)
        edge = 0.0
        for i in alive:
            edge += weights[i] / total
            if u < edge:
                return i
        return alive[-1]  # u within rounding of 1


def build_mixture_source(args: MixtureArgs, build_source: Callable[[str, Any], Any]) -> MixtureSource:
    raise_problems("data source mixture", args.check())
    names = sorted(args.sources)  # the tables' order (which extends may change) is not the stream's
    entries = [args.sources[n] for n in names]
    sources = [build_source(e.source, e.args) for e in entries]
    for name, source in zip(names, sources):
        if hasattr(source, "table"):  # its fixes name its fields where this recipe sets them
            source.table = f"data.mixture.sources.{name}"
    return MixtureSource(names, [e.weight for e in entries], sources, args.by)
