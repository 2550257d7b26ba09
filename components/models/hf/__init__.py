"""The transformer as a Hugging Face folder: the hf_format hook (components/model_hooks.py).

modeling_nsa_titan.py is the self-contained file the folder ships; it keeps the trainer's module
names under `model.`, so weights map one to one.
"""

from __future__ import annotations

import os

import torch

from components.model_hooks import HFFormat
from components.models.args import TransformerArgs

MODELING_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "modeling_nsa_titan.py")
PREFIX = "model."
NSA_FIELDS = ("block_size", "block_stride", "sel_block_size", "num_selected", "window_size", "compress",
              "kv_per_branch", "gate")


def _config(args: TransformerArgs, vocab_size: int) -> dict:
    nsa = {name: getattr(args.nsa, name) for name in NSA_FIELDS} if args.attention == "nsa" else {}
    return dict(vocab_size=vocab_size, dim=args.dim, n_layers=args.n_layers, n_heads=args.n_heads,
                n_kv_heads=args.n_kv_heads, mlp_hidden_dim=args.mlp_hidden_dim(), norm_eps=args.norm_eps,
                rope_theta=args.rope_theta, max_seq_len=args.max_seq_len, attention=args.attention, nsa=nsa,
                init_std=args.init_std, tie_word_embeddings=args.tie_embeddings)


def _to_hf(state_dict: dict) -> dict:
    # Tied weights are written twice (safetensors refuses shared storage); the model ties them again.
    return {PREFIX + name: tensor.detach().contiguous().clone() for name, tensor in state_dict.items()}


def _from_hf(tensors: dict, tied: bool) -> dict:
    state = {name[len(PREFIX):]: tensor for name, tensor in tensors.items() if name.startswith(PREFIX)}
    if tied and "tok_embeddings.weight" in state:
        head = state.setdefault("output.weight", state["tok_embeddings.weight"])  # transformers saves it once
        if not torch.equal(head, state["tok_embeddings.weight"]):  # untied by something: which one counts?
            raise ValueError("the output layer's weights differ from the embedding table's, but the model ties "
                             "them (tie_embeddings = true)")
    return state


def hf_format(args: TransformerArgs, vocab_size: int) -> HFFormat:
    return HFFormat(modeling_file=MODELING_FILE, model_type="nsa_titan", architectures=("NSATitanForCausalLM",),
                    auto_map={"AutoConfig": "modeling_nsa_titan.NSATitanConfig",
                              "AutoModelForCausalLM": "modeling_nsa_titan.NSATitanForCausalLM"},
                    config=_config(args, vocab_size), max_length=args.max_seq_len, to_hf=_to_hf,
                    from_hf=lambda tensors: _from_hf(tensors, args.tie_embeddings))
