"""From command line to a checked Recipe: load, compose, override, import plugins, build, check."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import sysconfig
import traceback
from dataclasses import dataclass

from components.errors import raised, read_from
from nsa_titan.config.build import RecipeBuilder, coerce, is_flag
from nsa_titan.config.errors import NO_LONGER_PASSES, Problem, RecipeError
from nsa_titan.config.overrides import ACTIONS, CliText, CommandLine, apply_overrides, parse_args
from nsa_titan.config.render import recipe_text
from nsa_titan.config.rules import check_rules
from nsa_titan.config.schema import Recipe
from nsa_titan.config.toml_io import load_composed, origins, shown_path, tomllib
from nsa_titan.run_recipe import RECIPE_FILE, run_of_folder


@dataclass
class ResolvedRecipe:
    recipe: Recipe
    toml: str  # the resolved recipe, every field written out
    hash: str  # first 12 hex digits of the SHA-256 of `toml`
    path: str | None
    command_line: CommandLine
    notes: tuple[str, ...] = ()  # overrides worth telling the user about

    def start_lines(self) -> list[str]:
        """What a training run says of its recipe as it starts (doctor shows the same lines)."""
        return [f"note: {note}" for note in self.notes]


def resolve(argv: list[str], *, world_size: int | None = 1, default_recipe: str | None = None,
            actions: tuple[str, ...] = (), training: bool = False) -> ResolvedRecipe:
    """Parse, compose and check a recipe; raise RecipeError listing every problem at once.

    world_size=None checks everything but the layout rules (for commands that read a run's files
    in one process, such as export, whatever layout trained it). `actions`: the command-line actions
    the command acts on (say print_config for train); another one given is a problem, not ignored.
    training: the recipe is resolved to train (train, doctor), so a flag for a feature it switched off is
    refused even where another command reads it regardless (compile.* for inspect, validation.steps for eval).
    """
    problems: list[Problem] = []
    cmd = parse_args(argv, problems)
    twice = tuple(cmd.notes)  # the flags given twice: which one counts may be what a refusal is about
    for action in sorted(cmd.actions - set(actions) - {"help"}):  # help is answered before a recipe is read
        flag = next(f for f, a in ACTIONS.items() if a == action)
        problems.append(Problem(f"flag {flag!r}", "command", None, "is not an option of this command, which would "
                                "ignore it", f"drop it (`nsa-titan train RECIPE {flag}` prints the resolved recipe)"))
    path = cmd.recipe or default_recipe
    table: dict = {}
    origin: dict[str, str] = {}
    if path is not None:
        table, origin = load_composed(path, problems)
    apply_overrides(table, origin, cmd.overrides, problems)
    if path is not None:
        _name_the_run_after(path, table, origin, cmd.notes)
        _note_a_run_recipe_naming_another_folder(path, table, origin, cmd.notes)
    return _finish(table, origin, problems, world_size, path, cmd, training=training, command_notes=twice)


# In the note of a recipe whose [job] an extended file set: the commands that read a run's folder say it too.
NOT_INHERITED = "a run's name and folder are not inherited"


def run_identity_notes(resolved: ResolvedRecipe) -> list[str]:
    """The notes on which run (folder) the recipe names, for commands that read a run's outputs."""
    return [note for note in resolved.notes if NOT_INHERITED in note]


# In a command's `reads`: the table of arguments of the recipe's tokenizer ([data.<tokenizer>]).
TOKENIZER_ARGS = "data.<tokenizer>"


def unread_flags_note(resolved: ResolvedRecipe, command: str, reads: tuple[str, ...],
                      effect: str = "nothing here") -> str | None:
    """A note naming the command-line overrides that `command` does not read (the training command line
    given again, say), or None. `reads`: the fields and sections it reads, dotted ("model", "checkpoint.folder",
    TOKENIZER_ARGS); `effect`: what they change. They are not refused: the same flags serve every command of
    a run."""
    prefixes = [f"data.{resolved.recipe.data.tokenizer}" if read == TOKENIZER_ARGS else read for read in reads]
    unread = list(dict.fromkeys(key for _, key, _ in resolved.command_line.overrides
                                if not any(key == prefix or key.startswith(prefix + ".") for prefix in prefixes)))
    if not unread:
        return None
    flags = ", ".join(f"--{key}" for key in unread)
    return f"{command} does not read {flags}: {'it changes' if len(unread) == 1 else 'they change'} {effect}"


