"""An export's relative paths: a recipe reads its plugin, tokenizer and data files relative to the directory the run
starts in, so an export records the directory it was made in (`run_dir`) and its readers, started anywhere, read those
paths from there (or say which file is gone and where it was). The fields that name files say so in their metadata
("path", components/problems.py), so a plugin's part is read the same way."""

from __future__ import annotations

import dataclasses
import glob
import os
import shlex
import sys

from components.errors import UserError
from nsa_titan.config.toml_io import dumps, tomllib

RUN_DIR = "run_dir"  # the key, in an export's metadata, of the absolute directory it was made in


def made_in() -> str:
    return os.getcwd()


def _module_in(name: str, folder: str) -> bool:
    """Whether the plugin module `name` is a module or package in `folder`."""
    top = name.split(".")[0]
    return os.path.isfile(os.path.join(folder, top + ".py")) or os.path.isfile(os.path.join(folder, top, "__init__.py"))


def reads_run_dir(recipe) -> bool:
    """Whether a reader of a --format hf folder of `recipe` needs the directory it was made in: job.plugins names a
    plugin file by a relative path or a module there, or the data names files by relative paths (the folder carries
    its tokenizer). Such a folder, which may be shared, records the directory only then."""
    plugins = recipe.job.plugins
    return (any(_relative(name) if name.endswith(".py") else _module_in(name, os.getcwd()) for name in plugins)
            or bool(files_read_from(recipe.data.source_args, os.getcwd())[1]))


def _moved(run_dir: str | None) -> bool:
    """Whether relative paths read here would name other files than they did where the export was made."""
    return isinstance(run_dir, str) and bool(run_dir) and os.path.abspath(run_dir) != os.getcwd()


def _relative(path: str) -> bool:
    return not os.path.isabs(os.path.expanduser(path))


def plugins_read_from(recipe_toml: str, run_dir: str | None, where: str) -> str:
    """The recipe with the plugin files of job.plugins named by their paths in `run_dir`; each must be there. A plugin
    module in `run_dir` is found there: the folder goes last on the import path, as the working directory would."""
    if not _moved(run_dir):
        return recipe_toml
    try:
        table = tomllib.loads(recipe_toml)
    except tomllib.TOMLDecodeError:  # left to the recipe's reader to report
        return recipe_toml
    plugins = table.get("job", {}).get("plugins")
    if not isinstance(plugins, list):
        return recipe_toml
    found = []
    for name in plugins:
        if isinstance(name, str) and name.endswith(".py") and _relative(name):
            name = os.path.join(run_dir, name)
            if not os.path.isfile(name):
                raise UserError(f"{where} was exported in {run_dir}, and its recipe's plugin file {name!r} "
                                f"(job.plugins, which registers parts it needs) is not there now. Fix: put the plugin "
                                f"file back there.")
        elif isinstance(name, str) and not name.endswith(".py") and _module_in(name, run_dir) and \
                run_dir not in sys.path:
            sys.path.append(run_dir)
        found.append(name)
    if found == plugins:
        return recipe_toml
    table["job"]["plugins"] = found
    return dumps(table)


def files_read_from(args, folder: str, prefix: str = "", given: frozenset[str] = frozenset(), every: bool = False):
    """(`args` with the relative paths its "path" fields name read from `folder`, [(field, path as given, path in
    folder)]), through nested tables, named tables and the arguments of the parts they choose. given: fields left
    as they are (set on the command line: read from the current folder); every: absolute paths are listed too."""
    if not dataclasses.is_dataclass(args) or isinstance(args, type):
        return args, []
    changes, moved = {}, []
    for fld in dataclasses.fields(args):
        value, name = getattr(args, fld.name), _field_name(args, fld, prefix)
        says = fld.metadata.get("path")
        if name in given:
            continue
        if says is True or (callable(says) and says(args, folder)):
            new, found = _texts_read_from(value, folder, name, every)
        elif isinstance(value, dict):
            read = {key: files_read_from(entry, folder, f"{name}.{key}.", given, every) for key, entry in value.items()}
            new, found = {key: entry for key, (entry, _) in read.items()}, [m for _, ms in read.values() for m in ms]
        else:
            new, found = files_read_from(value, folder, name + ".", given, every)
        if found:
            changes[fld.name] = new
            moved += found
    return (dataclasses.replace(args, **changes) if changes else args), moved


def _field_name(args, fld: dataclasses.Field, prefix: str) -> str:
    """The field's name in the recipe; a chosen part's arguments sit in its table, or inline beside its name."""
    if "args_for" not in fld.metadata:
        return prefix + fld.name
    if fld.metadata.get("placement") == "inline":
        return prefix.rstrip(".")
    return prefix + str(getattr(args, fld.metadata["args_for"]))


def _texts_read_from(value, folder: str, name: str, every: bool = False):
    """A path field's text, or list of texts, with each relative path (not a URL, not '') read from `folder`
    (every: each absolute one listed too, as itself)."""
    texts = value if isinstance(value, list) else [value]
    moved = [(name, text, os.path.join(folder, text) if _relative(text) else os.path.expanduser(text))
             for text in texts if isinstance(text, str) and text and "://" not in text and (every or _relative(text))]
    if not moved:
        return value, []
    new = dict((given, path) for _, given, path in moved)
    read = [new.get(text, text) if isinstance(text, str) else text for text in texts]
    return (read if isinstance(value, list) else read[0]), moved


def _gone(path: str) -> bool:
    """Whether nothing is at `path` (a glob: matches nothing; the first match answers, not a walk of a large corpus)."""
    if glob.has_magic(path):
        return next(glob.iglob(path, recursive=True), None) is None
    return not os.path.exists(path)


def data_read_from(data, run_dir: str | None, export: str, given: frozenset[str] = frozenset()):
    """(the data settings with the source's relative paths read from `run_dir`, an error naming the files they name
    that are not there now, or None): a reader of the data raises it, so a command that reads none runs without
    them. given: the data fields set on the command line, whose paths are read from the current folder (the
    user's words now; their source names one that is not there)."""
    moved = _moved(run_dir)
    args, read = files_read_from(data.source_args, run_dir if moved else os.getcwd(), f"data.{data.source}.", given,
                                 every=True)
    if moved:
        data = dataclasses.replace(data, source_args=args)
    gone = [m for m in read if _gone(m[2])]
    if not gone:
        return data, None
    shown = ", ".join(f"{name} {text!r}" + (f" ({path})" if moved and _relative(text) else "")
                      for name, text, path in gone)
    made = f" (exported in {run_dir}, which its relative paths are read from)" if moved else ""
    flags = " ".join(f"--{name}=..." for name in dict.fromkeys(name for name, _, _ in gone))
    return data, UserError(f"the recipe saved in {export!r}{made} reads its data from {shown}, which "
                           f"{'is' if len(gone) == 1 else 'are'} not there now. Fix: put the data back there, or "
                           f"name where it is now: `nsa-titan eval {shlex.quote(export)} {flags} --out DIR` (a "
                           f"relative path given there is read from the current folder).")


def tokenizer_read_from(args, run_dir: str | None, where: str):
    """The tokenizer's arguments with the files they name read from `run_dir`; each must be there."""
    if not _moved(run_dir):
        return args
    args, files = files_read_from(args, run_dir)
    for _, given, path in files:
        if not os.path.exists(path):
            raise UserError(f"{where} was exported in {run_dir}, and its tokenizer reads {given!r} from there "
                            f"({path}), which is not there now. Fix: put the file back there, or export the run with "
                            f"--format hf, whose folder carries its tokenizer.")
    return args
