"""The run folder: created first, and the resolved recipe with its hash (the trainer says when: in a folder
of an earlier run, once this one is known to start)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
from typing import Any, Callable

from components.errors import UserError
from nsa_titan.config.toml_io import tomllib
from nsa_titan.run_recipe import RECIPE_FILE, RESOLVED_HEADER
from nsa_titan.step_folders import train_state_file

LOCK_FILE = ".run.lock"


def create_new(path: str, make: Callable[[str], None]) -> str:
    """make(path), or make(stem-2.ext), make(stem-3.ext), ... while the name is taken (make must raise
    FileExistsError then); returns the name made. For what is set aside within one second of another."""
    stem, ext = os.path.splitext(path)
    candidate, n = path, 1
    while True:
        try:
            make(candidate)
            return candidate
        except FileExistsError:
            n += 1
            candidate = f"{stem}-{n}{ext}"


def _file_in_the_way(folder: str) -> str:
    """The first part of `folder`'s path that exists and is not a folder (the path itself, or a file above it)."""
    path = os.path.abspath(folder)
    parts = [path]
    while os.path.dirname(parts[-1]) != parts[-1]:
        parts.append(os.path.dirname(parts[-1]))
    return next((p for p in reversed(parts) if os.path.lexists(p) and not os.path.isdir(p)), folder)


def refuse_file_in_the_way(folder: str) -> None:
    """A file (or a link to nothing) at the dump folder's path or above it: no folder can be made there. Asked by
    the launch once per node before its ranks start, and by the run as it creates the folder."""
    blocking = _file_in_the_way(folder)
    if not os.path.lexists(blocking) or os.path.isdir(blocking):
        return
    if os.path.islink(blocking):  # a link to a folder that is gone (an unmounted scratch disk, say)
        raise UserError(f"cannot create job.dump_folder {folder!r}: {blocking!r} is a symbolic link to "
                        f"{os.readlink(blocking)!r}, which does not exist. Fix: mount or create what it points "
                        f"to, remove the link, or choose another folder with --job.dump_folder=PATH.")
    raise UserError(f"cannot create job.dump_folder {folder!r}: {blocking!r} is a file, not a folder. Fix: "
                    f"choose another folder with --job.dump_folder=PATH, or move that file away.")


def create_run_folder(folder: str, outputs: dict[str, str] | None = None) -> bool:
    """The dump folder, and the output folders the run will write inside it ({recipe field: its value},
    e.g. checkpoint.folder when checkpoints are on): found unwritable now, not at the first save after
    hours of training. Whether the dump folder is new (nothing was at its path, '..' and links resolved)."""
    made = not os.path.lexists(os.path.realpath(folder))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        refuse_file_in_the_way(folder)
        raise UserError(f"cannot create job.dump_folder {folder!r}: {exc.strerror}. Fix: choose a writable folder "
                        f"with --job.dump_folder=PATH.") from None
    _check_recipe_slot(folder)
    for field, name in (outputs or {}).items():
        path = os.path.join(folder, name)
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as exc:  # the recipe refuses an absolute path here: the run's folders lie inside its own
            in_way = ", or move away the file in its way" if isinstance(exc, (FileExistsError, NotADirectoryError)) \
                else ""
            raise UserError(f"cannot create the folder {path!r} ({field} = {name!r}): {exc.strerror}. Fix: choose a "
                            f"writable folder with --{field}=NAME (a relative path inside job.dump_folder){in_way}."
                            ) from None
    return made


def _first_line(path: str) -> str | None:
    """The file's first line; None when there is no file."""
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.readline()
    except FileNotFoundError:
        return None


def _check_recipe_slot(folder: str) -> None:
    """A recipe.toml in the dump folder that no run wrote (a user's own recipe kept beside its outputs)
    would be replaced by the run's resolved recipe: refused before anything is written."""
    path = os.path.join(folder, RECIPE_FILE)
    try:
        first = _first_line(path)
    except OSError as exc:
        raise UserError(f"cannot read {path!r}: {exc.strerror}. The run keeps its resolved recipe under that name. "
                        f"Fix: make it readable, or choose another --job.dump_folder.") from None
    if first is not None and not first.startswith(RESOLVED_HEADER):
        raise UserError(f"{path!r} was not written by a run (it does not begin with '{RESOLVED_HEADER.strip()}'), "
                        f"and the run keeps its resolved recipe under that name. Fix: move your file out of the "
                        f"dump folder (or rename it), or choose another --job.dump_folder.")


