"""Named builders: the recipe names parts, the registry turns names into objects.

Kinds: model, attention_backend, data_source, tokenizer, optimizer, lr_schedule. A part has a
builder and, optionally, an argument dataclass whose fields become recipe fields. User modules
listed in job.plugins call `register` to add their own parts.

NSA backends have one table, components.nsa's: the attention_backend kind reads and writes it
rather than keeping a copy here.
"""

from __future__ import annotations

import dataclasses
import errno
import inspect
import math
import traceback
from dataclasses import dataclass
from typing import Any, Callable

from components import nsa
from components.errors import UserError

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
    plugin: bool = False  # registered by a module of job.plugins (its failures are named as a plugin's)


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
    # The built-in parts first: a plugin's name clashes with them now (or replaces them), not later.
    ensure_builtins()
    if args is not None and not dataclasses.is_dataclass(args):
        raise ValueError(f"{kind} {name!r}: args must be a dataclass type (its fields become recipe fields), "
                         f"got {args!r}")
    if args is not None and kind in ("lr_schedule", "attention_backend"):
        raise ValueError(f"{kind} {name!r}: a {kind} takes no args (nothing would read them)")
    if kind == "attention_backend":
        nsa.register_backend(name, build, doc=doc, replace=replace)
        return _backend_part(name)
    if name in _PARTS[kind] and not replace:
        raise ValueError(f"{kind} {name!r} is already registered; pass replace=True to override it")
    part = Part(kind, name, build, args, doc, **model_hooks, plugin=not _registering_builtins)
    _PARTS[kind][name] = part
    return part


def build(kind: str, name: str, args: Any) -> Any:
    """The part `name` built from its recipe arguments (a part without arguments takes none)."""
    part = get(kind, name)
    return call(part, args) if part.args is not None else call(part)


# What each kind's builder is called with and returns: what a plugin's message says it should be.
CONTRACTS = {
    "model": "build(args, vocab_size) -> a torch.nn.Module with init_weights() and forward(tokens, documents=None) "
             "-> logits [batch, tokens, vocab]",
    "data_source": "build(args) -> a source with check(), fingerprint() and documents(shard, num_shards, split, seed, "
                   "epoch, cursor) (components/data/sources/base.py)",
    "tokenizer": "build(args) -> a tokenizer with name, vocab_size, bos_id, eos_id, encode(text) and decode(ids) "
                 "(components/data/tokenizers.py)",
    "optimizer": "build(model, lr=, betas=, eps=, weight_decay=[, args=]) -> a torch.optim.Optimizer",
    "lr_schedule": "shape(progress) -> factor: progress through the decay in [0, 1] to 1 at its start and 0 at its end",
}
# What a built part must have, checked once where a plugin builds it.
_MEMBERS = {"model": ("init_weights", "forward"), "data_source": ("check", "fingerprint", "documents"),
            "tokenizer": ("vocab_size", "bos_id", "eos_id", "encode", "decode")}


def call(part: Part, *args: Any, **kwargs: Any) -> Any:
    """part.build(*args, **kwargs); a plugin's part that fails, or builds something without what its kind
    needs, is one UserError naming the part, where it failed and the contract of its kind."""
    if not part.plugin:
        return part.build(*args, **kwargs)
    try:
        built = part.build(*args, **kwargs)
    except UserError:
        raise
    except OSError as exc:
        if exc.errno == errno.ENOSPC:  # a full disk is the disk's, said as such by the command
            raise
        raise _failed_to_build(part, exc) from None
    except Exception as exc:
        raise _failed_to_build(part, exc) from None
    missing = [member for member in _MEMBERS.get(part.kind, ()) if not hasattr(built, member)]
    if missing:
        raise UserError(f"{part.kind} {part.name!r} (a plugin's) built a {type(built).__name__} without "
                        f"{', '.join(missing)}. Fix: {part.kind} builders are called as {CONTRACTS[part.kind]}")
    return built


def schedule_shape_problem(part: Part, samples: int = 101) -> tuple[str, str] | None:
    """(why, fix) when a plugin's lr_schedule breaks its contract anywhere over its range, else None: a factor
    above the peak, below the floor or not finite would otherwise train (or poison the weights) without a word."""
    if not part.plugin:
        return None
    fix = f"lr_schedule shapes are called as {CONTRACTS['lr_schedule']}"
    for i in range(samples):
        progress = i / (samples - 1)
        try:
            value = float(part.build(progress))
        except Exception as exc:
            return f"fails at progress {progress:g}: {type(exc).__name__}: {exc}", fix
        wanted = 1.0 if i == 0 else 0.0 if i == samples - 1 else None
        if not math.isfinite(value) or not -1e-6 <= value <= 1 + 1e-6 or \
                (wanted is not None and abs(value - wanted) > 1e-6):
            expected = f"{wanted:g}" if wanted is not None else "a factor in [0, 1]"
            return f"gives {value!r} at progress {progress:g}, where the contract asks for {expected}", fix
    return None


def _failed_to_build(part: Part, exc: Exception) -> UserError:
    """The plugin's line where its builder failed (the deepest in the builder's own file; else the deepest
    outside this module; else the call itself, whose arguments the builder does not take)."""
    try:
        own_file = inspect.getsourcefile(part.build)
    except TypeError:  # a builtin or a C function
        own_file = None
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename != __file__]
    inside = [f for f in frames if own_file and f.filename == own_file] or frames
    where = f"{inside[-1].filename}, line {inside[-1].lineno}" if inside else "in the call: its parameters"
    return UserError(f"{part.kind} {part.name!r} (a plugin's) failed to build: {type(exc).__name__}: {exc} "
                     f"({where}). Fix: {part.kind} builders are called as {CONTRACTS[part.kind]}")


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
_registering_builtins = False


def ensure_builtins() -> None:
    """Register the built-in parts once, on first use (keeps `import nsa_titan` light)."""
    global _builtins_loaded, _registering_builtins
    if not _builtins_loaded:
        _builtins_loaded = True
        from nsa_titan import parts

        _registering_builtins = True
        try:
            parts.register_builtins(register, build)
        finally:
            _registering_builtins = False
