"""The transformer's answers to the engine's model hooks (components/model_hooks.py).

    parallel_plan      blocks = model.layers; the token embedding, then the final norm with the
                       output layer (kept gathered), sharded on their own unless tied
    activation_memory  the per-block count of saved activations, by attention kind (formula below)
    self_check         the NSA backend's causality / coverage / parity check (components/nsa/self_check.py)
    attention_maps, telemetry, telemetry_applies   components/models/telemetry.py
    flops_per_token    components/models/flops.py
    describe           the attention in a few words, for reports
    documents          with model.document_masking, the forward's document layout from a batch's
                       document_starts (components/nsa/documents.py for NSA,
                       components/models/dense_documents.py for dense), else None
    hf_format          components/models/hf: the model as a Hugging Face folder
    context_shard      context parallelism: this rank's share of a batch's rows (components/models/context_parallel.py)
    compiled           the blocks' compile backend: dense attention takes FlexAttention under inductor

Elements saved per token per block (activation_memory's per_block):
    4 d + 4 h                              two RMSNorms (input, output) and SwiGLU (w1, w3, silu, product)
  + dense attention: 3 d + 2 kv + H        q, k, v, attention output and its log-sum-exp
  + NSA: 6 d + (n_kv + 2) kv + 2 (l/d) kv + d/2 + 3 H
                                           q, the fused K/V projection, rotated keys, compression MLP
                                           inputs, gate MLP, three branch outputs in fp32, gated output
d = dim, h = SwiGLU hidden, kv = n_kv_heads x head_dim, H = n_heads, n_kv = 6 with kv_per_branch
else 2, l = block_size, d = block_stride. Attention scores are not counted: the reference computes
them in bounded chunks and the kernels keep none. A checkpointed block keeps its input (dim).

With context parallelism (cp > 1) the key/value terms are kept for every token of the whole rows
instead (per_row_token): dense keeps the gathered k and v (2 kv); NSA keeps the compression MLP's
inputs over the whole rows (2 (l/d) kv), the keys and values each chunk's op call picks out (p kv,
about one whole row's worth over the two calls; fewer with documents) and the RoPE tables of the
rotated keys at every row position (2 r D). p = 4 and r = 2 with kv_per_branch, else 2 and 1;
D = head_dim.

Dense attention over packed documents, where FlexAttention does not run (dense_documents.py), holds
one explicit mask per forward, shared by the layers: one element per (local query, key of its row)
pair (per_row_pair), counted for rows of several documents.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from components.errors import UserError
from components.model_hooks import FAIL, OK, ActivationMemory, MemoryLayout, ParallelPlan, SelfCheck, ShardGroup
from components.models.args import TransformerArgs
from components.models.dense_documents import flex_attention_runs
from components.models.flops import flops_per_token
from components.models.hf import hf_format
from components.models.telemetry import attention_maps, collect_nsa_telemetry, telemetry_applies


def parallel_plan(model) -> ParallelPlan:
    if model.output.weight is model.tok_embeddings.weight:  # tied: one unit with the root
        return ParallelPlan(model.layers)
    return ParallelPlan(model.layers, (ShardGroup((model.tok_embeddings,)),
                                       ShardGroup((model.norm, model.output), keep_gathered=True)))


def activation_memory(args: TransformerArgs, layout: MemoryLayout = MemoryLayout()) -> ActivationMemory:
    d, H = args.dim, args.n_heads
    context_parallel = layout.context_parallel
    kv = args.n_kv_heads * args.head_dim
    per_block = 4 * d + 4 * args.mlp_hidden_dim()
    if args.attention != "nsa":
        per_block += 3 * d + H
        keys = row_keys = 2 * kv
    else:
        nsa = args.nsa
        n_kv, picked, rotated = (6, 4, 2) if nsa.kv_per_branch else (2, 2, 1)
        per_block += 6 * d + d / 2 + 3 * H
        compression = 2 * (nsa.block_size / nsa.block_stride) * kv
        keys = (n_kv + 2) * kv + compression
        row_keys = compression + picked * kv + 2 * rotated * args.head_dim
    mask = args.attention != "nsa" and args.document_masking and \
        not flex_attention_runs(layout.compile_backend, layout.device_type)
    pairs = 1.0 if mask else 0.0
    workspace = _nsa_workspace_bytes(args, layout.tokens, layout.seq_len or layout.tokens, layout.compute_bytes)
    if context_parallel == 1:
        return ActivationMemory(blocks=args.n_layers, per_block=per_block + keys, block_input=d, per_row_pair=pairs,
                                workspace_bytes=workspace)
    return ActivationMemory(blocks=args.n_layers, per_block=per_block, block_input=d, per_row_token=row_keys,
                            per_row_pair=pairs, workspace_bytes=workspace)


def _nsa_workspace_bytes(args: TransformerArgs, tokens: int, row_keys: int, element_bytes: int) -> float:
    """The Triton selected branch's fp32 partials when it takes the block layout for these tokens."""
    if args.attention != "nsa" or args.nsa.backend != "triton":
        return 0.0
    from components.nsa.triton import tile_configs

    shape = (tokens, args.n_heads, args.slots_used, args.head_dim, args.nsa.sel_block_size, element_bytes)
    layout = tile_configs.selected_layout_for(tokens, args.n_heads, args.n_kv_heads, *shape[2:], row_keys=row_keys)
    if layout != "block":
        return 0.0
    return float(tile_configs.block_layout_partial_bytes(*shape))


