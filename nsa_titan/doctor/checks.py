"""The preflight checks, each returning one verdict line: ok, warn or fail, with what it saw.

Order: what the machine has (versions, devices), then what the recipe asks of it (the recipe
itself, its data, its output folder, its NSA backend on this device, its memory). A check that
needs a valid recipe is reported as skipped (warn) when the recipe does not validate.
"""

from __future__ import annotations

import os
import platform
import shutil
import tempfile
import time
from dataclasses import dataclass

import torch

from components.errors import UserError
from nsa_titan.command_options import existing_ancestor
from nsa_titan.run_folder import folder_held_by

OK, WARN, FAIL = "ok", "warn", "fail"
SUPPORTED_TORCH = ((2, 11), (2, 13))
MIN_FREE_DISK = 2 * 1024**3  # below this a run cannot keep even small checkpoints and logs comfortably
GiB = 1024**3


@dataclass
class Check:
    name: str
    status: str
    detail: str

    def line(self) -> str:
        head = f"{self.status:<4}  {self.name}: "
        return head + self.detail.replace("\n", "\n" + " " * len(head))


def _version_tuple(version: str) -> tuple[int, int]:
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (0, 0)


def check_versions() -> Check:
    parts = [f"python {platform.python_version()}", f"torch {torch.__version__}"]
    status, notes = OK, []
    low, high = SUPPORTED_TORCH
    if not low <= _version_tuple(torch.__version__) <= high:
        status = WARN
        notes.append(f"torch {torch.__version__} is outside the supported {low[0]}.{low[1]}-{high[0]}.{high[1]}")
    try:
        import triton

        parts.append(f"triton {triton.__version__}")
    except ImportError:
        parts.append("triton not installed (NSA backend 'triton' unavailable)")
    parts.append(f"CUDA {torch.version.cuda}" if torch.version.cuda else "CUDA none (CPU build of torch)")
    if torch.cuda.is_available() and torch.distributed.is_nccl_available():
        nccl = torch.cuda.nccl.version()
        parts.append("NCCL " + (".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)))
    return Check("versions", status, ", ".join(parts) + ("" if not notes else "; " + "; ".join(notes)))


def _host_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def device_memory(device: torch.device) -> tuple[int | None, str]:
    """(bytes a process can use on this device, a description)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return total, f"{torch.cuda.get_device_name(device)} {total / GiB:.1f} GiB ({free / GiB:.1f} GiB free)"
    host = _host_memory()
    return host, f"host memory {host / GiB:.1f} GiB" if host else "host memory unknown"


def check_devices(device_choice: str | None, world_size: int) -> Check:
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        names = [device_memory(torch.device("cuda", i))[1] for i in range(count)]
        status, note = OK, ""
        if world_size > count:
            status, note = WARN, (f"; {world_size} processes need {world_size} GPUs, this node has {count} "
                                  "(fine across several nodes)")
        return Check("devices", status, f"{count} CUDA device(s): " + "; ".join(names) + note)
    cpus = os.cpu_count() or 1
    detail = f"no CUDA device; {cpus} CPU core(s), {device_memory(torch.device('cpu'))[1]}"
    if device_choice == "cuda":
        return Check("devices", FAIL, detail + ". The recipe sets training.device = 'cuda'. Fix: run on a GPU "
                                               "machine or set --training.device=cpu (or auto)")
    return Check("devices", OK, detail + " (training runs on the CPU)")


def check_data(recipe, runtime, world_size: int = 1) -> tuple[Check, object | None, object | None]:
    """Build the tokenizer and source and take one batch, as training would, and ask every data-parallel rank of
    `world_size` processes for a row of its own shards (and of the held-out set, where validation is on), as
    training refuses to start without them; also returns the tokenizer (None when it cannot be built), which the
    memory estimate needs for the vocabulary size, and the source (None unless it passed), which the resume check
    reads with, as the training run's one source is read by all its loaders."""
    from nsa_titan import assemble

    start = time.perf_counter()
    name = f"data ({recipe.data.source}, tokenizer {recipe.data.tokenizer})"
    try:
        tokenizer = assemble.build_tokenizer(recipe)
    except UserError as exc:
        said = str(exc)  # the tokenizers' messages begin "tokenizer NAME: ..."; a plugin's may not
        return Check(name, FAIL, said if said.startswith("tokenizer") else f"tokenizer: {said}"), None, None
    try:
        source = assemble.build_source(recipe)
        loader = assemble.build_loader(recipe, runtime, source, tokenizer, dp_rank=0, dp_size=1, split="train",
                                       batch_size=recipe.training.local_batch_size)
        batch = next(iter(loader))
        dp_size = _data_parallel_size(recipe, world_size)
        _every_rank_has_rows(recipe, runtime, source, tokenizer, dp_size)
        scan = getattr(source, "scan", None)  # the whole corpus once: what a long run would meet late
        scanned = scan() if callable(scan) else ""
        notes = assemble.source_notes(recipe, source)
        balance = assemble.reader_balance_note(recipe, source, dp_size)
        notes += [balance] if balance else []
        lost = assemble.lost_text_note(recipe, source, tokenizer)
        notes += [lost] if lost else []
    except UserError as exc:
        return Check(name, FAIL, str(exc)), tokenizer, None
    inputs = batch["input"]
    documents = int(batch["document_starts"].sum())
    detail = (f"one batch {tuple(inputs.shape)} of token ids {int(inputs.min())}..{int(inputs.max())} "
              f"(vocab {tokenizer.vocab_size}) holding {documents} documents or pieces of them (mean "
              f"{inputs.numel() / documents:.0f} tokens){'; ' + scanned if scanned else ''}, in "
              f"{time.perf_counter() - start:.1f} s")
    expected = (recipe.training.local_batch_size, recipe.training.seq_len)
    if tuple(inputs.shape) != expected or int(inputs.max()) >= tokenizer.vocab_size or int(inputs.min()) < 0:
        return Check(name, FAIL, detail + f"; expected shape {expected} and ids in 0..{tokenizer.vocab_size - 1}"), \
            tokenizer, None
    return Check(name, WARN if notes else OK, "; ".join([detail, *notes, *assemble.tokenizer_notes(tokenizer)])), \
        tokenizer, source


def _every_rank_has_rows(recipe, runtime, source, tokenizer, dp_size: int) -> None:
    """Training's start-up refusals that depend on the ranks' shards: a data-parallel rank whose shards hold no
    training document, and a held-out set that no rank's shards hold a row of (NoDocuments, as training says it)."""
    from nsa_titan import assemble, held_out

    if dp_size > 1:
        for rank in range(dp_size):  # in this process, one row each: a rank's shards, as its loader reads them
            next(iter(assemble.build_loader(recipe, runtime, source, tokenizer, dp_rank=rank, dp_size=dp_size,
                                            split="train", batch_size=1, num_workers=0)))
    if recipe.validation.enable and not any(held_out.rank_has_rows(recipe, runtime, source, tokenizer, rank, dp_size)
                                            for rank in range(dp_size)):
        raise held_out.empty_set_error(recipe)


def _data_parallel_size(recipe, world_size: int) -> int:
    from nsa_titan.config.rules import data_parallel_degrees

    replicate, shard = data_parallel_degrees(recipe, world_size)
    return replicate * shard


def checkpoint_bytes(num_params: int, keep: int) -> int:
    """fp32 weights and two AdamW moments per checkpoint, times the checkpoints kept (0 keeps all: count 2)."""
    return 12 * num_params * max(keep if keep > 0 else 2, 1)


def check_dump_folder(folder: str, needed: int) -> Check:
    """Writable (tried with a real file) and with room: at least MIN_FREE_DISK and what checkpoints need."""
    target = existing_ancestor(folder)
    shown = folder if target == os.path.abspath(folder) else f"{folder} (to be created under {target})"
    if not os.path.isdir(target):
        return Check("dump folder", FAIL, f"{target} exists but is not a folder. Fix: set --job.dump_folder to a "
                                          "folder path")
    try:
        with tempfile.NamedTemporaryFile(dir=target, prefix=".nsa_titan_doctor_") as fh:
            fh.write(b"ok")
            fh.flush()
    except OSError as exc:
        return Check("dump folder", FAIL, f"{shown} is not writable ({exc.strerror or exc}). Fix: choose a "
                                          "writable --job.dump_folder")
    free = shutil.disk_usage(target).free
    floor = max(MIN_FREE_DISK, needed)
    detail = f"{shown} is writable, {free / GiB:.1f} GiB free"
    holder = folder_held_by(folder)
    if holder is not None:
        return Check("dump folder", WARN, detail + f"; in use by a run now ({holder}): training started there "
                                                   "would be refused. Fix: wait for it to end, or choose another "
                                                   "--job.dump_folder")
    if free < floor:
        return Check("dump folder", WARN, detail + f"; under {floor / GiB:.1f} GiB (2 GiB or the checkpoints this "
                                                   f"recipe keeps, ~{needed / GiB:.1f} GiB). Fix: free space or "
                                                   "move --job.dump_folder")
    return Check("dump folder", OK, detail)


def check_model(recipe, device: torch.device, compute_dtype: torch.dtype | None = None) -> Check:
    """The model part's own self-check on this device (for NSA: the backend computes NSA); compute_dtype:
    the half type the run computes in (autocast), for a hook that takes it."""
    import inspect

    from nsa_titan import assemble, registry

    part = registry.get("model", recipe.model.name)
    hook = part.self_check
    problem = assemble.device_problem(recipe, device)
    if hook is None:
        return Check("model self-check", FAIL if problem else OK, problem or f"model {recipe.model.name!r} has none")
    takes_dtype = "compute_dtype" in inspect.signature(hook).parameters  # (args, device) hooks keep working
    result = hook(recipe.model.args, device, **({"compute_dtype": compute_dtype} if takes_dtype else {}))
    if problem and result.status != FAIL:  # what training refuses at its start fails here too
        return Check(result.name, FAIL, problem)
    return Check(result.name, result.status, result.detail)


def memory_fixes(recipe, world_size: int, shard: int, estimate) -> str:
    """The settings that would lower this recipe's estimate, only those it can still change: a recipe already
    checkpointing every block, at one row per rank, sharded over every rank, is told of context parallelism,
    which alone divides the tokens each rank holds."""
    from nsa_titan import registry

    t, cp = recipe.training, recipe.parallelism.context_parallel_degree
    per_token = estimate.activations + estimate.logits + estimate.masks
    fixes = []
    if recipe.activation_checkpoint.mode != "full":
        fixes.append("set activation_checkpoint.mode = 'full'")
    if t.local_batch_size > 1:
        fixes.append("lower training.local_batch_size (raising the micro-batches a step takes)")
    can_split = registry.get("model", recipe.model.name).context_shard is not None  # a model part's hook
    if can_split and t.seq_len % (4 * cp) == 0:  # twice the degree still splits a row into 2 x cp even chunks
        fixes.append(f"raise parallelism.context_parallel_degree (now {cp}) over more processes: it divides the "
                     f"tokens each holds")
    if shard < world_size or estimate.states > per_token:
        fixes.append("shard the weights and optimizer state over more processes "
                     "(parallelism.data_parallel_shard_degree)")
    return ", or ".join(fixes) if fixes else "a device with more memory, or a smaller model"


def check_memory(recipe, world_size: int, runtime, tokenizer) -> Check:
    """The estimate of nsa_titan/doctor/memory.py against what one device (or one process's share of the host) has."""
    from components.model_hooks import MemoryLayout
    from nsa_titan import assemble, registry
    from nsa_titan.config.rules import LayoutError, data_parallel_degrees
    from nsa_titan.doctor.memory import estimate_memory

    part = registry.get("model", recipe.model.name)
    if part.activation_memory is None:
        return Check("memory estimate", WARN, f"no estimate: model {recipe.model.name!r} registers no "
                                              "activation_memory hook")
    cp = recipe.parallelism.context_parallel_degree
    try:
        shard = data_parallel_degrees(recipe, world_size)[1] * cp  # FSDP shards over dp_shard x cp
    except LayoutError:
        shard = 1
    model = assemble.build_model_on_meta(recipe, tokenizer.vocab_size)
    blocks = assemble.parallel_plan(part, model).blocks
    block_params = max((sum(p.numel() for p in b.parameters()) for b in blocks), default=0)
    ac = recipe.activation_checkpoint
    t = recipe.training
    compiled = recipe.compile.backend if recipe.compile.enable else None
    try:
        compute_bytes = (runtime.autocast_dtype or torch.float32).itemsize
        activation = part.activation_memory(recipe.model.args, MemoryLayout(cp, compiled, runtime.device.type,
                                                                            t.local_batch_size * t.seq_len // cp,
                                                                            compute_bytes, t.seq_len))
    except UserError as e:  # a plugin's hook, said by the registry with the hook's line
        return Check("memory estimate", FAIL, f"{e}; activation_memory is called as (args, layout), layout a "
                                              "components.model_hooks.MemoryLayout")
    except Exception as e:  # a plugin's hook
        return Check("memory estimate", FAIL, f"model {recipe.model.name!r}'s activation_memory hook failed "
                                              f"({type(e).__name__}: {e}). It is called as (args, layout), layout a "
                                              "components.model_hooks.MemoryLayout; a hook written for (args, "
                                              "context_parallel) reads layout.context_parallel instead")
    estimate = estimate_memory(activation=activation, context_parallel=cp, seq_len=t.seq_len,
                               num_params=assemble.count_parameters(model),
                               block_params=block_params, vocab_size=tokenizer.vocab_size, shard=shard,
                               tokens=t.local_batch_size * t.seq_len // cp, bf16=runtime.autocast_dtype is not None,
                               ac_mode=ac.mode, ac_every=ac.selective_every,
                               buffer_bytes=sum(b.numel() * b.element_size() for b in model.buffers()),
                               chunked_loss=runtime.device.type != "cuda")
    capacity, where = device_memory(runtime.device)
    if runtime.device.type == "cpu" and capacity:
        capacity //= world_size  # the processes of one node share its memory
        where += f", {world_size} process(es)"
    detail = f"{estimate.describe()}; device: {where} (formula: nsa_titan/doctor/memory.py)"
    if not capacity:
        return Check("memory estimate", WARN, detail + "; device capacity unknown")
    share = estimate.total / capacity
    detail += f"; {share:.0%} of it"
    if share > 1.0:  # the estimate leaves out the allocator's slack (and on CUDA the context): past 100% cannot fit
        fixes = memory_fixes(recipe, world_size, shard, estimate)
        if runtime.device.type == "cpu" and world_size > 1:
            fixes += (f", or run fewer of the {world_size} processes on this node (they share its memory; "
                      "spread them over several nodes)")
        return Check("memory estimate", FAIL, f"{detail}. Fix: {fixes}")
    if share > 0.8:
        return Check("memory estimate", WARN, detail + "; little headroom for allocator fragmentation")
    return Check("memory estimate", OK, detail)
