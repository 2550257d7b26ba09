"""`nsa-titan`: the command line. Bad input ends in one clear message and exit code 2, never a traceback."""

from __future__ import annotations

import sys

from components.errors import UserError
from nsa_titan.config import RecipeError, resolve

COMMANDS = {
    "train": "train from a recipe: nsa-titan train RECIPE.toml [--section.field=VALUE ...]",
}

INPUT_ERROR = 2


def _usage() -> str:
    lines = ["usage: nsa-titan COMMAND [RECIPE.toml] [overrides...]", "", "commands:"]
    lines += [f"  {name:<8} {text}" for name, text in COMMANDS.items()]
    lines += ["", "`nsa-titan COMMAND --help` lists every recipe field."]
    return "\n".join(lines)


def _fail(message: str) -> int:
    print(message, file=sys.stderr, flush=True)
    return INPUT_ERROR


def train(argv: list[str]) -> int:
    from nsa_titan.config.help import help_text
    from nsa_titan.runtime import launch_world

    if "--help" in argv or "-h" in argv:
        print(help_text(), end="")
        return 0
    _, _, world_size = launch_world()
    resolved = resolve(argv, world_size=world_size)
    if "print_config" in resolved.command_line.actions:
        print(f"# resolved recipe, hash {resolved.hash}\n{resolved.toml}", end="")
        return 0
    if resolved.path is None:
        return _fail("error: no recipe given. Fix: name one, e.g. `nsa-titan train recipes/debug.toml`.")

    from nsa_titan.runtime import make_runtime
    from nsa_titan.trainer import Trainer

    recipe = resolved.recipe
    runtime = make_runtime(recipe.training.device, recipe.training.dtype)
    trainer = Trainer(resolved, runtime)
    try:
        trainer.run()
    finally:
        trainer.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else INPUT_ERROR
    command, rest = argv[0], argv[1:]
    handlers = {"train": train}
    if command not in handlers:
        return _fail(f"error: unknown command {command!r}. Fix: use one of {', '.join(handlers)} "
                     f"(`nsa-titan --help` describes them).")
    try:
        return handlers[command](rest)
    except RecipeError as exc:
        return _fail(exc.render())
    except UserError as exc:
        return _fail(f"error: {exc}")


if __name__ == "__main__":
    sys.exit(main())
