"""A recipe plugin registering transformers the engine must handle with care: three that torch.compile
cannot compile whole, one without hooks, one whose telemetry cannot split sequences.

`breaking_transformer`: each block reads a tensor value into Python (`float(...)`, a host sync)
between attention and the feed-forward: with fullgraph = false every block compiles as two graphs
with a break between them (with fullgraph = true, Dynamo may capture the read in one graph).
`branching_transformer`: each block branches on a tensor's value, which Dynamo cannot trace in any
mode: a break with fullgraph = false, an error with fullgraph = true. `eager_transformer`: each block
opts out of compilation, so compiling it changes nothing. `nsa-titan inspect` must report all three,
with reasons and source lines. `many_breaks_transformer`: each block breaks at 12 lines, more than the console
lists.
"""

from __future__ import annotations

import torch
from torch import nn

from components.models import Transformer, TransformerArgs, TransformerBlock, transformer_hooks
from nsa_titan.registry import register


class BreakingBlock(TransformerBlock):
    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        scale = max(float(x.detach().abs().amax()), 1.0)  # the deliberate graph break
        return x + self.feed_forward(self.ffn_norm(x)) / scale


class BranchingBlock(TransformerBlock):
    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        if x.detach().abs().amax() > 1e4:  # the deliberate data-dependent branch
            x = x.clamp(-1e4, 1e4)
        return x + self.feed_forward(self.ffn_norm(x))


class ManyBreaksBlock(TransformerBlock):
    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        # Twelve deliberate breaks, each on a line of its own (a loop's would be one line), each after an op (a
        # break with no op before it leaves no graph).
        x = x * 1.0
        torch._dynamo.graph_break()
        x = x * 1.0
        torch._dynamo.graph_break()
        x = x * 1.0
        torch._dynamo.graph_break()
        x = x * 1.0
        torch._dynamo.graph_break()
        x = x * 1.0
        torch._dynamo.graph_break()
        x = x * 1.0
        torch._dynamo.graph_break()
        x = x * 1.0
        torch._dynamo.graph_break()
        x = x * 1.0
        torch._dynamo.graph_break()
        x = x * 1.0
        torch._dynamo.graph_break()
        x = x * 1.0
        torch._dynamo.graph_break()
        x = x * 1.0
        torch._dynamo.graph_break()
        x = x * 1.0
        torch._dynamo.graph_break()
        return x + self.feed_forward(self.ffn_norm(x))


class EagerBlock(TransformerBlock):
    @torch.compiler.disable
    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return super().forward(x, cos, sin)


class TransformerOf(Transformer):
    """The transformer with every block of the class `block`."""

    def __init__(self, args: TransformerArgs, vocab_size: int, block: type[TransformerBlock]):
        super().__init__(args, vocab_size)
        self.layers = nn.ModuleList(block(args) for _ in range(args.n_layers))
        if not self.norm.weight.is_meta:
            self.init_weights()


def builder_of(block: type[TransformerBlock]):
    def build(args: TransformerArgs, vocab_size: int) -> TransformerOf:
        return TransformerOf(args, vocab_size, block)

    return build


# The plugin is imported again whenever a recipe naming it is resolved (e.g. once per test).
register("model", "breaking_transformer", builder_of(BreakingBlock), args=TransformerArgs,
         doc="transformer whose blocks read a tensor into Python (a graph break)", replace=True,
         **transformer_hooks())
register("model", "branching_transformer", builder_of(BranchingBlock), args=TransformerArgs,
         doc="transformer whose blocks branch on a tensor's value (a graph break even under fullgraph)", replace=True,
         **transformer_hooks())
register("model", "many_breaks_transformer", builder_of(ManyBreaksBlock), args=TransformerArgs,
         doc="transformer whose blocks break the graph at 12 lines", replace=True, **transformer_hooks())
register("model", "eager_transformer", builder_of(EagerBlock), args=TransformerArgs,
         doc="transformer whose blocks opt out of torch.compile", replace=True, **transformer_hooks())
# The transformer without its hooks: the engine cannot tell its blocks, so it cannot compile them.
register("model", "blockless_transformer", Transformer, args=TransformerArgs,
         doc="transformer registered without hooks", replace=True)


def _whole_rows_telemetry(model, tokens, documents=None):
    """A telemetry hook written before context parallelism: it cannot take a rank's share of the rows."""
    return {}


# The transformer whose telemetry hook has no context= parameter.
register("model", "whole_rows_telemetry_transformer", Transformer, args=TransformerArgs,
         doc="transformer whose telemetry hook takes whole rows only", replace=True,
         **{**transformer_hooks(), "telemetry": _whole_rows_telemetry})
