"""`nsa-titan` (the console script) and `python -m nsa_titan`: the command line, started so that a Ctrl-C
while its modules import ends in one line rather than a traceback."""

from __future__ import annotations

import sys


def main() -> int:
    try:
        from nsa_titan.start_up import prepare_process

        prepare_process()  # first thing: the launcher is still this process's parent
        from nsa_titan import cli
    except BaseException as exc:  # a Ctrl-C, or a stop signal (start_up.StoppedWhileStarting), while importing
        from nsa_titan.start_up import StoppedWhileStarting, say_interrupted_while_starting

        if not isinstance(exc, (KeyboardInterrupt, StoppedWhileStarting)):
            raise
        return say_interrupted_while_starting(exc if isinstance(exc, StoppedWhileStarting) else None)
    return cli.main()


if __name__ == "__main__":
    sys.exit(main())
