"""An nsa_titan language model for Hugging Face transformers (written by `nsa-titan export --format hf`).

Self-contained on purpose: it needs only torch and transformers, so an exported folder loads anywhere
with `AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`. It computes what the
trainer's model computes (the same weights, names and numerics), one sequence per row:

- a pre-norm decoder: x + attention(rmsnorm(x)), then x + swiglu(rmsnorm(x)); RoPE with half-split
  pairs; an output projection, tied to the embedding or not;
- attention "dense": causal softmax attention with grouped-query heads;
- attention "nsa": Native Sparse Attention, three branches gated per head by sigmoid gates
  (cmp, sel, win):
  - compressed: keys/values of blocks of l tokens every d tokens, compressed by phi (a small MLP
    with intra-block positions, or the mean); query t sees block i iff i*d + l - 1 <= t; the
    compressed key is rotated at that last token;
  - selected: the n selection blocks of l' tokens whose importance (the compressed branch's
    probabilities spread onto selection blocks by token overlap, summed over a KV group's heads)
    is highest; the current block, block 0 and the previous block rank first, in that order; ties
    go to the smaller block; query t sees their tokens s <= t;
  - window: the keys t - w + 1 .. t.

Attention runs in fp32 over query chunks (memory grows with chunk x length, not length^2), which
makes this the reference math, not a fast kernel. Generation keeps a cache of every layer's selection
keys and values and the compressed blocks done so far, in buffers that grow by doubling, and of the
window's keys/values and the raw keys/values of blocks not yet compressed only a bounded tail (what the
next step reads, and CROP_ROOM tokens for crop()); a decode step (one token) reads only what each branch
sees (every compressed block, the chosen blocks' tokens, the last w keys), so beyond scoring the
compressed keys its cost does not grow with the context.

A sequence that opens with the end of text, with leading_eos_apart (a model trained with document masking and no
BOS, where documents follow the end of text of the one before): the model reads that token alone and the tokens
after it as a document from position 0, which never sees it, as training ran them. generate() with no input starts
there (config.bos_token_id), and so do lm-eval's empty contexts and first rolling windows.

Padded batches (attention_mask with zeros, padding on either side of each row): every row runs
alone on its own tokens, with its own cache, so it computes exactly what it would unpadded (NSA's
blocks count from a sequence's first token, so padding cannot simply be masked). Pad positions
get zero logits. Generation pads on the left (tokenizer.padding_side = "left"). A batch padded on
the right only, without a cache (training), runs in one call: its rows start together, and causal
attention keeps the pads after a row's tokens out of their logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
import transformers
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.generation import candidate_generator
from transformers.modeling_outputs import CausalLMOutputWithPast

# transformers 5 names the output's cache field `cache` (the old name still works, with a warning); 4 has
# past_key_values.
_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"

QUERY_CHUNK = 256  # queries per attention chunk
# crop() keeps any count of tokens at least length - CROP_ROOM and at least what the last crop kept (while the cache
# records, as assisted decoding has it do, also any from the last forward's first token on); fewer may be refused
CROP_ROOM = 64
# generate() arguments that verify draft tokens, then crop the cache back to those accepted
_DRAFTING = ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit")


def _prefix_rows(attention_mask) -> bool:
    """Whether every row's real tokens come first (padding on the right only)."""
    real = attention_mask.bool()
    return bool((real[:, 1:] <= real[:, :-1]).all())


class NSATitanConfig(PretrainedConfig):
    model_type = "nsa_titan"
    attribute_map = {"hidden_size": "dim", "num_hidden_layers": "n_layers", "num_attention_heads": "n_heads",
                     "num_key_value_heads": "n_kv_heads", "max_position_embeddings": "max_seq_len"}

    def __init__(self, vocab_size: int = 258, dim: int = 256, n_layers: int = 4, n_heads: int = 4,
                 n_kv_heads: int = 2, mlp_hidden_dim: int = 704, norm_eps: float = 1e-5, rope_theta: float = 10000.0,
                 max_seq_len: int = 2048, attention: str = "nsa", nsa: dict | None = None, init_std: float = 0.02,
                 tie_word_embeddings: bool = False, use_cache: bool = True, leading_eos_apart: bool = False, **kwargs):
        self.vocab_size, self.dim, self.n_layers, self.n_heads, self.n_kv_heads = (
            vocab_size, dim, n_layers, n_heads, n_kv_heads)
        self.mlp_hidden_dim, self.norm_eps, self.rope_theta, self.max_seq_len = (
            mlp_hidden_dim, norm_eps, rope_theta, max_seq_len)
        self.attention, self.init_std, self.use_cache = attention, init_std, use_cache
        # a leading end of text (eos_token_id) ends the document before: the tokens after it do not see it
        self.leading_eos_apart = leading_eos_apart
        # block_size l, block_stride d, sel_block_size l', num_selected n, window_size w, compress,
        # kv_per_branch, gate
        self.nsa = dict(nsa or {})
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)


# ---- pieces shared by both attentions -----------------------------------------------------------

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


_ROPE_TABLES: dict = {}  # (device, head_dim, theta) -> cos, sin [L, D/2] of positions 0 .. L-1


def rope_tables(device, head_dim: int, theta: float, length: int):
    """cos/sin [>= length, D/2] in fp32 from fp64 angles, the trainer's tables: computed once per device and head size,
    and again (twice as long) only when a position past them is asked for."""
    key = (str(device), head_dim, theta)
    tables = _ROPE_TABLES.get(key)
    if tables is None or tables[0].shape[0] < length:
        size = max(length, 2 * (0 if tables is None else tables[0].shape[0]))
        with torch.inference_mode(False), torch.no_grad():  # plain tensors, usable in and out of inference mode
            inv_freq = theta ** -(torch.arange(0, head_dim, 2, device=device, dtype=torch.float64) / head_dim)
            angles = torch.arange(size, device=device, dtype=torch.float64)[:, None] * inv_freq[None, :]
            tables = _ROPE_TABLES[key] = (angles.cos().float(), angles.sin().float())
    return tables


