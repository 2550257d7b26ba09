"""What a model part tells the engine: the records its hooks return.

A model registers these hooks with its builder (nsa_titan.registry.register("model", ...)); the
engine calls them and knows nothing else about the model's insides. All are optional.

    parallel_plan(model) -> ParallelPlan      the blocks to activation-checkpoint, compile and shard
                                              one by one, and the other modules sharded on their own
                                              before the root (the model itself)
    activation_memory(args, layout) -> ActivationMemory   what one block keeps for backward, and what
                                              a forward holds once, when run as layout (a MemoryLayout)
                                              says
    self_check(args, device[, compute_dtype]) -> SelfCheck   a short numerical check of the model's op on this
                                              device (compute_dtype: the run's autocast type, or None)
    attention_maps(model, tokens, context=None) -> {layer: AttentionMap}   what each sparse attention
                                              layer chose (with context: the whole rows', gathered)
    telemetry(model, tokens, documents=None, context=None) -> {name: 0-d tensor}   documents and context
                                              as the forward gets them (with context, every rank of the
                                              group calls it and gets the whole rows' numbers)
    telemetry_applies(args) -> bool
    flops_per_token(args, vocab_size, seq_len) -> float    for MFU
    describe(args) -> str                     the model's attention in a few words, for reports
    documents(model, document_starts, device) -> the forward's `documents=` argument for a batch whose
                                              document_starts [B, T] bool (on the host) the loader gave,
                                              or None when the model attends across documents
    hf_format(args, vocab_size) -> HFFormat   how the model reads and writes as a Hugging Face folder
    context_shard(model, document_starts, rows, shard, device) -> the forward's `context=` argument when
                                              each of the batch's rows is split over a context-parallel
                                              group (components.sequence_shard.SequenceShard); the model
                                              then gets only this rank's tokens of every row
    device_problem(args, device) -> str | None   why the model cannot run on this device, with the fix
                                              (asked at start-up, before anything is built); None if it can
    args_for_device(args, device) -> (args, note or None)   arguments of the same model (its weights mean
                                              the same) that run on this device, e.g. another attention
                                              backend, for commands that read a trained model on the CPU
    compiled(model, backend) -> None          the engine compiled the plan's blocks with this torch.compile
                                              backend: the model may pick kernels that pay off only when
                                              fused (the transformer's dense attention: FlexAttention under
                                              inductor)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

OK, WARN, FAIL = "ok", "warn", "fail"


@dataclass(frozen=True)
class ShardGroup:
    """Modules sharded together as one unit. keep_gathered: the group runs last in forward, so
    freeing its parameters after forward would only gather them again for backward."""

    modules: tuple[Any, ...]
    keep_gathered: bool = False


@dataclass(frozen=True)
class ParallelPlan:
    blocks: Sequence[Any]  # the repeated blocks, in order (e.g. an nn.ModuleList)
    groups: tuple[ShardGroup, ...] = ()  # sharded after the blocks, before the root


@dataclass(frozen=True)
class ActivationMemory:
    """Elements per token, for the engine's memory estimate (nsa_titan/doctor/memory.py)."""

    blocks: int  # how many blocks the model has
    per_block: float  # saved for backward by one block, per token the rank holds
    block_input: float  # kept by an activation-checkpointed block (its input)
    # With context parallelism: also saved per token of the whole rows (keys and values gathered from
    # the group, say). 0 when each rank holds whole rows.
    per_row_token: float = 0.0
    # Held once per forward (not per block) for each (query the rank holds, key of its row) pair: an
    # explicit attention mask, say. 0 when attention needs none.
    per_row_pair: float = 0.0
    # Bytes held for the length of one block's call beside what blocks save, at MemoryLayout.tokens (an
    # attention kernel's fp32 partials, say).
    workspace_bytes: float = 0.0


@dataclass(frozen=True)
class MemoryLayout:
    """How the engine will run the model, as far as its memory depends on it."""

    context_parallel: int = 1  # ranks sharing each row
    compile_backend: str | None = None  # torch.compile backend of the blocks; None: eager
    device_type: str = "cuda"
    tokens: int = 0  # tokens the rank holds per micro-batch (0: not known)
    compute_bytes: int = 2  # bytes per element the blocks compute in: 2 under bf16 autocast, 4 in fp32
    seq_len: int = 0  # tokens per sample, the whole row's even where context parallelism splits it (0: not known)


@dataclass(frozen=True)
class SelfCheck:
    name: str  # e.g. "NSA backend 'triton' on cuda"
    status: str  # OK, WARN or FAIL
    detail: str  # what was checked and what was seen, with the fix when it failed


@dataclass(frozen=True)
class AttentionMap:
    """One sparse attention layer on one input: what it chose."""

    gates: Any  # [B, T, H, len(branches)] in (0, 1)
    selected: Any  # [B, T, groups, n] block indices chosen per query and key/value group, -1 unused
    block_tokens: int  # tokens per selectable block
    groups: int  # key/value groups (each selects on its own)
    branches: tuple[str, ...]  # the gated branches' names, in the order of gates' last dimension
    legend: dict = field(default_factory=dict)  # the layer's settings, as the plots' legend shows them


@dataclass(frozen=True)
class HFFormat:
    """The model as a Hugging Face transformers folder (nsa-titan export --format hf, and back).

    The engine writes config.json from `config` (plus the token ids and what it needs to come back),
    model.safetensors from `to_hf(state_dict)`, and copies `modeling_file`, which `auto_map` names
    for trust_remote_code. `from_hf(tensors)` gives the model's state dict back."""

    modeling_file: str  # path of a self-contained modeling .py file
    auto_map: dict  # e.g. {"AutoConfig": "modeling_x.XConfig", "AutoModelForCausalLM": "modeling_x.XForCausalLM"}
    model_type: str
    architectures: tuple[str, ...]
    config: dict  # the config class's own fields
    max_length: int  # the longest input, for the tokenizer's model_max_length
    to_hf: Any  # (state_dict) -> {name: tensor}, no two sharing storage
    from_hf: Any  # ({name: tensor}) -> state_dict
