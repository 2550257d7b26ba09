"""What a command-line process does first, before its slow imports (torch alone takes seconds).

- Under torchrun, note the launcher (the parent now) and ask Linux for a SIGTERM when it dies: during
  start-up its default action ends the rank; once training runs, GracefulStop answers it with a stop after
  the step and a save (a launcher killed with SIGKILL cannot end its ranks itself).
- `kill -USR1` writes every thread's stack to stderr from the start (its default would end the process; the
  trainer then sends the dumps to its stacks file as well), so a rank stuck in start-up can be asked too.
- A Ctrl-C during the imports ends in one line, not the import's traceback.
- `train` run alone: a SIGTERM or SIGHUP before the trainer answers it itself (GracefulStop, at the end of its
  set-up) ends the process at once, as its default action would, but with one line saying nothing was saved
  (a scheduler's log would otherwise show only exit code 143); after the run has ended, one says so and
  exits 0 (answer_stops_after_the_run).
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import signal
import sys
import time

INTERRUPTED = 130  # as a shell reports a process ended by SIGINT
INTERRUPTED_WHILE_STARTING = "error: interrupted while starting (nothing ran)."
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_launcher: int | None = None
_before_start_up: dict = {}  # {signal: the handler hear_stops_while_starting replaced}
_training_program = False  # this process was started as `train` (prepare_process), not a program calling main()
_started_at = time.time()  # this module is the command's first import


class StoppedWhileStarting(BaseException):
    """A stop signal that came while training started: not an Exception, so no `except Exception` takes it for
    an error of its own."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def stopped_while_starting_message(signum: int, command: str = "train") -> str:
    return (f"error: {command} stopped by {signal.Signals(signum).name} while starting, before its first step: "
            f"nothing was saved (the same command starts it again, from its newest complete checkpoint if it has one).")


def _raise_stop(signum, frame) -> None:
    if signum == signal.SIGHUP:  # its line must not fail on the terminal that went
        detach_from_terminal()
    raise StoppedWhileStarting(signum)


def hear_stops_while_starting() -> None:
    """SIGTERM and SIGHUP raise StoppedWhileStarting from now on, in a process that trains alone. Under a launcher
    a rank's SIGTERM is the launcher ending it after another rank failed (which that rank says), and run_train.sh
    turns a user's stop into the halt file; a hang-up ignored (nohup) stays ignored."""
    if not _trains_alone():
        return  # (a garbled WORLD_SIZE is named by the command, not here)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        try:
            current = signal.getsignal(sig)
            if current is _raise_stop or current == signal.SIG_IGN:
                continue
            _before_start_up[sig] = signal.signal(sig, _raise_stop)
        except ValueError:  # not the main thread: no handlers to install
            return


def stop_hearing_stops_while_starting() -> None:
    """The handlers hear_stops_while_starting replaced, back (the run has ended, or answers stops itself)."""
    while _before_start_up:
        sig, handler = _before_start_up.popitem()
        signal.signal(sig, handler)


def _trains_alone() -> bool:
    return os.environ.get("WORLD_SIZE", "1").strip() in ("", "1") and "TORCHELASTIC_RUN_ID" not in os.environ


def _already_ended(signum, frame) -> None:
    if signum == signal.SIGHUP:
        detach_from_terminal()
    try:
        os.write(2, f"{signal.Signals(signum).name}: the run had already ended (its checkpoint and records are "
                    f"written); exiting.\n".encode())
    except OSError:
        pass
    os._exit(0)


def answer_stops_after_the_run() -> None:
    """A run that ended (finished, or stopped and saved) has put back the handlers it found: a SIGTERM or SIGHUP
    in the second or so the process takes to exit would end it with 143 and no word, and a scheduler would count a
    finished job killed. From now on one says so and exits 0 at once (everything is written). A process that
    trains alone, started as `train` (a program calling main() keeps its own handlers): a launcher's SIGTERM to a
    rank keeps its default action."""
    if not (_training_program and _trains_alone()):
        return
    for sig in (signal.SIGTERM, signal.SIGHUP):
        try:
            if signal.getsignal(sig) != signal.SIG_IGN:  # a hang-up ignored (nohup) stays ignored
                signal.signal(sig, _already_ended)
        except ValueError:  # not the main thread
            return


def prepare_process() -> None:
    global _launcher
    if _launcher is None and "TORCHELASTIC_RUN_ID" in os.environ and _signal_on_parent_death(signal.SIGTERM):
        _launcher = os.getppid()  # may be pid 1: a container whose command is torchrun
    if signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL:
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    if sys.argv[1:2] == ["train"]:
        global _training_program
        _training_program = True
        hear_stops_while_starting()


def process_started_at() -> float:
    """When this process began: what a file written before it predates. run_train.sh execs the run in its own
    process, so that is when the script started, before its set-up (seconds, in which a user may already write a
    halt file); the kernel's record of it where there is one (Linux), else this module's import."""
    try:
        with open("/proc/self/stat") as fh:
            ticks = int(fh.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime: clock ticks after boot
        with open("/proc/stat") as fh:
            boot = next(int(line.split()[1]) for line in fh if line.startswith("btime "))
    except (OSError, ValueError, IndexError, StopIteration):
        return _started_at
    return min(_started_at, boot + ticks / os.sysconf("SC_CLK_TCK"))  # the earlier: a doubt keeps the file


def launcher_pid() -> int | None:
    """The launcher noted by prepare_process (None: not under torchrun, or not on Linux)."""
    return _launcher


def say_interrupted_while_starting(stop: StoppedWhileStarting | None = None) -> int:
    """The one line for a Ctrl-C (or a stop signal) during the imports; returns the exit code."""
    line = INTERRUPTED_WHILE_STARTING if stop is None else stopped_while_starting_message(stop.signum)
    try:
        os.write(2, (line + "\n").encode())
    except OSError:
        pass
    return INTERRUPTED if stop is None else 128 + stop.signum


def detach_from_terminal() -> None:
    """After a hang-up every write to the terminal fails (EIO): point stdout and stderr where nohup would, so
    the run's last lines cannot crash it between its step and its save."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
    except OSError:
        return
    for fd in (1, 2):
        try:
            if os.isatty(fd):
                os.dup2(devnull, fd)
        except OSError:
            pass
    os.close(devnull)


def _signal_on_parent_death(signum: int) -> bool:
    """Ask Linux to send `signum` to this process when its parent ends; False elsewhere."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False
