"""The exported modeling file holds its own copy of the NSA math (transformers loads it without this package): it must
compute the trainer model's logits for every NSA setting, not only the debug recipe's. Random weights of a large scale
make attention sharp, so a wrong block choice, gate or compression shows; no training."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from components.models import build_transformer
from components.models.hf import MODELING_FILE, _config, _to_hf
from tests.test_models_helpers import VOCAB, small_nsa, tiny_args

pytest.importorskip("transformers", reason="the hf extra (pip install -e '.[hf]')")

T = 29  # several selection blocks of the small settings; decode starts past the first compression block
PROMPT = 9

# (NSA settings, (query heads, key/value heads)); None is dense attention.
CASES = {
    "defaults_gqa2": ({}, (4, 2)),
    "mean_compression_gqa3": ({"compress": "mean"}, (3, 1)),
    "shared_kv_linear_gate_mha": ({"kv_per_branch": False, "gate": "linear"}, (4, 4)),
    "one_selected_block": ({"num_selected": 1}, (4, 2)),
    "stride_3_of_6": ({"block_size": 6, "block_stride": 3, "sel_block_size": 6, "num_selected": 3,
                       "window_size": 7}, (3, 1)),
    "window_past_the_row": ({"block_size": 4, "block_stride": 4, "sel_block_size": 4, "num_selected": 5,
                             "window_size": 100}, (4, 2)),
    "dense": (None, (4, 2)),
}


def load_modeling_file(name: str):
    """The modeling file an hf folder ships, imported as module `name` (each test file its own copy)."""
    spec = importlib.util.spec_from_file_location(name, MODELING_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def counted_crops(monkeypatch, modeling) -> list[int]:
    """The tokens each NSATitanCache.crop() call drops, appended as generate() crops."""
    dropped, crop = [], modeling.NSATitanCache.crop

    def counted(cache, tokens):
        before = cache.length
        crop(cache, tokens)
        dropped.append(before - cache.length)

    monkeypatch.setattr(modeling.NSATitanCache, "crop", counted)
    return dropped


@pytest.fixture(scope="module")
def modeling():
    return load_modeling_file("modeling_nsa_titan_shapes")


def _pair(modeling, nsa, heads, **overrides):
    attention = "dense" if nsa is None else "nsa"
    extra = {} if nsa is None else {"nsa": small_nsa(**nsa)}
    args = tiny_args(attention, n_heads=heads[0], n_kv_heads=heads[1], dim=48, **extra, **overrides)
    model = build_transformer(args, VOCAB)
    model.init_weights()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.4)
    hf = modeling.NSATitanForCausalLM(modeling.NSATitanConfig(**_config(args, VOCAB)))
    missing, unexpected = hf.model.load_state_dict(
        {k[len("model."):]: v for k, v in _to_hf(model.state_dict()).items()}, strict=False)
    assert not unexpected and all("rope" in name or "freqs" in name for name in missing), (missing, unexpected)
    return model.eval(), hf.eval()


@pytest.mark.parametrize("case", list(CASES))
def test_full_and_cached_forwards_give_the_trainers_logits(modeling, monkeypatch, case):
    model, hf = _pair(modeling, *CASES[case])
    tokens = torch.randint(0, VOCAB, (2, T))
    with torch.no_grad():
        expected = model(tokens)
        assert expected.std() > 1.0  # sharp enough that a wrong key changes the logits
        whole = hf(input_ids=tokens, use_cache=False).logits
        monkeypatch.setattr(modeling, "QUERY_CHUNK", 4)  # the chunked path, as a row longer than a chunk takes it
        chunked = hf(input_ids=tokens, use_cache=False).logits
        out = hf(input_ids=tokens[:, :PROMPT], use_cache=True)
        steps, cache = [out.logits], out.past_key_values
        for t in range(PROMPT, T):
            out = hf(input_ids=tokens[:, t:t + 1], past_key_values=cache, use_cache=True)
            steps.append(out.logits)
            cache = out.past_key_values
    for name, logits in (("whole", whole), ("chunked", chunked), ("decoded", torch.cat(steps, 1))):
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4, msg=lambda m: f"{name}: {m}")


class _LargestNewTensor(TorchDispatchMode):
    """The largest tensor any op allocates: an op returning an alias of its input (a view, an in-place write)
    allocates nothing."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not any(r.alias_info is not None for r in func._schema.returns):
            for x in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(x, torch.Tensor):
                    self.largest = max(self.largest, x.numel())
        return out


