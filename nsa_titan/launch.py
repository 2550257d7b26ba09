"""`python -m nsa_titan.launch TORCHRUN_ARGS`: torchrun (torch.distributed.run, same arguments) whose end
reads like the rest of nsa_titan.

torchrun ends a failed run with a Python traceback of its own and exit code 1 whatever the ranks
returned. Here the rank that failed first has already printed its one-line error; the launcher adds one
line naming that rank and exits with its code (2 for bad input, a fault's own code), so scripts and
schedulers can tell a bad recipe from a crash. Ranks that stopped only because a peer was gone
(PEER_LOST_EXIT_CODE), or that the launcher stopped, are passed over when a rank failed of its own.
"""

from __future__ import annotations

import signal
import sys


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    from nsa_titan.parallel.distributed import PEER_LOST_EXIT_CODE

    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        run(args)
    except ChildFailedError as failed:
        rank, code = _cause(failed.failures, PEER_LOST_EXIT_CODE)
        if code == PEER_LOST_EXIT_CODE:  # none of this launcher's ranks failed of its own
            how = (f"rank {rank} lost contact with a rank that failed on another node; that node's output says "
                   "why")
        elif code >= 0:
            how = f"rank {rank} failed first (exit code {code}); its own message is above"
        else:
            how = (f"rank {rank} failed first (signal {_signal_name(-code)}); a signal leaves no message: look for "
                   "the system's out-of-memory killer or a scheduler that ended it")
        print(f"error: the run stopped: {how}.", file=sys.stderr, flush=True)
        return code if code > 0 else 1
    except SignalException as stopped:  # the launcher itself was told to stop (a second Ctrl-C, a scheduler)
        print(f"error: the launcher was stopped by signal {_signal_name(stopped.sigval)}; the ranks were ended.",
              file=sys.stderr, flush=True)
        return 128 + int(stopped.sigval)
    return 0


def _cause(failures: dict, peer_lost: int) -> tuple[int, int]:
    """(rank, exit code) of the failure to blame: among the failures of the first second (torchrun stamps
    them in whole seconds, and also lists the ranks it stopped itself, later), one that failed of its own
    (an exit code), else one a signal ended, a rank that only lost contact with a failed peer last."""
    first = min(failure.timestamp for failure in failures.values())

    def rank_of(failure) -> tuple[int, int]:
        code = failure.exitcode
        return (0 if code > 0 and code != peer_lost else 1 if code < 0 else 2), failure.timestamp

    early = {rank: failure for rank, failure in failures.items() if failure.timestamp <= first + 1}
    rank = min(early, key=lambda r: (*rank_of(early[r]), r))
    return rank, failures[rank].exitcode


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


if __name__ == "__main__":
    sys.exit(main())
