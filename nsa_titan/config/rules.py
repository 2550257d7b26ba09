"""Rules that span sections, checked once the whole recipe is typed."""

from __future__ import annotations

import dataclasses
import math
import os

from nsa_titan import registry
from nsa_titan.checkout_hints import launch_size
from nsa_titan.config.errors import Problem
from nsa_titan.config.fields import default_of
from nsa_titan.config.render import recipe_text
from nsa_titan.config.schema import CUDA_GRAPH_MODES, Recipe
from nsa_titan.config.toml_io import toml_value


def _changed(section, name: str) -> bool:
    """Whether a field differs from its default: a non-default value that is ignored is a mistake."""
    return getattr(section, name) != getattr(type(section)(), name)


def _divisors_text(n: int) -> str:
    """'1, 2, 4, 8, 16, 32 or 64': the data-parallel sizes that share n logical shards equally."""
    found = [d for d in range(1, n + 1) if n % d == 0]
    if len(found) > 12:
        return ", ".join(map(str, found[:10])) + f", ... or {found[-1]}"
    return ", ".join(map(str, found[:-1])) + f" or {found[-1]}" if len(found) > 1 else str(found[0])


def _resumed_data_layout(recipe: Recipe) -> tuple[int, str, dict] | None:
    """(step, checkpoint folder, saved data layout) of the checkpoint a training run of `recipe` resumes, or None."""
    from nsa_titan.checkpoint import recipe_branches, saved_data_layout

    if not recipe.checkpoint.enable:
        return None
    folder = os.path.join(recipe.job.dump_folder, recipe.checkpoint.folder)
    found = saved_data_layout(folder, recipe.checkpoint.load_step, recipe_branches(recipe, *recipe_text(recipe)))
    return None if found is None else (found[0], folder, found[1])


def _flagged(source_of, path: str) -> bool:
    """Whether a flag on the command line set the field (source_of names a flag first)."""
    return source_of(path).startswith("flag")


def _unused_or_overridden(add, notes: list[str], source_of, section, field: str, switch: str, switch_value,
                          why: str, fix: str) -> None:
    """`field` (of the recipe table `section`) is set but `switch` = switch_value leaves it unused: a problem,
    unless a flag made that choice over a recipe file's `field` (a later layer turning a feature off: the file's
    setting waits for it, as the table of a part another layer replaced does), which is a note; the field then
    takes its default, as that table does, so the recipe the run writes reads back."""
    name = field.rsplit(".", 1)[1]
    value = getattr(section, name)
    if _flagged(source_of, switch) and not _flagged(source_of, field):
        notes.append(f"{field} = {toml_value(value)} from {source_of(field)} is not used: {source_of(switch)} set "
                     f"{switch} = {toml_value(switch_value)}")
        setattr(section, name, default_of(next(f for f in dataclasses.fields(section) if f.name == name)))
    else:
        add(field, value, why, fix)


def _set(section, path: str, name: str, source_of) -> bool:
    """Whether a field was asked for: a value other than the default, or any value given as a flag."""
    return _changed(section, name) or _flagged(source_of, f"{path}.{name}")


class LayoutError(ValueError):
    """The data-parallel degrees cannot be resolved for this world size; the message says why, `field`
    names the setting at fault and `fix` how to mend it (None: the data-parallel degrees' own fix)."""

    def __init__(self, message: str, field: str = "parallelism.data_parallel_shard_degree",
                 fix: str | None = None):
        super().__init__(message)
        self.field, self.fix = field, fix


# How a launch sets its process count, in layout fixes; a command that checks a recipe for a size it is told
# (doctor's --world-size) names its own option instead.
LAUNCH_SIZE = launch_size()


