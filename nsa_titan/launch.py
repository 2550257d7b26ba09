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
        how = (f"exit code {code}); its own message is above" if code >= 0 else
               f"signal {_signal_name(-code)}); a signal leaves no message: look for the system's out-of-memory "
               "killer or a scheduler that ended it")
        print(f"error: the run stopped: rank {rank} failed first ({how}.", file=sys.stderr, flush=True)
        return code if code > 0 else 1
    except SignalException as stopped:  # the launcher itself was told to stop (a second Ctrl-C, a scheduler)
        print(f"error: the launcher was stopped by signal {_signal_name(stopped.sigval)}; the ranks were ended.",
              file=sys.stderr, flush=True)
        return 128 + int(stopped.sigval)
    return 0


def _cause(failures: dict, peer_lost: int) -> tuple[int, int]:
    """(rank, exit code) of the failure to blame: the first rank that failed of its own (an exit code), else
    one that a signal ended (killed from outside, or by the launcher), a rank that only lost contact with a
    failed peer last of all."""
    def first(which):
        chosen = {rank: f for rank, f in failures.items() if which(f.exitcode)}
        return min(chosen, key=lambda r: chosen[r].timestamp) if chosen else None

    rank = first(lambda code: code > 0 and code != peer_lost)
    rank = first(lambda code: code != peer_lost) if rank is None else rank
    rank = first(lambda code: True) if rank is None else rank
    return rank, failures[rank].exitcode


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


if __name__ == "__main__":
    sys.exit(main())
