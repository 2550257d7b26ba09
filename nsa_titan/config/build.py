"""Turn the merged recipe table into typed dataclasses, collecting every problem on the way.

Nothing is silent: an unknown key (with a did-you-mean), a wrong type, a value out of range or not
among the choices, and a table for a part that the recipe did not choose are all problems.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any

from components.problems import bound_problem, suggest
from nsa_titan import registry
from nsa_titan.config.errors import NO_LONGER_PASSES, Problem
from nsa_titan.config.fields import default_of, is_dataclass_type, named_tables_of, resolved_types, type_name
from nsa_titan.config.overrides import CliText, NoValue
from nsa_titan.config.toml_io import toml_value, tomllib

_BOOL_TEXT = {"true": True, "false": False}


class _Invalid(Exception):
    def __init__(self, why: str, fix: str):
        super().__init__(why)
        self.why, self.fix = why, fix


class RecipeBuilder:
    def __init__(self, origin: dict[str, str], problems: list[Problem], saved: bool = False):
        self.origin = origin  # field path -> where it was set, in the order of the last writes
        self.problems = problems
        self.notes: list[str] = []  # overrides worth saying out loud (a part's table made unused)
        # A recipe saved with a run or an export, read back: it was valid when written, so a part's own
        # cross-field rule added since is a note, not a reason to refuse reading it.
        self.saved = saved
        # [section] path -> (kind, chosen part, its name field) of the part whose arguments sit inline there
        self._inline_choice: dict[str, tuple[str, str, str]] = {}
        # path of a part's arguments -> that part: a plugin's check() and notes() are held to their contract
        self._args_owner: dict[str, registry.Part] = {}

    # -- reporting ---------------------------------------------------------------------------
    def source_of(self, path: str) -> str:
        """Where `path` was set; for a table, where its fields were, a flag first (the layer the user just
        typed, and the one to change)."""
        if path in self.origin:
            return self.origin[path]
        inside = [source for key, source in self.origin.items() if key.startswith(path + ".")]
        flags = [source for source in inside if source.startswith("flag")]
        return flags[-1] if flags else inside[0] if inside else "defaults"

    def _sources_beside_choice(self, table_path: str, choice_path: str) -> list[str] | None:
        """The sources of `table_path`'s fields that the choice at `choice_path` does not override: those set in
        the choice's layer or a later one (a table set only in earlier layers, an extended preset or the recipe
        under command-line flags, is overridden like any field, not a mistake). None: the choice is the
        default, so nothing overrode the table."""
        if choice_path not in self.origin:
            return None
        position = {key: i for i, key in enumerate(self.origin)}
        choice_layer = _layer(self.origin[choice_path])
        return [source for key, source in self.origin.items()
                if (key == table_path or key.startswith(table_path + "."))
                and (_layer(source) == choice_layer or position[key] > position[choice_path])]

    def _set_but_unused(self, path: str, shown: str, switch_path: str, chosen: Any, wanted: Any) -> None:
        """`path` (written as `shown`) is set, but `switch_path` = chosen leaves it unused: a note when a
        later layer made that choice, else a problem whose fix is removing it or choosing `wanted`, blamed
        on the layer to change (not an extended preset whose table the choice overrides)."""
        beside = self._sources_beside_choice(path, switch_path)
        if beside == []:
            self.notes.append(f"{shown} from {self.source_of(path)} is not used: "
                              f"{self.source_of(switch_path)} chose {switch_path} = {chosen!r}")
        else:
            where = beside[-1] if beside else self.source_of(path)
            what = "that flag" if where.startswith("flag") else shown
            self.problem(path, None, f"is set but {switch_path} = {chosen!r}, so it would be ignored",
                         f"remove {what} or set {switch_path} = {wanted!r}", where=where)

    def problem(self, path: str, value: Any, why: str, fix: str, where: str | None = None) -> None:
        shown = str(value) if isinstance(value, CliText) else value
        self.problems.append(Problem(where or self.source_of(path), path, shown, why, fix))

    # -- building ----------------------------------------------------------------------------
    def build(self, cls: type, table: Any, path: str = "") -> Any:
        """Build an instance of the dataclass `cls` from `table`; problems go to the list."""
        if not isinstance(table, dict):
            if isinstance(table, CliText):  # a flag named the section itself (--compile, --compile=true)
                self.problem(path, None, "is a table, not a value", f"override one of its fields, e.g. "
                             f"--{path}.FIELD=VALUE (`nsa-titan train --help` lists them)")
            else:
                self.problem(path, table, "must be a table", f"write it as [{path}] with fields under it")
            table = {}
        before = len(self.problems)
        hints = resolved_types(cls)
        values: dict[str, Any] = {}
        known: set[str] = set()
        deferred: list[dataclasses.Field] = []
        for fld in dataclasses.fields(cls):
            if "args_for" in fld.metadata:
                deferred.append(fld)
                continue
            known.add(fld.name)
            values[fld.name] = self._field(fld, hints[fld.name], table, _join(path, fld.name))
        by_name = {fld.name: fld for fld in dataclasses.fields(cls)}
        for fld in deferred:
            kind = by_name[fld.metadata["args_for"]].metadata["component"]
            values[fld.name] = self._part_args(fld, kind, values, table, path, known)
        for fld in dataclasses.fields(cls):
            if "used_when" in fld.metadata:
                values[fld.name] = self._unused_when_switched_off(fld, values, table, path)
        self._unknown_keys(table, known, path)
        obj = cls(**values)
        prefix = path + "." if path else ""
        # A field already refused stands at its default: cross-field rules on it would only add noise.
        if not any(p.field == path or p.field.startswith(prefix) for p in self.problems[before:]):
            self._cross_checks(obj, path)
        return obj

    def _field(self, fld: dataclasses.Field, tp: Any, table: dict, path: str) -> Any:
        default = default_of(fld)
        if is_dataclass_type(tp):
            return self.build(tp, table.get(fld.name, {}), path)
        entry = named_tables_of(tp)
        if entry is not None:
            return self._named_tables(entry, table.get(fld.name, {}), path)
        if fld.name not in table:
            if default is dataclasses.MISSING:
                self.problem(path, None, "is required", f"set {path} in the recipe")
            return default
        raw = table[fld.name]
        if isinstance(raw, NoValue):  # a known field's flag without its value
            self.problem(path, None, "has no value", f"write --{path}=true or --{path}=false" if tp is bool else
                         f"write --{path}=VALUE")
            return default
        value = shown = raw  # a refusal shows the value as typed until it has the field's type (0, not '0')
        try:
            # The field's own default as the example a fix offers (3e-4, the learning rate's, reads as written).
            example = toml_value(default) if isinstance(default, float) and default != 3e-4 else "3e-4"
            value = shown = coerce(raw, tp, example)
            check_bounds(value, fld.metadata)
            if "component" in fld.metadata:
                registry.get(fld.metadata["component"], value)
                if value in fld.metadata.get("exclude", ()):
                    raise _Invalid(fld.metadata["exclude"][value], f"choose another {fld.metadata['component']}")
        except _Invalid as bad:
            self.problem(path, shown, bad.why, bad.fix)
            return default
        except registry.UnknownPartError as unknown:
            names = registry.available(unknown.kind)
            self.problem(path, raw, f"is not a registered {unknown.kind}" + suggest(value, names),
                         f"choose one of: {', '.join(names)} (job.plugins can register more)")
            return default
        return value

    def _named_tables(self, entry: type, raw: Any, path: str) -> dict[str, Any]:
        """[path.NAME] tables, each built as an `entry`."""
        self._name_the_tables_in_flag_fixes(path, raw)
        if isinstance(raw, CliText):  # a flag named the field itself (--data.mixture.sources)
            self.problem(path, None, "is a table, not a value", _named_tables_fix(path, {}))
            return {}
        if not isinstance(raw, dict):
            self.problem(path, raw, "must hold named tables", f"write each as [{path}.NAME] with its fields under it")
            return {}
        built = {}
        for name, value in raw.items():
            if isinstance(value, dict):
                before = len(self.problems)
                built[name] = self.build(entry, value, _join(path, name))
                if len(self.problems) > before:
                    self._misspelled_table(path, name, raw, before)
            else:  # one problem, not one per required field of an empty table
                self.problem(_join(path, name), value, "must be a table",
                             f"write it as [{_join(path, name)}] with its fields under it")
        return built

    def _name_the_tables_in_flag_fixes(self, path: str, raw: Any) -> None:
        """A flag that named this field while the recipe holds its tables was refused before the schema was known
        (overrides.apply_overrides), with a table's fix (--path.FIELD=VALUE): its fields are a level further."""
        for i, found in enumerate(self.problems):
            if found.field == path and found.why == "is a table, not a value" and is_flag(found.where):
                self.problems[i] = dataclasses.replace(found, fix=_named_tables_fix(path, raw))

    def _misspelled_table(self, path: str, name: str, raw: dict, before: int) -> None:
        """[path.name] is incomplete and only flags wrote it, beside tables a recipe file wrote: most likely
        a misspelled name (--data.mixture.sources.webb.weight=2 for web), so say that, not 'is required'."""
        sources = [s for key, s in self.origin.items() if key.startswith(_join(path, name) + ".")]
        filed = [other for other in raw if other != name and any(
            not s.startswith("flag") for key, s in self.origin.items() if key.startswith(_join(path, other) + "."))]
        only_missing = all(p.why == "is required" for p in self.problems[before:])  # else the flags' own faults
        if not sources or not all(s.startswith("flag") for s in sources) or not filed or not only_missing:
            return
        missing = ", ".join(p.field.rsplit(".", 1)[-1] for p in self.problems[before:])
        del self.problems[before:]
        self.problem(_join(path, name), None, f"is no table of the recipe{suggest(name, filed)}; it has "
                     f"{', '.join(repr(n) for n in filed)}, and the flags alone make no complete new one "
                     f"(missing: {missing})",
                     f"correct the name in the flag, or give every required field of a new [{_join(path, name)}]")

    def _unused_when_switched_off(self, fld: dataclasses.Field, values: dict, table: dict, path: str) -> Any:
        """A field used only while a sibling has a given value (metadata used_when = (sibling, value)),
        e.g. model.nsa while model.attention = 'nsa': set while switched off, it is not used."""
        sibling, wanted = fld.metadata["used_when"]
        default = default_of(fld)
        field_path = _join(path, fld.name)
        # Only values that differ from the default count as set in a file (a rendered recipe writes every
        # field); a flag is set whatever its value: it was asked for.
        flagged = self.source_of(field_path).startswith("flag")  # a flag first, when one set any of it
        if values[sibling] == wanted or (values[fld.name] == default and not flagged):
            return values[fld.name]
        self._set_but_unused(field_path, field_path, _join(path, sibling), values[sibling], wanted)
        return default

    def _part_args(self, fld: dataclasses.Field, kind: str, values: dict, table: dict, path: str,
                   known: set[str]) -> Any:
        """Arguments of the part chosen by the sibling field, inline or in a sub-table."""
        name_field = fld.metadata["args_for"]
        chosen = values[name_field]
        try:
            part = registry.get(kind, chosen)
        except registry.UnknownPartError:
            part = None  # already reported on the name field
        if fld.metadata.get("placement") == "inline":
            args_cls = part.args if part else None
            arg_names = {f.name for f in dataclasses.fields(args_cls)} if args_cls else set()
            for clash in sorted(arg_names & known):
                self.problem(_join(path, clash), None, f"{kind} {chosen!r} has an argument named like a field of "
                             f"[{path}] beside it, so the two cannot be told apart",
                             f"rename that argument of {kind} {chosen!r}")
            known.update(arg_names)
            self._inline_choice[path] = (kind, chosen, name_field)
            if part is None:
                known.update(k for k in table if k not in known)  # nothing more to say about them
                return None
            sub = {k: v for k, v in table.items() if k in arg_names}
            self._args_owner[path] = part
            return self.build(args_cls, sub, path) if args_cls else None
        # placement == "table": [section.<chosen>] holds the arguments
        for other in registry.available(kind):
            if other in table and other != chosen:
                known.add(other)
                table_path = _join(path, other)
                self._set_but_unused(table_path, f"[{table_path}]", _join(path, name_field), chosen, other)
        if part is None:
            known.add(chosen)
            return None
        known.add(chosen)
        if part.args is None:
            if chosen in table:
                self.problem(_join(path, chosen), None, f"{kind} {chosen!r} takes no arguments",
                             f"remove [{_join(path, chosen)}]")
            return None
        self._args_owner[_join(path, chosen)] = part
        return self.build(part.args, table.get(chosen, {}), _join(path, chosen))

    def _unknown_keys(self, table: dict, known: set[str], path: str) -> None:
        replaced: list[str] = []  # a saved recipe's arguments of the part a flag replaced
        for key in table:
            if key in known:
                continue
            full = _join(path, key)
            owner = self._other_part_taking(path, key)
            if owner is not None:  # the part was switched (model.name) in a later layer or on the command line
                kind, chosen, name_field = self._inline_choice[path]
                chose = _join(path, name_field)
                if self.saved and is_flag(self.source_of(chose)) and not is_flag(self.source_of(full)):
                    replaced.append(full)  # a saved recipe cannot be edited: its old part's arguments go with it
                    continue
                self.problem(full, None, f"is an argument of {owner!r}, but {chose} = {chosen!r} (from "
                             f"{self.source_of(chose)})", f"remove it from {self.source_of(full)}, or choose "
                             f"{owner!r} again")
                continue
            section = isinstance(table[key], dict)  # at the top level: a misspelled section, [jobb]
            homes = [] if path or section else _fields_named(key)  # a field given without its section (--steps)
            fix = (f"remove it, or see `nsa-titan train --help` for the fields of [{path}]" if path else
                   "remove it, or correct the section's name (`nsa-titan train --help` lists the sections)" if section
                   else f"name it with its section: {' or '.join(homes)}" if homes else
                   "remove it, or name a field with its section, e.g. training.steps (`nsa-titan train --help` "
                   "lists them)")
            self.problem(full, None, "is not a recipe field" + ("" if homes else suggest(key, sorted(known))), fix)
        if replaced:
            chose = _join(path, self._inline_choice[path][2])
            self.notes.append(f"{', '.join(replaced)} from {self.source_of(replaced[0])} "
                              f"{'is' if len(replaced) == 1 else 'are'} not used: {self.source_of(chose)} chose "
                              f"{chose} = {self._inline_choice[path][1]!r}")

    def _other_part_taking(self, path: str, key: str) -> str | None:
        """Another registered part (a built-in first) whose inline arguments at `path` include `key`, or None."""
        if path not in self._inline_choice:
            return None
        kind, chosen, _ = self._inline_choice[path]
        for other in sorted(registry.available(kind), key=lambda name: (registry.get(kind, name).plugin, name)):
            args = registry.get(kind, other).args if other != chosen else None
            if args is not None and key in {f.name for f in dataclasses.fields(args)}:
                return other
        return None

    def _cross_checks(self, obj: Any, path: str) -> None:
        """The part's own cross-field rules (its `check()`), re-homed under the recipe path, and what it has to
        say of legal but notable settings (its `notes()`: texts naming fields relative to its table)."""
        prefix = path + "." if path else ""
        notes = getattr(obj, "notes", None)
        if callable(notes) and not self.saved:
            said = self._ask(obj, "notes", path)
            # One text is one note (iterated, it was a note per character).
            for note in [said] if isinstance(said, str) else said:
                if not isinstance(note, str):
                    self._broken_contract(obj, "notes", path, f"gave {note!r} ({type(note).__name__}), not a text",
                                          _NOTES_CONTRACT)
                    break
                self.notes.append(f"{prefix}{note}")
        check = getattr(obj, "check", None)
        if not callable(check):
            return
        found = self._ask(obj, "check", path)
        for problem in [found] if isinstance(found, Problem) else found:
            if not isinstance(problem, Problem):
                self._broken_contract(obj, "check", path, f"gave {problem!r} ({type(problem).__name__}), "
                                      "not a Problem", _CHECK_CONTRACT)
                break
            problem = problem.under(prefix, where=self.source_of(prefix + problem.field))
            if self.saved and not is_flag(problem.where):  # a flag given now over a saved recipe is checked whole
                self.notes.append(f"{NO_LONGER_PASSES}{problem.render()}")
            else:
                self.problems.append(problem)

    def _ask(self, obj: Any, method: str, path: str) -> list | tuple | str | Problem:
        """obj.check() or obj.notes() as it came, [] for None: a list, or one Problem (check) or one text
        (notes). What else it returns, or what a plugin's raises, is a problem naming the part: its own fault,
        not the recipe's."""
        contract = _NOTES_CONTRACT if method == "notes" else _CHECK_CONTRACT
        try:
            said = getattr(obj, method)() or []
            if isinstance(said, types.GeneratorType):  # a check written with yield: its items, as a list's
                said = list(said)
        except (Exception, SystemExit) as exc:  # a plugin's sys.exit ended the command in silence
            owner = self._owner(path)
            if owner is None or not owner.plugin:
                raise  # a built-in part's failure is a bug to see whole
            self._broken_contract(obj, method, path, f"raised {type(exc).__name__}: {exc}", contract)
            return []
        if isinstance(said, (list, tuple)) or isinstance(said, str if method == "notes" else Problem):
            return said
        self._broken_contract(obj, method, path, f"gave {said!r} ({type(said).__name__})", contract)
        return []

    def _broken_contract(self, obj: Any, method: str, path: str, why: str, contract: str) -> None:
        """A part's check() or notes() that broke its contract: the part's fault, named as such."""
        owner = self._owner(path)
        who = type(obj).__module__ if owner is None else \
            f"{owner.kind} {owner.name!r}" + (" (a plugin's)" if owner.plugin else "")
        call = f"{type(obj).__name__}.{method}()"
        self.problems.append(Problem(who, path, None, f"{call} {why}", f"{call} must return {contract}"))

    def _owner(self, path: str) -> registry.Part | None:
        """The part whose arguments hold `path` (the nearest: a mixture's source within the mixture)."""
        holders = [key for key in self._args_owner if path == key or path.startswith(key + ".")]
        return self._args_owner[max(holders, key=len)] if holders else None


