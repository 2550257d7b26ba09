"""The --format hf folder's cache holds every token only for the selected branch (and the compressed blocks): the
window's and compression's raw keys/values keep a bounded tail that still holds what every later step reads and what
crop() may take back (CROP_ROOM tokens, or while recording the whole last forward); a deeper crop is refused."""

from __future__ import annotations

import pytest
import torch

from tests.test_hf_modeling_shapes import _pair, counted_crops, load_modeling_file
from tests.test_models_helpers import VOCAB

pytest.importorskip("transformers", reason="the hf extra (pip install -e '.[hf]')")


@pytest.fixture(scope="module")
def modeling():
    return load_modeling_file("modeling_nsa_titan_cache_bounds")


T = 180  # past 2 * (keep + CROP_ROOM) + 1 tokens: the tails drop tokens

SETTINGS = {
    "short_window": {"window_size": 3},  # chunks far longer than the window
    "small_stride": {"block_size": 8, "block_stride": 2, "sel_block_size": 8, "window_size": 4},
    "long_window": {"window_size": 200},  # a window longer than the context
    "shared_kv": {"kv_per_branch": False, "window_size": 5},
}


def _steps(hf, tokens, sizes, cache=None):
    """Logits of tokens fed in the given chunk sizes, and the cache."""
    outs, position = [], 0 if cache is None else cache.length
    with torch.no_grad():
        for size in sizes:
            out = hf(input_ids=tokens[:, position:position + size], past_key_values=cache, use_cache=True)
            outs.append(out.logits)
            cache, position = out.past_key_values, position + size
    return torch.cat(outs, 1), cache


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_bounded_tails_give_the_trainers_logits_for_any_chunking(modeling, setting):
    model, hf = _pair(modeling, SETTINGS[setting], (4, 2), max_seq_len=256)
    tokens = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        expected = model(tokens)
    for sizes in ([150] + [1] * 30, [70, 70, 40], [5] + [1] * 140 + [35]):
        logits, cache = _steps(hf, tokens, sizes)
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4, msg=lambda m: f"{sizes[:3]}: {m}")
        for layer in cache.layers:
            assert layer.count("k_sel") == T
            for name, keep in layer.keeps.items():
                assert layer.buffers[name].shape[1] <= 2 * (keep + modeling.CROP_ROOM) + 1, (name, sizes[:3])


def test_crop_goes_back_crop_room_tokens_and_refuses_more(modeling):
    """After many single steps (the tails moved to their front many times) crop() takes back CROP_ROOM tokens and
    the cache goes on as the shorter sequence; a crop past the tokens the tails still hold is refused, naming the
    fix, and leaves the cache as it was."""
    model, hf = _pair(modeling, {"window_size": 5}, (4, 2), max_seq_len=256)
    room = modeling.CROP_ROOM
    tokens = torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(12))
    _, cache = _steps(hf, tokens, [40] + [1] * 120)
    with pytest.raises(ValueError, match=r"crop\(-140\) would keep 20 .* keep at least \d+, or call "
                                         r"activate_past_recording\(\)"):
        cache.crop(-140)  # the tails hold at most 2 * (keep + CROP_ROOM) + 1 tokens
    assert cache.length == 160
    cache.crop(-room)
    after = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(13))
    sequence = torch.cat([tokens[:, :160 - room], after], 1)
    logits, _ = _steps(hf, sequence, [3, 1, 1, 1], cache)
    with torch.no_grad():
        expected = model(sequence)[:, -6:]
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("recording", [True, False])
def test_a_recording_cache_crops_back_across_its_whole_last_forward(modeling, recording):
    """activate_past_recording() (transformers calls it before assisted decoding) keeps a forward's tokens until
    the next: crop() may take back all but one of a 150-token forward, past CROP_ROOM; without it that is refused."""
    model, hf = _pair(modeling, {"window_size": 5}, (4, 2), max_seq_len=256)
    tokens = torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(14))
    _, cache = _steps(hf, tokens, [20])
    if recording:
        cache.activate_past_recording()
    _, cache = _steps(hf, tokens, [150], cache)
    if not recording:
        with pytest.raises(ValueError, match="activate_past_recording"):
            cache.crop(-149)
        return
    cache.crop(-149)
    logits, _ = _steps(hf, tokens, [1] * 10, cache)
    with torch.no_grad():
        expected = model(tokens[:, :31])[:, 21:]
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("setting", ["short_window", "small_stride", "shared_kv"])
def test_the_deepest_crop_allowed_still_holds_every_token_the_next_steps_read(modeling, setting):
    """crop() down to the fewest tokens it accepts (crop(n) keeps n) leaves the window's w - 1 keys and the raw
    keys/values of the blocks not yet compressed: the steps after it give the trainer's logits."""
    model, hf = _pair(modeling, SETTINGS[setting], (4, 2), max_seq_len=256)
    tokens = torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(15))
    _, cache = _steps(hf, tokens, [30] + [1] * 77 + [40])
    length = cache.length
    for keep in range(1, length):
        try:
            cache.crop(keep)
            break
        except ValueError:
            continue
    assert 1 < keep < length - modeling.CROP_ROOM
    sequence = torch.cat([tokens[:, :keep], tokens[:, -12:]], 1)
    logits, _ = _steps(hf, sequence, [1] * 4 + [8], cache)
    with torch.no_grad():
        expected = model(sequence)[:, keep:]
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


