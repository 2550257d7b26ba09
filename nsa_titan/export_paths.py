"""An export's relative paths: a recipe reads its plugin files and tokenizer files relative to the directory the run
starts in, so an export records the directory it was made in (`run_dir`) and its readers, started anywhere, read those
paths from there (or say which file is gone and where it was)."""

from __future__ import annotations

import os
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


def reads_run_dir(plugins: list[str]) -> bool:
    """Whether job.plugins names a plugin file by a relative path or a module in the working directory (a folder of
    --format hf, which may be shared, records the directory it was made in only then)."""
    return any(_relative(name) if name.endswith(".py") else _module_in(name, os.getcwd()) for name in plugins)


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


def tokenizer_read_from(args, run_dir: str | None, where: str):
    """The tokenizer's arguments with the files they name read from `run_dir`; each must be there."""
    from components.data import with_files_read_from

    if not _moved(run_dir):
        return args
    args, files = with_files_read_from(args, run_dir)
    for given, path in files:
        if not os.path.exists(path):
            raise UserError(f"{where} was exported in {run_dir}, and its tokenizer reads {given!r} from there "
                            f"({path}), which is not there now. Fix: put the file back there, or export the run with "
                            f"--format hf, whose folder carries its tokenizer.")
    return args
