"""Dense attention over packed documents: the FlexAttention block mask and the one-document shortcut.

The block tables are held to a brute-force reading of the token mask, and FlexAttention compiled
under inductor (forward; it has no CPU backward) to SDPA with the explicit mask. Training through
FlexAttention on CUDA is in tests/test_dense_documents_gpu.py.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention

from components.models import build_transformer
from components.models.dense_attention import DenseAttention
from components.models.dense_documents import DenseDocuments, dense_documents, document_block_mask
from components.sequence_shard import SequenceShard
from tests.test_models_helpers import VOCAB, tiny_args
from tests.test_models_packed import starts_of

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK = 16
# (row length, rows as document lengths): documents of one token, documents ending on and off block
# edges, a document spanning several blocks, and a row length that is not a whole number of blocks.
LAYOUTS = [
    (64, [[1, 15, 16, 32], [64]]),
    (70, [[5, 40, 1, 1, 23], [17, 17, 36]]),
    (48, [[48], [47, 1]]),
]
# Causal block pairs that share no document, counted by hand from the layouts above.
SKIPPED = [5, 4 + 5, 0]


def _document_ids(rows, T):
    starts = starts_of(rows, T)
    return dense_documents(starts, torch.device("cpu"), flex=False).document_ids


def _tile_sets(mask, block):
    """mask [B, Tq, T] -> (the block pairs with some visible key, those whose whole tile is visible)."""
    B, Tq, T = mask.shape
    some, every = set(), set()
    for b in range(B):
        for i in range(-(-Tq // block)):
            for j in range(-(-T // block)):
                tile = mask[b, i * block:(i + 1) * block, j * block:(j + 1) * block]
                if tile.any():
                    some.add((b, i, j))
                if tile.all() and tile.shape == (block, block):
                    every.add((b, i, j))
    return some, every


def _tables(counts, indices):
    """BlockMask tables [B, 1, nq] / [B, 1, nq, nk] -> the set of kept (row, q block, k block)."""
    kept = set()
    for b in range(counts.shape[0]):
        for i in range(counts.shape[2]):
            kept.update((b, i, int(j)) for j in indices[b, 0, i, :int(counts[b, 0, i])])
    return kept


@pytest.mark.parametrize("T, rows, skipped", [(*layout, n) for layout, n in zip(LAYOUTS, SKIPPED)])
def test_block_tables_are_the_token_masks_blocks(T, rows, skipped):
    """A block pair is kept exactly when some query of one may see some key of the other, and computed
    without a mask exactly when every query sees every key (and both blocks are all real tokens)."""
    ids = _document_ids(rows, T)
    mask = DenseDocuments(torch.zeros(0), ids, False, None).explicit_mask()[:, 0]
    block_mask = document_block_mask(ids, BLOCK, torch.device("cpu"))
    nb = -(-T // BLOCK)
    any_visible, all_visible = _tile_sets(mask, BLOCK)
    partial = _tables(block_mask.kv_num_blocks, block_mask.kv_indices)
    full = _tables(block_mask.full_kv_num_blocks, block_mask.full_kv_indices)
    assert full == all_visible
    assert partial == any_visible - all_visible
    assert len(partial | full) == len(rows) * nb * (nb + 1) // 2 - skipped


@pytest.mark.parametrize("T, rows", LAYOUTS)
def test_compiled_flex_attention_equals_the_explicit_mask(T, rows):
    """Inductor's FlexAttention kernel with the block mask (the forward; CPU has no flex backward)."""
    torch.manual_seed(0)
    ids = _document_ids(rows, T)
    block_mask = document_block_mask(ids, BLOCK, torch.device("cpu"))
    B, H, Hkv, D = len(rows), 4, 2, 16
    q, k, v = torch.randn(B, H, T, D), torch.randn(B, Hkv, T, D), torch.randn(B, Hkv, T, D)
    mask = DenseDocuments(torch.zeros(0), ids, False, None).explicit_mask()
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    with torch.no_grad():
        got = torch.compile(flex_attention)(q, k, v, block_mask=block_mask, enable_gqa=True)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def _context_queries(rows, T, rank, size):
    """The keys' document ids and one context-parallel rank's queries (their documents, row positions)."""
    ids = _document_ids(rows, T)
    local = SequenceShard(None, rank, size, T).positions()
    return ids, ids[:, local], local.expand(len(rows), -1)


