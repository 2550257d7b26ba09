"""`python -m nsa_titan.launch_check PROCESSES_PER_NODE < RESOLVED_RECIPE`: what run_train.sh asks once for a node
before it starts the ranks. Prints the run's dump folder; refuses a device the node cannot give every process, or
a dump folder whose path a file holds (every rank writes there), in one line, rather than once per rank. A halt
file already in the dump folder is an earlier launch's (this one has started no rank): set aside, with a note; the
empty stack dump files of an earlier launch's killed ranks are removed."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from nsa_titan.config.toml_io import tomllib  # the one reader (tomli on Python 3.10)

    processes_per_node = int((sys.argv[1:] if argv is None else argv)[0])
    recipe = tomllib.loads(sys.stdin.read())
    from components.errors import UserError
    from nsa_titan.cli import INPUT_ERROR, say_error_line
    from nsa_titan.graceful_stop import set_aside_stale_halt_file
    from nsa_titan.observe.stack_dump import remove_empty_dump_files
    from nsa_titan.run_folder import held_by_a_run, refuse_file_in_the_way

    try:
        if recipe["training"]["device"] != "cpu":  # a CPU run asks nothing of the node's devices
            from nsa_titan.runtime import uses_cuda

            uses_cuda(recipe["training"]["device"], processes_per_node)
        refuse_file_in_the_way(recipe["job"]["dump_folder"])
    except UserError as exc:
        say_error_line(f"error: {exc}")
        return INPUT_ERROR
    dump = recipe["job"]["dump_folder"]
    if not held_by_a_run(dump):  # the launch will be refused: that run's halt file (and stack dumps) are its own
        stale = set_aside_stale_halt_file(dump)  # no rank has started: any halt file is an earlier launch's
        if stale:
            print(f"note: {stale}", file=sys.stderr)
        remove_empty_dump_files(dump)  # a killed launch's ranks could not remove theirs
    print(dump)
    return 0


if __name__ == "__main__":
    try:
        code = main()
    except KeyboardInterrupt:  # a Ctrl-C while it imports or checks: one line, as the recipe check says it
        from nsa_titan.start_up import say_interrupted_while_starting

        code = say_interrupted_while_starting()
    sys.exit(code)