def data_parallel_degrees(recipe: Recipe, world_size: int) -> tuple[int, int]:
    """(replicate, shard) degrees for this world size (replicate x shard x context_parallel_degree);
    LayoutError when they cannot be resolved."""
    par = recipe.parallelism
    cp = par.context_parallel_degree
    if world_size % cp:
        raise LayoutError(f"the world size {world_size} is not divisible by parallelism.context_parallel_degree {cp}",
                          "parallelism.context_parallel_degree",
                          f"launch a multiple of {cp} processes {LAUNCH_SIZE}, or choose a context_parallel_degree "
                          f"that divides {world_size}")
    world_size //= cp
    size_name = "world size" if cp == 1 else f"data-parallel size (world size / context_parallel_degree {cp})"
    rep, shard = par.data_parallel_replicate_degree, par.data_parallel_shard_degree
    for name, value in (("data_parallel_replicate_degree", rep), ("data_parallel_shard_degree", shard)):
        if value == 0:  # named as itself, not as a world size that the other degree cannot divide
            raise LayoutError("a degree is -1 (to fill what the others leave) or at least 1, not 0",
                              f"parallelism.{name}", "use -1 or a positive degree")
    if rep == -1 and shard == -1:  # shard's default is -1: the replicate degree was set to -1 too
        raise LayoutError("only one of the two degrees may be -1", "parallelism.data_parallel_replicate_degree")
    if rep == -1 or shard == -1:
        known = shard if rep == -1 else rep
        if world_size % known:  # named as the fixed degree, the one set
            raise LayoutError(f"the {size_name} {world_size} is not divisible by the fixed degree {known}",
                              f"parallelism.data_parallel_{'shard' if rep == -1 else 'replicate'}_degree")
        fill = world_size // known
        return (fill, shard) if rep == -1 else (rep, fill)
    if rep * shard != world_size:
        raise LayoutError(f"replicate x shard = {rep} x {shard} = {rep * shard}, but the {size_name} is {world_size}")
    return rep, shard


def _tilde_refusal(key: str, value: str, flag: bool) -> tuple[str, str]:
    """Why a path starting with '~' is refused, and the fix for where it was written: a flag can say $HOME (the
    shell expands it), a recipe file needs the path itself; '~bob/x' is bob's home, which $HOME is not."""
    user, _, rest = value[1:].partition("/")
    whose = "the home folder" if not user else f"{user}'s home folder"
    why = f"starts with '~', which is not read as {whose}" + (" (nor does the shell expand it after '=')" if flag
                                                              else "")
    relative = "or a path relative to the directory the run starts in"
    full = os.path.expanduser(value)
    if full == value:  # '~name' of no user known here
        return why, f"write the path in full ('~{user}' names no user known here), {relative}"
    if flag and not user:
        home = "$HOME" + value[1:]
        return why, f"write the path in full, e.g. --{key}={home} (the shell expands $HOME), {relative}"
    example = f"--{key}={full}" if flag else f"{key} = {full!r}"
    return why, f"write the path in full, e.g. {example}, {relative}"