# (row length, rows, ranks): chunks of 16 tokens (whole blocks), and of 12 (blocks holding two chunks).
CONTEXT_CASES = [(64, LAYOUTS[0][1], 2), (96, [[5, 40, 1, 1, 49], [17, 17, 62]], 4)]


@pytest.mark.parametrize("T, rows, size", CONTEXT_CASES)
def test_block_tables_of_a_context_parallel_ranks_queries(T, rows, size):
    """Queries are one rank's two chunks, keys the whole rows: no visible key is left out, whole visible
    tiles need no mask, and with whole-block chunks nothing else is kept."""
    for rank in range(size):
        ids, query_ids, query_rows = _context_queries(rows, T, rank, size)
        mask = DenseDocuments(torch.zeros(0), ids, False, None, query_ids, query_rows).explicit_mask()[:, 0]
        block_mask = document_block_mask(ids, BLOCK, torch.device("cpu"), query_ids, query_rows)
        some, every = _tile_sets(mask, BLOCK)
        partial = _tables(block_mask.kv_num_blocks, block_mask.kv_indices)
        full = _tables(block_mask.full_kv_num_blocks, block_mask.full_kv_indices)
        assert full == every and not partial & full
        if (T // (2 * size)) % BLOCK == 0:
            assert partial == some - every
        else:
            assert partial >= some - every


@pytest.mark.parametrize("T, rows, size", CONTEXT_CASES)
def test_compiled_flex_attention_of_a_ranks_queries_equals_the_explicit_mask(T, rows, size):
    torch.manual_seed(0)
    ids, query_ids, query_rows = _context_queries(rows, T, size - 1, size)
    block_mask = document_block_mask(ids, BLOCK, torch.device("cpu"), query_ids, query_rows)
    B, H, Hkv, D, Tq = len(rows), 4, 2, 16, query_ids.shape[1]
    q, k, v = torch.randn(B, H, Tq, D), torch.randn(B, Hkv, T, D), torch.randn(B, Hkv, T, D)
    mask = DenseDocuments(torch.zeros(0), ids, False, None, query_ids, query_rows).explicit_mask()
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    with torch.no_grad():
        got = torch.compile(flex_attention)(q, k, v, block_mask=block_mask, enable_gqa=True)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_the_dense_layer_takes_flex_attention_when_compiled():
    """The layer's FlexAttention branch (q/k/v layout, GQA) equals its eager explicit-mask branch, and
    the compiled graph holds FlexAttention, not SDPA."""
    torch.manual_seed(0)
    T, rows = LAYOUTS[1]
    args = tiny_args("dense")
    layer = DenseAttention(args)
    layer.init_weights(0.2, 0.2)
    built = dense_documents(starts_of(rows, T), torch.device("cpu"), flex=False)
    documents = DenseDocuments(built.positions, built.document_ids, False,
                               document_block_mask(built.document_ids, BLOCK, torch.device("cpu")))
    x = torch.randn(len(rows), T, args.dim)
    cos, sin = _rope(args, T)
    eager = layer(x, cos, sin, documents)
    graphs = []

    def recording(gm, example_inputs):
        graphs.append(str(gm.graph))
        return gm

    with torch.no_grad():
        torch.compile(layer, backend=recording)(x, cos, sin, documents)
        compiled = torch.compile(layer)(x, cos, sin, documents)
    assert len(graphs) == 1 and "flex_attention" in graphs[0] and "scaled_dot_product" not in graphs[0]
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-5)


def _rope(args, T):
    from components.models.rope import RotaryEmbedding

    rope = RotaryEmbedding(args.head_dim, T, args.rope_theta)
    return rope.cos, rope.sin


