"""Options of the commands themselves (not recipe fields), taken out of argv before the recipe is read."""

from __future__ import annotations

import difflib
import fnmatch
import os
import re
import uuid
from typing import Callable

from components.errors import UserError


def take_option(argv: list[str], name: str, default: str | None = None) -> str | None:
    """Remove `NAME VALUE` or `NAME=VALUE` from argv and return VALUE (default when absent); given twice is an
    error (which one was meant?)."""
    for i, arg in enumerate(argv):
        if arg == name:
            if i + 1 >= len(argv):
                raise UserError(f"{name} needs a value. Fix: write {name}=VALUE.")
            value = argv[i + 1]
            del argv[i:i + 2]
            break
        if arg.startswith(name + "="):
            del argv[i]
            value = arg.split("=", 1)[1]
            break
    else:
        return default
    if any(arg == name or arg.startswith(name + "=") for arg in argv):
        raise UserError(f"{name} is given twice. Fix: give it once.")
    return value


def existing_ancestor(path: str) -> str:
    """The path itself, or its nearest parent that exists: where creating it would start."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def refuse_unknown_options(argv: list[str], command: str, known: str, overrides: bool = False) -> None:
    """An option still in argv once the command took its own is a typo or another command's: name it (with
    the closest of `known`'s options). overrides: argv also holds recipe overrides, --section.field with a
    dot, whose value may follow as the next word (a negative number included): only --words without a dot
    are options then."""
    names = [arg.split("=", 1)[0] for arg in argv]
    unknown = [n for n in names if n.startswith("--") and "." not in n] if overrides else \
        [n for n in names if n.startswith("-")]
    if unknown:
        # the options `known` names, not the placeholders of its overrides (--section.field=VALUE is no --section);
        # a word near one that opens a literal placeholder (--dat, --data of --data.FIELD=VALUE) is shown its whole form
        options = re.findall(r"--[a-z][a-z-]*(?![\w.-])", known)
        openers = {p.split(".")[0]: p for p in re.findall(r"--[a-z][\w-]*\.[\w.=]+", known)
                   if not p.startswith("--section.")}
        close = difflib.get_close_matches(unknown[0], options + list(openers), n=1, cutoff=0.6)
        close = "" if not close else f" (did you mean {openers[close[0]]}?)" if close[0] in openers else \
            f" (did you mean {close[0]!r}?)"
        raise UserError(f"{command} has no option {unknown[0]!r}{close}. Fix: remove it, or use one of {known}.")


def new_name_beside(target: str) -> str:
    """A name nothing has yet, beside the absolute path `target` (its folder made if missing), to write an output
    under before moving it into place (what mkstemp and mkdtemp make would be owner-only; this keeps the umask's
    permissions)."""
    os.makedirs(os.path.dirname(target), exist_ok=True)
    return f"{target}.tmp-{uuid.uuid4().hex[:12]}"


def with_umask_permissions(path: str) -> None:
    """Give a written file the permissions open() would have (0666 less the umask): safetensors writes through
    an owner-only temporary file, which would leave an export's weights unreadable to anyone else."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def take_flag(argv: list[str], name: str) -> bool:
    """Remove every bare `NAME` from argv; whether there was one. `NAME=VALUE` is an error: a flag takes none."""
    given = next((arg for arg in argv if arg.startswith(name + "=")), None)
    if given is not None:
        raise UserError(f"{name} takes no value (got {given!r}). Fix: write {name} alone to turn it on, or leave it "
                        f"out.")
    found = name in argv
    argv[:] = [arg for arg in argv if arg != name]
    return found


