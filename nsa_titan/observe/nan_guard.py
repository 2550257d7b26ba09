"""Non-finite loss or gradient norm: skip the update, and stop after too many bad steps in a row.

One NaN step must not poison the weights: the guard is asked between computing the gradient norm
and the optimizer step, and a bad step skips the update. Every rank gets the same answer (a rank
whose local loss is NaN makes all ranks skip), or the replicas' weights would drift apart.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

OK, SKIP, STOP = "ok", "skip", "stop"


def nonfinite_flag(loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
    """1.0 on the loss's device when the loss or the gradient norm is NaN or infinite, else 0.0."""
    bad = ~torch.isfinite(loss.detach().float()).all() | ~torch.isfinite(grad_norm.detach().float()).all()
    return bad.float().to(loss.device).reshape(1)


class NanGuard:
    """`check(loss, grad_norm)` once per step; "stop" once more than max_bad_steps bad steps come in a row.

    max_bad_steps = 0 stops at the first bad step. A good step resets the run of bad ones; the
    total is kept for the record.
    """

    def __init__(self, max_bad_steps: int):
        if max_bad_steps < 0:
            raise ValueError(f"max_bad_steps must be >= 0, got {max_bad_steps}")
        self.max_bad_steps = max_bad_steps
        self.consecutive_bad = 0
        self.total_bad = 0
        self.last_bad_step: int | None = None

    def check(self, loss: torch.Tensor, grad_norm: torch.Tensor, step: int | None = None) -> str:
        """"ok", "skip" (do not apply this update) or "stop"; the same on every rank.

        Costs one host synchronisation, plus one all-reduce when torch.distributed is initialised.
        `step` only labels the record for `stop_message`.
        """
        flag = nonfinite_flag(loss, grad_norm)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return self.decide(bool(flag.item()), step)

    def decide(self, bad: bool, step: int | None = None) -> str:
        """The decision for a step whose badness all ranks already agree on (see `check`)."""
        if not bad:
            self.consecutive_bad = 0
            return OK
        self.consecutive_bad += 1
        self.total_bad += 1
        self.last_bad_step = step
        return STOP if self.consecutive_bad > self.max_bad_steps else SKIP

    def state_dict(self) -> dict:
        """The counts a checkpoint keeps, so a resumed run stops (or skips) where an uninterrupted one would."""
        return {"consecutive_bad": self.consecutive_bad, "total_bad": self.total_bad,
                "last_bad_step": self.last_bad_step}

    def load_state_dict(self, state: dict) -> None:
        self.consecutive_bad = int(state["consecutive_bad"])
        self.total_bad = int(state["total_bad"])
        self.last_bad_step = state["last_bad_step"]

    def skip_message(self, step: int) -> str:
        return (f"step {step}: the loss or gradient norm is NaN/Inf on some rank; the update was skipped "
                f"({self.consecutive_bad} bad step(s) in a row, {self.total_bad} in total; "
                f"fault.max_bad_steps = {self.max_bad_steps})")

    def stop_message(self, step: int, way_on: str = "resume from the last checkpoint",
                     fixes: list[str] | None = None) -> str:
        """The message for a run stopped by the guard: what happened, `fixes` (what the run's settings leave to
        change; a general list when not given) and `way_on` (which checkpoint a rerun resumes, or that none
        was saved)."""
        fixes = fixes or ["lower optimizer.lr or raise lr_scheduler.warmup_steps",
                          "set training.max_norm > 0 to clip gradients",
                          "train in float32 to rule out bf16 overflow",
                          "raise fault.max_bad_steps to ride out isolated spikes"]
        listed = fixes[0] if len(fixes) == 1 else ", ".join(fixes[:-1]) + f", or {fixes[-1]}"
        return (f"stopping at step {step}: the loss or gradient norm was NaN/Inf for "
                f"{self.consecutive_bad} step(s) in a row ({self.total_bad} in total), more than "
                f"fault.max_bad_steps = {self.max_bad_steps}; no update of a bad step was applied. "
                f"Fix: {listed}; {way_on}.")