def test_drafts_longer_than_crop_room_are_taken_back_where_transformers_does_not_ask_to_record(modeling, monkeypatch):
    """transformers 4.57 never calls activate_past_recording(): generate() with drafting makes its caches record
    itself, so prompt lookup's long drafts, rejected far past CROP_ROOM, are cropped and decoding gives the greedy
    tokens (without it crop() refused them mid-generation)."""
    _, hf = _pair(modeling, {"window_size": 5}, (4, 2), max_seq_len=512)
    monkeypatch.setattr(modeling.NSATitanCache, "activate_past_recording", lambda self: None)
    dropped = counted_crops(monkeypatch, modeling)
    motif = torch.randint(1, VOCAB, (1, 100), generator=torch.Generator().manual_seed(16))
    prompt = torch.cat([motif, motif[:, :50], motif], 1)  # its end recurs: prompt lookup drafts what followed
    greedy = dict(do_sample=False, pad_token_id=0, eos_token_id=VOCAB - 1, max_new_tokens=90)
    plain = hf.generate(prompt, attention_mask=torch.ones_like(prompt), **greedy)
    drafted = hf.generate(prompt, attention_mask=torch.ones_like(prompt), prompt_lookup_num_tokens=80,
                          max_matching_ngram_size=4, **greedy)
    assert torch.equal(drafted, plain)
    assert max(dropped) > modeling.CROP_ROOM, dropped


def test_rows_reordered_and_repeated_after_the_tails_dropped_tokens_go_on_as_their_sequences(modeling):
    """Beam search's reorder_cache and batch_repeat_interleave / batch_select_indices copy rows whose window and raw
    tails start past position 0 (and share buffers until written): each row then decodes its own sequence."""
    model, hf = _pair(modeling, {"window_size": 5}, (4, 2), max_seq_len=256)
    tokens = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(17))
    _, cache = _steps(hf, tokens, [100] + [1] * 50)
    assert all(start > 0 for start in cache.layers[0].starts.values())
    cache.reorder_cache(torch.tensor([1, 0]))
    cache.batch_repeat_interleave(2)  # rows 1, 1, 0, 0
    cache.batch_select_indices(torch.tensor([0, 3]))  # rows 1, 0
    rows = tokens.flip(0)
    logits, _ = _steps(hf, rows, [1] * 5 + [10], cache)
    with torch.no_grad():
        expected = model(rows[:, :165])[:, 150:]
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


