"""`--help`: every recipe field with its type, default and doc, parts' arguments included."""

from __future__ import annotations

import dataclasses

from components.install_hint import from_checkout
from components.problems import choices_of
from nsa_titan import registry
from nsa_titan.config.fields import default_of, doc_of, is_dataclass_type, named_tables_of, resolved_types, type_name
from nsa_titan.config.schema import Recipe
from nsa_titan.config.toml_io import toml_value

USAGE = """usage: nsa-titan train RECIPE.toml [--section.field=VALUE | --section.field VALUE ...]
{launcher}
Overrides take precedence over the recipe, which takes precedence over the files it extends,
which take precedence over the defaults below. Booleans take =true / =false; lists are
comma-separated (--optimizer.betas=0.9,0.95) or TOML lists (--optimizer.betas='[0.9, 0.95]').
--print-config prints the resolved recipe and exits.
"""


def help_text() -> str:
    # run_train.sh is the checkout's (an installed copy has none); it names the debug recipe when given none.
    launcher = "       ./run_train.sh [RECIPE.toml] [overrides...]\n" if from_checkout() else ""
    lines = [USAGE.format(launcher=launcher), "Recipe fields:"]
    _describe(Recipe, "", lines)
    return "\n".join(lines) + "\n"


def _describe(cls: type, path: str, lines: list[str], within: tuple[type, ...] = ()) -> None:
    """cls's fields under path; `within` holds the classes described above it: a part that may not hold
    itself (a mixture of sources) is not listed inside itself."""
    within = (*within, cls)
    hints = resolved_types(cls)
    by_name = {fld.name: fld for fld in dataclasses.fields(cls)}
    for fld in dataclasses.fields(cls):
        full = f"{path}.{fld.name}" if path else fld.name
        tp = hints[fld.name]
        if "args_for" in fld.metadata:
            kind = by_name[fld.metadata["args_for"]].metadata["component"]
            for name in registry.available(kind):
                part = registry.get(kind, name)
                if part.args is None or part.args in within:
                    continue
                where = path if fld.metadata.get("placement") == "inline" else f"{path}.{name}"
                lines.append(f"\n  [{where}]  arguments of {kind} {name!r}" + (f": {part.doc}" if part.doc else ""))
                _describe(part.args, where, lines, within)
            continue
        if is_dataclass_type(tp):
            lines.append(f"\n[{full}]  {doc_of(fld)}")
            _describe(tp, full, lines, within)
            continue
        entry = named_tables_of(tp)
        if entry is not None:
            lines.append(f"\n[{full}.NAME]  {doc_of(fld)}")
            _describe(entry, f"{full}.NAME", lines, within)
            continue
        extra = ""
        meta = fld.metadata
        if "choices" in meta:
            extra = f" (one of: {', '.join(map(str, choices_of(meta)))})"
        elif "component" in meta:
            offered = [n for n in registry.available(meta["component"]) if n not in meta.get("exclude", ())]
            extra = f" (registered: {', '.join(offered)})"
        default = default_of(fld)
        shown = toml_value(default) if default is not dataclasses.MISSING else "required"
        lines.append(f"  --{full}: {type_name(tp)} = {shown}  {doc_of(fld)}{extra}")
