"""The packed documents' kernel tables are built once per offsets tensor (packing.kept), not once per launch:
a model's layers share them, an in-place change of the offsets builds them again, and nothing keeps the
offsets alive. Without a GPU the model runs its Triton kernels under the interpreter, on tiny rows."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from components.models import build_transformer
from components.nsa.documents import written_once
from components.nsa.triton import packing
from components.nsa.triton.launch import interpreting
from components.nsa.triton.packing import DocumentTables
from tests.test_models_helpers import VOCAB, small_nsa, tiny_args
from tests.test_models_packed import ROWS, T, starts_of

pytestmark = pytest.mark.usefixtures("one_thread")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
triton_only = pytest.mark.skipif(
    not (torch.cuda.is_available() or interpreting()),
    reason="Triton kernels need a CUDA GPU or TRITON_INTERPRET=1 (set by tests/conftest.py without a GPU)",
)


def _offsets(*values, mark: bool = True):
    """Offsets as a model's layout makes them: marked written once (documents.written_once)."""
    offsets = torch.tensor(values, device=DEVICE)
    if mark:
        written_once(offsets)
    return offsets


def _same_tables(a: DocumentTables, b: DocumentTables) -> None:
    for x, y in zip(a.tiles(4, 20), b.tiles(4, 20), strict=True):
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y


def test_one_offsets_tensor_gets_one_set_of_tables_per_kind_of_keys():
    cu = _offsets(0, 7, 20)
    tables = DocumentTables.of(cu, 1, 0)
    assert DocumentTables.of(cu, 1, 0) is tables
    assert tables.tiles(4, 20)[0] is tables.tiles(4, 20)[0]
    compressed = DocumentTables.of(cu, 2, 3)  # other keys (compressed blocks): other tables
    assert compressed is not tables
    assert not torch.equal(compressed.k_starts, tables.k_starts)
    # Equal values in another tensor: their own tables, equal to the first.
    other = DocumentTables.of(_offsets(0, 7, 20), 1, 0)
    assert other is not tables
    _same_tables(other, tables)


def test_an_in_place_change_of_either_offsets_builds_the_tables_again():
    cu, cu_q = _offsets(0, 7, 20), _offsets(0, 3, 9)
    tables, with_queries = DocumentTables.of(cu, 1, 0), DocumentTables.of(cu, 1, 0, cu_q)
    assert with_queries is not tables
    assert DocumentTables.of(cu, 1, 0, cu_q) is with_queries
    cu_q[1:] = _offsets(4, 9)
    rebuilt = DocumentTables.of(cu, 1, 0, cu_q)
    assert rebuilt is not with_queries
    _same_tables(rebuilt, DocumentTables(cu, 1, 0, cu_q))
    assert DocumentTables.of(cu, 1, 0) is tables  # the offsets without queries did not change
    cu[1] = 11
    rebuilt = DocumentTables.of(cu, 1, 0)
    assert rebuilt is not tables
    assert rebuilt.q_starts.tolist() == [0, 11, 20, 20]


def test_inference_tensors_are_not_kept():
    """An inference tensor has no version counter to tell an in-place change by."""
    with torch.inference_mode():
        cu = _offsets(0, 7, 20)
    assert DocumentTables.of(cu, 1, 0) is not DocumentTables.of(cu, 1, 0)


def test_offsets_not_marked_written_once_are_not_kept():
    """Offsets an op computed (inside a compiled graph, a buffer its own kernels may write again under the same
    tensor and version) get fresh tables at every launch; so do those marked with queries that are not."""
    cu = _offsets(0, 7, 20, mark=False)
    assert DocumentTables.of(cu, 1, 0) is not DocumentTables.of(cu, 1, 0)
    marked, unmarked_q = _offsets(0, 7, 20), _offsets(0, 3, 9, mark=False)
    assert DocumentTables.of(marked, 1, 0, unmarked_q) is not DocumentTables.of(marked, 1, 0, unmarked_q)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_tables_are_not_kept_off_the_default_stream():
    """CUDA graph trees warm up and capture on a stream of their own, allocating from the graph's pool: a table
    kept from there would outlive the run the pool must account for (or be overwritten by a later graph)."""
    cu = _offsets(0, 7, 20)
    with torch.cuda.stream(torch.cuda.Stream()):
        assert DocumentTables.of(cu, 1, 0) is not DocumentTables.of(cu, 1, 0)
    assert DocumentTables.of(cu, 1, 0) is DocumentTables.of(cu, 1, 0)


def test_kept_tables_do_not_keep_their_offsets_alive():
    cu, cu_q = _offsets(0, 7, 20), _offsets(0, 3, 9)
    DocumentTables.of(cu, 1, 0, cu_q)
    alive, alive_q = weakref.ref(cu), weakref.ref(cu_q)
    entries = len(packing._KEPT)
    del cu, cu_q
    gc.collect()
    assert alive() is None and alive_q() is None
    assert len(packing._KEPT) == entries - 1


class Builds:
    """Counts the document tables and tile tables built while it is on."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.documents = self.tiles = 0
        init, tile_table = DocumentTables.__init__, packing.tile_table

        def counted_init(tables, *args, **kwargs):
            self.documents += 1
            init(tables, *args, **kwargs)

        def counted_tile_table(*args, **kwargs):
            self.tiles += 1
            return tile_table(*args, **kwargs)

        monkeypatch.setattr(DocumentTables, "__init__", counted_init)
        monkeypatch.setattr(packing, "tile_table", counted_tile_table)

    def during(self, step) -> tuple[int, int]:
        self.documents = self.tiles = 0
        step()
        return self.documents, self.tiles


def _packed_step(n_layers: int, compile_blocks: bool = False):
    """A tiny NSA model's forward and backward on packed rows (two of them, documents of 1 to 30 tokens)."""
    torch.manual_seed(0)
    model = build_transformer(tiny_args("nsa", nsa=small_nsa(backend="triton"), n_layers=n_layers), VOCAB).to(DEVICE)
    if compile_blocks:
        for block in model.layers:
            block.compile(fullgraph=True)
    tokens = torch.randint(0, VOCAB, (len(ROWS), T), device=DEVICE)
    starts = starts_of(ROWS, T).to(DEVICE)

    def step():
        model(tokens, starts).float().square().mean().backward()
    return step


@pytest.fixture(scope="module")
def one_layer():
    """(document tables, tile tables) a one-layer model builds in a step, and the counter."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        builds = Builds(monkeypatch)
        documents, tiles = builds.during(_packed_step(1))
        assert documents > 0 and tiles > 0
        yield (documents, tiles), builds


@triton_only
def test_a_packed_models_layers_share_one_set_of_tables(one_layer):
    counts, builds = one_layer
    assert builds.during(_packed_step(2)) == counts


@triton_only
def test_compiled_blocks_share_one_set_of_tables(one_layer):
    """Compiled with the default backend (inductor) as a recipe's compile.enable does: the custom ops get the
    model's offsets tensor itself, so the blocks still build the tables once a step."""
    counts, builds = one_layer
    torch._dynamo.reset()
    assert builds.during(_packed_step(2, compile_blocks=True)) == counts  # tracing runs the ops' fake kernels only
