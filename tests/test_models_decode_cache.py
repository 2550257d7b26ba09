"""The decode cache keeps full-length buffers only for what selection reads (and the compressed blocks): the
window's and compression's raw tokens live in bounded streams that still hold every token a later step reads."""

from __future__ import annotations

import pytest
import torch

from components.models import build_transformer
from components.models.kv_cache import RecentTokens
from tests.test_models_decode import _decode
from tests.test_models_helpers import VOCAB, small_nsa, tiny_args

T = 41


@pytest.mark.parametrize("kv_per_branch", [True, False])
@pytest.mark.parametrize("hyper", [
    dict(window_size=3),  # chunks longer than the window
    dict(block_size=8, block_stride=2, sel_block_size=8, window_size=4),  # stride a quarter of the block
    dict(window_size=60),  # a window larger than the context
    dict(block_size=1, block_stride=1, sel_block_size=2, window_size=1),  # nothing to keep but the new token
], ids=["short_window", "small_stride", "long_window", "no_tail"])
def test_bounded_streams_give_the_full_forward_for_any_chunking(kv_per_branch, hyper):
    torch.manual_seed(0)
    model = build_transformer(tiny_args("nsa", nsa=small_nsa(kv_per_branch=kv_per_branch, **hyper)), VOCAB).double()
    tokens = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(tokens)
    for chunks in ([], [17], [3, 2, 9, 1, 11], [1] * 12 + [15], [40]):
        torch.testing.assert_close(_decode(model, tokens, chunks), full, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("kv_per_branch", [True, False])
def test_only_selection_and_the_compressed_blocks_grow_with_the_capacity(kv_per_branch):
    """Two caches 1000 tokens apart differ by the full-length buffers only: with kv_per_branch the selection's keys
    and values (2 per token), else the shared keys and values (2), plus the compressed blocks'; the window's and
    compression's raw tokens take the same room at any capacity."""
    nsa = small_nsa(kv_per_branch=kv_per_branch, window_size=16)
    model = build_transformer(tiny_args("nsa", nsa=nsa, max_seq_len=2048), VOCAB)
    small, large = (model.new_kv_cache(3, capacity=c).nbytes() for c in (1000, 2000))
    per_token = 3 * model.args.n_kv_heads * model.args.head_dim * 4  # fp32 [B, Hkv, D]
    blocks = 1000 // nsa.block_stride  # compressed blocks of 1000 more tokens
    assert large - small == model.args.n_layers * per_token * (2 * 1000 + 2 * blocks)


def _stream(keep: int, capacity: int = 100) -> RecentTokens:
    return RecentTokens(keep, capacity, (1, 1, 1), "cpu", torch.float64)


def _positions(start: int, n: int) -> torch.Tensor:
    return torch.arange(start, start + n, dtype=torch.float64).view(1, n, 1, 1)


def test_a_recent_stream_returns_every_needed_token_in_order():
    """Each step reads the `keep` tokens before it and its own, in order, through moves to the front and chunks
    longer than the buffer; a step that does not follow the held tokens is refused."""
    stream, position = _stream(keep=4), 0
    for n in [1] * 11 + [3, 9, 1, 2, 1, 1, 20, 1, 1, 4]:
        tokens, first = stream.extend(position, _positions(position, n))
        assert first <= position - min(position, 4)
        assert torch.equal(tokens, _positions(first, position + n - first))
        position += n
    assert stream.data.shape[1] == 9  # 2 * keep + 1, whatever the capacity
    with pytest.raises(ValueError, match="do not follow"):
        stream.extend(position + 1, _positions(position + 1, 1))
    stream.reset()
    tokens, first = stream.extend(0, _positions(0, 2))
    assert first == 0 and torch.equal(tokens, _positions(0, 2))


@pytest.mark.parametrize("kv_per_branch", [True, False])
def test_a_step_that_fails_midway_leaves_the_cache_as_it_was(kv_per_branch, monkeypatch):
    """A forward_step that raises after some layers took its tokens (out of memory, say) leaves every layer's cache
    as before it: the same step, or a shorter one, then gives the full forward's logits (the streams were left ahead
    of the cache's length and refused it: "tokens at position ... do not follow")."""
    torch.manual_seed(0)
    model = build_transformer(tiny_args("nsa", nsa=small_nsa(kv_per_branch=kv_per_branch, window_size=3)),
                              VOCAB).double().eval()
    tokens = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(tokens)
    last = model.layers[-1].attention

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("out of memory")

    # tokens appended in place, or after moving the held tail to the front (5 and 7 tokens fill the window's and the
    # raw streams' buffers, 3 more write over where that tail was); 30: longer than the buffers
    for before, step, retry in ((20, 1, 1), (5, 1, 1), (5, 3, 3), (7, 4, 4), (5, 30, 30), (5, 30, 2)):
        cache = model.new_kv_cache(2)
        model.forward_step(tokens[:, :before], cache)
        monkeypatch.setattr(last, "forward_step", out_of_memory)
        with pytest.raises(RuntimeError, match="out of memory"):
            model.forward_step(tokens[:, before:before + step], cache)
        monkeypatch.undo()
        assert cache.length == before
        logits = model.forward_step(tokens[:, before:before + retry], cache)
        torch.testing.assert_close(logits, full[:, before:before + retry], rtol=1e-9, atol=1e-10)
        torch.testing.assert_close(model.forward_step(tokens[:, before + retry:T], cache), full[:, before + retry:],
                                   rtol=1e-9, atol=1e-10)
