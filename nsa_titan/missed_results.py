"""The validation and telemetry due at the step a run resumes from, which the run that saved that step stopped
before logging (killed in the save, or in the validation after it): taken at start-up on the weights they were
due for, and logged once the run has begun (its first step succeeded)."""

from __future__ import annotations

import os

from nsa_titan.observe.metrics_log import METRICS_FILE, has_record
from nsa_titan.observe.telemetry_log import PREFIX as TELEMETRY_PREFIX
from nsa_titan.parallel.distributed import any_rank


def take_missed_validation(dump: str, step: int, due: bool, device, validate, memory_fault) -> dict | None:
    """The validation due at the step this run resumes from (`due`: the recipe validates after it), when the run
    that saved that step stopped before it logged one (between the save and the validation after it): computed
    now by validate(), on the weights it was due for, and logged once this run has begun (its first step
    succeeded). memory_fault(what, step): the run's context for a device out of memory."""
    if step == 0 or not due:
        return None
    logged = has_record(os.path.join(dump, METRICS_FILE), step, "val_loss")
    if any_rank(logged, device):  # agreed: a rank that validated alone would wait for the others
        return None
    with memory_fault("validation after step", step):
        return {"step": step, **validate()}


def take_missed_telemetry(dump: str, step: int, freq: int, device, telemetry_now
                          ) -> tuple[int, dict[str, float], dict] | None:
    """The telemetry due at the resumed step, when the run that saved it stopped before logging it (in the
    save or the validation after it): taken now by telemetry_now(), on the weights it was due for, and logged
    once this run has begun, as take_missed_validation's loss is."""
    if step == 0 or not freq or step % freq:
        return None
    logged = has_record(os.path.join(dump, METRICS_FILE), step, TELEMETRY_PREFIX, prefix=True)
    if any_rank(logged, device):  # agreed: telemetry walks the model on every rank
        return None
    return (step, *telemetry_now())


def log_missed_telemetry(step: int, records: dict[str, float], figures: dict, metrics, is_main: bool,
                         log_telemetry) -> None:
    """Log what take_missed_telemetry took, unless the records the run's begin brought back into `metrics` hold it
    already (as for validation); every rank calls it, rank 0 logs."""
    if not (is_main and has_record(metrics.path, step, TELEMETRY_PREFIX, prefix=True)):
        log_telemetry(step, records, figures)


def log_missed_validation(record: dict, metrics, is_main: bool, log) -> None:
    """Log the validation take_missed_validation computed, unless the records the run's begin brought back into
    `metrics` from a set-aside file (after a run without checkpoints in this folder) hold it already."""
    if is_main and not has_record(metrics.path, record["step"], "val_loss"):
        log(record)
