"""`python -m nsa_titan.launch TORCHRUN_ARGS`: torchrun (torch.distributed.run, same arguments) whose end
reads like the rest of nsa_titan.

torchrun ends a failed run with a Python traceback of its own and exit code 1 whatever the ranks
returned. Here the rank that failed first has already printed its one-line error; the launcher adds one
line naming that rank and exits with its code (2 for bad input, a fault's own code), so scripts and
schedulers can tell a bad recipe from a crash. Ranks that stopped only because a peer was gone
(PEER_LOST_EXIT_CODE), or that the launcher stopped, are passed over when a rank failed of its own.
"""

from __future__ import annotations

import logging
import signal
import sys


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import parse_args, run

    from nsa_titan.checkout_hints import node_meeting
    from nsa_titan.cli import say_error_line
    from nsa_titan.parallel.distributed import NUMERICAL_FAULT_EXIT, PEER_LOST_EXIT_CODE

    # Its log lines for a failed rank ("failed (exitcode: 2) local_rank: 1 ...") and for the ranks it then ends
    # ("Sending process 123 closing signal SIGTERM") say what the line below says; its other lines (a worker
    # that would not stop, and was killed) stay.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(
        lambda record: not str(record.msg).startswith(("failed (exitcode", "Sending process")))
    # Its banner for the threads it gives each rank (OMP_NUM_THREADS=1 where unset) opened every several-process
    # run with four warning lines; the README says it instead.
    logging.getLogger("torch.distributed.run").addFilter(
        lambda record: "Setting OMP_NUM_THREADS" not in str(record.msg))
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        run(args)
    except ChildFailedError as failed:
        how, code = failure_summary(failed.failures, args.nproc_per_node, PEER_LOST_EXIT_CODE, NUMERICAL_FAULT_EXIT)
        say_error_line(f"error: the run stopped: {how}.")
        return code if code > 0 else 1
    except RendezvousError as failed:  # the nodes never met: one missing, the endpoint unreachable or taken
        endpoint = getattr(args, "rdzv_endpoint", "") or "the rendezvous endpoint"
        say_error_line(f"error: the nodes did not meet at {endpoint} ({type(failed).__name__}: "
                       f"{str(failed).strip().splitlines()[0] if str(failed).strip() else 'no detail'}). Fix: "
                       f"{node_meeting()}, the host:port of node 0, reachable "
                       f"from each and not used by another program.")
        return 1
    except SignalException as stopped:  # the launcher itself was told to stop (a second Ctrl-C, a scheduler)
        say_error_line(f"error: the launcher was stopped by signal {_signal_name(stopped.sigval)}; the ranks "
                       "were ended.")
        return 128 + int(stopped.sigval)
    return 0


def failure_summary(failures: dict, nproc_per_node, peer_lost: int, agreed: int) -> tuple[str, int]:
    """(what ended the node's ranks, in words; the exit code to end with) from torchrun's failures by rank.
    agreed: the exit code of the stop every rank decides together (the NaN guard's)."""
    rank, code = _cause(failures, peer_lost)
    codes = {failure.exitcode for failure in failures.values()}
    if code == agreed:  # torchrun may end a rank still shutting down from it with SIGTERM: no failure of its own
        codes -= {-signal.SIGTERM}  # (after any other failure, a SIGTERM'd rank was stopped, not stopping)
    every = len(failures) > 1 and str(len(failures)) == str(nproc_per_node)
    if every and codes == {code} and code > 0 and code != peer_lost:
        # an agreed stop (a NaN guard's): every rank of this node ended with it, none before the others
        return f"every rank stopped together (exit code {code}); the message is above", code
    if code == peer_lost:  # none of this launcher's ranks failed of its own
        return f"rank {rank} lost contact with a rank that failed on another node; that node's output says why", code
    if code >= 0:
        return f"rank {rank} failed first (exit code {code}); its own message is above", code
    return (f"rank {rank} failed first (signal {_signal_name(-code)}); a signal leaves no message: look for the "
            f"system's out-of-memory killer or a scheduler that ended it"), code


def _cause(failures: dict, peer_lost: int) -> tuple[int, int]:
    """(rank, exit code) of the failure to blame, among those of the first second (torchrun stamps them in
    whole seconds, and also lists the ranks it stopped itself): one that failed of its own (an exit code),
    else one a signal ended (the out-of-memory killer's SIGKILL, an abort), else a rank that lost contact with
    a failed peer, and last a SIGTERM, which torchrun sends the ranks it ends after a failure. Ties go to
    the failure torchrun saw first."""
    first = min(failure.timestamp for failure in failures.values())

    def blame(item) -> tuple[int, int, int]:
        order, (rank, failure) = item
        code = failure.exitcode
        kind = (0 if code > 0 and code != peer_lost else 1 if code < 0 and -code != signal.SIGTERM
                else 2 if code == peer_lost else 3)
        return kind, failure.timestamp, order

    early = [(order, (rank, failure)) for order, (rank, failure) in enumerate(failures.items())
             if failure.timestamp <= first + 1]
    _, (rank, failure) = min(early, key=blame)
    return rank, failure.exitcode


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


if __name__ == "__main__":
    sys.exit(main())