def test_crop_takes_back_columns_before_a_rows_left_padding_or_its_standing_apart_end_of_text(modeling):
    """A row's tokens start past column 0 after left padding, and a leading end of text that stands apart is seen but
    not held: while the tails have dropped nothing, neither stops crop() from going back past them (it did: a crop
    into the padding, or of every token, was refused as if the tails had lost what it keeps)."""
    model, hf = _pair(modeling, {"window_size": 5}, (4, 2), max_seq_len=256)
    tokens = torch.randint(1, VOCAB - 1, (2, 30), generator=torch.Generator().manual_seed(18))
    mask = torch.ones_like(tokens)
    mask[1, :25] = tokens[1, :25] = 0  # row 1: 25 pads, then 5 tokens
    after = torch.randint(1, VOCAB - 1, (2, 3), generator=torch.Generator().manual_seed(19))
    with torch.no_grad():
        cache = hf(input_ids=tokens, attention_mask=mask, use_cache=True).past_key_values
        cache.crop(-10)  # 20 columns: row 0 keeps 20 tokens, row 1 none
        logits = hf(input_ids=after, attention_mask=torch.cat([mask[:, :20], torch.ones_like(after)], 1),
                    past_key_values=cache, use_cache=True).logits
        torch.testing.assert_close(logits[:1], model(torch.cat([tokens[:1, :20], after[:1]], 1))[:, -3:],
                                   rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(logits[1:], model(after[1:]), rtol=1e-4, atol=1e-4)

        hf.config.leading_eos_apart, hf.config.eos_token_id = True, VOCAB - 1
        opened = torch.cat([torch.full((1, 1), VOCAB - 1), tokens[:1, :9]], 1)
        cache = hf(input_ids=opened, use_cache=True).past_key_values
        assert (cache.length, cache.skipped) == (10, 1)
        cache.crop(-10)  # the end of text goes too: the cache starts over
        logits = hf(input_ids=after[:1], past_key_values=cache, use_cache=True).logits
        torch.testing.assert_close(logits, model(after[:1]), rtol=1e-4, atol=1e-4)


SHORT = {  # contexts shorter than a tail's bound: the window's reaches past the sequence, or past max_seq_len
    "window_past_max_seq_len": ({"window_size": 50}, 64, [10] + [1] * 54),
    "spec_defaults": ({"block_size": 32, "block_stride": 16, "sel_block_size": 64, "num_selected": 16,
                       "window_size": 512}, 1024, [100] + [1] * 50),
    "shared_kv": ({"kv_per_branch": False, "window_size": 40}, 128, [3] + [1] * 60 + [20]),
}


@pytest.mark.parametrize("setting", list(SHORT))
def test_bounded_tails_never_hold_more_than_the_full_length_buffers_beside_them(modeling, setting):
    """A window or raw tail grows by doubling, like the selection's full-length buffer (which holds every token, as
    every name did before the tails were bounded), up to its bound and never past max_seq_len: at a short context
    it holds no more bytes than before (it held up to 2 * (w - 1 + CROP_ROOM) + 1 entries from the first step)."""
    nsa, max_seq_len, sizes = SHORT[setting]
    _, hf = _pair(modeling, nsa, (4, 2), max_seq_len=max_seq_len)
    tokens = torch.randint(0, VOCAB, (1, sum(sizes)), generator=torch.Generator().manual_seed(20))
    cache = None
    for step, size in enumerate(sizes):
        _, cache = _steps(hf, tokens, [size], cache)
        for layer in cache.layers:
            full = layer.buffers["k_sel"]
            for name in layer.keeps:
                tail = layer.buffers[name]
                assert tail.shape[1] <= min(full.shape[1], max_seq_len), (name, step, tail.shape, full.shape)
                assert tail[0, 0].numel() * tail.element_size() == full[0, 0].numel() * full.element_size()


@pytest.mark.parametrize("recording", [False, True])
@pytest.mark.parametrize("setting", ["short_window", "small_stride", "shared_kv"])
def test_crop_keeps_any_count_it_promises_after_any_forwards_and_crops(modeling, setting, recording):
    """crop() keeps any count of tokens at least length - CROP_ROOM and at least what the last crop kept (while
    recording, also any from the last forward's first token on): random forwards and crops within that are all
    accepted, and each forward after them gives the trainer's logits for the tokens kept."""
    model, hf = _pair(modeling, SETTINGS[setting], (4, 2), max_seq_len=1024)
    room, draw = modeling.CROP_ROOM, torch.Generator().manual_seed(21)
    sequence, cache, last_kept = torch.zeros(1, 0, dtype=torch.long), None, 0
    if recording:
        cache = modeling.NSATitanCache(len(hf.model.layers))
        cache.activate_past_recording()
    for _ in range(80):
        size = min([1, 1, 1, 2, 5, 20, 70, 150][int(torch.randint(8, (1,), generator=draw))], 1024 - sequence.shape[1])
        if size == 0:
            break
        sequence = torch.cat([sequence, torch.randint(0, VOCAB, (1, size), generator=draw)], 1)
        logits, cache = _steps(hf, sequence, [size], cache)
        with torch.no_grad():
            torch.testing.assert_close(logits, model(sequence)[:, -size:], rtol=1e-4, atol=1e-4)
        length = sequence.shape[1]
        floor = max(length - room, last_kept)
        if recording:
            floor = min(floor, length - size)
        keep = [floor, floor, int(torch.randint(floor, length + 1, (1,), generator=draw)), length, length]
        keep = keep[int(torch.randint(len(keep), (1,), generator=draw))]  # the floor, anything above it, or no crop
        if keep < length:
            cache.crop(keep - length if keep % 2 else keep or -length)  # transformers 5's crop(-n) and 4's crop(n)
            sequence, last_kept = sequence[:, :keep], keep
            assert cache.length == keep


def test_a_crop_below_what_the_last_crop_kept_may_be_refused(modeling):
    """A crop of CROP_ROOM tokens leaves the tails only what the next step reads before the tokens kept: one token
    later, crop() goes back to what that crop kept but not further (it promises no more, and says so)."""
    _, hf = _pair(modeling, {"window_size": 5}, (4, 2), max_seq_len=256)
    tokens = torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(22))
    _, cache = _steps(hf, tokens, [150])
    cache.crop(-modeling.CROP_ROOM)
    _, cache = _steps(hf, tokens, [1], cache)
    cache.crop(-1)
    _, cache = _steps(hf, tokens, [1], cache)
    with pytest.raises(ValueError, match=r"crop\(-2\) would keep 85 .* not below what the last crop kept"):
        cache.crop(-2)
    assert cache.length == 87


