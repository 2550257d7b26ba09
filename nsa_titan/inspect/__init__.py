"""`nsa-titan inspect`: how the recipe's blocks compile: graphs, breaks, recompiles, custom ops, timing.

    inspect_recipe(resolved, seq_lens=None) -> InspectResult   build, compile per block, run, collect
    render(result, recipe_label, limit=None) -> str             the report, ending in the verdict line (with limit:
                                                                each list's first entries, and how many more)
    run_command(argv) -> int                                    the command line (exit 0, or 1 on problems)
"""

from nsa_titan.inspect.command import run_command
from nsa_titan.inspect.report import problems, render, verdict
from nsa_titan.inspect.run import InspectResult, inspect_recipe

__all__ = ["InspectResult", "inspect_recipe", "problems", "render", "run_command", "verdict"]
