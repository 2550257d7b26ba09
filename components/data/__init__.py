"""Data: sources, tokenizers, packing and the resumable per-rank sharded loader."""

from components.data.dataset import IGNORED_TARGET, DataStreamMismatch, NoDocuments, no_documents_error
from components.data.loader import build_dataloader, holds_split, no_split_error, stream_id
from components.data.sharding import (
    loader_state_by_logical_shard,
    merge_shard_states,
    shards_of_rank,
    shards_of_worker,
)
from components.data.sources import SOURCES
from components.data.sources.mixture import MIXTURE, MixtureArgs, build_mixture_source
from components.data.lost_text import first_texts, lost_text_note
from components.data.tokenizer_calls import decode_text, encode_text
from components.data.tokenizers import (TOKENIZERS, ByteTokenizer, TiktokenArgs, TiktokenTokenizer,
                                        document_prefix_id)
from components.data.workers import (DeathsInFinalizers, death_hidden_in, restore_worker_deaths, signal_that_ended,
                                     stop_hearing_worker_deaths, worker_died)

__all__ = [
    "DataStreamMismatch",
    "IGNORED_TARGET",
    "DeathsInFinalizers",
    "MIXTURE",
    "SOURCES",
    "MixtureArgs",
    "NoDocuments",
    "build_mixture_source",
    "TOKENIZERS",
    "ByteTokenizer",
    "TiktokenArgs",
    "TiktokenTokenizer",
    "build_dataloader",
    "decode_text",
    "encode_text",
    "first_texts",
    "holds_split",
    "lost_text_note",
    "document_prefix_id",
    "loader_state_by_logical_shard",
    "merge_shard_states",
    "no_documents_error",
    "no_split_error",
    "shards_of_rank",
    "shards_of_worker",
    "restore_worker_deaths",
    "death_hidden_in",
    "signal_that_ended",
    "stop_hearing_worker_deaths",
    "stream_id",
    "worker_died",
]