# What an argument dataclass's check() and notes() return (README, Plugins).
_CHECK_CONTRACT = "a list of Problems (components.problems.problem(field, value, why, fix)), empty when none"
_NOTES_CONTRACT = "a list of texts, one per note (one text is one note)"


def _whole(raw: Any) -> int:
    """The whole number a value that is not one stands nearest to (16.0 or '16.0': 16), else 20 as an example."""
    try:
        value = float(raw)
    except (TypeError, ValueError):
        return 20
    return round(value) if math.isfinite(value) else 20


def coerce(raw: Any, tp: Any, example: str = "3e-4") -> Any:
    """Give a recipe or command-line value the field's type, or say why it cannot be; `example`: a number the
    fix for a float field offers (the field's own default, where the caller knows it)."""
    origin = typing.get_origin(tp)
    if origin in (list, typing.List):
        (inner,) = typing.get_args(tp) or (Any,)
        if isinstance(raw, CliText) and raw.strip().startswith("["):  # a TOML list, as a recipe writes it
            try:
                items = tomllib.loads(f"value = {raw.strip()}")["value"]
            except tomllib.TOMLDecodeError:
                raise _Invalid(f"{raw!r} starts with '[', so it is read as a TOML list, and it is not one",
                               'write a TOML list as in a recipe, with quoted strings: \'["[ab]*.txt", "c.txt"]\' '
                               '(a value of its own that starts with [ goes in such a list)') from None
        elif isinstance(raw, CliText):
            items = [CliText(p.strip()) for p in raw.split(",")] if raw.strip() else []
        elif isinstance(raw, list):
            items = raw
        else:
            raise _Invalid(f"expected a list ({type_name(tp)}), got {_kind(raw)}",
                           "write a TOML list like [1, 2] or, on the command line, a comma-separated list")
        return [coerce(item, inner, example) for item in items]
    if tp is bool:
        if isinstance(raw, CliText):
            if raw.lower() in _BOOL_TEXT:
                return _BOOL_TEXT[raw.lower()]
            raise _Invalid(f"expected true or false, got {raw!r}", "write =true or =false")
        if isinstance(raw, bool):
            return raw
        raise _Invalid(f"expected a boolean, got {_kind(raw)}", "write true or false")
    if tp is int:
        if isinstance(raw, CliText):
            try:
                if not raw.isascii():  # int() reads other scripts' digits ('１２'); a recipe file would not
                    raise ValueError(raw)
                return int(raw)
            except ValueError:
                raise _Invalid(f"expected a whole number, got {raw!r}", f"write an integer such as {_whole(raw)}") \
                    from None
        if isinstance(raw, int) and not isinstance(raw, bool):
            return raw
        raise _Invalid(f"expected a whole number, got {_kind(raw)}",
                       f"write an integer such as {_whole(raw)}, without quotes")
    if tp is float:
        if isinstance(raw, CliText):
            try:
                if not raw.isascii():
                    raise ValueError(raw)
                return _finite(float(raw), example)
            except ValueError:
                raise _Invalid(f"expected a number, got {raw!r}", f"write a number such as {example}") from None
        if isinstance(raw, (int, float)) and not isinstance(raw, bool):
            return _finite(float(raw), example)
        raise _Invalid(f"expected a number, got {_kind(raw)}", f"write a number such as {example}, without quotes")
    if tp is str:
        if isinstance(raw, str):
            return str(raw)
        raise _Invalid(f"expected text, got {_kind(raw)}", 'write it in quotes, e.g. "value"')
    raise _Invalid(f"has unsupported type {type_name(tp)}", "report this field's declaration as a bug")


