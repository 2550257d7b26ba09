"""The built-in parts: what a recipe can name without plugins.

The registry calls `register_builtins(register, build)` on first use, handing over its `register`
and `build` (so this module needs nothing from the registry). NSA backends are not listed: the registry reads
components.nsa's backend table directly.
"""

from __future__ import annotations


def register_builtins(register, build) -> None:
    from components import data, models, optim

    register("model", "transformer", models.build_transformer, args=models.TransformerArgs,
             doc="decoder-only transformer; attention = 'nsa' or 'dense'", **models.transformer_hooks())
    for name, (args_cls, factory) in data.SOURCES.items():
        register("data_source", name, factory, args=args_cls)
    # A mixture's sources are built as the recipe's own source is (plugin sources included).
    register("data_source", data.MIXTURE,
             lambda args: data.build_mixture_source(args, lambda name, part_args: build("data_source", name,
                                                                                      part_args)),
             args=data.MixtureArgs, doc="a weighted mixture of other sources, [data.mixture.sources.NAME] each")
    for name, (args_cls, factory) in data.TOKENIZERS.items():
        register("tokenizer", name, factory, args=args_cls)
    register("optimizer", "adamw", optim.build_adamw, doc="AdamW, weight decay on matrices only")
    register("optimizer", "muon", optim.build_muon, args=optim.MuonArgs,
             doc="Muon for the linear layers' matrices, AdamW for embeddings, output head, norms and biases")
    for name, shape in optim.SCHEDULES.items():
        register("lr_schedule", name, shape)
