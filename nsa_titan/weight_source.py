"""checkpoint.initial_load_path, and a resumed checkpoint: may a run go on from weights trained with other
model fields?

Fields marked `keeps_weights` in the model part's argument dataclass (a longer max_seq_len to extend
the context, another NSA backend, window or top-n) leave every weight's meaning as it was: they may
differ, and the run names them. Any other difference (heads, tied embeddings, block sizes, ...) is
refused even where every weight's shape fits, since the weights would be read as something else.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from components.errors import UserError
from nsa_titan.config.fields import default_of, is_dataclass_type, resolved_types
from nsa_titan.config.toml_io import toml_value
from nsa_titan.run_folder import model_fields_of, model_fields_of_step_folder


def free_fields(args_cls: type, prefix: str = "model") -> set[str]:
    """Dotted paths (model.FIELD, model.nsa.FIELD) of the fields marked keeps_weights."""
    free = set()
    hints = resolved_types(args_cls)
    for fld in dataclasses.fields(args_cls):
        path = f"{prefix}.{fld.name}"
        if is_dataclass_type(hints[fld.name]):
            free |= free_fields(hints[fld.name], path)
        elif fld.metadata.get("keeps_weights"):
            free.add(path)
    return free


def switched_tables(args_cls: type, prefix: str = "model") -> dict[str, tuple[str, Any]]:
    """{table path: (the sibling's path, the value that switches the table on)} for tables marked used_when
    (model.nsa is used only while model.attention = 'nsa')."""
    found: dict[str, tuple[str, Any]] = {}
    hints = resolved_types(args_cls)
    for fld in dataclasses.fields(args_cls):
        path = f"{prefix}.{fld.name}"
        if "used_when" in fld.metadata:
            sibling, wanted = fld.metadata["used_when"]
            found[path] = (f"{prefix}.{sibling}", wanted)
        if is_dataclass_type(hints[fld.name]):
            found.update(switched_tables(hints[fld.name], path))
    return found


def _in_use(key: str, fields: dict[str, Any], switches: dict[str, tuple[str, Any]]) -> bool:
    """Whether the field `key` means something to the model `fields` describe (its table is switched on)."""
    return all(fields.get(sibling) == wanted for table, (sibling, wanted) in switches.items()
               if key.startswith(table + "."))


def field_defaults(args_cls: type, prefix: str = "model") -> dict[str, Any]:
    """Dotted paths of the fields with a default, and the default (a nested table's fields under it)."""
    defaults: dict[str, Any] = {}
    hints = resolved_types(args_cls)
    for fld in dataclasses.fields(args_cls):
        path = f"{prefix}.{fld.name}"
        if is_dataclass_type(hints[fld.name]):
            defaults.update(field_defaults(hints[fld.name], path))
        elif default_of(fld) is not dataclasses.MISSING:
            defaults[path] = default_of(fld)
    # As a rendered recipe holds them (render.recipe_to_table writes sequences as lists).
    return {path: list(value) if isinstance(value, (list, tuple)) else value for path, value in defaults.items()}


# Who reads the weights -> (the message's lead, given the path; the way out besides matching the fields).
_READERS = {
    "initial": ("checkpoint.initial_load_path = {path!r} holds weights trained with other model fields",
                "or start from weights of this model"),
    "resume": ("the checkpoint this run resumes, {path!r}, was trained with other model fields",
               "or train the changed model from its start in another job.dump_folder"),
    "read": ("the checkpoint {path!r} was trained with other model fields", "or train the changed model first"),
}


def model_field_changes(theirs: dict[str, Any], ours: dict[str, Any], args_cls: type | None, path: str,
                        where: str, reader: str = "initial") -> list[str]:
    """'model.FIELD: theirs -> ours' for every model field that differs (flat dotted dicts); UserError
    when one not marked keeps_weights does. where: the file that holds the weights' own fields; reader:
    checkpoint.initial_load_path's weights ("initial"), the checkpoint this run resumes ("resume"), or a
    command reading a checkpoint (export, eval, plot: "read")."""
    if args_cls is not None:  # a field the weights' recipe predates had its default there
        theirs = {**field_defaults(args_cls), **theirs}
    switches = switched_tables(args_cls) if args_cls is not None else {}
    # A switched-off table's fields (model.nsa on a dense model) mean nothing to the weights: where the switch
    # differs, the switch is the change to name.
    differ = sorted(key for key in theirs.keys() | ours.keys() if theirs.get(key) != ours.get(key)
                    and _in_use(key, theirs, switches) and _in_use(key, ours, switches))
    free = {key for key in (free_fields(args_cls) if args_cls is not None else set()) if _in_use(key, ours, switches)}
    blocked = [key for key in differ if key not in free]
    if blocked:
        shown = "; ".join(f"{key} = {_as_written(theirs.get(key))} there, {_as_written(ours.get(key))} here"
                          for key in blocked[:4])
        more = f"; and {len(blocked) - 4} more" if len(blocked) > 4 else ""
        allowed = f" ({', '.join(sorted(free))} may differ)" if free else ""
        lead, other = _READERS[reader]
        lead = lead.format(path=path)
        raise UserError(f"{lead}: {shown}{more}. The weights would be read as another model. Fix: set those fields "
                        f"to the values in {where}{allowed}, {other}.")
    return [f"{key}: {theirs.get(key)!r} -> {ours.get(key)!r}" for key in differ]


def step_field_changes(step_dir: str, run: str | None, recipe_toml: str, args_cls: type | None, path: str,
                       say: Callable[[str], None], reader: str = "initial") -> list[str]:
    """model_field_changes between the fields that trained the step folder's weights (recorded in it, or in its
    run's recipe; run: the run folder when known) and those of `recipe_toml`; where neither records them, a
    note through `say` that nothing could be compared, and no changes."""
    source = model_fields_of_step_folder(step_dir, run)
    if source is None:
        say(f"note: the model fields that trained the weights in {path} are not recorded (a step saved by an older "
            f"release, its run folder's recipe.toml gone), so they could not be compared with this recipe's: make "
            f"sure its [model] is the one that trained them")
        return []
    where, theirs = source
    return model_field_changes(theirs, model_fields_of(recipe_toml), args_cls, path, where, reader)


def changes_note(changes: list[str]) -> str | None:
    """The note naming the allowed model-field changes (max_seq_len to extend the context, say): legal, and said
    so that no change passes unseen; None when there are none."""
    return f"note: the model differs from the one that trained these weights: {'; '.join(changes)}" if changes else None


def _as_written(value: Any) -> str:
    """A model field's value as a recipe writes it (true, not True); 'unset' where one side lacks it."""
    if value is None:
        return "unset"
    try:
        return toml_value(value)
    except TypeError:
        return repr(value)