def test_rows_of_one_document_take_plain_causal_attention():
    """Causal SDPA (is_causal, the flash kernels) where every row is one document, equal to the mask."""
    torch.manual_seed(0)
    model = build_transformer(tiny_args("dense"), VOCAB).double()
    tokens = torch.randint(0, VOCAB, (2, 40))
    documents = model.document_layout(torch.zeros(2, 40, dtype=torch.bool), tokens.device)
    assert isinstance(documents, DenseDocuments) and documents.one_per_row and documents.block_mask is None
    masked = DenseDocuments(documents.positions, documents.document_ids, False, None)
    torch.testing.assert_close(model(tokens, documents), model(tokens, masked), rtol=1e-12, atol=1e-12)
    several = model.document_layout(starts_of([[10, 30], [40]], 40), tokens.device)
    assert not several.one_per_row
    assert several.document_ids.tolist()[1] == [2] * 40 and several.positions.tolist()[:12] == [*range(10), 0, 1]


def test_the_block_mask_is_built_only_where_flex_attention_runs():
    """Blocks compiled with inductor (the `compiled` hook says so) on CUDA; never for the CPU, never for
    other backends, never for rows of one document."""
    from components.models.hooks import compiled

    starts = starts_of([[10, 30], [40]], 40)
    assert dense_documents(starts, torch.device("cpu"), flex=True).block_mask is not None
    assert dense_documents(starts, torch.device("cpu"), flex=False).block_mask is None
    assert dense_documents(torch.zeros(2, 40, dtype=torch.bool), torch.device("cpu"), flex=True).block_mask is None
    model = build_transformer(tiny_args("dense"), VOCAB)
    assert model.compile_backend is None and not model._flex_on(torch.device("cuda"))
    for backend, flex in (("inductor", True), ("aot_eager", False), ("eager", False)):
        compiled(model, backend)
        assert model._flex_on(torch.device("cuda")) == flex and not model._flex_on(torch.device("cpu"))
    compiled(model, "inductor")
    assert model.document_layout(starts, torch.device("cpu")).block_mask is None


def test_one_mask_serves_every_layer_of_a_forward():
    """The explicit mask is built once per forward, as SDPA's 0 / -inf bias in the queries' dtype: the
    layers save one [B, 1, T, T] bias for backward, not one each, and compute exactly what SDPA's
    boolean mask gives (it converts a boolean mask into the same bias)."""
    from tests.saved_tensors import saved_bytes

    torch.manual_seed(0)
    B, T = 2, 48
    tokens = torch.randint(0, VOCAB, (B, T))
    starts = starts_of([[10, 38], [20, 20, 8]], T)
    extra = {}
    for layers in (1, 3):
        model = build_transformer(tiny_args("dense", n_layers=layers), VOCAB)
        documents = model.document_layout(starts, tokens.device)
        plain = model.document_layout(torch.zeros(B, T, dtype=torch.bool), tokens.device)
        extra[layers] = (saved_bytes(model, lambda: model(tokens, documents))
                         - saved_bytes(model, lambda: model(tokens, plain)))
    mask_bytes = B * T * T * 4  # one fp32 bias; the rest of the difference is a few elements per token
    assert mask_bytes <= extra[1] < 1.5 * mask_bytes, extra
    assert extra[3] - extra[1] < mask_bytes / 2, extra  # two more layers, no more masks

    seen = []
    bool_mask = DenseDocuments.with_bias
    logits = model(tokens, documents)
    try:
        DenseDocuments.with_bias = lambda self, dtype: seen.append(dtype) or self  # each layer builds its own
        assert torch.equal(model(tokens, documents), logits) and seen == [torch.float32]
    finally:
        DenseDocuments.with_bias = bool_mask
    shared = documents.with_bias(torch.bfloat16)
    assert shared.bias.dtype == torch.bfloat16 and shared.attention_mask(torch.bfloat16) is shared.bias
    assert shared.attention_mask(torch.float32).dtype == torch.bool  # another dtype: the boolean mask
    masks = []
    attention_mask = DenseDocuments.attention_mask
    try:
        DenseDocuments.attention_mask = lambda self, dtype: masks.append(attention_mask(self, dtype)) or masks[-1]
        with torch.autocast("cpu", dtype=torch.bfloat16):  # the queries are bf16: every layer takes the bf16 bias
            model(tokens, documents)
    finally:
        DenseDocuments.attention_mask = attention_mask
    assert len(masks) == 3 and all(m.dtype == torch.bfloat16 and m is masks[0] for m in masks)
