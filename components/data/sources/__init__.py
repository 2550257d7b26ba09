"""Document sources by name: name -> (argument dataclass, factory taking those arguments)."""

from components.data.sources.base import SPLITS, DocumentSource, split_of, unit_hash
from components.data.sources.huggingface import HuggingFaceArgs, HuggingFaceSource, build_huggingface_source
from components.data.sources.python_stdlib import PythonStdlibArgs, PythonStdlibSource, build_python_stdlib_source
from components.data.sources.synthetic import SyntheticArgs, SyntheticSource, build_synthetic_source
from components.data.sources.text_files import TextFilesArgs, TextFilesSource, build_text_files_source

SOURCES = {
    "synthetic": (SyntheticArgs, build_synthetic_source),
    "text_files": (TextFilesArgs, build_text_files_source),
    "huggingface": (HuggingFaceArgs, build_huggingface_source),
    "python_stdlib": (PythonStdlibArgs, build_python_stdlib_source),
}

__all__ = [
    "SOURCES",
    "SPLITS",
    "DocumentSource",
    "HuggingFaceArgs",
    "HuggingFaceSource",
    "PythonStdlibArgs",
    "PythonStdlibSource",
    "SyntheticArgs",
    "SyntheticSource",
    "TextFilesArgs",
    "TextFilesSource",
    "split_of",
    "unit_hash",
]