def _triton_without_cuda(args: TransformerArgs, device: torch.device) -> bool:
    from components.nsa.triton.launch import interpreting

    return args.attention == "nsa" and args.nsa.backend == "triton" and device.type != "cuda" and not interpreting()


def device_problem(args: TransformerArgs, device: torch.device) -> str | None:
    """Why the model cannot run on `device`, with the fix; None when it can."""
    if _triton_without_cuda(args, device):
        return (f"model.nsa.backend = 'triton' runs CUDA kernels, but this run is on {device.type}. Fix: run on a GPU "
                f"(training.device = 'cuda' or 'auto'), or set --model.nsa.backend=reference")
    return None


def args_for_device(args: TransformerArgs, device: torch.device) -> tuple[TransformerArgs, str | None]:
    """Arguments of the same model that run on `device` (the weights mean the same), and a note when they
    differ: a model trained with the Triton backend is read on the CPU with the reference one."""
    if not _triton_without_cuda(args, device):
        return args, None
    return (dataclasses.replace(args, nsa=dataclasses.replace(args.nsa, backend="reference")),
            f"model.nsa.backend = 'triton' runs CUDA kernels; on {device.type} the model computes with the "
            f"'reference' backend (the same function of the same weights)")


def self_check(args: TransformerArgs, device: torch.device, compute_dtype: torch.dtype | None = None) -> SelfCheck:
    """With NSA attention: does the chosen backend compute NSA on this device (a small problem, in fp32, and in
    compute_dtype, the half type the run computes in, when it has one)?"""
    from components.nsa.self_check import check_backend

    nsa = args.nsa
    if args.attention != "nsa":
        return SelfCheck("NSA backend", OK, f"not used (attention {args.attention!r})")
    name = f"NSA backend {nsa.backend!r} on {device.type}"
    problem = device_problem(args, device)
    if problem:  # training here refuses to start: so does the check
        return SelfCheck(name, FAIL, problem)
    hyper = dict(block_size=nsa.block_size, block_stride=nsa.block_stride, sel_block_size=nsa.sel_block_size,
                 num_selected=args.slots_used, window_size=nsa.window_size)
    start = time.perf_counter()
    try:
        failures = check_backend(nsa.backend, hyper, args.n_heads, args.n_kv_heads, args.head_dim, device,
                                 documents=args.document_masking, low_precision=compute_dtype)
    except UserError as exc:
        return SelfCheck(name, FAIL, str(exc))
    what = "causality, full coverage = dense attention"
    if nsa.backend != "reference":
        what += ", parity with the reference (outputs and gradients" + (", packed documents too" if
                                                                        args.document_masking else "")
        what += f"; in {compute_dtype} too)".replace("torch.", "") if compute_dtype else ")"
    if nsa.backend == "triton" and device.type != "cuda":
        what += " under Triton's interpreter"
    if failures:
        return SelfCheck(name, FAIL, "; ".join(failures))
    return SelfCheck(name, OK, f"{what}: passed in {time.perf_counter() - start:.1f} s")


def describe(args: TransformerArgs) -> str:
    """The attention in a few words: 'nsa (backend reference)' or 'dense'."""
    return f"nsa (backend {args.nsa.backend})" if args.attention == "nsa" else args.attention


def documents(model, document_starts: torch.Tensor, device: torch.device):
    """The forward's `documents` argument for a batch, or None when the recipe does not mask documents."""
    return model.document_layout(document_starts, device) if model.args.document_masking else None


def compiled(model, backend: str) -> None:
    """Dense attention masks documents through FlexAttention only where inductor fuses it (elsewhere
    it computes every score): tell the model which backend compiled its blocks."""
    model.compile_backend = backend


def context_shard(model, document_starts: torch.Tensor | None, rows: int, shard, device: torch.device):
    """The forward's `context` for this rank's share of a batch (context parallelism)."""
    return model.context_shard(document_starts, rows, shard, device)


def transformer_hooks() -> dict:
    """Every hook, as keyword arguments for register("model", ...); models built like the Transformer
    (plugins subclassing it) pass them too."""
    return dict(flops_per_token=flops_per_token, telemetry=collect_nsa_telemetry, telemetry_applies=telemetry_applies,
                parallel_plan=parallel_plan, activation_memory=activation_memory, self_check=self_check,
                attention_maps=attention_maps, describe=describe, documents=documents, hf_format=hf_format,
                context_shard=context_shard, compiled=compiled, device_problem=device_problem,
                args_for_device=args_for_device)
