"""The `doctor` command: run every check, print one line each, exit 1 when any fails."""

from __future__ import annotations

import os

from components.errors import UserError
from nsa_titan.checkout_hints import no_recipe
from nsa_titan.command_options import refuse_unknown_options, take_option
from nsa_titan.doctor.checks import FAIL, OK, WARN, Check

NEEDS_RECIPE = ("data", "dump folder", "resume", "NSA backend", "memory estimate")
USAGE = ("nsa-titan doctor RECIPE.toml [--section.field=VALUE ...] [--world-size N]\n"
         "  --world-size N   check the recipe for N processes (default: this launch's WORLD_SIZE, else 1)\n"
         "Prints one line per check (ok / warn / fail); exit 1 when a check fails (the recipe's own included),\n"
         "2 when the command line is wrong (no recipe named or found, two recipes, a bad --world-size).")


def _pop_world_size(argv: list[str]) -> int | None:
    text = take_option(argv, "--world-size")
    if text is None:
        return None
    if not text.isdigit() or int(text) < 1:
        raise UserError(f"--world-size {text!r} is not a positive whole number. Fix: e.g. --world-size 8.")
    return int(text)


def _guarded(name: str, fn) -> Check:
    """Run one check; an unexpected error is that check's failure, shown with its type and message."""
    try:
        return fn()
    except UserError as exc:
        return Check(name, FAIL, str(exc))
    except Exception as exc:  # a preflight tool reports what broke and goes on to the next check
        return Check(name, FAIL, f"{type(exc).__name__}: {exc}")


class _Reported(list):
    """The checks so far; each is printed as it is added, so a doctor stopped midway has said what it found."""

    def append(self, check: Check) -> None:
        super().append(check)
        print(check.line(), flush=True)

    def __iadd__(self, checks):
        for check in checks:
            self.append(check)
        return self


def run_checks(argv: list[str], world_size: int) -> list[Check]:
    """Every check, each printed as it completes."""
    from nsa_titan.config import RecipeError, resolve
    from nsa_titan.doctor import checks
    from nsa_titan.runtime import make_runtime

    try:
        resolved = resolve(argv, world_size=world_size, training=True)
    except RecipeError as exc:
        from nsa_titan.config.rules import LAUNCH_SIZE

        said = exc.render().replace(LAUNCH_SIZE, "(doctor: --world-size N)")  # the size doctor checks for
        recipe_check, resolved = Check("recipe", FAIL, said), None
    else:
        if resolved.path is None:
            raise UserError(no_recipe("doctor"))
        said = "".join(f"\n{line}" for line in resolved.start_lines())  # what training says of it, as it says it
        recipe_check = Check("recipe", OK, f"{resolved.path} validates for {world_size} process(es) "
                                           f"(hash {resolved.hash}){said}")
    results = _Reported()
    results.append(_guarded("versions", checks.check_versions))
    recipe = resolved.recipe if resolved else None
    devices = _guarded("devices", lambda: checks.check_devices(recipe.training.device if recipe else None, world_size))
    results += [devices, recipe_check]
    if recipe is None:
        results += [Check(name, WARN, "skipped: the recipe does not validate") for name in NEEDS_RECIPE]
        return results

    runtime = make_runtime(recipe.training.device, recipe.training.dtype) if devices.status != FAIL else None
    if runtime is None:
        results += [Check(name, WARN, "skipped: no device to run on") for name in NEEDS_RECIPE]
        return results
    data_check, tokenizer, source = _data(recipe, runtime, world_size)
    results.append(data_check)
    results.append(_guarded("dump folder", lambda: _dump_folder(recipe, tokenizer)))
    # The data stream is compared only with data the data check could read (its failure is said there, once).
    readable = tokenizer if data_check.status != FAIL else None
    results.append(_guarded("resume", lambda: _resume(resolved, runtime, readable, source)))
    results.append(_guarded("NSA backend", lambda: checks.check_model(recipe, runtime.device,
                                                                       runtime.autocast_dtype)))
    if tokenizer is None:
        results.append(Check("memory estimate", WARN, "skipped: the tokenizer (vocabulary size) could not be built"))
    else:
        results.append(_guarded("memory estimate", lambda: checks.check_memory(recipe, world_size, runtime, tokenizer)))
    return results


def _data(recipe, runtime, world_size: int):
    from nsa_titan.doctor.checks import check_data

    try:
        return check_data(recipe, runtime, world_size)
    except Exception as exc:  # reported as the data check's failure, with its type
        failed = Check("data", FAIL, f"{type(exc).__name__}: {exc}")
    try:  # the data failed past the tokenizer, most likely: the checks that need only it still run
        from nsa_titan import assemble

        return failed, assemble.build_tokenizer(recipe), None
    except Exception:
        return failed, None, None


def _resume(resolved, runtime, tokenizer, source) -> Check:
    from nsa_titan.doctor.resume import check_resume

    return check_resume(resolved, runtime, tokenizer, source)


def _dump_folder(recipe, tokenizer) -> Check:
    from nsa_titan import assemble
    from nsa_titan.doctor.checks import check_dump_folder, checkpoint_bytes

    needed = 0
    if recipe.checkpoint.enable and tokenizer is not None:
        params = assemble.count_parameters(assemble.build_model_on_meta(recipe, tokenizer.vocab_size))
        needed = checkpoint_bytes(params, recipe.checkpoint.keep_latest_k)
    return check_dump_folder(recipe.job.dump_folder, needed)


def _refuse_a_wrong_recipe_path(argv: list[str]) -> None:
    """A recipe path that names no file, or two recipes, is the command line's mistake (exit 2, said as train
    says it), not a failing check of a recipe that was read."""
    from nsa_titan.config.overrides import parse_args
    from nsa_titan.config.toml_io import read_toml

    problems: list = []
    cmd = parse_args(argv, problems)
    wrong = [p for p in problems if p.field == "recipe"]
    if not wrong and cmd.recipe is not None and not os.path.isfile(cmd.recipe):
        read_toml(cmd.recipe, wrong, where="command line")  # says why it is no recipe file
    if wrong:
        raise UserError(wrong[0].render())


def run_command(argv: list[str]) -> int:
    from nsa_titan.runtime import launch_world

    argv = list(argv)
    if "--help" in argv or "-h" in argv:
        print(USAGE + "\nRecipe fields and overrides: `nsa-titan train --help`.")
        return 0
    world_size = _pop_world_size(argv) or launch_world()[2]
    refuse_unknown_options(argv, "doctor", "--world-size, or recipe overrides --section.field=VALUE", overrides=True)
    _refuse_a_wrong_recipe_path(argv)
    results = run_checks(argv, world_size)
    counts = {status: sum(c.status == status for c in results) for status in (OK, WARN, FAIL)}
    print(f"doctor: {counts[OK]} ok, {counts[WARN]} warn, {counts[FAIL]} fail")
    return 1 if counts[FAIL] else 0