def rope(x, positions, theta: float, end: int):
    """Rotate x [B, T, H, D] at positions [T] (each < end): feature i pairs with i + D/2."""
    cos, sin = rope_tables(x.device, x.shape[-1], theta, end)
    dtype = torch.promote_types(x.dtype, torch.float32)
    cos = cos.index_select(0, positions).to(dtype)[None, :, None, :]
    sin = sin.index_select(0, positions).to(dtype)[None, :, None, :]
    x1, x2 = x.to(dtype).chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def grouped(q, num_kv_heads: int):
    """q [B, T, H, D] -> [B, Hkv, T, G, D] in fp32: the G query heads of each KV head together."""
    B, T, H, D = q.shape
    return q.float().view(B, T, num_kv_heads, H // num_kv_heads, D).permute(0, 2, 1, 3, 4)


def attend(qg, k, v, visible):
    """Softmax attention of grouped queries [B, Hkv, C, G, D] over keys/values [B, K, Hkv, D] where
    visible [B or 1, Hkv or 1, C, K] allows; a query that sees nothing gets 0. -> [B, Hkv, C, G, D]"""
    return attend_by_head(qg, k.float().permute(0, 2, 1, 3), v.float().permute(0, 2, 1, 3), visible)


def attend_by_head(qg, kh, vh, visible):
    """attend() with keys/values laid out by KV head, [B, Hkv, K, D] in fp32."""
    scores = torch.einsum("bhcgd,bhkd->bhcgk", qg, kh) * qg.shape[-1] ** -0.5
    scores = scores.masked_fill(~visible[:, :, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return torch.einsum("bhcgk,bhkd->bhcgd", probs, vh), probs


def ungrouped(o):
    """[B, Hkv, T, G, D] -> [B, T, H, D]."""
    B, Hkv, T, G, D = o.shape
    return o.permute(0, 2, 1, 3, 4).reshape(B, T, Hkv * G, D)


class LayerCache:
    """One layer's keys and values so far (by name), and NSA's compressed blocks done so far, each [B, count, ...]
    at the front of a buffer with room to grow: a decode step writes its token in place, and a full buffer doubles
    (up to a limit), so the cache is not copied whole every step. Names that later steps read only near their own
    tokens (extend_recent: NSA's window and the raw keys/values of blocks not yet compressed) keep a bounded tail,
    from position `starts[name]` on; `counts` are positions past the last entry. Copies share buffers until they
    write (`shared`): a shared cache moves to buffers of its own first."""

    def __init__(self):
        self.buffers: dict[str, torch.Tensor] = {}
        self.counts: dict[str, int] = {}
        self.starts: dict[str, int] = {}  # the position of a bounded name's first entry held
        self.keeps: dict[str, int] = {}  # the entries before its own a step reads of a bounded name
        self.shared = self.recording = False

    def count(self, name: str) -> int:
        return self.counts.get(name, 0)

    def _like(self, buffers: dict) -> "LayerCache":
        twin = LayerCache()
        twin.buffers, twin.counts, twin.starts, twin.keeps = buffers, dict(self.counts), dict(self.starts), dict(
            self.keeps)
        twin.recording = self.recording
        return twin

    def select_rows(self, index: torch.Tensor) -> "LayerCache":
        return self._like({name: x.index_select(0, index.to(x.device)) for name, x in self.buffers.items()})

    def earliest_crop(self) -> int:
        """The fewest tokens crop() can keep: a bounded name must still hold the entries the next step reads."""
        return max([self.starts[name] + keep for name, keep in self.keeps.items() if self.starts[name]], default=0)

    def crop(self, tokens: int) -> None:
        """Keep the first `tokens` entries of each name (NSAAttention then trims its compressed blocks to the ones the
        kept tokens complete); the dropped entries stay in the buffers, to be written over."""
        self.crop_names(tokens, *self.counts)

    def crop_names(self, count: int, *names: str) -> None:
        for name in names:
            if name in self.counts:
                self.counts[name] = min(self.counts[name], count)

    def state(self) -> tuple:
        """What rewind() goes back to: no copy, since a forward writes a buffer only past the entries it holds, or
        into a new one."""
        return dict(self.buffers), dict(self.counts), dict(self.starts), dict(self.keeps), self.shared

    def rewind(self, state: tuple) -> None:
        buffers, counts, starts, keeps, self.shared = state
        self.buffers, self.counts, self.starts, self.keeps = dict(buffers), dict(counts), dict(starts), dict(keeps)

    def copy(self) -> "LayerCache":
        """A cache of the same tokens sharing this one's buffers: neither writes into them again."""
        twin = self._like(dict(self.buffers))
        self.shared = twin.shared = True
        return twin

    def _prepare(self, new: dict) -> None:
        for name, x in new.items():  # checked before anything is written: a refused call leaves the cache usable
            buffer = self.buffers.get(name)
            if buffer is not None and x.shape[0] != buffer.shape[0]:
                raise ValueError(f"the cache holds {buffer.shape[0]} row(s) and this call gives {x.shape[0]}: "
                                 f"continue a cache with the batch it was made with")
        if self.shared:
            self.buffers = {name: x.clone() for name, x in self.buffers.items()}
            self.shared = False

    def extend(self, limit: int, **new):
        """Append each named tensor [B, T, ...] along dim 1 and return the views of everything so far; a buffer
        grows to at most `limit` entries unless more are needed."""
        self._prepare(new)
        for name, x in new.items():
            count, buffer = self.count(name), self.buffers.get(name)
            need = count + x.shape[1]
            if buffer is not None and not _writable(buffer, x):  # earlier steps' views must keep their values
                self.buffers[name] = torch.cat([buffer[:, :count], x], dim=1)
                self.counts[name] = need
                continue
            if buffer is None or need > buffer.shape[1]:
                room = max(need, min(2 * (0 if buffer is None else buffer.shape[1]), limit))
                grown = x.new_empty((x.shape[0], room) + tuple(x.shape[2:]))
                if count:
                    grown[:, :count] = buffer[:, :count]
                self.buffers[name] = buffer = grown
            buffer[:, count:need] = x
            self.counts[name] = need
        return [self.buffers[name][:, :self.counts[name]] for name in new]

    def extend_recent(self, keep: int, limit: int, **new):
        """extend() for names whose later steps read only the `keep` entries before their own: returns (the views
        from position `first` on, first), first <= the step's start - keep (or 0). A buffer holds those, CROP_ROOM
        more for crop() to take back and, while recording (activate_past_recording), the whole last step. It grows by
        doubling from the first step's size, as extend()'s do, up to 2 * (keep + CROP_ROOM) + 1 entries and never
        past `limit` (max_seq_len), and is no longer than that between steps: a short context holds no more than a
        full-length buffer would, a long one no more than this bound."""
        self._prepare(new)
        tail = keep + CROP_ROOM
        bound = min(2 * tail + 1, limit)
        views = []
        for name, x in new.items():
            buffer, start, end = self.buffers.get(name), self.starts.get(name, 0), self.count(name)
            held, n, size = end - start, x.shape[1], 0 if buffer is None else buffer.shape[1]
            writable = buffer is None or _writable(buffer, x)
            if buffer is not None and held + n <= size and writable:
                buffer[:, held:held + n] = x
            else:  # the tail still needed, then the step's own
                lead = min(held, tail)
                room = max(lead + n, min(2 * size, bound))
                if not writable:  # earlier steps' views must keep their values
                    buffer = torch.cat([buffer[:, held - lead:held], x], dim=1)
                else:  # a new buffer (the old one stays whole for rewind())
                    grown = x.new_empty((x.shape[0], room) + tuple(x.shape[2:]))
                    if lead:
                        grown[:, :lead] = buffer[:, held - lead:held]
                    grown[:, lead:lead + n] = x
                    buffer = grown
                start = end - lead
            views.append(buffer[:, :end + n - start])
            first = start  # the same for every name: they hold the same positions
            if buffer.shape[1] > bound and not self.recording:  # a long step: keep its last entries alone
                kept = min(end + n - start, tail)
                buffer, start = buffer[:, end + n - start - kept:end + n - start].clone(), end + n - kept
            self.buffers[name], self.starts[name], self.counts[name], self.keeps[name] = buffer, start, end + n, keep
        return views, first


def _writable(buffer: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether a step may write into the buffer in place: not when autograd records the cache (an earlier step's
    graph saved views of it) or when it was made under torch.inference_mode and this step runs outside it."""
    recorded = torch.is_grad_enabled() and (buffer.requires_grad or x.requires_grad)
    return not recorded and (torch.is_inference_mode_enabled() or not buffer.is_inference())


class NSATitanCache:
    """Every layer's LayerCache and the number of tokens (input columns) seen, `skipped` of them (a leading end of
    text that stands apart) not held; for a padded batch, one cache per row (`rows`), each of that row's real tokens
    only, and the column after its last one (`end`).

    It answers what transformers' generate() asks of a cache: its length, whether torch.compile or linear attention
    apply (neither does), reorder_cache (beam search), crop (assisted and prompt-lookup decoding take back the draft
    tokens the model did not accept; NSA's window and raw keys/values are held only as far back as CROP_ROOM says, so
    a deeper crop is refused),
    batch_repeat_interleave and batch_select_indices."""

    is_compileable = False
    is_croppable = True

    def __init__(self, num_layers: int, rows: int = 0, recording: bool = False):
        self.layers = [LayerCache() for _ in range(num_layers)]
        self.length = self.skipped = self.end = 0
        self.recording = False
        self.rows = [NSATitanCache(num_layers) for _ in range(rows)] if rows else None
        if recording:
            self._record()

    @property
    def is_linear(self) -> list[bool]:
        return [False] * len(self.layers)  # no layer keeps a recurrent state

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def activate_past_recording(self) -> None:
        """From now on hold every layer's window and raw keys/values of the last forward whole (transformers calls
        this before assisted decoding), so that crop() can take back any of its tokens."""
        self._record()

    def _record(self) -> None:
        for cache in [self] + (self.rows or []):
            cache.recording = True
            for layer in cache.layers:
                layer.recording = True

    def crop(self, tokens: int) -> None:
        """Drop tokens from the end: crop(-n) the last n (transformers 5), crop(n) all but the first n (transformers
        4); crop(0) drops nothing. Any count CROP_ROOM's comment names is kept; a count the tails no longer reach
        back to is refused, the cache left as it was."""
        keep = self.length + tokens if tokens < 0 else tokens if tokens > 0 else self.length
        if keep < 0:
            raise ValueError(f"crop({tokens}) asks to drop more than the cache's {self.length} tokens")
        earliest = self._earliest_crop()
        if keep < min(earliest, self.length):
            raise ValueError(f"crop({tokens}) would keep {keep} of the cache's {self.length} tokens, but the tokens "
                             f"before {earliest} have left its window and raw key/value buffers (a crop may keep any "
                             f"count from {CROP_ROOM} tokens before the end on, not below what the last crop kept, "
                             f"or while recording from the last forward's first token): keep at least {earliest}, "
                             f"or call activate_past_recording() before the forward that crop() takes back")
        self._keep(keep)

    def state(self) -> tuple:
        """What rewind() goes back to (taken before a forward): counts, rows and every layer's state."""
        rows = None if self.rows is None else [(row, row.state()) for row in self.rows]
        return self.length, self.skipped, self.end, rows, [layer.state() for layer in self.layers]

    def rewind(self, state: tuple) -> None:
        """Back to `state`, as if the forward since had not run (one that failed after some layers took its tokens)."""
        self.length, self.skipped, self.end, rows, layers = state
        self.rows = None if rows is None else [row for row, _ in rows]
        for row, saved in rows or []:
            row.rewind(saved)
        for layer, saved in zip(self.layers, layers):
            layer.rewind(saved)

    def _earliest_crop(self) -> int:
        """The fewest tokens (columns) crop() can keep: 0 while no tail has dropped a token, whatever columns (left
        padding, an end of text standing apart) come before the tokens held."""
        if self.rows is not None:  # a row's tokens end at its `end` column
            earliest = [(row._earliest_crop(), row) for row in self.rows]
            return max([held + row.end - row.length for held, row in earliest if held], default=0)
        earliest = max([layer.earliest_crop() for layer in self.layers], default=0)
        return earliest + self.skipped if earliest else 0

    def _keep(self, keep: int) -> None:
        """Keep the first `keep` tokens (columns)."""
        if keep >= self.length:
            return
        if self.rows is not None:  # a row's tokens end at its `end` column: those past `keep` go
            for row in self.rows:
                row._keep(max(0, row.length - max(0, row.end - keep)))
                row.end = min(row.end, keep)
        else:
            if keep < self.skipped:  # the end of text that stood apart goes too
                self.skipped = 0
            for layer in self.layers:
                layer.crop(keep - self.skipped)
        self.length = keep

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each row becomes `repeats` rows in a row, which share its buffers until they write."""
        rows = len(self.rows) if self.rows is not None else next(
            (x.shape[0] for layer in self.layers for x in layer.buffers.values()), 0)
        self.reorder_cache(torch.arange(rows).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.reorder_cache(indices)

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        """Beam search: row i now continues row beam_idx[i]."""
        if self.rows is not None:
            self.rows = [self.rows[i]._copy() for i in beam_idx.tolist()]
        self.layers = [layer.select_rows(beam_idx) for layer in self.layers]

    def _copy(self) -> "NSATitanCache":
        copy = NSATitanCache(0)
        copy.layers = [layer.copy() for layer in self.layers]
        copy.length, copy.skipped, copy.end, copy.recording = self.length, self.skipped, self.end, self.recording
        return copy


# ---- attention ----------------------------------------------------------------------------------

class DenseAttention(nn.Module):
    def __init__(self, c: NSATitanConfig):
        super().__init__()
        self.c, self.hd = c, c.dim // c.n_heads
        self.wq = nn.Linear(c.dim, c.n_heads * self.hd, bias=False)
        self.wk = nn.Linear(c.dim, c.n_kv_heads * self.hd, bias=False)
        self.wv = nn.Linear(c.dim, c.n_kv_heads * self.hd, bias=False)
        self.wo = nn.Linear(c.n_heads * self.hd, c.dim, bias=False)

    def forward(self, x, start: int, cache: LayerCache | None):
        B, T, _ = x.shape
        c = self.c
        positions = torch.arange(start, start + T, device=x.device)
        q = rope(self.wq(x).view(B, T, c.n_heads, self.hd), positions, c.rope_theta, start + T)
        k = rope(self.wk(x).view(B, T, c.n_kv_heads, self.hd), positions, c.rope_theta, start + T)
        v = self.wv(x).view(B, T, c.n_kv_heads, self.hd)
        if cache is not None:
            k, v = cache.extend(c.max_seq_len, k=k, v=v)
        qg, outs = grouped(q, c.n_kv_heads), []
        keys = torch.arange(start + T, device=x.device)
        for c0 in range(0, T, QUERY_CHUNK):
            t = positions[c0:c0 + QUERY_CHUNK, None]
            outs.append(attend(qg[:, :, c0:c0 + QUERY_CHUNK], k, v, (keys[None, :] <= t)[None, None])[0])
        return self.wo(ungrouped(torch.cat(outs, dim=2)).to(x.dtype).reshape(B, T, -1))


class Compressor(nn.Module):
    """phi: blocks [B, Tc, Hkv, l, D] -> [B, Tc, Hkv, D]."""

    def __init__(self, mode: str, block_size: int, head_dim: int):
        super().__init__()
        self.mode = mode
        if mode == "mlp":
            self.pos_embed = nn.Parameter(torch.zeros(block_size, head_dim))
            self.fc1 = nn.Linear(block_size * head_dim, 4 * head_dim)
            self.fc2 = nn.Linear(4 * head_dim, head_dim)

    def forward(self, blocks):
        if self.mode == "mean":
            return blocks.mean(dim=-2)
        B, Tc, Hkv, l, D = blocks.shape
        return self.fc2(F.gelu(self.fc1((blocks + self.pos_embed).reshape(B, Tc, Hkv, l * D))))


class NSAAttention(nn.Module):
    def __init__(self, c: NSATitanConfig):
        super().__init__()
        n = c.nsa
        self.c, self.hd = c, c.dim // c.n_heads
        self.l, self.d, self.lp, self.n, self.w = (n["block_size"], n["block_stride"], n["sel_block_size"],
                                                   n["num_selected"], n["window_size"])
        self.per_branch = n["kv_per_branch"]
        self.wq = nn.Linear(c.dim, c.n_heads * self.hd, bias=False)
        self.wkv = nn.Linear(c.dim, (6 if self.per_branch else 2) * c.n_kv_heads * self.hd, bias=False)
        self.wo = nn.Linear(c.n_heads * self.hd, c.dim, bias=False)
        self.compress_k = Compressor(n["compress"], self.l, self.hd)
        self.compress_v = Compressor(n["compress"], self.l, self.hd)
        if n["gate"] == "linear":
            self.gate = nn.Linear(c.dim, 3 * c.n_heads)
        else:
            hidden = max(c.dim // 4, 1)
            self.gate = nn.Sequential(nn.Linear(c.dim, hidden), nn.SiLU(), nn.Linear(hidden, 3 * c.n_heads))

    def _compressed(self, k_raw, v_raw, done: int, k_start: int = 0, v_start: int = 0):
        """Compressed keys (rotated) and values of the complete blocks after the first `done`, from raw keys/values
        held from positions k_start / v_start on (a cache keeps the tokens of blocks not yet compressed alone)."""
        end = k_start + k_raw.shape[1]
        total = 0 if end < self.l else (end - self.l) // self.d + 1
        starts = torch.arange(done, max(total, done), device=k_raw.device) * self.d
        rows = starts[:, None] + torch.arange(self.l, device=k_raw.device)  # [new blocks, l]
        k_cmp = self.compress_k(k_raw[:, rows - k_start].transpose(2, 3))
        v_cmp = self.compress_v(v_raw[:, rows - v_start].transpose(2, 3))
        return rope(k_cmp, starts + self.l - 1, self.c.rope_theta, end), v_cmp

    def _select(self, probs, t, num_blocks: int):
        """Top-n selection blocks [B, Hkv, C, n] (-1 unused) for queries at positions t [C] from the
        compressed probabilities [B, Hkv, C, G, Tc]."""
        Tc = probs.shape[-1]
        i, j = torch.arange(Tc, device=t.device)[:, None], torch.arange(num_blocks, device=t.device)[None, :]
        # tokens shared by compression block i [i*d, i*d + l) and selection block j, in strides
        shared = (torch.minimum(i * self.d + self.l, (j + 1) * self.lp) - torch.maximum(i * self.d, j * self.lp))
        return self._top(probs.sum(dim=3) @ (shared.clamp_min(0) // self.d).float(), t)  # scores [B, Hkv, C, Ts]

    def _top(self, scores, t):
        """Top-n selection blocks [B, Hkv, C, n] (-1 unused) from the group scores [B, Hkv, C, Ts] of the queries
        at positions t [C]: the current block, block 0 and the previous block first, then by score."""
        j = torch.arange(scores.shape[-1], device=t.device)[None, :]
        current = (t // self.lp)[:, None]
        big = torch.finfo(torch.float32).max
        rank = torch.zeros(t.shape[0], scores.shape[-1], device=t.device)
        rank = rank.masked_fill(j == current - 1, torch.nextafter(torch.tensor(big), torch.tensor(0.0)).item())
        rank = rank.masked_fill(j == 0, big).masked_fill(j == current, float("inf"))
        rank = rank.masked_fill(j > current, float("-inf"))
        order = torch.sort(scores + rank, dim=-1, descending=True, stable=True).indices[..., :self.n]
        used = torch.arange(order.shape[-1], device=t.device)[None, :] <= current  # the valid picks come first
        return torch.where(used, order, -1)

    def _spread(self, p, num_blocks: int):
        """p [..., Tc] spread onto selection blocks by overlap, [..., Ts], multiplying only the overlapping pairs
        (linear in Tc, where _select's [Tc, Ts] matrix grows with the square of the context). Selection block j
        spans strides [j*S, (j+1)*S) (S = l'/d) and compression block i strides [i, i + span) (span = l/d): they
        overlap for i - j*S in 1 - span .. S - 1, by a count that depends on that offset alone."""
        span, S = self.l // self.d, self.lp // self.d
        offset = torch.arange(1 - span, S, device=p.device)
        weights = ((offset + span).clamp_max(S) - offset.clamp_min(0)).to(p.dtype)
        # Block j reads p[j*S - (span - 1) ...]: pad before block 0 and after the last block, then one window each.
        padded = F.pad(p, (span - 1, num_blocks * S - p.shape[-1]))
        return padded.unfold(-1, weights.numel(), S) @ weights

    def forward(self, x, start: int, cache: LayerCache | None):
        B, T, _ = x.shape
        c, Hkv = self.c, self.c.n_kv_heads
        positions = torch.arange(start, start + T, device=x.device)
        q = rope(self.wq(x).view(B, T, c.n_heads, self.hd), positions, c.rope_theta, start + T)
        kv = self.wkv(x).view(B, T, -1, Hkv, self.hd).unbind(2)
        if self.per_branch:
            k_raw, v_raw, k_sel, v_sel, k_win, v_win = kv
            k_sel, k_win = (rope(k, positions, c.rope_theta, start + T) for k in (k_sel, k_win))
        else:
            k_raw, v_raw = kv
            k_sel = k_win = rope(k_raw, positions, c.rope_theta, start + T)
            v_sel = v_win = v_raw
        win_start = 0  # the position of k_win's first key
        if cache is None:
            k_cmp, v_cmp = self._compressed(k_raw, v_raw, 0)
        else:
            held = cache.count("k_raw")  # after a crop, only the blocks these tokens complete are kept
            cache.crop_names(0 if held < self.l else (held - self.l) // self.d + 1, "k_cmp", "v_cmp")
            # Every token for selection; for compression the tokens of blocks not yet compressed (fewer than l before
            # a step), for the window the w - 1 before a step: bounded tails.
            k_sel, v_sel = cache.extend(c.max_seq_len, k_sel=k_sel, v_sel=v_sel)
            if self.per_branch:
                (k_raw, v_raw), raw_start = cache.extend_recent(self.l - 1, c.max_seq_len, k_raw=k_raw, v_raw=v_raw)
                (k_win, v_win), win_start = cache.extend_recent(self.w - 1, c.max_seq_len, k_win=k_win, v_win=v_win)
                v_start = raw_start
            else:  # shared K/V: the window reads the selection's keys and values, compression the values too
                (k_raw,), raw_start = cache.extend_recent(self.l - 1, c.max_seq_len, k_raw=k_raw)
                k_win, v_win, v_raw, v_start = k_sel, v_sel, v_sel, 0
            new_blocks = self._compressed(k_raw, v_raw, cache.count("k_cmp"), raw_start, v_start)
            most = max(0, (c.max_seq_len - self.l) // self.d + 1)  # the blocks max_seq_len tokens hold
            k_cmp, v_cmp = cache.extend(most, **dict(zip(("k_cmp", "v_cmp"), new_blocks)))

        gates = torch.sigmoid(self.gate(x)).view(B, T, c.n_heads, 3).float()
        g = grouped(gates, Hkv)  # [B, Hkv, T, G, 3]
        qg = grouped(q, Hkv)
        # fp32 scores and selection whatever autocast region calls the model (transformers' Trainer with bf16,
        # say): in bf16 they would pick other blocks than the trained model did.
        with torch.autocast(x.device.type, enabled=False):
            if T == 1:  # a decode step
                outs = [self._attend_one(qg, g, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, start, win_start)]
            else:
                outs = self._attend_chunks(qg, g, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, positions, start + T,
                                           win_start)
        return self.wo(ungrouped(torch.cat(outs, dim=2)).to(x.dtype).reshape(B, T, -1))

    def _attend_chunks(self, qg, g, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, positions, end, win_start: int):
        """The three branches, gated, for query chunks of QUERY_CHUNK: a list of [B, Hkv, C, G, D] (k_win / v_win
        hold the keys from position win_start on)."""
        T, outs = qg.shape[2], []
        keys = torch.arange(end, device=qg.device)
        win_keys = keys[win_start:]
        blocks = torch.arange(k_cmp.shape[1], device=qg.device)
        for c0 in range(0, T, QUERY_CHUNK):
            qc, t = qg[:, :, c0:c0 + QUERY_CHUNK], positions[c0:c0 + QUERY_CHUNK]
            o_cmp, probs = attend(qc, k_cmp, v_cmp, (blocks[None, :] * self.d + self.l - 1 <= t[:, None])[None, None])
            chosen = self._select(probs, t, -(-int(t[-1] + 1) // self.lp))  # [B, Hkv, C, n]
            spare = -(-end // self.lp)  # unused slots (-1) mark this extra column, never read
            in_block = torch.zeros(*chosen.shape[:3], spare + 1, dtype=torch.bool, device=qg.device)
            in_block.scatter_(-1, torch.where(chosen < 0, spare, chosen), True)
            sel_visible = in_block[..., keys // self.lp] & (keys[None, :] <= t[:, None])
            o_sel = attend(qc, k_sel, v_sel, sel_visible)[0]
            win_visible = (win_keys[None, :] <= t[:, None]) & (win_keys[None, :] > t[:, None] - self.w)
            o_win = attend(qc, k_win, v_win, win_visible[None, None])[0]
            gc = g[:, :, c0:c0 + QUERY_CHUNK, :, :, None]
            outs.append(gc[..., 0, :] * o_cmp + gc[..., 1, :] * o_sel + gc[..., 2, :] * o_win)
        return outs

    def _attend_one(self, qg, g, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, t: int, win_start: int):
        """_attend_chunks for one query at position t, the last of the keys ([B, Hkv, 1, G, D]), reading only
        what each branch sees, so that beyond the compressed keys a decode step costs the same at any length:
        every compressed block (each complete one ends by t), the tokens of the chosen blocks, the last w keys."""
        B, Hkv, device = qg.shape[0], qg.shape[1], qg.device
        o_cmp, probs = attend(qg, k_cmp, v_cmp, torch.ones(1, 1, 1, k_cmp.shape[1], dtype=torch.bool, device=device))
        scores = self._spread(probs.sum(dim=3), -(-(t + 1) // self.lp))  # [B, Hkv, 1, Ts]
        chosen = self._top(scores, torch.tensor([t], device=device))[:, :, 0]  # [B, Hkv, n]
        tokens = (chosen[..., None] * self.lp + torch.arange(self.lp, device=device)).flatten(2)  # [B, Hkv, n*l']
        visible = (tokens >= 0) & (tokens <= t)  # an unused slot (-1) gives negative tokens
        tokens = tokens.clamp(0, t)  # hidden slots read a real token, masked out
        rows, heads = torch.arange(B, device=device)[:, None, None], torch.arange(Hkv, device=device)[None, :, None]
        k_chosen, v_chosen = k_sel[rows, tokens, heads].float(), v_sel[rows, tokens, heads].float()
        o_sel = attend_by_head(qg, k_chosen, v_chosen, visible[:, :, None])[0]
        first = max(0, t - self.w + 1)
        win = slice(first - win_start, None)
        o_win = attend(qg, k_win[:, win], v_win[:, win], torch.ones(1, 1, 1, t + 1 - first, dtype=torch.bool,
                                                                    device=device))[0]
        gc = g[..., None]
        return gc[..., 0, :] * o_cmp + gc[..., 1, :] * o_sel + gc[..., 2, :] * o_win


# ---- the model ----------------------------------------------------------------------------------

class Block(nn.Module):
    def __init__(self, c: NSATitanConfig):
        super().__init__()
        self.attention_norm = RMSNorm(c.dim, c.norm_eps)
        self.attention = NSAAttention(c) if c.attention == "nsa" else DenseAttention(c)
        self.ffn_norm = RMSNorm(c.dim, c.norm_eps)
        self.feed_forward = SwiGLU(c.dim, c.mlp_hidden_dim)

    def forward(self, x, start: int, cache: LayerCache | None):
        x = x + self.attention(self.attention_norm(x), start, cache)
        return x + self.feed_forward(self.ffn_norm(x))


class NSATitanModel(nn.Module):
    """The trainer's module tree (tok_embeddings, layers, norm, output), so weights keep their names."""

    def __init__(self, c: NSATitanConfig):
        super().__init__()
        self.tok_embeddings = nn.Embedding(c.vocab_size, c.dim)
        self.layers = nn.ModuleList(Block(c) for _ in range(c.n_layers))
        self.norm = RMSNorm(c.dim, c.norm_eps)
        self.output = nn.Linear(c.dim, c.vocab_size, bias=False)

    def forward(self, input_ids, cache: NSATitanCache | None):
        seen = 0 if cache is None else cache.length
        start = seen - (0 if cache is None else cache.skipped)  # positions count from the document's first token
        h = self.tok_embeddings(input_ids)
        for i, layer in enumerate(self.layers):
            h = layer(h, start, None if cache is None else cache.layers[i])
        if cache is not None:
            cache.length = seen + input_ids.shape[1]
        return self.output(self.norm(h))


def _refuse_unsupported(input_ids, kwargs: dict, start: int) -> None:
    """Standard arguments this model does not compute with raise, rather than being ignored (start: the tokens
    the cache has seen, where the new tokens' positions begin)."""
    if kwargs.get("inputs_embeds") is not None or input_ids is None:
        raise ValueError("this model takes input_ids (token ids), not inputs_embeds")
    for name in ("output_hidden_states", "output_attentions"):
        if kwargs.get(name):
            raise ValueError(f"this model does not return {name[len('output_'):]}; call it without {name}")
    positions = kwargs.get("position_ids")
    if positions is not None:
        expected = torch.arange(start, start + positions.shape[-1], device=positions.device)
        if not bool((positions == expected).all()):
            raise ValueError(f"this model places tokens by their order: position_ids, when given, must be "
                             f"{start}, {start + 1}, ... (the tokens seen before these), as it computes them itself")


def _unseen(input_ids, attention_mask, cache: NSATitanCache, kwargs: dict) -> int:
    """How many of the last input tokens the cache has not seen. The mask, when generate() gives one, spans every
    column; else transformers 5 says how many are new (next_sequence_length), or gives the whole sequence, or in a
    chunked prefill just the next chunk, which after the first is never longer than what the cache holds."""
    given = input_ids.shape[1]
    if attention_mask is not None and attention_mask.dim() == 2:
        new = attention_mask.shape[1] - cache.length
    elif kwargs.get("next_sequence_length") is not None:
        new = kwargs["next_sequence_length"]
    else:
        new = given - cache.length if given > cache.length else given
    if not 0 < new <= given:
        raise ValueError(f"generate() was given {given} token(s) and a cache that has seen {cache.length}: give the "
                         f"whole sequence, the cache's tokens and at least one more (a cache from a forward over a "
                         f"sequence has seen its last token too: make it from all but that one)")
    return new


class NSATitanForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = NSATitanConfig
    base_model_prefix = "model"
    _no_split_modules = ["Block"]
    # With tie_word_embeddings the output layer is the embedding table: said so, transformers keeps them one
    # tensor through from_pretrained and save_pretrained (5 takes target -> source, 4 the tied names).
    _tied_weights_keys = ({"model.output.weight": "model.tok_embeddings.weight"}
                          if int(transformers.__version__.split(".")[0]) >= 5 else ["model.output.weight"])

    def __init__(self, config: NSATitanConfig):
        super().__init__(config)
        self.model = NSATitanModel(config)
        if config.tie_word_embeddings:
            self.model.output.weight = self.model.tok_embeddings.weight
        self._drafting = False  # inside a generate() that drafts: the caches forward() makes record (crop() needs it)
        self.post_init()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the model keeps its own cache (NSATitanCache)

    def _init_weights(self, module):
        std = self.config.init_std
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)
        elif isinstance(module, Compressor) and module.mode == "mlp":
            nn.init.zeros_(module.pos_embed)

    def get_input_embeddings(self):
        return self.model.tok_embeddings

    def get_output_embeddings(self):
        return self.model.output

    def forward(self, input_ids=None, attention_mask=None, past_key_values=None, use_cache=None, labels=None,
                return_dict=None, cache=None, **kwargs):
        # transformers 5 names the cache `cache`, 4 past_key_values; generate() checks its arguments against these names
        cache = past_key_values if past_key_values is not None else cache
        if cache is not None and not isinstance(cache, NSATitanCache):
            raise ValueError(f"this model keeps its own cache (NSATitanCache), not {type(cache).__name__}")
        _refuse_unsupported(input_ids, kwargs, 0 if cache is None else cache.length)
        caching = cache is not None or ((use_cache if use_cache is not None else self.config.use_cache)
                                        and not self.training)
        padded = attention_mask is not None and not bool(attention_mask.all())
        saved = None if cache is None else cache.state()
        try:
            logits, cache = self._logits(input_ids, attention_mask, cache, caching, padded)
        except BaseException:  # out of memory, say, after some layers took the tokens: as if the call never ran
            if saved is not None:
                cache.rewind(saved)
            raise
        loss = None
        if labels is not None:
            targets = labels[:, 1:]
            if padded:  # a pad neither predicts nor is predicted
                real = attention_mask[:, -input_ids.shape[1]:].bool()
                targets = targets.masked_fill(~(real[:, :-1] & real[:, 1:]), -100)
            # transformers' Trainer passes num_items_in_batch (the label tokens of every micro-batch of a step)
            # to a forward that takes **kwargs, and then leaves the division over accumulation to the model.
            items = kwargs.get("num_items_in_batch")
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), targets.flatten(), ignore_index=-100,
                                   reduction="mean" if items is None else "sum")
            loss = loss if items is None else loss / items
        output = CausalLMOutputWithPast(loss=loss, logits=logits, **{_CACHE_FIELD: cache})
        return output if return_dict is not False else output.to_tuple()

    def _logits(self, input_ids, attention_mask, cache, caching: bool, padded: bool):
        """The logits [B, T, V] and the cache (a new one when caching and none was given)."""
        apart = self._opens_apart(input_ids, cache)
        if padded and attention_mask.shape == input_ids.shape:  # a row of pads alone opens with nothing
            apart &= attention_mask[:, 0].bool()
        alike = not bool(apart.any()) or bool(apart.all())  # rows opening otherwise run one by one
        if (padded and cache is None and not caching and attention_mask.shape == input_ids.shape
                and _prefix_rows(attention_mask) and alike):
            # Right padding only: each row's tokens start at column 0, and a causal model's logits there do not
            # depend on the pads after them, so the batch runs in one call (training on padded batches). Pads
            # become token 0, so a pad id outside the vocabulary is never looked up.
            self._check_length(input_ids.shape[1])
            real = attention_mask.bool()
            logits = self._decode(input_ids.masked_fill(~real, 0), None, bool(apart.any()))
            logits = logits.masked_fill(~real[..., None], 0)
        elif padded or not alike or (cache is not None and cache.rows is not None):
            logits, cache = self._padded_rows(input_ids, attention_mask, cache, caching)
        else:
            self._check_length((0 if cache is None else cache.length) + input_ids.shape[1])
            if cache is None and caching:
                cache = NSATitanCache(self.config.n_layers, recording=self._drafting)
            logits = self._decode(input_ids, cache, bool(apart.any()))
        return logits, cache

    def generate(self, inputs=None, generation_config=None, **kwargs):
        """transformers' generate, refused before any work when the prompt and max_new_tokens (or max_length)
        exceed max_seq_len, rather than failing at the token past it with the generated tokens lost. With no input it
        starts from bos_token_id as one real token: the pad is the end of text, so transformers would take that start
        for padding once eos_token_id=None lets it read a mask from the ids."""
        config = generation_config if generation_config is not None else self.generation_config
        start = kwargs.get("bos_token_id", getattr(config, "bos_token_id", None))
        if inputs is None and kwargs.get("input_ids") is None and start is not None:
            inputs = torch.full((1, 1), start, dtype=torch.long, device=self.device)
            kwargs.setdefault("attention_mask", torch.ones_like(inputs))
        prompt = inputs if inputs is not None else kwargs.get("input_ids")
        new = kwargs.get("max_new_tokens", getattr(config, "max_new_tokens", None))
        if prompt is not None and prompt.dim() == 2:
            length = (prompt.shape[1] + new if new is not None else
                      kwargs.get("max_length", getattr(config, "max_length", None)))
            limit = self.config.max_seq_len
            if length is not None and length > limit:
                raise ValueError(f"the prompt's {prompt.shape[1]} tokens and the tokens asked for make {length}, over "
                                 f"max_seq_len {limit}: ask for at most {max(limit - prompt.shape[1], 0)} new tokens "
                                 f"(max_new_tokens)")
        drafting = [name for name in _DRAFTING if kwargs.get(name, getattr(config, name, None))]
        if drafting and hasattr(candidate_generator, "_crop_past_key_values"):
            raise ValueError(f"{drafting[0]}: transformers {transformers.__version__} takes back rejected draft tokens "
                             f"only from its own cache classes, not from this model's cache; upgrade transformers "
                             f"(4.57 and later call the cache's crop()) or generate without {drafting[0]}")
        if kwargs.get("past_key_values") is None and kwargs.get("cache") is None:
            kwargs.pop("past_key_values", None)
            use_cache = kwargs.get("use_cache", getattr(config, "use_cache", True))
            other = kwargs.get("cache_implementation", getattr(config, "cache_implementation", None))
            if _CACHE_FIELD == "cache" and use_cache is not False and other is None:
                # transformers 5 makes no cache for a model with its own (it warns that a cache_implementation is
                # ignored), and assisted decoding and chunked prefill need one before the first step: an empty one
                # that the first forward fills
                kwargs["cache"] = NSATitanCache(self.config.n_layers)
        given = kwargs.get("cache", kwargs.get("past_key_values"))
        if drafting and isinstance(given, NSATitanCache):
            # crop() takes back any of the drafts a forward checked only from a recording cache; transformers 5 says
            # so itself (activate_past_recording), 4.57 does not
            given._record()
        self._drafting = bool(drafting)
        try:
            return super().generate(inputs, generation_config, **kwargs)
        finally:
            self._drafting = False

    def _opens_apart(self, input_ids, cache) -> torch.Tensor:
        """[B] bool: the rows that open with an end of text standing apart (config.leading_eos_apart), where
        nothing was seen before them."""
        if not self.config.leading_eos_apart or (cache is not None and cache.length) or input_ids.shape[1] == 0:
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        return input_ids[:, 0] == self.config.eos_token_id

    def _decode(self, input_ids, cache: NSATitanCache | None, apart: bool):
        """The decoder's logits; `apart`: every row opens with an end of text standing apart, which is read alone,
        the rest from position 0 without it (the cache counts it as seen, not held)."""
        if not apart:
            return self.model(input_ids, cache)
        first = self.model(input_ids[:, :1], None)
        if cache is not None:
            cache.length = cache.skipped = 1
        if input_ids.shape[1] == 1:
            return first
        return torch.cat([first, self.model(input_ids[:, 1:], cache)], dim=1)

    def _check_length(self, tokens: int):
        if tokens > self.config.max_seq_len:
            raise ValueError(f"{tokens} tokens exceed max_seq_len {self.config.max_seq_len}")

    def _padded_rows(self, input_ids, attention_mask, cache, caching: bool):
        """Logits [B, T, V] of a padded batch, each row computed alone on its real tokens (and cache)."""
        B, T = input_ids.shape
        seen = 0 if cache is None else cache.length
        if attention_mask is None:
            attention_mask = torch.ones(B, seen + T, dtype=torch.long, device=input_ids.device)
        if attention_mask.shape != (B, seen + T):
            raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}; expected {(B, seen + T)}: "
                             f"every column seen so far and the {T} new ones")
        real = attention_mask.bool()
        for i in range(B):
            where = real[i].nonzero()
            if len(where) and int(where[-1] - where[0]) + 1 != len(where):
                raise ValueError(f"row {i} of attention_mask has padding between its tokens: pad only before "
                                 "a sequence or after it (for generation, before it: tokenizer.padding_side = "
                                 "'left')")
        if cache is None and caching:
            cache = NSATitanCache(self.config.n_layers, rows=B, recording=self._drafting)
        elif cache is not None and cache.rows is None:  # an unpadded start, now padded: one cache per row
            if cache.length:
                raise ValueError("padding appeared after generation started unpadded; pad the prompts instead")
            cache.rows = [NSATitanCache(self.config.n_layers, recording=cache.recording) for _ in range(B)]
        if cache is not None and len(cache.rows) != B:
            raise ValueError(f"the cache holds {len(cache.rows)} rows, the batch {B}")
        logits = self.model.output.weight.new_zeros(B, T, self.config.vocab_size)
        for i in range(B):
            new = real[i, seen:]
            if not bool(new.any()):
                continue
            row_cache, row = None if cache is None else cache.rows[i], input_ids[i, new][None]
            self._check_length((0 if row_cache is None else row_cache.length) + int(new.sum()))
            logits[i, new] = self._decode(row, row_cache, bool(self._opens_apart(row, row_cache)))[0].to(logits.dtype)
            if row_cache is not None:
                row_cache.end = seen + int(new.nonzero()[-1]) + 1
        if cache is not None:
            cache.length = seen + T
        return logits, cache

    def prepare_inputs_for_generation(self, input_ids, past_key_values=None, attention_mask=None, use_cache=True,
                                      **kwargs):
        # transformers 4 passes the cache as past_key_values, 5 as cache (with next_sequence_length)
        cache = past_key_values if past_key_values is not None else kwargs.get("cache")
        if isinstance(cache, NSATitanCache):  # empty when generate() starts with one; another kind: forward refuses it
            input_ids = input_ids[:, input_ids.shape[1] - _unseen(input_ids, attention_mask, cache, kwargs):]
        return {"input_ids": input_ids, "past_key_values": cache, "use_cache": use_cache,
                "attention_mask": attention_mask}