def _percent_below(percent: float) -> str:
    """`percent` (0 < percent < 100) to three figures, rounded to the nearest (2 of 3 is 66.7, 1 of 700 is 0.143:
    never 0 for one step of a long warmup) but down where that would say 100 (1999 of 2000 is 99.9); no trailing
    zeros."""
    exponent = math.floor(math.log10(percent))
    unit = 10.0 ** (exponent - 2)
    figures = math.floor(percent / unit + 0.5 + 1e-9)
    if figures * unit >= 100:
        figures = math.floor(percent / unit + 1e-9)
    text = f"{figures * unit:.{max(0, 2 - exponent)}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def check_rules(recipe: Recipe, world_size: int | None, source_of, problems: list[Problem],
                notes: list[str] | None = None, training: bool = False) -> None:
    """world_size None: a one-process reader of a run (export, plot); the layout rules do not apply.
    Settings that are legal but worth saying out loud are appended to `notes`. training: flags of switched-off
    features that other commands read either way are refused too (resolve's training)."""
    notes = [] if notes is None else notes

    def add(field: str, value, why: str, fix: str) -> None:
        problems.append(Problem(source_of(field), field, value, why, fix))

    try:
        degrees = (1, 1) if world_size is None else data_parallel_degrees(recipe, world_size)
    except LayoutError as exc:
        add(exc.field, getattr(recipe.parallelism, exc.field.split(".")[1]), str(exc),
            exc.fix or f"make replicate x shard x context_parallel_degree equal the number of processes "
                       f"{LAUNCH_SIZE}, or set one of replicate and shard to -1")
        dp, degrees = None, None  # unknown: the checks that need it wait for a layout that resolves
    else:
        for name, value in zip(("data_parallel_replicate_degree", "data_parallel_shard_degree"), degrees):
            if value < 1:
                add(f"parallelism.{name}", value, "must be at least 1 (or -1 to fill)", "use a positive degree or -1")
        dp = degrees[0] * degrees[1]

    t = recipe.training
    cp = recipe.parallelism.context_parallel_degree
    if cp > 1:
        if t.seq_len % (2 * cp):
            add("training.seq_len", t.seq_len, f"cannot be cut into 2 x context_parallel_degree = {2 * cp} equal "
                f"chunks (each rank holds two, one early and one late, to balance the work)",
                f"use a multiple of {2 * cp}, or another parallelism.context_parallel_degree")
        if registry.get("model", recipe.model.name).context_shard is None:
            add("parallelism.context_parallel_degree", cp, f"model {recipe.model.name!r} cannot split its sequences "
                f"(its part registers no context_shard hook)", "set parallelism.context_parallel_degree = 1")
    per_step = t.local_batch_size * (dp or 1)
    if dp is not None and t.global_batch_size == 0:
        add("training.global_batch_size", 0, "would train on no samples: it is -1 (local_batch_size x "
            f"data-parallel size) or a positive multiple of local_batch_size x data-parallel size = {per_step}",
            f"use -1 or a multiple of {per_step}")
    elif dp is not None and t.global_batch_size != -1 and t.global_batch_size % per_step:
        add("training.global_batch_size", t.global_batch_size,
            f"is not a multiple of local_batch_size x data-parallel size = {t.local_batch_size} x {dp} = {per_step}",
            f"use a multiple of {per_step} (e.g. {per_step * max(1, round(t.global_batch_size / per_step))}) or -1")
    if recipe.metrics.telemetry_freq > 0:
        part = registry.get("model", recipe.model.name)
        if part.telemetry is None or not (part.telemetry_applies is None or part.telemetry_applies(recipe.model.args)):
            add("metrics.telemetry_freq", recipe.metrics.telemetry_freq,
                f"model {recipe.model.name!r} with these arguments has no attention telemetry (e.g. dense attention)",
                "set metrics.telemetry_freq = 0")

    prof = recipe.profiling
    if prof.enable and prof.start_step == 1 and recipe.compile.enable:
        notes.append(f"profiling.start_step = 1 from {source_of('profiling.start_step')} with compile.enable: the "
                     f"window's first step compiles the blocks (no warmup step comes before it), so the trace and "
                     f"op table are mostly compilation; start at step 2 or later to profile training")
    if prof.enable and prof.start_step + prof.steps - 1 > t.steps:
        add("profiling.start_step", prof.start_step, f"with profiling.steps = {prof.steps} ends after training.steps "
            f"= {t.steps}, so the window would never be written whole",
            f"profile steps within the run: start_step at most {t.steps - prof.steps + 1}" if prof.steps <= t.steps
            else f"lower profiling.steps to at most {t.steps} and start at step 1, or train longer")
    if prof.memory_snapshot and not prof.enable:
        _unused_or_overridden(add, notes, source_of, prof, "profiling.memory_snapshot", "profiling.enable", False,
                              "is recorded over the profiled steps, but profiling.enable is false",
                              "set profiling.enable = true, or memory_snapshot = false")
    if prof.memory_snapshot and t.device == "cpu":
        add("profiling.memory_snapshot", True, "records the CUDA allocator, but training.device is 'cpu'",
            "set profiling.memory_snapshot = false, or train on CUDA")

    per_rank = recipe.data.logical_shards // dp if dp and recipe.data.logical_shards % dp == 0 else None
    if per_rank is not None and recipe.data.num_workers > per_rank:
        add("data.num_workers", recipe.data.num_workers,
            f"exceeds the {per_rank} logical shards each of the {dp} data-parallel ranks owns, so workers would idle",
            f"use at most {per_rank} workers, or raise data.logical_shards (fixed for the life of a run)")

    max_len = getattr(recipe.model.args, "max_seq_len", None)
    if isinstance(max_len, int) and t.seq_len > max_len:
        add("training.seq_len", t.seq_len, f"exceeds the model's max_seq_len = {max_len}",
            f"lower training.seq_len or raise model.max_seq_len to at least {t.seq_len}")
    row_notes = getattr(recipe.model.args, "row_notes", None)  # what rows of training.seq_len tokens add
    if callable(row_notes):
        notes.extend(f"model.{note}" for note in row_notes(t.seq_len))

    if len(recipe.optimizer.betas) != 2 or not all(0.0 <= b < 1.0 for b in recipe.optimizer.betas):
        add("optimizer.betas", recipe.optimizer.betas, "must be two numbers in [0, 1)", "write betas = [0.9, 0.95]")
    if recipe.checkpoint.keep_latest_k == 1:
        add("checkpoint.keep_latest_k", 1, "keeping one checkpoint loses it while the next one is written",
            "use 2 or more, or 0 to keep all")
    # A flag for a feature the recipe switched off does nothing: refused. A recipe file may keep such settings
    # for when the feature is on (a flag turns it on for one run): a training run says they wait. Fields another
    # command reads either way (checkpoint.folder and load_step for export, eval and plot, validation.steps for
    # eval, compile.* for inspect) are listed only for training.
    refused_sections = set()
    for section, switch, names in _SWITCHED_FIELDS + (_SWITCHED_FIELDS_READ_ELSEWHERE if training else ()):
        table = getattr(recipe, section)
        if getattr(table, switch):
            continue
        # A switch a flag turned off is the user's choice: adding the opposite flag would set it twice.
        fix = (f"remove this flag ({source_of(f'{section}.{switch}')} turns it off), or turn it on there instead"
               if _flagged(source_of, f"{section}.{switch}") else f"add --{section}.{switch}=true")
        waiting = []
        for name in names:  # a flag counts as set even at the default value: it was asked for
            if _flagged(source_of, f"{section}.{name}"):
                refused_sections.add(section)
                add(f"{section}.{name}", getattr(table, name), f"is set on the command line but {section}.{switch} "
                    "is false, so it would be ignored", fix)
            elif training and (section, switch, names) in _SWITCHED_FIELDS and _changed(table, name):
                waiting.append(f"{section}.{name} = {toml_value(getattr(table, name))} from "
                               f"{source_of(f'{section}.{name}')}")
        if waiting:
            notes.append(f"{', '.join(waiting)} {'waits' if len(waiting) == 1 else 'wait'} for {section}.{switch}, "
                         f"which is false ({source_of(f'{section}.{switch}')}): not used in this run")
    if recipe.lr_scheduler.warmup_steps > t.steps:
        # A run shortened to try something (--training.steps=3) is still a run: it ends mid-warmup.
        notes.append(f"lr_scheduler.warmup_steps = {recipe.lr_scheduler.warmup_steps} from "
                     f"{source_of('lr_scheduler.warmup_steps')} is longer than the run (training.steps = {t.steps}): "
                     f"the learning rate stays in warmup and peaks at "
                     f"{_percent_below(100 * t.steps / recipe.lr_scheduler.warmup_steps)}% of optimizer.lr")
    elif recipe.lr_scheduler.warmup_steps == t.steps and recipe.lr_scheduler.decay_type != "constant":
        notes.append(f"lr_scheduler.warmup_steps = {t.steps} from {source_of('lr_scheduler.warmup_steps')} is the "
                     f"whole run (training.steps = {t.steps}): the learning rate reaches optimizer.lr at the last "
                     f"step, and there is no decay")
    _check_lr_schedule(recipe, add, notes, source_of)
    if recipe.data.num_workers == 0 and _set(recipe.data, "data", "prefetch_factor", source_of):
        _unused_or_overridden(add, notes, source_of, recipe.data, "data.prefetch_factor", "data.num_workers", 0,
                              "has no effect without worker processes",
                              "remove it, or set data.num_workers > 0")
    name = recipe.job.name
    parts = name.replace("\\", "/").split("/")
    if not name.strip():
        add("job.name", name, "is empty: a run needs a name", "name the run, e.g. my_run")
    elif source_of("job.dump_folder") == "job.name" and (os.path.isabs(name) or ".." in parts or
                                                          os.path.normpath(name) == "."):
        # It names the run's folder, ./outputs/<job.name>: '.' or '../x' would make ./outputs itself, or a
        # folder outside it, the run's folder (a name like ablations/w64 stays inside).
        add("job.name", name, f"names the run's folder ./outputs/{name}, which is not a folder inside ./outputs",
            "name the run without '..', '.' or a leading '/', e.g. my_run, or set job.dump_folder")
    if not recipe.job.dump_folder.strip():
        add("job.dump_folder", recipe.job.dump_folder, "is empty: a run needs a folder of its own",
            "name one, e.g. ./outputs/<run name> (or leave it unset: ./outputs/<job.name>)")
    for key, value in (("job.dump_folder", recipe.job.dump_folder),
                       ("checkpoint.initial_load_path", recipe.checkpoint.initial_load_path)):
        if value.startswith("~"):  # read as it stands: a folder named '~' where the run starts, not the home folder
            add(key, value, *_tilde_refusal(key, value, source_of(key).startswith("flag ")))
    for section, name in _RUN_SUBFOLDERS:
        table = getattr(recipe, section)
        value = getattr(table, name)
        # "." is the run folder itself: its step-N folders, event files or traces would mix with the run's files.
        if not value.strip() or os.path.isabs(value) or ".." in value.replace("\\", "/").split("/") or \
                os.path.normpath(value) == ".":
            add(f"{section}.{name}", value, "must be a folder inside job.dump_folder (a relative path that stays in "
                "it, not '.'), so that the run's folder and its lock hold everything the run writes",
                f"use a relative name such as {getattr(type(table)(), name)!r}, or move job.dump_folder instead")
    _check_run_subfolders_apart(recipe, add)
    _check_unused_data_fields(recipe, add, source_of)
    if "compile" not in refused_sections:  # its flags refused as switched off: the mode checks would say more of it
        _check_compile(recipe, world_size, add)
    par = recipe.parallelism
    if world_size == 1 and not par.fsdp_single_process:
        for name, why in (("fsdp_reshard_after_forward", "shards nothing"),
                          ("init_timeout_seconds", "starts no process group")):
            if _flagged(source_of, f"parallelism.{name}"):
                add(f"parallelism.{name}", getattr(par, name), f"is set on the command line, but one process "
                    f"without parallelism.fsdp_single_process {why}, so it would be ignored",
                    "remove it, or add --parallelism.fsdp_single_process=true (or launch several processes)")
    if world_size is not None and world_size > 1:
        if _flagged(source_of, "parallelism.fsdp_single_process"):
            add("parallelism.fsdp_single_process", par.fsdp_single_process, f"is set on the command line, but it only "
                f"applies to a job of one process and this one has {world_size}, so it would be ignored",
                "remove it: with several processes the degrees choose FSDP2, HSDP or DDP")
        if degrees is not None and degrees[1] * cp == 1 and par.fsdp_reshard_after_forward != "always" and \
                _flagged(source_of, "parallelism.fsdp_reshard_after_forward"):
            add("parallelism.fsdp_reshard_after_forward", par.fsdp_reshard_after_forward, "is set on the command "
                "line, but data_parallel_shard_degree is 1 (DDP: every rank holds the whole model), where nothing is "
                "resharded unless it is 'always' (which frees the gathered low-precision copies), so it would be "
                "ignored", "remove it, or shard over several ranks (parallelism.data_parallel_shard_degree)")
    if recipe.activation_checkpoint.mode != "selective" and _set(recipe.activation_checkpoint, "activation_checkpoint",
                                                                 "selective_every", source_of):
        _unused_or_overridden(add, notes, source_of, recipe.activation_checkpoint,
                              "activation_checkpoint.selective_every", "activation_checkpoint.mode",
                              recipe.activation_checkpoint.mode,
                              f"only applies to mode = 'selective' (mode is {recipe.activation_checkpoint.mode!r})",
                              "remove it, or set activation_checkpoint.mode = 'selective'")
    if dp is not None:
        _check_logical_shards(recipe, dp, add, training)


