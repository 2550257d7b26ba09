"""Small corpora and an independent model of the loader's output, shared by the data tests (no tests here).

`expected_batches` recomputes what a rank must yield straight from the documents of its logical
shards: each shard's token stream is built by plain concatenation (doc + EOS, epoch after epoch),
windows are sliced from it at multiples of seq_len, and shards are interleaved by counting.
"""

from __future__ import annotations

import json
import os
import random

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from components.data import ByteTokenizer, build_dataloader
from components.data.sources import TextFilesArgs, TextFilesSource

EOS_TEXT = "<|endoftext|>"
WORDS = ["alpha", "beta", "gamma", "delta", "kappa", "lambda", "sigma", "omega", "über", "naïve", "日本"]


def unique_texts(n: int, seed: int = 0, prefix: str = "doc", max_words: int = 12) -> list[str]:
    rng = random.Random(seed)
    texts = []
    for i in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(0, max_words))]
        texts.append(f"{prefix}{i:04d}: " + " ".join(words))
    return texts


def write_jsonl(path: str, texts: list[str], field: str = "text") -> str:
    with open(path, "w", encoding="utf-8") as f:
        for i, t in enumerate(texts):
            f.write(json.dumps({"id": i, field: t}, ensure_ascii=False) + "\n")
    return path


def write_parquet(path: str, texts: list[str], row_group_size: int = 7, field: str = "text") -> str:
    table = pa.table({field: texts, "id": list(range(len(texts)))})
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def write_txt_folder(folder: str, texts: list[str]) -> list[str]:
    os.makedirs(folder, exist_ok=True)
    paths = []
    for i, t in enumerate(texts):
        p = os.path.join(folder, f"file{i:03d}.txt")
        with open(p, "w", encoding="utf-8") as f:
            f.write(t)
        paths.append(p)
    return paths


def mixed_corpus(tmp_path, n_jsonl=40, n_parquet=30, n_txt=6) -> tuple[list[str], list[str]]:
    """A .jsonl, a .parquet and a few .txt files; returns (paths for text_files, every document)."""
    jsonl = unique_texts(n_jsonl, seed=1, prefix="json")
    parq = unique_texts(n_parquet, seed=2, prefix="parq")
    txt = unique_texts(n_txt, seed=3, prefix="text")
    write_jsonl(str(tmp_path / "a.jsonl"), jsonl)
    write_parquet(str(tmp_path / "b.parquet"), parq)
    write_txt_folder(str(tmp_path / "txt"), txt)
    return [str(tmp_path / "a.jsonl"), str(tmp_path / "b.parquet"), str(tmp_path / "txt")], jsonl + parq + txt


def jsonl_source(tmp_path, n=48, validation_fraction=0.0, name="corpus.jsonl") -> tuple[TextFilesSource, list[str]]:
    texts = unique_texts(n, seed=7)
    write_jsonl(str(tmp_path / name), texts)
    return TextFilesSource(TextFilesArgs(paths=[str(tmp_path / name)], validation_fraction=validation_fraction)), texts


def shard_documents(source, shard: int, num_shards: int, split: str = "train", seed: int = 0, epoch: int = 0):
    return [d for d, _ in source.documents(shard, num_shards, split, seed, epoch, None)]


def _tokens(tokenizer, doc) -> list[int]:
    return list(tokenizer.encode(doc)) if isinstance(doc, str) else [int(x) for x in doc]


