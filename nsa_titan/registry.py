"""Named builders: the recipe names parts, the registry turns names into objects.

Kinds: model, attention_backend, data_source, tokenizer, optimizer, lr_schedule. A part has a
builder and, optionally, an argument dataclass whose fields become recipe fields. User modules
listed in job.plugins call `register` to add their own parts.

NSA backends have one table, components.nsa's: the attention_backend kind reads and writes it
rather than keeping a copy here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from components import nsa

KINDS = ("model", "attention_backend", "data_source", "tokenizer", "optimizer", "lr_schedule")


@dataclass(frozen=True)
class Part:
    kind: str
    name: str
    build: Callable[..., Any]
    args: type | None = None
    doc: str = ""
    # Models only, all optional: how the engine reaches into a model without knowing its insides.
    # The records they return, and what each is for, are in components/model_hooks.py.
    flops_per_token: Callable[..., float] | None = None  # (args, vocab_size, seq_len) -> float, for MFU
    telemetry: Callable[..., dict] | None = None  # (model, tokens, documents=None) -> {name: 0-d tensor}
    telemetry_applies: Callable[[Any], bool] | None = None  # (args) -> whether telemetry has anything to say
    parallel_plan: Callable[..., Any] | None = None  # (model) -> ParallelPlan: blocks and shard groups
    activation_memory: Callable[..., Any] | None = None  # (args, MemoryLayout) -> ActivationMemory, for doctor's estimate
    self_check: Callable[..., Any] | None = None  # (args, device[, compute_dtype]) -> SelfCheck, run by doctor
    attention_maps: Callable[..., dict] | None = None  # (model, tokens) -> {layer: AttentionMap}, for plots
    describe: Callable[[Any], str] | None = None  # (args) -> a few words on the model's attention, for reports
    documents: Callable[..., Any] | None = None  # (model, document_starts, device) -> forward's documents= or None
    hf_format: Callable[..., Any] | None = None  # (args, vocab_size) -> HFFormat, for export/import in HF form
    # (model, document_starts or None, rows, SequenceShard, device) -> forward's context= (context parallelism)
    context_shard: Callable[..., Any] | None = None
    compiled: Callable[..., None] | None = None  # (model, backend): the plan's blocks were compiled so
    device_problem: Callable[..., str | None] | None = None  # (args, device) -> why it cannot run there, or None
    # (args, device) -> (args of the same model that run there, a note when they differ), for readers on the CPU
    args_for_device: Callable[..., Any] | None = None


_PARTS: dict[str, dict[str, Part]] = {kind: {} for kind in KINDS if kind != "attention_backend"}


class UnknownPartError(KeyError):
    def __init__(self, kind: str, name: str):
        self.kind, self.name = kind, name
        super().__init__(f"unknown {kind} {name!r}; available: {', '.join(available(kind)) or 'none'}")

    def __str__(self) -> str:
        return self.args[0]


def register(kind: str, name: str, build: Callable[..., Any], *, args: type | None = None,
             doc: str = "", replace: bool = False, **model_hooks: Callable[..., Any]) -> Part:
    """Add a part. Registering a taken name is an error unless replace=True.

    An attention_backend's build is the op itself, with nsa_attention's signature minus `backend`;
    it must compute the reference's function (see tests/test_nsa_reference.py for the properties).
    Models may pass the hooks of Part (flops_per_token=, telemetry=, telemetry_applies=, parallel_plan=,
    activation_memory=, self_check=, attention_maps=, describe=, documents=, hf_format=, context_shard=,
    compiled=, device_problem=, args_for_device=); a
    transformer-shaped model passes **components.models.transformer_hooks().
    """
    if kind not in KINDS:
        raise ValueError(f"unknown part kind {kind!r}; kinds are {', '.join(KINDS)}")
    if kind == "attention_backend":
        nsa.register_backend(name, build, doc=doc, replace=replace)
        return _backend_part(name)
    if name in _PARTS[kind] and not replace:
        raise ValueError(f"{kind} {name!r} is already registered; pass replace=True to override it")
    part = Part(kind, name, build, args, doc, **model_hooks)
    _PARTS[kind][name] = part
    return part


def build(kind: str, name: str, args: Any) -> Any:
    """The part `name` built from its recipe arguments (a part without arguments takes none)."""
    part = get(kind, name)
    return part.build(args) if part.args is not None else part.build()


def get(kind: str, name: str) -> Part:
    if kind == "attention_backend":
        if name not in nsa.available_backends():
            raise UnknownPartError(kind, name)
        return _backend_part(name)
    ensure_builtins()
    try:
        return _PARTS[kind][name]
    except KeyError:
        raise UnknownPartError(kind, name) from None


def available(kind: str) -> list[str]:
    if kind == "attention_backend":
        return sorted(nsa.available_backends())
    ensure_builtins()
    return sorted(_PARTS[kind])


def _backend_part(name: str) -> Part:
    """A view of components.nsa's backend table entry as a part."""
    backend = nsa.get_backend(name)
    doc = f"built-in NSA backend {name!r}: {backend.doc}" if backend.built_in else backend.doc
    return Part("attention_backend", name, backend.attention, None, doc)


_builtins_loaded = False


def ensure_builtins() -> None:
    """Register the built-in parts once, on first use (keeps `import nsa_titan` light)."""
    global _builtins_loaded
    if not _builtins_loaded:
        _builtins_loaded = True
        from nsa_titan import parts

        parts.register_builtins(register, build)