def _check_logical_shards(recipe: Recipe, dp: int, add, training: bool) -> None:
    """Logical shards that dp ranks cannot own equally; on a resume, as the checkpoint it reads saved them. Checked
    last, once every rule has set the recipe's fields, since a resume finds its checkpoint by the recipe's hash."""
    if not recipe.data.logical_shards % dp:
        return
    shards = recipe.data.logical_shards
    resumed = _resumed_data_layout(recipe) if training else None
    if resumed is None:
        add("data.logical_shards", shards, f"is not divisible by the data-parallel size {dp}, so ranks cannot own "
            f"equal shards", f"use a multiple of {dp}, e.g. {dp * max(1, shards // dp)}, or a data-parallel size "
            f"that divides {shards} ({_divisors_text(shards)})")
    else:  # a resume: the checkpoint's data goes on only over the logical shards it was saved with
        step, folder, saved = resumed
        kept = saved["logical_shards"]
        sizes = "a data-parallel size (processes / context_parallel_degree)"
        if recipe.checkpoint.data_mismatch == "restart":  # already starts the data afresh over other shards
            fix = f"resume on {sizes} that divides {shards} ({_divisors_text(shards)}), or "
            if kept % dp == 0:  # the checkpoint's own shards suit this size
                fix += f"set data.logical_shards = {kept}, the checkpoint's, whose data continues on this size"
            else:
                fix += ("" if kept == shards else f"with data.logical_shards = {kept} on one that divides {kept} "
                        f"({_divisors_text(kept)}), where its data continues, or ")
                fix += (f"set data.logical_shards to a multiple of {dp}, e.g. {dp * max(1, shards // dp)} "
                        "(checkpoint.data_mismatch = 'restart' starts the data afresh over them; the model, "
                        "optimizer and step resume)")
        else:
            fix = (f"resume{'' if kept == shards else f' with data.logical_shards = {kept}'} on {sizes} that "
                   f"divides {kept} ({_divisors_text(kept)}), or start the data afresh over a multiple of {dp} "
                   "logical shards with --checkpoint.data_mismatch=restart (the model, optimizer and step resume)")
        add("data.logical_shards", shards,
            f"is not divisible by the data-parallel size {dp}, so ranks cannot own equal shards; the checkpoint "
            f"this run resumes (step {step} in {folder}) was saved over {kept} logical shards by "
            f"{saved['world_size']} data-parallel rank(s), and its data continues only over those {kept}", fix)