def test_a_forward_that_fails_midway_leaves_the_cache_as_it_was(modeling, monkeypatch):
    """A forward that raises after some layers took its tokens (out of memory, say) leaves the cache as before it:
    the same tokens then give the trainer's logits, for a cache whose tails dropped tokens, one per padded row, and
    an empty one given a sequence that opens with an end of text standing apart (a retry failed on mismatched
    shapes, or read the failed forward's keys)."""
    model, hf = _pair(modeling, {"window_size": 5}, (4, 2), max_seq_len=256)
    hf.config.leading_eos_apart, hf.config.eos_token_id = True, VOCAB - 1
    tokens = torch.randint(1, VOCAB - 1, (2, T), generator=torch.Generator().manual_seed(23))
    last = hf.model.layers[-1].attention

    def fail_then_retry(cache, new, runs=0, **kwargs):
        """The logits of `new` after a first try whose last layer raised once it had run `runs` times."""
        forward, calls = last.forward, []

        def out_of_memory(*args, **kwargs):
            calls.append(1)
            if len(calls) > runs:
                raise RuntimeError("out of memory")
            return forward(*args, **kwargs)

        monkeypatch.setattr(last, "forward", out_of_memory)
        with pytest.raises(RuntimeError, match="out of memory"):
            hf(input_ids=new, past_key_values=cache, use_cache=True, **kwargs)
        monkeypatch.undo()
        with torch.no_grad():
            return hf(input_ids=new, past_key_values=cache, use_cache=True, **kwargs).logits

    _, cache = _steps(hf, tokens, [150] + [1] * 10)
    with torch.no_grad():
        expected = model(tokens)
    for size in (1, 19):
        start = cache.length
        torch.testing.assert_close(fail_then_retry(cache, tokens[:, start:start + size]),
                                   expected[:, start:start + size], rtol=1e-4, atol=1e-4)

    mask = torch.ones_like(tokens[:, :40])
    mask[1, :15] = 0  # row 1: 15 pads, then 25 tokens
    with torch.no_grad():
        cache = hf(input_ids=tokens[:, :30], attention_mask=mask[:, :30], use_cache=True).past_key_values
    logits = fail_then_retry(cache, tokens[:, 30:40], attention_mask=mask)
    with torch.no_grad():
        torch.testing.assert_close(logits[:1], model(tokens[:1, :40])[:, 30:], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(logits[1:], model(tokens[1:, 15:40])[:, 15:], rtol=1e-4, atol=1e-4)

    opened = torch.cat([torch.full((1, 1), VOCAB - 1), tokens[:1, :20]], 1)
    cache = modeling.NSATitanCache(len(hf.model.layers))
    logits = fail_then_retry(cache, opened, runs=1)  # after the end of text, read alone
    with torch.no_grad():
        torch.testing.assert_close(logits[:, 1:], model(tokens[:1, :20]), rtol=1e-4, atol=1e-4)
    assert (cache.length, cache.skipped) == (21, 1)
