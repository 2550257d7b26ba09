"""What the engine checks of what a plugin's parts give it, at the first use: weights init_weights() leaves
unset, documents a source yields, token ids a tokenizer gives, logits a model returns. Each mistake was a
traceback deep in the engine, a NaN stop blamed on model.init_std, or a run on garbage with exit 0."""

from __future__ import annotations

import pytest

from nsa_titan import cli
from tests.registry_state import registry_restored

PLUGIN = '''
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from components.data.sources import SyntheticArgs, SyntheticSource
from nsa_titan.registry import register


@dataclass
class Args:
    mode: str = field(default="fine", metadata={"doc": "which mistake"})


class Bigram(nn.Module):
    def __init__(self, args, vocab_size):
        super().__init__()
        self.mode = args.mode
        self.embed, self.out = nn.Embedding(vocab_size, 8), nn.Linear(8, vocab_size)
        self.mix = nn.Linear(8, 8)

    def init_weights(self):
        self.embed.reset_parameters()
        self.out.reset_parameters()
        if self.mode != "half_init":
            self.mix.reset_parameters()

    def forward(self, tokens, **kwargs):
        logits = self.out(self.mix(self.embed(tokens)))
        if self.mode == "tuple":
            return logits, None
        if self.mode == "narrow":
            return logits[..., :100]
        if self.mode == "detached":
            return logits.detach()
        return logits


class Odd(SyntheticSource):
    """Synthetic documents, then one mistake."""

    def __init__(self, args):
        super().__init__(SyntheticArgs())
        self.mode = args.mode

    def documents(self, shard, num_shards, split, seed, epoch, cursor):
        for document, after in super().documents(shard, num_shards, split, seed, epoch, cursor):
            if self.mode == "bare":
                yield "a bare string"
            elif self.mode == "floats":
                yield np.arange(5, dtype=np.float32), after
            elif self.mode == "bytes":
                yield b"bytes", after
            elif self.mode == "big_ids":
                yield np.array([1, 2, 300]), after
            else:
                yield document, after


register("model", "part_outputs_bigram", Bigram, args=Args)
register("data_source", "part_outputs_odd", Odd, args=Args)
'''


RECIPE = """
[model]
name = "part_outputs_bigram"
[data]
tokenizer = "byte"
logical_shards = 4
[training]
steps = 1
seq_len = 64
local_batch_size = 2
device = "cpu"
[checkpoint]
enable = false
[validation]
enable = false
"""


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    """(recipe, plugin file); the registry as it was afterwards."""
    folder = tmp_path_factory.mktemp("plugin")
    (folder / "part_outputs_plugin.py").write_text(PLUGIN)
    (folder / "bigram.toml").write_text(RECIPE)
    with registry_restored():
        yield str(folder / "bigram.toml"), str(folder / "part_outputs_plugin.py")


def _train(plugin, tmp_path, capsys, *flags) -> tuple[int, str]:
    recipe, path = plugin
    code = cli.main(["train", recipe, f"--job.plugins={path}", f"--job.dump_folder={tmp_path}", *flags])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--model.mode=half_init"], "error: the model's init_weights() (Bigram) leaves 2 weight(s) unset: mix.weight, "
                                 "mix.bias; they would start as whatever memory held. Fix: set every parameter and "
                                 "buffer in init_weights()"),
    (["--model.mode=tuple"], "error: the model's forward returned a tuple, not a logits tensor."),
    (["--model.mode=narrow"], "error: the model returned logits of shape [2, 64, 100], over 100 tokens, fewer than "
                              "the tokenizer's 258."),
    (["--model.mode=detached"], "error: the model returned logits no parameter's gradient reaches"),
    (["--data.source=part_outputs_odd", "--data.part_outputs_odd.mode=bare"],
     "error: the data source (Odd) yielded a str, not a (document, cursor) pair."),
    (["--data.source=part_outputs_odd", "--data.part_outputs_odd.mode=floats"],
     "error: the data source (Odd) gave a document as an array of float32 with shape [5]. Fix: a document is a str"),
    (["--data.source=part_outputs_odd", "--data.part_outputs_odd.mode=bytes"],
     "error: the data source (Odd) gave a document as a bytes."),
    (["--data.source=part_outputs_odd", "--data.part_outputs_odd.mode=big_ids"],
     "error: the data source (Odd) gave token id 300, outside the tokenizer's vocabulary of 258 (ids 0 to 257)."),
])
def test_a_part_that_gives_the_wrong_thing_is_one_line(plugin, tmp_path, capsys, flags, message):
    code, err = _train(plugin, tmp_path, capsys, *flags)
    assert code == 2 and err.startswith(message) and err.count("\n") == 1, err


def test_a_part_that_keeps_the_contract_trains(plugin, tmp_path, capsys):
    code, err = _train(plugin, tmp_path, capsys, "--data.source=part_outputs_odd")
    assert code == 0, err