def _name_the_run_after(path: str, table: dict, origin: dict[str, str], notes: list[str]) -> None:
    """The run a recipe names is its own: job.name and job.dump_folder come from the file itself or the
    command line, never from a file it extends (a copy of nsa_125m.toml's settings would otherwise train in,
    and resume, nsa_125m's folder). A recipe that names no run is named after its file: my_run.toml runs as
    my_run in ./outputs/my_run, not in the defaults' debug folder."""
    job = table.setdefault("job", {})
    if not isinstance(job, dict):
        return  # the schema check reports it
    own = shown_path(os.path.abspath(path))
    inherited = {key: origin[key] for key in ("job.name", "job.dump_folder")
                 if key in origin and origin[key] != own and not origin[key].startswith("flag ")}
    given = {key: job.pop(key.split(".")[1]) for key in inherited}
    for key in inherited:
        del origin[key]
    stem = os.path.splitext(os.path.basename(path))[0]
    if "job.name" not in origin:
        job["name"] = stem
        origin["job.name"] = f"the recipe's file name ({os.path.basename(path)})"
    if "job.dump_folder" not in origin and isinstance(job["name"], str):
        job["dump_folder"] = f"./outputs/{job['name']}"
        origin["job.dump_folder"] = "job.name"
    if inherited and isinstance(job.get("name"), str) and isinstance(job.get("dump_folder"), str):
        theirs = ", ".join(f"{key} = {given[key]!r} in {inherited[key]}" for key in inherited)
        notes.append(f"this run is {job['name']!r} in {job['dump_folder']!r}, not the run of the recipe it extends "
                     f"({theirs}): {NOT_INHERITED}. To continue that run, set them in [job] of "
                     f"{os.path.basename(path)} or on the command line.")


def _note_a_run_recipe_naming_another_folder(path: str, table: dict, origin: dict[str, str], notes: list[str]) -> None:
    """A run's saved recipe, given from another folder than the run started in: its relative job.dump_folder names
    a folder here, so the command would start or read another run than the one it was saved with. Said, since a
    fresh run from an old run's recipe is also a use of it."""
    job, checkpoint = table.get("job"), table.get("checkpoint", {})
    if os.path.basename(path) != RECIPE_FILE or not isinstance(job, dict) or not isinstance(checkpoint, dict):
        return
    dump, saved_in = job.get("dump_folder"), os.path.dirname(os.path.abspath(path))
    checkpoints = checkpoint.get("folder", "checkpoint")
    if not isinstance(dump, str) or not isinstance(checkpoints, str) or origin.get("job.dump_folder", "").startswith(
            "flag ") or os.path.realpath(dump) == os.path.realpath(saved_in):
        return
    run = run_of_folder(os.path.join(saved_in, checkpoints))
    if run is None or run[0] != os.path.abspath(path):
        return
    notes.append(f"{shown_path(path)} is the recipe the run in {shown_path(saved_in)} saved, but its job.dump_folder "
                 f"= {dump!r}, read from the current folder, names {os.path.abspath(dump)}: another run than that "
                 f"one. To continue that run, add --job.dump_folder={shown_path(saved_in)} or start from the folder "
                 f"it started in.")


def resolve_text(text: str, *, world_size: int | None = None, overrides: list[str] | tuple[str, ...] = ()
                 ) -> ResolvedRecipe:
    """Check a recipe held as TOML text (e.g. the one saved with a run or an export), with command-line
    `overrides` (--section.field=VALUE words) over it, read and checked as a recipe's are."""
    problems: list[Problem] = []
    try:
        table = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise RecipeError([Problem("saved recipe", "recipe", None, f"is not valid TOML: {exc}",
                                   "export or train again to write a fresh one")]) from None
    origin = origins(table, "saved recipe")
    cmd = parse_args(list(overrides), problems)
    actions = [next(flag for flag, action in ACTIONS.items() if action == name) for name in sorted(cmd.actions)]
    for word in ([cmd.recipe] if cmd.recipe is not None else []) + actions:  # the recipe is `text` itself
        problems.append(Problem(f"argument {word!r}", "override", None, "is not an override of the saved recipe",
                                "write overrides as --section.field=value"))
    apply_overrides(table, origin, cmd.overrides, problems)
    return _finish(table, origin, problems, world_size, None, cmd, saved=True, command_notes=tuple(cmd.notes))


def read_saved_recipe(text: str, where: str, overrides: list[str] | tuple[str, ...] = ()):
    """The Recipe of a recipe saved in `where` (an export), with `overrides` over it; the checks added since it
    was written that it no longer passes said on stderr (its other notes were said when it ran), and the notes
    on the flags given now."""
    resolved = resolve_text(text, overrides=overrides)
    flags = [f"flag {flag!r}" for flag, _, _ in resolved.command_line.overrides]
    for note in resolved.notes:
        if note.startswith(NO_LONGER_PASSES):
            print(f"note: {where}: {note}", file=sys.stderr)
        elif note in resolved.command_line.notes or any(flag in note for flag in flags):
            print(f"note: {note}", file=sys.stderr)
    return resolved.recipe


