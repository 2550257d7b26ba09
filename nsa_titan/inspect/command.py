"""The `inspect` command line: options, the report on stdout and in the run folder, the exit code."""

from __future__ import annotations

import os

from components.errors import UserError
from nsa_titan.checkout_hints import no_recipe
from nsa_titan.command_options import refuse_unknown_options, take_flag, take_option

# On the console each list shows its first entries (a model that breaks everywhere would print thousands of lines);
# report.txt holds them all.
CONSOLE_ENTRIES = 10

USAGE = ("nsa-titan inspect RECIPE.toml [--section.field=VALUE ...] [--seq-lens 64,96] [--fail-on-break]\n"
         "  --seq-lens L1,L2,...  run forward + backward at these sequence lengths (default: training.seq_len)\n"
         "                        to see which length changes recompile and which guard failed\n"
         "  --fail-on-break       exit 1 when a block does not compile to whole graphs (a break, a failed\n"
         "                        frame, or a block that ran eagerly)\n"
         f"The report lists the first {CONSOLE_ENTRIES} graphs, breaks and recompiles (and says how many more);\n"
         "{job.dump_folder}/inspect/report.txt lists them all.\n"
         "Exit codes: 0 inspected, 1 compilation failed (or a problem with --fail-on-break), 2 bad input.")

FAILED = 1


def parse_seq_lens(text: str) -> list[int]:
    try:
        lengths = [int(part) for part in text.split(",")]  # an empty entry ('64,,96') is a mistake, not skipped
    except ValueError:
        lengths = []
    if not lengths or any(n < 1 for n in lengths):
        raise UserError(f"--seq-lens {text!r} is not a comma-separated list of positive lengths. Fix: e.g. "
                        "`--seq-lens 64,96`.")
    repeated = sorted({n for n in lengths if lengths.count(n) > 1})
    if repeated:  # a second run at a length would only recompile or reuse the first: likely a typo for another
        raise UserError(f"--seq-lens {text!r} names {', '.join(map(str, repeated))} twice. Fix: give each length "
                        f"once.")
    return lengths


def run_command(argv: list[str]) -> int:
    from nsa_titan.config import resolve
    from nsa_titan.inspect.report import problems, render
    from nsa_titan.inspect.run import inspect_recipe
    from nsa_titan.runtime import launch_world

    argv = list(argv)
    if "--help" in argv or "-h" in argv:
        print(USAGE + "\nRecipe fields and overrides: `nsa-titan train --help`.")
        return 0
    fail_on_break = take_flag(argv, "--fail-on-break")
    lengths_text = take_option(argv, "--seq-lens")
    refuse_unknown_options(argv, "inspect", "--seq-lens, --fail-on-break, or recipe overrides --section.field=VALUE",
                           overrides=True)
    seq_lens = parse_seq_lens(lengths_text) if lengths_text is not None else None
    cp = resolve(argv, world_size=None).recipe.parallelism.context_parallel_degree
    if cp > 1:  # said before the layout check, whose fix (launch cp processes) would not help here
        raise UserError(f"inspect compiles the model in one process, and parallelism.context_parallel_degree = {cp} "
                        f"splits each sequence over {cp} processes, whose exchange of keys one process cannot run. "
                        f"Fix: inspect the blocks without it, adding --parallelism.context_parallel_degree=1 (their "
                        f"graphs then hold no exchange between processes).")
    resolved = resolve(argv, world_size=launch_world()[2])
    if resolved.path is None:
        raise UserError(no_recipe("inspect"))

    result = inspect_recipe(resolved, seq_lens)
    with open(os.path.join(result.folder, "report.txt"), "w", encoding="utf-8") as fh:
        fh.write(render(result, resolved.path))
    print(render(result, resolved.path, limit=CONSOLE_ENTRIES), end="", flush=True)
    if result.crashed or (fail_on_break and problems(result)):
        return FAILED
    return 0