def write_run_recipe(folder: str, resolved) -> str:
    """Write the resolved recipe; an earlier run's different recipe is kept aside."""
    path = os.path.join(folder, RECIPE_FILE)
    header = f"{RESOLVED_HEADER}{resolved.hash}\n"
    first = _first_line(path)
    if first is not None:
        if first != header and first.startswith(RESOLVED_HEADER):
            old_hash = first.strip().rsplit(" ", 1)[-1]
            os.replace(path, os.path.join(folder, f"recipe.{old_hash}.toml"))
    tmp = path + ".tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(header + resolved.toml)
        os.replace(tmp, path)
    except OSError as exc:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise UserError(f"cannot write the run's recipe {path!r} ({exc.strerror}). Fix: free space on that file "
                        f"system, or choose another --job.dump_folder.") from None
    return path


def recipe_changes(folder: str, resolved, limit: int = 12) -> list[str]:
    """What this run's recipe changes from the one the folder's last run kept as recipe.toml, field by field
    ('model.nsa.window_size: 64 -> 32'), at most `limit` of them and a count of the rest; [] when the same
    or when there is none to compare with. A resumed run says so: a changed field is applied, not ignored,
    and should not pass unseen."""
    return recipe_differences(_read_run_recipe(folder), resolved, limit=limit)


def _read_run_recipe(folder: str, name: str = RECIPE_FILE) -> str | None:
    """The recipe a run wrote into `folder` as `name`, or None (none there, unreadable, or not a run's)."""
    try:
        with open(os.path.join(folder, name), encoding="utf-8") as fh:
            text = fh.read()
    except (OSError, UnicodeDecodeError):
        return None
    return text if text.startswith(RESOLVED_HEADER) else None


def recipe_differences(text: str | None, resolved, limit: int = 12) -> list[str]:
    """Fields whose values in the resolved recipe TOML `text` differ from this run's, as 'field: old -> new';
    [] when the same or text is None or unreadable."""
    if text is None or text.startswith(f"{RESOLVED_HEADER}{resolved.hash}\n"):
        return []
    return toml_differences(text, resolved.toml, limit, same=_same_folder)


# Paths read from the directory the run starts in: the same file or folder spelled another way is no change.
_PATH_FIELDS = ("job.dump_folder", "checkpoint.initial_load_path")


def _same_folder(key: str, before: Any, now: Any) -> bool:
    return (key in _PATH_FIELDS and isinstance(before, str) and isinstance(now, str) and bool(before)
            and bool(now) and os.path.realpath(before) == os.path.realpath(now))


def toml_differences(before_text: str, now_text: str, limit: int = 12, same=None) -> list[str]:
    """Fields whose values differ between two recipes' TOML, as 'field: before -> now' ([] when unreadable);
    same(key, before, now): whether two values that differ mean the same all the same."""
    try:
        before, now = flat_fields(tomllib.loads(before_text)), flat_fields(tomllib.loads(now_text))
    except tomllib.TOMLDecodeError:
        return []  # nothing readable to compare with
    changes = [f"{key}: {_short(before.get(key, _UNSET))} -> {_short(now.get(key, _UNSET))}"
               for key in sorted(before.keys() | now.keys()) if before.get(key, _UNSET) != now.get(key, _UNSET)
               and not (same and same(key, before.get(key, _UNSET), now.get(key, _UNSET)))]
    return changes[:limit] + ([f"and {len(changes) - limit} more"] if len(changes) > limit else [])


def model_fields_of_step_folder(step_dir: str, run: str | None = None) -> tuple[str, dict[str, Any]] | None:
    """(where they were found, the [model] fields) that trained a checkpoint step folder's weights, or None
    where they cannot be found or read. The step's train_state.json holds them; a step saved before it did is
    judged by the recipe that wrote it, in the run folder (which holds the checkpoint folder): recipe.toml, or
    recipe.<hash>.toml for the hash train_state.json names. run: the run folder, when known (else the folder
    above the step's checkpoint folder)."""
    run = run or os.path.dirname(os.path.dirname(step_dir.rstrip(os.sep)))
    state_file = train_state_file(step_dir)
    try:
        with open(state_file, encoding="utf-8") as fh:
            record = json.load(fh)
        wanted = record.get("recipe_hash")
    except (OSError, ValueError, AttributeError):
        record, wanted = {}, None
    if isinstance(record.get("model"), dict):  # steps saved since checkpoints keep their model fields
        return state_file, record["model"]
    names = [RECIPE_FILE] + ([f"recipe.{wanted}.toml"] if isinstance(wanted, str) and wanted.isalnum() else [])
    for name in names:
        text = _read_run_recipe(run, name)
        if text is None or (wanted is not None and not text.startswith(f"{RESOLVED_HEADER}{wanted}\n")):
            continue
        try:
            return os.path.join(run, name), model_fields_of(text)
        except tomllib.TOMLDecodeError:
            return None
    return None