# The recipe's folders inside job.dump_folder, (section, field); and those the trainer writes on its own there,
# which no recipe folder may be or hold.
_RUN_SUBFOLDERS = (("checkpoint", "folder"), ("metrics", "save_tb_folder"), ("profiling", "folder"))
_RUN_OWN_FOLDERS = ("stacks", "wandb")


def _check_run_subfolders_apart(recipe, add) -> None:
    """The checkpoint, TensorBoard and profiler folders are each managed on their own (checkpoint steps are moved
    aside and pruned; events are purged on a resume): none may be, or lie inside, another, or a folder the
    trainer writes itself (an event file inside a pruned step ended a run with a traceback)."""
    tables = [(section, name, getattr(recipe, section)) for section, name in _RUN_SUBFOLDERS]
    named = [(f"{section}.{name}", os.path.normpath(getattr(table, name)), getattr(type(table)(), name))
             for section, name, table in tables]
    named = [(field, path, default) for field, path, default in named if path not in ("", ".")
             and not os.path.isabs(path) and ".." not in path.split(os.sep)]  # those are refused above
    for i, (field, path, default) in enumerate(named):
        parts = path.split(os.sep)
        if parts[0] in _RUN_OWN_FOLDERS:
            add(field, path, f"lies in the run's {parts[0]}/ folder, which the trainer writes itself",
                f"choose another name, e.g. {default!r}")
            continue
        for other, where, _ in named[:i]:
            if path == where or path.startswith(where + os.sep) or where.startswith(path + os.sep):
                how = "is" if path == where else "lies inside" if path.startswith(where + os.sep) else "holds"
                add(field, path, f"{how} {other} = {where!r}: each of the run's folders is kept on its own (checkpoint "
                    f"steps are moved aside and pruned, TensorBoard events purged on a resume)",
                    f"give it a folder of its own beside the other, e.g. {default!r}" if default != where else
                    "give it a folder of its own beside the other")


