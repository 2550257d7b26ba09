"""Graceful stop: SIGTERM, SIGINT, SIGHUP or a halt file ends the run after the current step, with a checkpoint.

Preemption is normal on clusters: the scheduler's SIGTERM should cost nothing but a short save.
A second SIGINT stops at once, for a user who really means it. A rank whose launcher dies (torchrun
killed with SIGKILL cannot end its ranks) gets a SIGTERM from the kernel and stops the same way,
rather than train on as an orphan holding the run folder.
"""

from __future__ import annotations

import os
import signal
import time

from nsa_titan.start_up import detach_from_terminal, launcher_pid

HALT_FILE = "HALT"
HANDLED_HALT_FILE = HALT_FILE + ".handled"  # where a halt file goes once read (kept: the user wrote it)
LAUNCHER_ENDED = "its launcher ended"
# File systems that keep coarse times (whole seconds, or two) may date a halt file written just after the start
# before it: only one older by more than this is taken for an earlier launch's.
_TIME_SLACK_S = 2.0


def set_aside_stale_halt_file(dump_folder: str, started_at: float | None = None) -> str | None:
    """A halt file from an earlier launch, which ended before it read it (run_train.sh turns a stop into the file;
    a crash or a kill -9 then leaves it), would stop this run after its first step: it is set aside as
    HALT.handled, and the note saying so returned (None: nothing set aside). started_at: when this launch began
    (a file written since, a stop asked while it started, stays); None: no rank has started yet, so any halt file
    is an earlier launch's."""
    path = os.path.join(dump_folder, HALT_FILE)
    try:
        written = os.stat(path).st_mtime
    except OSError:
        return None
    if started_at is not None and written >= started_at - _TIME_SLACK_S:
        return None
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(written))
    try:
        aside = _set_aside(path)
    except OSError as exc:
        return (f"{path} (written {when}) is from an earlier launch but could not be set aside ({exc.strerror}): "
                f"this run stops after its first step. Fix: remove it, then run the same command again")
    return (f"{path} (written {when}) is from an earlier launch, which ended before reading it: set aside as "
            f"{os.path.basename(aside)}, and this run trains on (a halt file written while a run trains stops it)")


def _set_aside(path: str) -> str:
    """Rename the halt file `path` to HALT.handled beside it, or where that cannot be replaced (a folder of that
    name, say: a stop once asked with `mkdir HALT`) to HALT.handled-<time>; returns the new path."""
    handled = os.path.join(os.path.dirname(path), HANDLED_HALT_FILE)
    try:
        os.replace(path, handled)
        return handled
    except OSError as exc:  # e.g. IsADirectoryError, or a folder that is not empty
        if not os.path.lexists(handled) or not os.path.lexists(path):
            raise  # not in the way of an older one: the folder's own problem, for the caller to say
        first = exc
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in range(100):
        aside = f"{handled}-{stamp}" + (f"-{n}" if n else "")
        if not os.path.lexists(aside):
            os.rename(path, aside)
            return aside
    raise first


class GracefulStop:
    def __init__(self, dump_folder: str, saves: bool = True, world_size: int = 1):
        self.halt_path = os.path.join(dump_folder, HALT_FILE)
        self.saves = saves  # whether the run saves a checkpoint when it stops (checkpoint.enable)
        # Under a launcher, a SIGTERM is as likely torchrun ending the ranks after one failed (no step
        # completes then): only a stop the agreement carries through is said, by the trainer.
        self.say_sigterm = world_size == 1
        self.reason: str | None = None
        self._previous = {}
        # SIGHUP: the terminal or ssh session that started the run closed (with several processes,
        # run_train.sh turns it into the halt file; a single process meets it here).
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            try:
                if sig == signal.SIGHUP and signal.getsignal(sig) == signal.SIG_IGN:
                    continue  # started under nohup: a hang-up is meant to leave the run going
                self._previous[sig] = signal.signal(sig, self._on_signal)
            except ValueError:  # not the main thread: no handlers to install
                pass
        # A rank of a launch ends with its launcher (start_up.prepare_process): one already gone stops at once.
        self._launcher = launcher_pid()
        if self._launcher is not None and os.getppid() != self._launcher:
            self.reason = LAUNCHER_ENDED

    def _on_signal(self, signum, frame) -> None:
        if self.reason is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        first = self.reason is None
        self.reason = signal.Signals(signum).name
        if signum == signal.SIGTERM and self._launcher is not None and os.getppid() != self._launcher:
            self.reason = LAUNCHER_ENDED
        if signum == signal.SIGHUP:
            detach_from_terminal()
        if first and (signum == signal.SIGINT or self.say_sigterm):
            # Said at once: a step can be long, and a user who hears nothing presses again. os.write, not
            # print: the handler may run while the main code is inside a print to stderr.
            saving = ", with a checkpoint" if self.saves else " (checkpoint.enable is false: nothing is saved)"
            again = "; Ctrl-C again stops at once" + (" without saving" if self.saves else "") \
                if signum == signal.SIGINT else ""
            try:
                os.write(2, f"{self.reason}: stopping after the current step{saving}{again}.\n".encode())
            except OSError:  # stderr closed: the stop goes on unsaid
                pass

    def local_request(self) -> bool:
        """Whether this process was asked to stop (a signal, or the halt file appearing)."""
        if self.reason is None and os.path.exists(self.halt_path):
            self.reason = f"halt file {self.halt_path}"
        return self.reason is not None

    def agree(self, any_rank_asked: bool) -> bool:
        """Record the all-ranks answer (the trainer's per-step agreement carries it) and return it."""
        # The halt file may have appeared after this rank looked: name it rather than another rank.
        if any_rank_asked and not self.local_request():
            self.reason = "another rank was asked to stop"
        return any_rank_asked

    def consume_halt_file(self) -> str | None:
        """Keep the halt file from stopping the resumed run, without deleting what the user wrote. A note when it
        could not be renamed: the stop and its save go on (the next launch sets an older halt file aside)."""
        if not os.path.lexists(self.halt_path):
            return None
        try:
            _set_aside(self.halt_path)
        except OSError as exc:
            return (f"the halt file {self.halt_path} could not be renamed ({exc.strerror or exc}); the next launch "
                    f"sets it aside as one from before it, or remove it")
        return None

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