class ShardStreamModel:
    """The token stream of one shard, grown epoch by epoch on demand."""

    def __init__(self, source, tokenizer, shard, num_shards, split, seed, add_bos=False, min_document_tokens=0):
        self.args = (source, tokenizer, shard, num_shards, split, seed)
        self.bos = [tokenizer.bos_id] if add_bos else []
        self.min_document_tokens = min_document_tokens
        self.tokens: list[int] = []
        self.epoch = 0
        self.epoch_starts: list[int] = []  # the stream offset where each epoch's first document begins
        self.empty = not self._documents(0)

    def _documents(self, epoch: int) -> list[list[int]]:
        """The epoch's documents as the stream holds them ([BOS] + tokens + EOS), the short ones left out."""
        source, tokenizer, shard, num_shards, split, seed = self.args
        docs = [self.bos + _tokens(tokenizer, d) + [tokenizer.eos_id]
                for d in shard_documents(source, shard, num_shards, split, seed, epoch)]
        return [d for d in docs if len(d) >= self.min_document_tokens]

    def _grow(self, length: int) -> None:
        while len(self.tokens) < length:
            self.epoch_starts.append(len(self.tokens))
            for doc in self._documents(self.epoch):
                self.tokens += doc
            self.epoch += 1

    def window(self, k: int, seq_len: int) -> torch.Tensor:
        self._grow((k + 1) * seq_len + 1)
        return torch.tensor(self.tokens[k * seq_len : k * seq_len + seq_len + 1], dtype=torch.long)

    def _epoch_at(self, k: int, seq_len: int) -> int:
        """The epoch of the token window k starts at."""
        self._grow(k * seq_len + 1)
        return max(e for e, start in enumerate(self.epoch_starts) if start <= k * seq_len)

    def position(self, k: int, seq_len: int) -> tuple[int, int]:
        """(epoch, windows emitted in it) of a shard that has emitted k windows: the interleave's key."""
        epoch = self._epoch_at(k, seq_len)
        first = -(-self.epoch_starts[epoch] // seq_len)  # the first window starting in that epoch
        return epoch, k - first


def expected_batches(
    source,
    tokenizer,
    *,
    seq_len,
    batch_size,
    num_batches,
    dp_rank=0,
    dp_world_size=1,
    logical_shards=8,
    split="train",
    seed=0,
    num_workers=0,
    start_counts: dict[int, int] | None = None,
    models: dict[int, ShardStreamModel] | None = None,
    min_document_tokens: int = 0,
):
    """(batches, per-batch shard ids) a rank must yield; workers take turns batch by batch."""
    rank_shards = list(range(dp_rank, logical_shards, dp_world_size))
    groups = [rank_shards[k :: max(1, num_workers)] for k in range(max(1, num_workers))]
    models = models if models is not None else {}
    for s in rank_shards:
        if s not in models:
            models[s] = ShardStreamModel(source, tokenizer, s, logical_shards, split, seed,
                                         min_document_tokens=min_document_tokens)
    counts = {s: (start_counts or {}).get(s, 0) for s in rank_shards}
    batches, owners = [], []
    for b in range(num_batches):
        group = [s for s in groups[b % len(groups)] if not models[s].empty]
        rows, ids = [], []
        for _ in range(batch_size):
            s = min(group, key=lambda x: (models[x].position(counts[x], seq_len), x))
            rows.append(models[s].window(counts[s], seq_len))
            ids.append(s)
            counts[s] += 1
        w = torch.stack(rows)
        batches.append({"input": w[:, :-1], "target": w[:, 1:],
                        "document_starts": document_starts_of(w[:, :-1], tokenizer.eos_id)})
        owners.append(ids)
    return batches, owners


def document_starts_of(inputs: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Where documents start in rows of input tokens, from the tokens alone: each row's first token
    and every token after an EOS (no document holds the EOS id in these tests)."""
    starts = torch.zeros_like(inputs, dtype=torch.bool)
    starts[:, 0] = True
    starts[:, 1:] = inputs[:, :-1] == eos_id
    return starts


def take(loader, n: int) -> list[dict]:
    it = iter(loader)
    return [next(it) for _ in range(n)]


def assert_same_batches(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert set(g) == {"input", "target", "document_starts"}
        for key, dtype in (("input", torch.long), ("target", torch.long), ("document_starts", torch.bool)):
            assert g[key].dtype == dtype and g[key].dim() == 2, (i, key, g[key].shape)
            assert torch.equal(g[key], w[key]), f"batch {i} {key} differs"


def documents_in(rows: list[tuple[torch.Tensor, torch.Tensor]], tokenizer=None) -> list[str]:
    """Complete documents in one shard's consecutive (input, target) rows, in order."""
    tokenizer = tokenizer or ByteTokenizer()
    stream = torch.cat([rows[0][0][:1]] + [t for _, t in rows])
    return tokenizer.decode(stream.tolist()).split(EOS_TEXT)[:-1]


def rows_by_shard(batches: list[dict], owners: list[list[int]]) -> dict[int, list[tuple[torch.Tensor, torch.Tensor]]]:
    out: dict[int, list] = {}
    for batch, ids in zip(batches, owners):
        for r, s in enumerate(ids):
            out.setdefault(s, []).append((batch["input"][r], batch["target"][r]))
    return out


def byte_loader(source, **kw):
    kw.setdefault("seq_len", 16)
    kw.setdefault("batch_size", 2)
    kw.setdefault("logical_shards", 8)
    return build_dataloader(source, ByteTokenizer(), **kw)