def test_a_decode_step_reads_only_what_its_branches_see(modeling):
    """A decode step at the end of a long cache allocates nothing of the cache's size (the cache was copied whole
    to append each token, and every branch scored every key): its largest new tensor is the compressed keys', and
    its logits are the trainer's."""
    nsa = {"block_size": 8, "block_stride": 4, "sel_block_size": 16, "num_selected": 3, "window_size": 24}
    model, hf = _pair(modeling, nsa, (4, 2), max_seq_len=2048)
    B, T, Hkv, D = 2, 1000, 2, 12
    tokens = torch.randint(0, VOCAB, (B, T + 2), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        cache = hf(input_ids=tokens[:, :T], use_cache=True).past_key_values
        cache = hf(input_ids=tokens[:, T:T + 1], past_key_values=cache).past_key_values  # the cache makes room
        with _LargestNewTensor() as rec:
            step = hf(input_ids=tokens[:, T + 1:], past_key_values=cache).logits
        expected = model(tokens)[:, -1:]
    Tc = (T + 2 - 8) // 4 + 1
    assert rec.largest <= B * Hkv * D * Tc < B * Hkv * D * T // 3, rec.largest
    torch.testing.assert_close(step, expected, rtol=1e-4, atol=1e-4)


def test_caches_copied_by_beam_search_write_apart(modeling):
    """Beam search copies a row's cache into two beams (reorder_cache), which share its buffers: each beam's tokens
    then give the logits of its own sequence, never the other's."""
    model, hf = _pair(modeling, {}, (4, 2))
    gen = torch.Generator().manual_seed(8)
    prompt, beams = torch.randint(0, VOCAB, (1, 11), generator=gen), torch.randint(0, VOCAB, (2, 9), generator=gen)
    ids, mask = torch.cat([torch.zeros(1, 1, dtype=torch.long), prompt], 1), torch.ones(1, 12, dtype=torch.long)
    mask[0, 0] = 0  # a padded batch: one cache per row
    with torch.no_grad():
        cache = hf(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], use_cache=True).past_key_values
        cache = hf(input_ids=ids[:, -1:], attention_mask=mask, past_key_values=cache).past_key_values  # room to write
        cache.reorder_cache(torch.tensor([0, 0]))
        steps = []
        for t in range(beams.shape[1]):
            mask = torch.cat([mask[:1].expand(2, -1), torch.ones(2, 1, dtype=torch.long)], 1)
            out = hf(input_ids=beams[:, t:t + 1], attention_mask=mask, past_key_values=cache)
            steps.append(out.logits)
            cache = out.past_key_values
        expected = model(torch.cat([prompt.expand(2, -1), beams], 1))[:, prompt.shape[1]:]
    torch.testing.assert_close(torch.cat(steps, 1), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("nsa", [{}, None], ids=["nsa", "dense"])
def test_cached_steps_keep_what_autograd_and_inference_mode_need(modeling, nsa):
    """A cached step writes its token into the cache's buffer in place, which an earlier step's graph saved
    (backward through a cached decode failed: 'modified by an inplace operation'), and which a cache made under
    torch.inference_mode cannot take outside it ('Inplace update to inference tensor'). Both now work and give the
    logits and gradients of the uncached forward."""
    _, hf = _pair(modeling, nsa, (4, 2))
    ids = torch.randint(0, VOCAB, (1, 14), generator=torch.Generator().manual_seed(3))
    out = hf(input_ids=ids[:, :10], use_cache=True)
    logits, cache = [out.logits], out.past_key_values
    for t in range(10, 14):
        out = hf(input_ids=ids[:, t:t + 1], past_key_values=cache)
        logits.append(out.logits)
        cache = out.past_key_values
    loss = torch.nn.functional.cross_entropy  # of each next token: gradients of the size training sees
    loss(torch.cat(logits, 1)[0, :-1], ids[0, 1:]).backward()
    cached = [p.grad.clone() for p in hf.parameters()]
    hf.zero_grad()
    loss(hf(input_ids=ids).logits[0, :-1], ids[0, 1:]).backward()
    for got, want in zip(cached, [p.grad for p in hf.parameters()]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    with torch.inference_mode():
        cache = hf(input_ids=ids[:, :11], use_cache=True).past_key_values
    with torch.no_grad():
        step = hf(input_ids=ids[:, 11:12], past_key_values=cache).logits
        torch.testing.assert_close(step, hf(input_ids=ids[:, :12]).logits[:, -1:], rtol=1e-4, atol=1e-4)


def test_a_step_with_another_batch_is_refused_and_leaves_the_cache_usable(modeling):
    """A one-row step on a two-row cache was broadcast into the first layer's buffer before failing later, so a
    retry with the right batch failed too ('The size of tensor a (5) must match ...')."""
    _, hf = _pair(modeling, {}, (4, 2))
    ids = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        cache = hf(input_ids=ids[:, :11], use_cache=True).past_key_values
        with pytest.raises(ValueError, match="the cache holds 2 row"):
            hf(input_ids=ids[:1, 11:12], past_key_values=cache)
        step = hf(input_ids=ids[:, 11:12], past_key_values=cache).logits
        torch.testing.assert_close(step, hf(input_ids=ids[:, :12]).logits[:, -1:], rtol=1e-4, atol=1e-4)


GREEDY = dict(do_sample=False, eos_token_id=None, pad_token_id=0, return_dict_in_generate=True, output_logits=True)


def _greedy(hf, ids, new_tokens: int, **kwargs):
    return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, **GREEDY, **kwargs)


@pytest.mark.parametrize("argument", ["past_key_values", "cache"])
def test_generate_goes_on_from_the_cache_it_returned(modeling, argument):
    """generate(sequence, cache=returned) (or past_key_values=) reads only the tokens the cache has not seen and gives
    the tokens and logits of one longer call (transformers refused it: "model_kwargs are not used by the model:
    ['cache']")."""
    from transformers import DynamicCache

    from tests.test_hf_export import _count_tokens_per_call

    _, hf = _pair(modeling, {}, (4, 2))
    prompt = torch.randint(1, VOCAB, (1, 12), generator=torch.Generator().manual_seed(6))
    whole = _greedy(hf, prompt, 10)
    first = _greedy(hf, prompt, 4)
    calls = _count_tokens_per_call(hf)
    rest = _greedy(hf, first.sequences, 6, **{argument: first[modeling._CACHE_FIELD]})
    assert calls == [1] * 6
    assert torch.equal(rest.sequences, whole.sequences)
    torch.testing.assert_close(torch.stack(first.logits + rest.logits, 1), torch.stack(whole.logits, 1),
                               rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="keeps its own cache"):  # another kind is refused, not silently replaced
        _greedy(hf, prompt, 2, **{argument: DynamicCache()})


def test_generate_refuses_a_sequence_its_cache_has_seen_whole(modeling):
    """generate() goes on from a cache given the whole sequence: a part of it, or a sequence whose every token the cache
    has seen (one made by a forward over it), failed with "cannot reshape tensor of 0 elements"."""
    _, hf = _pair(modeling, {}, (4, 2))
    prompt = torch.randint(1, VOCAB, (1, 12), generator=torch.Generator().manual_seed(6))
    first = _greedy(hf, prompt, 4)  # its cache has seen 15 tokens
    with torch.no_grad():
        seen = hf(input_ids=prompt, use_cache=True).past_key_values
    for ids, cache in ((first.sequences[:, :10], first[modeling._CACHE_FIELD]), (prompt, seen)):
        with pytest.raises(ValueError, match=rf"given {ids.shape[1]} token\(s\) .* give the whole sequence"):
            _greedy(hf, ids, 3, cache=cache)


@pytest.mark.parametrize("form", ["drop", "keep"])
@pytest.mark.parametrize("padding", ["none", "left", "right"])
@pytest.mark.parametrize("nsa", [{}, None], ids=["nsa", "dense"])
def test_a_cropped_cache_goes_on_as_the_shorter_sequence(modeling, nsa, padding, form):
    """crop() takes the cache back to its first tokens, as assisted decoding does with the drafts the model rejects
    (crop(-n) drops the last n, as transformers 5 asks; crop(n) keeps n, as 4 asks): the tokens after it see only
    those, across the compressed blocks the dropped tokens had completed. A padded batch's rows lose only their own
    tokens among the dropped columns."""
    _, hf = _pair(modeling, nsa, (4, 2))
    gen = torch.Generator().manual_seed(9)
    ids, after = torch.randint(1, VOCAB, (2, 24), generator=gen), torch.randint(1, VOCAB, (2, 5), generator=gen)
    mask = torch.ones(2, 24, dtype=torch.long)
    if padding == "left":
        mask[1, :3] = 0
    elif padding == "right":  # row 1 ends at column 20: of the 7 columns dropped, 3 are its tokens
        mask[0, 0] = mask[1, 20:] = 0
    with torch.no_grad():
        cache = hf(input_ids=ids[:, :12], attention_mask=mask[:, :12], use_cache=True).past_key_values
        for t in range(12, 24):  # decode steps complete blocks in the cache
            cache = hf(input_ids=ids[:, t:t + 1], attention_mask=mask[:, :t + 1], past_key_values=cache).past_key_values
        cache.crop(-7 if form == "drop" else 17)
        assert cache.get_seq_length() == 17
        cache.crop(0)  # drops nothing
        mask = torch.cat([mask[:, :17], torch.ones(2, 5, dtype=torch.long)], 1)
        got = hf(input_ids=after, attention_mask=mask, past_key_values=cache).logits
        expected = hf(input_ids=torch.cat([ids[:, :17], after], 1), attention_mask=mask, use_cache=False).logits
    torch.testing.assert_close(got, expected[:, 17:], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left_padded"])
@pytest.mark.parametrize("drafts", ["prompt_lookup", "assistant_model"])
def test_assisted_and_prompt_lookup_decoding_give_the_greedy_tokens(modeling, monkeypatch, drafts, padded):
    """Assisted and prompt-lookup decoding check draft tokens with one forward and crop the cache back to those
    accepted (the cache had no crop(): AttributeError, or transformers 5's 'Assisted decoding requires a cache'): the
    tokens and logits are greedy decoding's."""
    _, hf = _pair(modeling, {}, (4, 2))
    dropped = counted_crops(monkeypatch, modeling)
    prompt = torch.randint(1, VOCAB, (1, 14), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(prompt)
    if padded:
        mask[0, :4] = 0
    how = ({"prompt_lookup_num_tokens": 3} if drafts == "prompt_lookup" else
           {"assistant_model": _pair(modeling, {}, (4, 2))[1]})  # other weights: most drafts are rejected
    greedy = {**GREEDY, "eos_token_id": VOCAB - 1}  # transformers 4's prompt lookup needs one
    plain = hf.generate(prompt, attention_mask=mask, max_new_tokens=16, **greedy)
    drafted = hf.generate(prompt, attention_mask=mask, max_new_tokens=16, **greedy, **how)
    assert torch.equal(drafted.sequences, plain.sequences)
    torch.testing.assert_close(torch.stack(drafted.logits, 1), torch.stack(plain.logits, 1), rtol=1e-4, atol=1e-4)
    assert max(dropped) > 0, dropped  # rejected drafts were cropped away


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left_padded"])
def test_a_chunked_prefill_gives_the_greedy_tokens(modeling, padded):
    """generate(prefill_chunk_size=n) reads the prompt into the cache n tokens a call (transformers 5 refused it:
    'Cannot use prefill chunking without a cache'): the tokens and logits of greedy decoding."""
    if modeling._CACHE_FIELD != "cache":
        pytest.skip("transformers 4 makes no cache for chunked prefill of a model with its own")
    _, hf = _pair(modeling, {}, (4, 2))
    prompt = torch.randint(1, VOCAB, (2, 23), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(prompt)
    if padded:
        mask[1, :6] = 0
    plain = hf.generate(prompt, attention_mask=mask, max_new_tokens=6, **GREEDY)
    chunked = hf.generate(prompt, attention_mask=mask, max_new_tokens=6, prefill_chunk_size=5, **GREEDY)
    assert torch.equal(chunked.sequences, plain.sequences)
    torch.testing.assert_close(torch.stack(chunked.logits, 1), torch.stack(plain.logits, 1), rtol=1e-4, atol=1e-4)


def test_drafting_is_refused_up_front_where_transformers_cannot_crop_the_cache(modeling, monkeypatch):
    """A transformers whose generate() crops the cache with its _crop_past_key_values (before 4.57) handles its own
    cache classes only and failed on this model's after the first drafts (TypeError: object of type 'NSATitanCache'
    has no len()): refused before any work, naming the argument and the fix."""
    _, hf = _pair(modeling, {}, (4, 2))
    monkeypatch.setattr(modeling.candidate_generator, "_crop_past_key_values", lambda *a: None, raising=False)
    prompt = torch.randint(1, VOCAB, (1, 8), generator=torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="^prompt_lookup_num_tokens: transformers .* upgrade transformers"):
        _greedy(hf, prompt, 4, prompt_lookup_num_tokens=3)


def test_a_cache_repeated_and_selected_by_row_goes_on_for_each_row(modeling):
    """batch_repeat_interleave and batch_select_indices (transformers' Cache methods for expanding and choosing rows):
    each row then gives the logits of its own sequence."""
    _, hf = _pair(modeling, {}, (4, 2))
    gen = torch.Generator().manual_seed(12)
    prompt, steps = torch.randint(1, VOCAB, (1, 13), generator=gen), torch.randint(1, VOCAB, (2, 3), generator=gen)
    with torch.no_grad():
        cache = hf(input_ids=prompt, use_cache=True).past_key_values
        cache.batch_repeat_interleave(2)
        got = hf(input_ids=steps[:, :2], past_key_values=cache).logits
        cache.batch_select_indices(torch.tensor([1]))
        last = hf(input_ids=steps[1:, 2:], past_key_values=cache).logits
        expected = hf(input_ids=torch.cat([prompt.expand(2, -1), steps], 1), use_cache=False).logits
    torch.testing.assert_close(got, expected[:, 13:15], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(last, expected[1:, 15:], rtol=1e-4, atol=1e-4)
