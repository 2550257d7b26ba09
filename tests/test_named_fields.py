"""Every `--section.field` a message, note or fix of the package names is a recipe field: a fix that names a flag
the recipe does not take leaves its reader with a second error instead of a way on."""

from __future__ import annotations

import ast
import pathlib
import re

from nsa_titan.config.help import help_text
from nsa_titan.config.schema import Recipe
from tests.conftest import REPO_ROOT

# A flag as a text names it: not part of a longer word or path ('x--a.b', '/--a.b'), nor an option's value such
# as --override=--a.b, which is matched on its own.
FLAG = re.compile(r"(?<![\w./-])--([a-z_]+(?:\.[A-Za-z_0-9]+)+)")
SECTIONS = set(Recipe.__dataclass_fields__)


def recipe_flags() -> set[str]:
    """Every field `nsa-titan train --help` lists, as the flag's path (data.mixture.sources.NAME.weight)."""
    return set(re.findall(r"^\s*--([a-z_.A-Z0-9]+):", help_text(), re.M))


def named_flags() -> list[tuple[str, int, str]]:
    """(file, line, field path) of each --section.field in a string of the package, the parts and the benchmarks
    (an f-string's literal parts: a path built from values, --{section}.{field}, is not read), and in the launch
    scripts' lines."""
    texts = []
    for folder in ("nsa_titan", "components", "bench"):
        for path in sorted(pathlib.Path(REPO_ROOT, folder).rglob("*.py")):
            texts += [(path, node.lineno, node.value) for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
                      if isinstance(node, ast.Constant) and isinstance(node.value, str)]
    root = pathlib.Path(REPO_ROOT)
    for path in [root / "run_train.sh", *sorted(root.glob("bench/*.sh")), *sorted(root.glob("scripts/*.sh"))]:
        texts += [(path, number, line) for number, line in enumerate(path.read_text().splitlines(), 1)]
    return [(str(path.relative_to(REPO_ROOT)), line, match.group(1)) for path, line, text in texts
            for match in FLAG.finditer(text) if match.group(1).split(".")[0] in SECTIONS]


def as_listed(field: str) -> str | None:
    """The path as --help lists it (a mixture's source name as NAME), or None for a placeholder (FIELD, N)."""
    parts = field.split(".")
    if "sources" in parts[:-1] and parts[:2] == ["data", "mixture"]:
        at = parts.index("sources") + 1
        parts[at] = "NAME"
    if any(part.isupper() and part != "NAME" for part in parts):
        return None
    return ".".join(parts)


def test_every_flag_a_message_names_is_a_recipe_field():
    known = recipe_flags()
    named = named_flags()
    assert len(named) > 40, named  # the scan reads the messages (a broken pattern would pass vacuously)
    wrong = [f"{path}:{line}: --{field}" for path, line, field in named
             if as_listed(field) is not None and as_listed(field) not in known]
    assert not wrong, "\n".join(wrong)


def test_the_scan_finds_a_misspelled_flag_and_reads_a_mixtures_names():
    known = recipe_flags()
    assert "training.steps" in known and "data.mixture.sources.NAME.weight" in known
    assert as_listed("data.mixture.sources.web.weight") in known
    assert as_listed("training.step") not in known and as_listed("data.FIELD") is None
    texts = "Fix: add --checkpoint.enable=true, or --override=--training.steps=3; not a/--b.c nor x--d.e"
    assert [m.group(1) for m in FLAG.finditer(texts)] == ["checkpoint.enable", "training.steps"]