def _finite(value: float, example: str) -> float:
    """TOML and Python both read inf and nan as numbers; no recipe field means either."""
    if not math.isfinite(value):
        raise _Invalid(f"must be a finite number, got {value}", f"write a finite number such as {example}")
    return value


def check_bounds(value: Any, meta: typing.Mapping[str, Any]) -> None:
    bad = bound_problem(value, meta)
    if bad:
        raise _Invalid(*bad)


def _kind(value: Any) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "text", list: "a list", dict: "a table"}
    return f"{names.get(type(value), type(value).__name__)} {value!r}"


def is_flag(source: str) -> bool:
    """Whether `source` (where a field was set, as source_of names it) is a command-line flag."""
    return source.startswith("flag ")


def _layer(source: str) -> str:
    """Every command-line flag is one layer; every file is its own."""
    return "flags" if is_flag(source) else source


def _fields_named(name: str) -> list[str]:
    """The recipe fields (parts' arguments included) whose own name is `name`, with their sections, as --help
    lists them."""
    import re

    from nsa_titan.config.help import help_text

    return sorted(set(re.findall(rf"^  --([a-z_.A-Z0-9]+\.{re.escape(name)}):", help_text(), re.M)))


def _named_tables_fix(path: str, raw: Any) -> str:
    names = ", ".join(repr(name) for name in raw) if isinstance(raw, dict) else ""
    return (f"override a field of one of its tables, e.g. --{path}.NAME.FIELD=VALUE"
            + (f" (its tables: {names})" if names else " (NAME: a name of your choice)"))


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key