def _check_unused_data_fields(recipe: Recipe, add, source_of) -> None:
    """Source and tokenizer arguments that the rest of the recipe leaves unused."""
    data = recipe.data
    source, tokenizer = data.source_args, data.tokenizer_args
    if (not data.add_bos and _has_field(tokenizer, "bos_token")
            and _part_arg_set(tokenizer, f"data.{data.tokenizer}", "bos_token", source_of)):
        add(f"data.{data.tokenizer}.bos_token", tokenizer.bos_token,
            "only names the token data.add_bos puts before each document, and data.add_bos is false",
            "remove it, or set data.add_bos = true")
    for path, args in _source_args(f"data.{data.source}", source):
        if (_has_field(args, "validation_split") and _has_field(args, "validation_fraction")
                and args.validation_split and _part_arg_set(args, path, "validation_fraction", source_of)):
            add(f"{path}.validation_fraction", args.validation_fraction,
                f"is not used: validation_split = {args.validation_split!r} names the documents to validate on",
                "remove validation_fraction, or set validation_split = '' to hold out that fraction of `split`")


def _source_args(path: str, args):
    """(recipe path, arguments) of a data source and, in a mixture, of every source it mixes (inline in
    [data.mixture.sources.NAME]), at any depth."""
    yield path, args
    entries = getattr(args, "sources", None)
    if isinstance(entries, dict):
        for name, entry in entries.items():
            if hasattr(entry, "args"):
                yield from _source_args(f"{path}.sources.{name}", entry.args)


