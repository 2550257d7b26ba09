"""Autoregressive sampling with the KV cache."""

from __future__ import annotations

import math

import torch

from components.errors import UserError


def sample_next(
    logits: torch.Tensor, *, temperature: float, top_k: int | None, generator: torch.Generator | None
) -> torch.Tensor:
    """logits [B, V] -> next tokens [B]; argmax when temperature == 0."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    # In fp64 (a temperature as small as 1e-300 is 0 in fp32), shifted so the largest is 0 before dividing:
    # a tiny temperature sends the others to -inf (nearly greedy), where dividing first overflowed to inf
    # and the softmax gave NaN.
    logits = logits.double()
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def check_decodes(model) -> None:
    """UserError unless `model` decodes as generate() needs: new_kv_cache(), forward_step() and a max_seq_len
    in its args (the transformer's; a plugin's model may have none of them)."""
    missing = [name for name in ("new_kv_cache", "forward_step") if not callable(getattr(model, name, None))]
    if not isinstance(getattr(getattr(model, "args", None), "max_seq_len", None), int):
        missing.append("args.max_seq_len")
    if missing:
        raise UserError(f"{type(model).__name__} cannot generate text: decoding needs the model's {', '.join(missing)} "
                        f"(components/models/transformer.py's Transformer has them). Fix: give the model a KV-cache "
                        f"decoding path like the transformer's; sample and eval's passkey probe decode")


def _last_logits(model, tokens: torch.Tensor, cache) -> torch.Tensor:
    """The logits [B, V] of the last of `tokens` [B, Tnew] from forward_step, held to its contract: logits
    [B, Tnew, V]. (A plugin model's [B, V] went on as one number per row, decoding token 0 in silence.)"""
    logits = model.forward_step(tokens, cache)
    if not (isinstance(logits, torch.Tensor) and logits.dim() == 3 and logits.shape[:2] == tokens.shape):
        got = f"shape {list(logits.shape)}" if isinstance(logits, torch.Tensor) else f"a {type(logits).__name__}"
        raise UserError(f"{type(model).__name__}.forward_step returned {got} for tokens of shape "
                        f"{list(tokens.shape)}; decoding needs their logits [batch, tokens, vocab], as "
                        f"components/models/transformer.py's Transformer.forward_step returns. Fix: return the "
                        f"logits of every token it is given")
    return logits[:, -1]


def check_room(model, prompt_tokens: int, max_new_tokens: int) -> None:
    """UserError, with the fix, unless the prompt and the new tokens fit in the model's max_seq_len."""
    T0, total = prompt_tokens, prompt_tokens + max_new_tokens
    if total > model.args.max_seq_len:
        room, limit = model.args.max_seq_len - T0, model.args.max_seq_len
        if room > 0:
            fix = f"ask for at most {room} new tokens (sample's --max-new-tokens), or shorten the prompt"
        elif max_new_tokens < limit:
            fix = (f"shorten the prompt to at most {limit - max_new_tokens} tokens, leaving room for the "
                   f"{max_new_tokens} new ones")
        else:
            fix = f"ask for fewer than {limit} new tokens and shorten the prompt to fit beside them"
        raise UserError(f"prompt + new tokens = {T0} + {max_new_tokens} = {total} exceeds the model's max_seq_len "
                        f"{model.args.max_seq_len}. Fix: {fix}")


@torch.no_grad()
def generate(
    model,
    prompt: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    stop_id: int | None = None,
) -> torch.Tensor:
    """Continue prompt [B, T0] by max_new_tokens tokens; returns [B, T0 + max_new_tokens], or fewer new
    tokens when every row has produced `stop_id` (say the end-of-text token): rows that ended earlier
    carry on past theirs, for the caller to cut.

    The prompt is prefilled in one `forward_step`, then one token per step. temperature == 0 is
    greedy decoding; otherwise softmax(logits / temperature), restricted to the top_k logits when
    given, sampled with `generator` (the global RNG when None).
    """
    if prompt.dim() != 2 or prompt.shape[1] < 1:
        raise UserError(f"prompt must be [batch, tokens] with at least one token, got shape {tuple(prompt.shape)}")
    if max_new_tokens < 0:
        raise UserError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if not 0 <= temperature < math.inf:  # nan too, which the sampler would meet as nan probabilities
        raise UserError(f"temperature must be finite and >= 0 (0 = greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise UserError(f"top_k must be >= 1 or None, got {top_k}")
    check_decodes(model)
    device = next(model.parameters()).device
    if generator is not None and generator.device != device:
        raise UserError(f"the generator is on {generator.device} but the model is on {device}; "
                        f"create it with torch.Generator(device={str(device)!r})")
    prompt = prompt.to(device)
    B, T0 = prompt.shape
    total = T0 + max_new_tokens
    check_room(model, T0, max_new_tokens)
    out = prompt.new_empty(B, total)
    out[:, :T0] = prompt
    if max_new_tokens == 0:
        return out
    cache = model.new_kv_cache(B, capacity=total)
    logits = _last_logits(model, prompt, cache)
    ended = torch.zeros(B, dtype=torch.bool, device=device)
    for t in range(T0, total):
        out[:, t] = sample_next(logits, temperature=temperature, top_k=top_k, generator=generator)
        if stop_id is not None:
            ended |= out[:, t] == stop_id
            if bool(ended.all()):
                return out[:, :t + 1]
        if t + 1 < total:
            logits = _last_logits(model, out[:, t:t + 1], cache)
    return out