def check_output(flag: str, path: str, *, folder: bool, fresh: bool = False,
                 replaceable: Callable[[str], bool] | None = None) -> None:
    """Refuse, before any work, an output that cannot be written: the wrong kind (folder: the output is a folder,
    else one file), one under a file or an unwritable folder, or (fresh) one that exists already, so that
    nothing is overwritten (an empty folder counts as new). With `replaceable` (--overwrite), an existing
    output it recognizes (an earlier one of this command) may be replaced; anything else still may not."""
    kind = "folder" if folder else "file"
    if os.path.exists(path):
        if os.path.isdir(path) != folder:
            example = "" if folder else f", e.g. {os.path.join(path, 'model.pt')!r}"
            raise UserError(f"{flag} {path!r} is a {'file' if folder else 'folder'}, but the output is a {kind}; "
                            f"nothing was written. Fix: choose a {kind} path{example}.")
        if fresh and (not folder or os.listdir(path)):
            if replaceable is None:
                raise UserError(f"{flag} {path!r} already exists{' and is not an empty folder' if folder else ''}; "
                                f"nothing was written. Fix: choose a new {kind}, remove this one first, or add "
                                f"--overwrite to replace an earlier export there.")
            if os.path.islink(path):
                raise UserError(f"{flag} {path!r} is a symbolic link; --overwrite replaces only what is at the path "
                                f"itself; nothing was written. Fix: give the path it points to, "
                                f"{os.path.realpath(path)!r}.")
            if not replaceable(path):
                raise UserError(f"{flag} {path!r} already exists and is not an earlier export, so --overwrite "
                                f"leaves it alone; nothing was written. Fix: choose a new {kind}.")
    # A fresh output is written beside its path, then moved there: its folder must take new entries.
    existing = existing_ancestor(os.path.dirname(os.path.abspath(path)) if fresh and os.path.exists(path) else path)
    if not os.path.isdir(existing):
        raise UserError(f"{flag} {path!r} cannot be created: {existing!r} is a file, not a folder. Fix: choose a "
                        f"path under a folder.")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"{flag} {path!r} cannot be created: the folder {existing!r} is not writable. Fix: choose "
                        f"a folder you can write to.")


def earlier_results(out: str, patterns: tuple[str, ...]) -> list[str]:
    """The files in folder `out` whose names match `patterns` (a command's outputs), in the patterns' order."""
    if not os.path.isdir(out):
        return []
    names = sorted(os.listdir(out))
    return [n for pattern in patterns for n in names if fnmatch.fnmatchcase(n, pattern)]


def refuse_earlier_results(out: str, command: str, patterns: tuple[str, ...], overwrite: bool) -> list[str]:
    """A command never silently replaces what an earlier run of it wrote into --out (eval results may be
    all that is left of a pruned checkpoint; an earlier plot's legend would describe the new pictures).
    Returns the earlier results (there to replace, with overwrite)."""
    earlier = earlier_results(out, patterns)
    if earlier and not overwrite:
        raise UserError(f"--out {out!r} holds an earlier {command}'s results ({', '.join(earlier)}); nothing was "
                        f"written. Fix: choose a new folder, or add --overwrite to replace them.")
    return earlier


def write_results(out: str, command: str, patterns: tuple[str, ...], overwrite: bool,
                  writers: dict[str, Callable[[str], None]]) -> None:
    """A command's result files into --out: writers maps each final path to a function that writes the file
    at the (temporary) path it is given. Every file is written under a temporary name first; only then do
    the new files move in, each replacing its earlier namesake at once, and (with --overwrite) the earlier
    results they did not replace go. A write that fails (a full disk) leaves no partial file and the
    earlier results as they were."""
    staged = {path: os.path.join(out, f".{os.path.basename(path)}.{os.getpid()}.tmp") for path in writers}
    try:
        os.makedirs(out, exist_ok=True)
        for path, write in writers.items():
            write(staged[path])
    except OSError as exc:
        raise UserError(f"cannot write the {command} results into --out {out!r} ({exc.strerror or exc}); nothing "
                        f"was written and any earlier results there are as they were. Fix: free some space, or "
                        f"choose another folder.") from None
    else:
        earlier = refuse_earlier_results(out, command, patterns, overwrite)  # again: another run may have written
        try:
            for path in writers:
                os.replace(staged[path], path)
            for name in earlier:
                if os.path.join(out, name) not in writers:  # another layer's picture, a stale lm_eval.json
                    os.remove(os.path.join(out, name))
        except OSError as exc:
            raise UserError(f"cannot move the {command} results into --out {out!r} ({exc.strerror or exc}); the "
                            f"folder may hold some new and some earlier results. Fix: run the command again with "
                            f"--overwrite.") from None
    finally:
        for path in staged.values():
            if os.path.exists(path):
                os.remove(path)
