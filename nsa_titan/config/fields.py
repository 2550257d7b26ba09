"""Recipe fields: one helper to declare them and a few to read their metadata back.

Every recipe field is a dataclass field whose metadata carries a one-line "doc" and, where it
applies, "choices" and numeric bounds ("ge", "gt", "le", "lt"); components.problems.FIELD_METADATA
lists every key a field may carry. Components declare their argument
dataclasses with plain `dataclasses.field(metadata=...)` in the same convention, so they need not
import the engine.

Two metadata keys are the engine's own:
"choices" may be a callable returning the allowed values when the recipe is checked.

- "component": the field names a registered part of this kind ("model", "data_source", ...);
  "exclude" maps parts it may not name to why not.
A field typed `dict[str, Entry]` (Entry a dataclass) holds tables the user names, one Entry each.

- "args_for": the field holds the arguments of the part named by the sibling field given here;
  "placement" says where they live in TOML: "inline" (the rest of the same table, as in [model])
  or "table" (a sub-table named after the chosen part, as in [data.text_files]).

A model's argument field may say "keeps_weights": a run may start from weights trained with another
value of it (nsa_titan/weight_source.py). A field naming files on this machine says "path"
(components/problems.py): an export read elsewhere reads them from where it was made (nsa_titan/export_paths.py).
A source's field choosing which documents are held out says "held_out" ("share" or "split"): eval of an export says
when a data flag's value would hold out documents the model trained on (nsa_titan/evaluate/export_flags.py).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any


def f(default: Any = dataclasses.MISSING, doc: str = "", *, choices=None, ge=None, gt=None,
      le=None, lt=None, component: str | None = None, args_for: str | None = None,
      placement: str | None = None) -> Any:
    """Declare a recipe field with its one-line doc and constraints."""
    if not doc:
        raise ValueError("every recipe field needs a one-line doc")
    meta = {"doc": doc}
    for key, value in (("choices", choices), ("ge", ge), ("gt", gt), ("le", le), ("lt", lt),
                       ("component", component), ("args_for", args_for),
                       ("placement", placement)):
        if value is not None:
            meta[key] = tuple(value) if key == "choices" and not callable(value) else value
    if isinstance(default, list):
        items = list(default)
        return dataclasses.field(default_factory=lambda: list(items), metadata=meta)
    if dataclasses.is_dataclass(default) and isinstance(default, type):
        return dataclasses.field(default_factory=default, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def doc_of(fld: dataclasses.Field) -> str:
    return fld.metadata.get("doc", "")


def resolved_types(cls: type) -> dict[str, Any]:
    """Field name -> real type annotation (strings from `from __future__ import annotations` resolved)."""
    return typing.get_type_hints(cls)


def default_of(fld: dataclasses.Field) -> Any:
    if fld.default is not dataclasses.MISSING:
        return fld.default
    if fld.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return fld.default_factory()  # type: ignore[misc]
    return dataclasses.MISSING


def type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (list, typing.List):
        (inner,) = typing.get_args(tp) or (Any,)
        return f"list[{type_name(inner)}]"
    if dataclasses.is_dataclass(tp):
        return "table"
    if named_tables_of(tp) is not None:
        return "tables"
    if tp is Any:
        return "table"
    return getattr(tp, "__name__", str(tp))


def is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def named_tables_of(tp: Any) -> type | None:
    """The entry dataclass of a `dict[str, Entry]` field (tables named by the user, e.g.
    [data.mixture.sources.web]), else None."""
    if typing.get_origin(tp) is not dict:
        return None
    key, value = typing.get_args(tp) or (None, None)
    return value if key is str and is_dataclass_type(value) else None