def import_plugins_of_command_line(argv: list[str]) -> list[Problem]:
    """Import the job.plugins a command line's recipe and flags name, nothing else checked (for --help,
    which then lists the plugins' parts too); the plugins that could not be imported, as problems."""
    ignored: list[Problem] = []  # the recipe's own problems are for a run to report
    cmd = parse_args([a for a in argv if a not in ("--help", "-h")], ignored)
    table: dict = {}
    origin: dict[str, str] = {}
    if cmd.recipe is not None:
        table, origin = load_composed(cmd.recipe, ignored)
    apply_overrides(table, origin, cmd.overrides, ignored)
    problems: list[Problem] = []
    _import_plugins(table, origin, problems)
    return problems


def import_plugins_of(text: str) -> None:
    """Import the job.plugins a saved recipe names (before its model is rebuilt: a plugin may register
    it). A recipe that is not valid TOML is left to resolve_text to report."""
    try:
        table = tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        return
    problems: list[Problem] = []
    _import_plugins(table, {"job.plugins": "saved recipe"}, problems)
    if problems:
        raise RecipeError(problems)


def _finish(table: dict, origin: dict[str, str], problems: list[Problem], world_size: int | None, path: str | None,
            cmd: CommandLine, saved: bool = False, training: bool = False,
            command_notes: tuple[str, ...] = ()) -> ResolvedRecipe:
    """saved: a recipe a run or an export wrote, read back to rebuild its model and data. It was valid when
    written: rules added since (cross-field checks, recipe rules) become notes; its fields and types
    must still read. command_notes: said with the problems, if any."""
    _import_plugins(table, origin, problems)
    builder = RecipeBuilder(origin, problems, saved=saved)
    recipe = builder.build(Recipe, table)
    if not problems:
        broken: list[Problem] = []
        check_rules(recipe, world_size, builder.source_of, broken if saved else problems, builder.notes,
                    training=training)
        # A saved recipe's own settings were valid when written; a flag given over it now is held to every rule.
        problems.extend(found for found in broken if is_flag(found.where))
        builder.notes.extend(f"{NO_LONGER_PASSES}{found.render()}" for found in broken if not is_flag(found.where))
    if problems:
        raise RecipeError(problems, command_notes)
    text, digest = recipe_text(recipe)
    return ResolvedRecipe(recipe, text, digest, path, cmd, tuple(cmd.notes + builder.notes))


def _plugin_import_problem(source: str, name: str, exc: BaseException) -> Problem:
    """A plugin that is not there, or one that is but raised while it was imported (then: where, in it)."""
    missing = isinstance(exc, ModuleNotFoundError) and (
        str(exc).startswith("no file ") or (exc.name is not None and (name + ".").startswith(exc.name + ".")))
    if missing:
        return Problem(source, "job.plugins", name, f"could not be imported ({type(exc).__name__}: {exc})",
                       "give an importable module name (on PYTHONPATH or in the directory the run starts in) or "
                       "a path to a .py file")
    if isinstance(exc, SyntaxError):
        where = f"{exc.filename}, line {exc.lineno}"
    else:
        # The plugin's own line: past importlib's frames and the engine's (register raising for it, say), and
        # past the library's it called (argparse's sys.exit, say) where it has one of its own.
        engine = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        frames = [f for f in traceback.extract_tb(exc.__traceback__)
                  if "importlib" not in f.filename and not os.path.abspath(f.filename).startswith(engine + os.sep)]
        libraries = tuple({os.path.abspath(sysconfig.get_paths()[key]) + os.sep for key in ("stdlib", "purelib")})
        frames = [f for f in frames if not os.path.abspath(f.filename).startswith(libraries)] or frames
        where = f"{frames[-1].filename}, line {frames[-1].lineno}" if frames else name
    if isinstance(exc, SystemExit):  # a script taken for a plugin: its command-line part ran (and ended the run)
        return Problem(source, "job.plugins", name, f"{raised(exc)} while it was imported ({where})",
                       "a plugin is imported to register parts, not run: put the script's own work under "
                       "`if __name__ == \"__main__\":`, or remove the name from job.plugins")
    return Problem(source, "job.plugins", name, f"raised {type(exc).__name__} while it was imported ({where}): {exc}",
                   "mend the plugin there (parts it registers are missing until it imports)")


# The modules imported here from plugin files (by file name): one of them, unlike an installed module, may be
# replaced by another plugin file of its name.
_PLUGIN_MODULES: set[str] = set()


