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
import functools
import inspect
import math
import numbers
import traceback
import typing
from dataclasses import dataclass
from typing import Any, Callable

import torch

from components import nsa
from components.errors import UserError, raised

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
    # (args, MemoryLayout) -> ActivationMemory, for doctor's estimate
    activation_memory: Callable[..., Any] | None = None
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
    _check_hooks(kind, name, model_hooks)
    # The built-in parts first: a plugin's name clashes with them now (or replaces them), not later.
    ensure_builtins()
    if args is not None and not dataclasses.is_dataclass(args):
        raise ValueError(f"{kind} {name!r}: args must be a dataclass type (its fields become recipe fields), "
                         f"got {args!r}")
    if args is not None and kind in ("lr_schedule", "attention_backend"):
        raise ValueError(f"{kind} {name!r}: a {kind} takes no args (nothing would read them)")
    if args is not None:
        _check_args_fields(kind, name, args)
    if kind == "attention_backend":
        nsa.register_backend(name, build, doc=doc, replace=replace)
        return _backend_part(name)
    if name in _PARTS[kind] and not replace:
        raise ValueError(f"{kind} {name!r} is already registered; pass replace=True to override it")
    if not _registering_builtins:
        model_hooks = {hook: _plugin_hook(name, hook, fn) if callable(fn) else fn for hook, fn in model_hooks.items()}
    part = Part(kind, name, build, args, doc, **model_hooks, plugin=not _registering_builtins)
    _PARTS[kind][name] = part
    return part


# The model hooks register() takes: Part's fields less what every part has.
MODEL_HOOKS = tuple(f.name for f in dataclasses.fields(Part) if f.name not in ("kind", "name", "build", "args", "doc",
                                                                                  "plugin"))


def _check_hooks(kind: str, name: str, hooks: dict[str, Any]) -> None:
    """Refuse a hook no one would call: a misspelled one, or one given to a part that is not a model (it got
    Part's TypeError, or was kept in silence)."""
    from components.problems import suggest

    for hook in hooks:
        if hook not in MODEL_HOOKS:
            raise ValueError(f"{kind} {name!r}: {hook!r} is not a model hook{suggest(hook, list(MODEL_HOOKS))}; the "
                             f"hooks are {', '.join(MODEL_HOOKS)} (components/model_hooks.py)")
    if hooks and kind != "model":
        raise ValueError(f"{kind} {name!r}: hooks ({', '.join(hooks)}) are for models; nothing calls them for a "
                         f"{kind}")


def _plugin_hook(model: str, hook: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """A plugin model's hook whose failure is one UserError naming the model, the hook and the plugin's line (it
    was a traceback from inside the engine: a hook declared with other parameters than the engine passes, say).
    A device out of memory or a full disk stays what it is, for the command's own message."""
    from components import model_hooks

    record = {"parallel_plan": model_hooks.ParallelPlan, "activation_memory": model_hooks.ActivationMemory,
              "self_check": model_hooks.SelfCheck, "hf_format": model_hooks.HFFormat}.get(hook)
    fix = "Fix: components/model_hooks.py says how each hook is called and what it returns"

    @functools.wraps(fn)  # the engine reads a hook's parameters (inspect.signature follows __wrapped__)
    def called(*args: Any, **kwargs: Any) -> Any:
        try:
            given = fn(*args, **kwargs)
        except (UserError, torch.OutOfMemoryError):
            raise
        except (Exception, SystemExit) as exc:  # a plugin's sys.exit ended the command in silence
            if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
                raise
            frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename != __file__]
            where = f"{frames[-1].filename}, line {frames[-1].lineno}" if frames else "in the call: its parameters"
            raise UserError(f"model {model!r} (a plugin's): its {hook} hook failed: {raised(exc)} "
                            f"({where}). {fix}") from None
        if record is not None and not isinstance(given, record):
            raise UserError(f"model {model!r} (a plugin's): its {hook} hook returned a {type(given).__name__}, not "
                            f"the {record.__name__} the engine reads. {fix}")
        return given
    return called


# What an argument dataclass's field may be declared as: what the recipe reads, --help shows and a run saves.
ARG_TYPES = ("bool, int, float, str, list[bool | int | float | str], a dataclass (a sub-table) "
             "or dict[str, a dataclass] (named tables)")
_SCALARS = (bool, int, float, str)


def _check_args_fields(kind: str, name: str, args: type, seen: tuple[type, ...] = ()) -> None:
    """Refuse, at register(), a field the recipe could not hold: a type the recipe builder cannot read
    (Optional, dict, tuple, ...) or a default it cannot write as TOML (None, an object). Left to the
    recipe, either one failed every command later (--help included) with a traceback or a 'bug' message."""
    from nsa_titan.config.fields import default_of, is_dataclass_type, named_tables_of

    if args in seen:  # a dataclass nested within itself: checked already
        return
    try:
        hints = typing.get_type_hints(args)
    except Exception as exc:  # an annotation naming something its module does not define
        raise ValueError(f"{kind} {name!r}: the annotations of {args.__qualname__} cannot be read "
                         f"({type(exc).__name__}: {exc}); fields are {ARG_TYPES}") from None
    for fld in dataclasses.fields(args):
        if "args_for" in fld.metadata:  # another part's arguments: the engine builds and checks them
            continue
        tp, default = hints[fld.name], default_of(fld)
        where = f"{kind} {name!r}: argument {args.__qualname__}.{fld.name}"
        nested = tp if is_dataclass_type(tp) else named_tables_of(tp)
        if nested is not None:
            _check_args_fields(kind, name, nested, seen + (args,))
            holds = isinstance(default, tp) if is_dataclass_type(tp) else (
                isinstance(default, dict) and all(isinstance(v, nested) for v in default.values()))
        elif _scalar_type(tp) is not None:
            holds = _holds(tp, default)
        else:
            raise ValueError(f"{where} has type {_type_text(tp)}, which no recipe field can hold: declare it "
                             f"as one of {ARG_TYPES} (a field that may be unset: a sentinel such as 0 or \"\")")
        if default is not dataclasses.MISSING and not holds:
            raise ValueError(f"{where} ({_type_text(tp)}) has the default {default!r}, which a recipe cannot "
                             f"hold (the recipe and --help write every default as TOML): give it a default "
                             f"of its type (a field that may be unset: a sentinel such as 0 or \"\"), or none")


