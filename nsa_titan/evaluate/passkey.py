"""A synthetic long-context retrieval probe (passkey in a haystack), generated offline.

Each prompt is filler text of about `length` tokens with one sentence hiding a random 5-digit key at
a relative depth (0 = the start, 1 = just before the question), and ends with a question whose
answer is the key; it starts with BOS where training started documents with one (data.add_bos). A
trial passes when the greedy continuation's text starts with the key (text, not token ids: a
tokenizer may split the digits differently after the prompt).
"""

from __future__ import annotations

import random

import torch

from components.data import decode_text

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = " The pass key is {key}. Remember it."
QUESTION = " What is the pass key? The pass key is"


def shortest_length(tokenizer, add_bos: bool = False) -> int:
    """The fewest prompt tokens that hold the needle and the question (and BOS, with add_bos)."""
    return len(tokenizer.encode(NEEDLE.format(key="99999"))) + len(tokenizer.encode(QUESTION)) + int(add_bos)


def prompt(tokenizer, length: int, depth: float, key: str, add_bos: bool = False) -> list[int]:
    """Token ids of about `length` tokens (never more, BOS first with add_bos) with the key's sentence at
    `depth`."""
    needle = tokenizer.encode(NEEDLE.format(key=key))
    question = tokenizer.encode(QUESTION)
    filler_unit = tokenizer.encode(FILLER)
    start = [tokenizer.bos_id] if add_bos else []
    room = length - len(start) - len(needle) - len(question)
    if room < 0:
        raise ValueError(f"length {length} is too short for the needle and the question "
                         f"({len(needle) + len(question)} tokens)")
    filler = (filler_unit * (room // max(len(filler_unit), 1) + 1))[:room]
    cut = round(depth * room)
    return start + filler[:cut] + needle + filler[cut:] + question


def unwritable_keys(tokenizer) -> str | None:
    """What the tokenizer makes of the digits a key is written in, when it loses some (a vocabulary without them
    drops them): no continuation can then spell the key, and every trial fails whatever the model reads.
    None when it writes them all."""
    digits = " 0123456789"
    read = decode_text(tokenizer, list(tokenizer.encode(digits)))
    return None if digits.strip() in read else read


def answer_tokens(tokenizer) -> int:
    """Tokens generated per trial: room for a 5-digit key however the tokenizer splits it."""
    return len(tokenizer.encode(" 99999")) + 2


@torch.no_grad()
def passkey_accuracy(model, tokenizer, generate, lengths: list[int], depths: list[float], trials: int, seed: int,
                     progress, add_bos: bool = False) -> dict:
    """accuracy[i][j] at lengths[i] and depths[j], over `trials` random keys each (add_bos: the run's
    data.add_bos)."""
    rng = random.Random(seed)
    device = next(model.parameters()).device
    grid = [(length, depth) for length in lengths for depth in depths]
    correct = {cell: 0 for cell in grid}
    for length, depth in progress(grid):
        for _ in range(trials):
            key = str(rng.randint(10000, 99999))
            ids = prompt(tokenizer, length, depth, key, add_bos)
            out = generate(model, torch.tensor([ids], device=device), answer_tokens(tokenizer), temperature=0.0)
            correct[(length, depth)] += int(decode_text(tokenizer, out[0, len(ids):].tolist()).strip().startswith(key))
    return {"lengths": lengths, "depths": depths, "trials": trials,
            "accuracy": [[correct[(length, depth)] / trials for depth in depths] for length in lengths]}