def _module_shadowed_by(path: str) -> str | None:
    """Where the module a plugin file would be imported as (its file name) already comes from, when that is not
    the file itself: loaded as that name, the plugin would replace it for every later import (a plugin file
    datasets.py made `import datasets` the plugin)."""
    module = os.path.basename(path)[:-3]
    loaded = sys.modules.get(module)
    if module in _PLUGIN_MODULES and loaded is not None:
        return None  # another plugin file of that name, loaded by an earlier recipe: this one replaces it
    if loaded is not None:
        where = getattr(loaded, "__file__", None) or ("built-in" if module in sys.builtin_module_names else None)
    else:
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):  # a name with dots whose parent is no package: nothing to shadow
            return None
        if spec is None:
            return None
        where = spec.origin
    if not where:  # a plain folder of that name (a namespace package: a corpus's data/): a module file comes first
        return None
    if os.path.isfile(where) and os.path.samefile(where, path):
        return None  # the plugin itself, found on the path
    return f"the module at {where}" if os.path.isabs(where) else "a built-in module"


def _shadowed_problem(source: str, name: str, where: str) -> Problem:
    module = os.path.basename(name)[:-3]
    return Problem(source, "job.plugins", name, f"would be imported as module {module!r}, which names "
                   f"{where} already, and would replace it for every later import of {module!r}",
                   f"rename the file (e.g. {module}_plugin.py)")


def _search_working_directory() -> None:
    """A plugin module in the directory the run starts in imports however the run was started: `python -m`,
    run_train.sh and torchrun's ranks have that directory on the import path, the `nsa-titan` console script
    its own bin folder instead. Put last, it shadows no installed package."""
    here = os.getcwd()
    if "" not in sys.path and here not in sys.path:
        sys.path.append(here)


def _working_directory_module_passed_over(name: str) -> tuple[str, str] | None:
    """(the file in the directory the run starts in, the module imported instead) when the plugin module `name` is
    there but an installed module of its name came first on the import path (the console script puts that directory
    last), so the user's file was never read."""
    top = name.split(".")[0]
    here = os.getcwd()
    local = next((path for path in (os.path.join(here, top + ".py"), os.path.join(here, top, "__init__.py"))
                  if os.path.isfile(path)), None)
    imported = getattr(sys.modules.get(top), "__file__", None)
    if local is None or (imported and os.path.isfile(imported) and os.path.samefile(imported, local)):
        return None
    return local, imported or "a built-in module"


def _passed_over_problem(source: str, name: str, local: str, imported: str) -> Problem:
    top = name.split(".")[0]
    package = os.path.basename(local) == "__init__.py"
    shown = (top + os.sep) if package else os.path.basename(local)
    renamed = f"{top}_plugin{os.sep if package else '.py'}"
    return Problem(source, "job.plugins", name, f"imported {imported}, not {shown} in the directory the run starts in: "
                   f"an installed module named {top!r} comes first on the import path, so {shown} registered nothing",
                   f"rename {shown} (e.g. to {renamed}) and set job.plugins = [\"{top}_plugin{name[len(top):]}\"]; if "
                   "the installed module is the one meant, start the run in another directory")


def _import_plugins(table: dict, origin: dict[str, str], problems: list[Problem]) -> None:
    plugins = table.get("job", {}).get("plugins", []) if isinstance(table.get("job"), dict) else []
    if isinstance(plugins, CliText):  # a flag's text: read as any list flag is (comma-separated, or a TOML list)
        try:
            plugins = coerce(plugins, list[str])
        except Exception:  # not a list of names: the schema check reports it
            return
    if not isinstance(plugins, list):
        return  # the schema check reports the wrong type
    source = origin.get("job.plugins", "defaults")
    for name in plugins:
        if not isinstance(name, str):
            continue
        try:
            if name.endswith(".py"):
                if not os.path.isfile(name):
                    raise ModuleNotFoundError(f"no file {name}{read_from(name)}")
                loaded = sys.modules.get(os.path.basename(name)[:-3])
                if loaded is not None and os.path.isfile(getattr(loaded, "__file__", None) or "") and \
                        os.path.samefile(loaded.__file__, name):
                    continue  # imported by an earlier recipe of this process: its parts are registered
                shadowed = _module_shadowed_by(name)
                if shadowed:
                    problems.append(_shadowed_problem(source, name, shadowed))
                    continue
                spec = importlib.util.spec_from_file_location(os.path.basename(name)[:-3], name)
                module = importlib.util.module_from_spec(spec)
                sys.modules[spec.name] = module
                _PLUGIN_MODULES.add(spec.name)
                try:
                    spec.loader.exec_module(module)
                except BaseException:
                    del sys.modules[spec.name]  # a failed import is not taken for a done one next time
                    raise
            else:
                _search_working_directory()
                importlib.import_module(name)
                passed_over = _working_directory_module_passed_over(name)
                if passed_over:
                    problems.append(_passed_over_problem(source, name, *passed_over))
        except (Exception, SystemExit) as exc:  # a plugin may fail in any way (a script's sys.exit, its argparse
            problems.append(_plugin_import_problem(source, name, exc))  # too); report it as a recipe problem