def _scalar_type(tp: Any) -> Any:
    """tp when the recipe reads it as a value (a scalar, or a list of scalars), else None."""
    if tp in _SCALARS:
        return tp
    if typing.get_origin(tp) is list and len(typing.get_args(tp)) == 1 and typing.get_args(tp)[0] in _SCALARS:
        return tp
    return None


def _holds(tp: Any, value: Any) -> bool:
    """Whether `value` is one the recipe holds in a field of type tp (and so writes and reads back)."""
    if typing.get_origin(tp) is list:
        return isinstance(value, list) and all(_holds(typing.get_args(tp)[0], item) for item in value)
    if isinstance(value, bool):
        return tp is bool
    if tp is float:
        return isinstance(value, (int, float)) and math.isfinite(value)
    return isinstance(value, tp)


def _type_text(tp: Any) -> str:
    """A declared type as written (Optional[int], dict[str, int], Widget)."""
    return tp.__qualname__ if isinstance(tp, type) and typing.get_origin(tp) is None else \
        str(tp).replace("typing.", "")


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
    "optimizer": "build(model, lr=, betas=, eps=, weight_decay=[, args=]) -> a torch.optim.Optimizer whose param "
                 "groups hold every model parameter that requires grad",
    "lr_schedule": "shape(progress) -> factor: progress through the decay in [0, 1] to 1 at its start and 0 at its end",
}


def contract_of(part: Part) -> str:
    """How `part`'s builder is called and what it returns: a data_source or tokenizer registered without args=
    is built with no arguments (build(), not build(args)), an optimizer without args= gets no args=."""
    builders = f"{part.kind} builders"
    if part.args is None and part.kind in ("data_source", "tokenizer"):
        return f"{builders} registered without args= are called as build(){CONTRACTS[part.kind][len('build(args)'):]}"
    if part.args is None and part.kind == "optimizer":
        return f"{builders} registered without args= are called as {CONTRACTS['optimizer'].replace('[, args=]', '')}"
    if part.kind in ("data_source", "tokenizer", "optimizer"):
        return f"{builders} registered with args= are called as {CONTRACTS[part.kind].replace('[, args=]', ', args=')}"
    return f"{builders} are called as {CONTRACTS[part.kind]}"


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
    except (Exception, SystemExit) as exc:  # a plugin's sys.exit ended the command in silence
        raise _failed_to_build(part, exc) from None
    missing = [member for member in _MEMBERS.get(part.kind, ()) if not hasattr(built, member)]
    if missing:
        raise UserError(f"{part.kind} {part.name!r} (a plugin's) built a {type(built).__name__} without "
                        f"{', '.join(missing)}. Fix: {contract_of(part)}")
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
            given = part.build(progress)
        except (Exception, SystemExit) as exc:
            return f"fails at progress {progress:g}: {raised(exc)}", fix
        # A real number only: float() would pass a text ("0.5") or a tensor here, which the optimizer's
        # step then fails on (a bool is no factor either).
        if isinstance(given, bool) or not isinstance(given, numbers.Real):
            return (f"gives {given!r} ({type(given).__name__}) at progress {progress:g}, where the contract asks "
                    f"for a real number (a float)"), fix
        value = float(given)
        wanted = 1.0 if i == 0 else 0.0 if i == samples - 1 else None
        if not math.isfinite(value) or not -1e-6 <= value <= 1 + 1e-6 or \
                (wanted is not None and abs(value - wanted) > 1e-6):
            expected = f"{wanted:g}" if wanted is not None else "a factor in [0, 1]"
            return f"gives {value!r} at progress {progress:g}, where the contract asks for {expected}", fix
    return None


def _failed_to_build(part: Part, exc: BaseException) -> UserError:
    """The plugin's line where its builder failed (the deepest in the builder's own file; else the deepest
    outside this module; else the call itself, whose arguments the builder does not take)."""
    try:
        own_file = inspect.getsourcefile(part.build)
    except TypeError:  # a builtin or a C function
        own_file = None
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename != __file__]
    inside = [f for f in frames if own_file and f.filename == own_file] or frames
    where = f"{inside[-1].filename}, line {inside[-1].lineno}" if inside else "in the call: its parameters"
    return UserError(f"{part.kind} {part.name!r} (a plugin's) failed to build: {raised(exc)} "
                     f"({where}). Fix: {contract_of(part)}")


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