def model_fields_of(recipe_text: str) -> dict[str, Any]:
    """The [model] table of a resolved recipe, flat: model.name, model.dim, model.nsa.window_size, ..."""
    return flat_fields({"model": tomllib.loads(recipe_text).get("model", {})})


def recipe_change_note(resolved, lead: str) -> str | None:
    """'note: LEAD: field: old -> new; ...' for the fields recipe_changes finds in the run's folder, or None."""
    changes = recipe_changes(resolved.recipe.job.dump_folder, resolved)
    return f"note: {lead}: {'; '.join(changes)}" if changes else None


@contextlib.contextmanager
def said_if_refused(note: str | None):
    """A recipe change note said (on stderr) before a refusal from within the block: a checkpoint that does not fit
    the recipe is most often the run's fields changed, which the note names (an export's or eval's note otherwise
    follows its result)."""
    try:
        yield
    except UserError:
        if note:
            print(note, file=sys.stderr, flush=True)
        raise


def flat_fields(table: dict, prefix: str = "") -> dict[str, Any]:
    """Nested tables as one level of dotted keys: {"model": {"nsa": {"w": 1}}} -> {"model.nsa.w": 1}."""
    flat: dict[str, Any] = {}
    for key, value in table.items():
        if isinstance(value, dict):
            flat.update(flat_fields(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


_UNSET = object()


def _short(value: Any) -> str:
    """A recipe value as the recipe writes it (true, not True), cut at 60 characters."""
    text = "(not set)" if value is _UNSET else str(value).lower() if isinstance(value, bool) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def held_by_a_run(folder: str) -> bool:
    """Whether a running run holds the folder's lock now (a launch it refuses leaves that run's files alone)."""
    try:
        fd = os.open(os.path.join(folder, LOCK_FILE), os.O_RDWR)
    except OSError:
        return False  # no lock file: no run has held it
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except (BlockingIOError, PermissionError):
        return True
    except OSError:  # a file system without locks: no run can be told
        return False
    finally:
        os.close(fd)  # closing the file releases a lock taken here
    return False


class RunFolderLock:
    """Held by a run's main process from start-up until it ends (the system releases it when the process
    dies, however it dies): a second run started in the same dump folder, say a requeued job while the
    first still runs, is refused instead of moving aside and pruning the first run's checkpoints."""

    def __init__(self, folder: str, warn: Callable[[str], None]):
        path = os.path.join(folder, LOCK_FILE)
        self._fd: int | None = None
        try:
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise UserError(f"cannot open {path!r} ({exc.strerror}), which a run holds while it uses the folder. "
                            f"Fix: make job.dump_folder writable for this user, or choose another "
                            f"--job.dump_folder.") from None
        try:
            fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except (BlockingIOError, PermissionError):
            holder = _holder(self._fd)
            self.release()
            raise UserError(f"job.dump_folder {folder!r} is in use by another run ({holder}): two runs in one "
                            f"folder overwrite and prune each other's checkpoints. Fix: wait for that run to end "
                            f"(or stop it), or choose another --job.dump_folder.") from None
        except OSError as exc:  # a file system without locks: say so, and go on unguarded
            self.release()
            warn(f"cannot lock job.dump_folder {folder!r} ({exc.strerror}): a second run started in it would not "
                 f"be refused")
            return
        try:
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, f"pid {os.getpid()} on {socket.gethostname()}, since "
                                f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode(), 0)
        except OSError as exc:  # a full disk: name the file (cli's full-disk message says the rest)
            self.release()
            raise OSError(exc.errno, exc.strerror, path) from None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the file releases the lock
            self._fd = None


def _holder(fd: int) -> str:
    """Who holds a run folder's lock, as its holder wrote into the lock file."""
    return os.pread(fd, 512, 0).decode("utf-8", "replace").strip() or "a process"


def folder_held_by(folder: str) -> str | None:
    """Who holds the run-folder lock of `folder` now, or None when no run does (another process: a lock is per
    process)."""
    try:
        fd = os.open(os.path.join(folder, LOCK_FILE), os.O_RDWR)
    except OSError:  # no lock file (no run was here), or none we may open: nothing to say
        return None
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free: taken and, at close below, given back
        return None
    except (BlockingIOError, PermissionError):
        return _holder(fd)
    except OSError:  # a file system without locks
        return None
    finally:
        os.close(fd)
