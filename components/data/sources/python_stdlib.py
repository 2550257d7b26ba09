"""The running Python's standard library (.py files, sorted): a real corpus on every machine."""

from __future__ import annotations

import os
import sys
import sysconfig
from dataclasses import dataclass, field

from components.errors import UserError
from components.data.sources.corpus_source import CorpusSource
from components.data.sources.file_corpus import CorpusFile, FileCorpus

_SKIPPED_FOLDERS = {"site-packages", "dist-packages", "__pycache__"}


@dataclass
class PythonStdlibArgs:
    """Every .py file of the standard library is one document; no network, no downloads."""

    validation_fraction: float = field(
        default=0.05,
        metadata={"doc": "share of files held out for validation (by a stable hash of the path)", "ge": 0.0, "le": 0.5,
                  "held_out": "share"},
    )


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def stdlib_files(root: str) -> list[CorpusFile]:
    found = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = sorted(d for d in subfolders if d not in _SKIPPED_FOLDERS)
        found.extend(os.path.join(folder, n) for n in names if n.endswith(".py"))
    return [CorpusFile(p, "whole", os.path.relpath(p, root)) for p in sorted(found)]


class PythonStdlibSource(CorpusSource):
    args: PythonStdlibArgs

    def __init__(self, args: PythonStdlibArgs | None = None):
        super().__init__(args or PythonStdlibArgs())

    def _build_corpus(self) -> FileCorpus:
        root = stdlib_root()
        files = stdlib_files(root) if os.path.isdir(root) else []
        if not files:
            raise UserError(
                f"data source python_stdlib: no .py files under {root!r} (this Python ships without its "
                "standard library sources); use data source text_files instead"
            )
        # A few test modules are in other encodings on purpose: their odd bytes read as U+FFFD.
        return FileCorpus(files, "text", self.args.validation_fraction, "data source python_stdlib",
                          invalid_utf8="replace")

    def check(self) -> None:
        self.corpus().check()

    def fingerprint(self) -> str:
        version = ".".join(map(str, sys.version_info[:3]))
        return f"python_stdlib({version},{self.corpus().fingerprint()},val={self.args.validation_fraction})"


def build_python_stdlib_source(args: PythonStdlibArgs) -> PythonStdlibSource:
    return PythonStdlibSource(args)