def _has_field(args, name: str) -> bool:
    return dataclasses.is_dataclass(args) and any(fld.name == name for fld in dataclasses.fields(args))


def _part_arg_set(args, path: str, name: str, source_of) -> bool:
    """_set for a part's arguments, whose dataclass (a plugin's) may have fields without defaults."""
    default = default_of(next(fld for fld in dataclasses.fields(args) if fld.name == name))
    if default is dataclasses.MISSING:
        return True  # a required field: the recipe had to set it
    return getattr(args, name) != default or _flagged(source_of, f"{path}.{name}")


# (section, its switch, the fields only that switch uses)
_SWITCHED_FIELDS = (
    ("checkpoint", "enable", ("interval", "keep_latest_k", "async_mode", "data_mismatch")),
    ("validation", "enable", ("freq",)),
    ("profiling", "enable", ("start_step", "steps", "folder")),
    ("metrics", "enable_tensorboard", ("save_tb_folder",)),
    ("metrics", "enable_wandb", ("wandb_project", "wandb_mode")),
)
# Read by another command whatever the switch says: inspect compiles, eval validates, export, eval and plot read
# the run's checkpoints (a run folder keeps them when a later run there turned checkpoints off).
_SWITCHED_FIELDS_READ_ELSEWHERE = (
    ("compile", "enable", ("backend", "fullgraph", "mode")),
    ("validation", "enable", ("steps",)),
    ("checkpoint", "enable", ("load_step",)),
)


def _check_lr_schedule(recipe: Recipe, add, notes: list[str], source_of) -> None:
    sched, steps = recipe.lr_scheduler, recipe.training.steps
    shape = registry.schedule_shape_problem(registry.get("lr_schedule", sched.decay_type))  # a plugin's, tried
    if shape:
        add("lr_scheduler.decay_type", sched.decay_type, f"names a plugin's shape that {shape[0]}", shape[1])
    if sched.decay_type == "constant":
        for name in ("min_lr_factor", "decay_steps"):
            if _set(sched, "lr_scheduler", name, source_of):  # a flag even at the default: it was asked for
                _unused_or_overridden(add, notes, source_of, sched, f"lr_scheduler.{name}",
                                      "lr_scheduler.decay_type", "constant",
                                      "has no effect with decay_type = 'constant'",
                                      "remove it, or choose a decaying shape such as decay_type = 'cosine'")
    elif sched.decay_steps == 0:
        add("lr_scheduler.decay_steps", 0, "is a decay of no steps",
            "use -1 to decay over every step after warmup, or, for no decay, decay_type = 'constant' without "
            "decay_steps (which a constant rate refuses)")
    elif sched.decay_steps > 0 and sched.decay_steps > steps - sched.warmup_steps and steps > sched.warmup_steps:
        # Like a long warmup: a shortened trial run is still a run; its decay starts after warmup.
        notes.append(f"lr_scheduler.decay_steps = {sched.decay_steps} from {source_of('lr_scheduler.decay_steps')} "
                     f"is longer than the steps after warmup ({max(steps - sched.warmup_steps, 0)}): "
                     "the decay runs over those instead, still ending at min_lr_factor on the last step")


def _check_compile(recipe: Recipe, world_size: int | None, add) -> None:
    """compile.mode against the backend and the layout (inspect compiles whatever compile.enable says)."""
    comp = recipe.compile
    if comp.mode != "default" and comp.backend != "inductor":
        add("compile.mode", comp.mode, f"is a mode of the inductor backend, but compile.backend is {comp.backend!r}",
            "set compile.backend = 'inductor', or compile.mode = 'default'")
    if comp.mode in CUDA_GRAPH_MODES:
        if recipe.training.device == "cpu":
            add("compile.mode", comp.mode, "replays CUDA graphs, but training.device is 'cpu'",
                "use compile.mode = 'default' (or 'max-autotune-no-cudagraphs'), or train on CUDA")
        if (world_size or 1) > 1 or recipe.parallelism.fsdp_single_process:
            add("compile.mode", comp.mode, "replays CUDA graphs, which need the parameters at fixed addresses; FSDP2 "
                "gathers them afresh every step", "use compile.mode = 'max-autotune-no-cudagraphs', or train in "
                "one process without parallelism.fsdp_single_process")
