"""Local .txt / .jsonl / .parquet files (or folders and globs of them) as a document source."""

from __future__ import annotations

from dataclasses import dataclass, field

from components.data.sources.base import ANOTHER_STREAM
from components.data.sources.corpus_source import CorpusSource
from components.data.sources.file_corpus import FileCorpus, corpus_files, expand_paths
from components.problems import Problem, problem, raise_problems


@dataclass
class TextFilesArgs:
    """Local files: .txt/.text/.md/.py are one document each; .jsonl lines and .parquet rows are documents."""

    paths: list[str] = field(
        default_factory=list,
        metadata={"doc": "files, folders (searched recursively) or glob patterns (** allowed)", "path": True},
    )
    text_field: str = field(
        default="text", metadata={"doc": "the JSON field / parquet column holding each document's text"}
    )
    validation_fraction: float = field(
        default=0.01,
        metadata={"doc": "share of documents held out for validation (by a stable hash)", "ge": 0.0, "le": 0.5,
                  "held_out": "share"},
    )
    invalid_utf8: str = field(
        default="error",
        metadata={"doc": "bytes that are not UTF-8 in text files (.txt/.text/.md/.py, .jsonl): error (stop, naming the "
                         "file) or replace (read them as U+FFFD)", "choices": ("error", "replace")},
    )

    def check(self) -> list[Problem]:
        if not self.paths:
            return [problem("paths", None, "no files given", "list .txt/.jsonl/.parquet files, folders or globs")]
        return []


class TextFilesSource(CorpusSource):
    args: TextFilesArgs
    table = "data.text_files"  # where a recipe sets the arguments, which the fixes name (a mixture's: its own table)

    def _build_corpus(self) -> FileCorpus:
        files = corpus_files(expand_paths(list(self.args.paths), "data source text_files"))
        return FileCorpus(
            files, self.args.text_field, self.args.validation_fraction, "data source text_files",
            self.args.invalid_utf8, f" from {self.table}.paths (either way {ANOTHER_STREAM}), or set "
            f"{self.table}.invalid_utf8 = 'replace' to read such bytes as U+FFFD (the same stream)",
        )

    def check(self) -> None:
        raise_problems("data source text_files", self.args.check())
        self.corpus().check()

    def scan(self) -> str:
        """Read every file once (doctor): what check() samples, in full."""
        size, records = self.corpus().scan()
        return f"every file reads as training reads it ({records:,} documents, {size / 2**20:.1f} MiB)"

    def fingerprint(self) -> str:
        a = self.args
        # invalid_utf8 is not part of it: every document "error" reads, "replace" reads the same.
        return f"text_files({self.corpus().fingerprint()},field={a.text_field},val={a.validation_fraction})"


def build_text_files_source(args: TextFilesArgs) -> TextFilesSource:
    return TextFilesSource(args)
