"""What the file-backed sources share: each reads a FileCorpus, built on first use, and hands it the work."""

from __future__ import annotations

from components.data.sources.file_corpus import FileCorpus


class CorpusSource:
    """A source over one FileCorpus; subclasses say which files it holds (`_build_corpus`) and name it."""

    def __init__(self, args):
        self.args = args
        self._corpus: FileCorpus | None = None

    def _build_corpus(self) -> FileCorpus:
        raise NotImplementedError

    def corpus(self) -> FileCorpus:
        if self._corpus is None:
            self._corpus = self._build_corpus()
        return self._corpus

    def has_split(self, split: str) -> bool:
        return split == "train" or self.args.validation_fraction > 0

    def files_fingerprint(self) -> str:
        """The files' sampled bytes: a file rewritten to the same size is another corpus (fingerprint() holds the
        names and sizes)."""
        return self.corpus().sampled_fingerprint()

    def documents(self, shard, num_shards, split, seed, epoch, cursor):
        return self.corpus().documents(shard, num_shards, split, seed, epoch, cursor)

    def shard_notes(self, num_shards: int) -> list[str]:
        corpus = self.corpus()
        return corpus.row_group_notes(num_shards) + corpus.whole_file_notes()

    def shard_sizes(self, num_shards: int) -> list[float]:
        """Each logical shard's share of the training split, in bytes (from the files' metadata)."""
        return self.corpus().shard_bytes("train", num_shards)
