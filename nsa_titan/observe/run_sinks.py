"""The metrics sinks a run writes its records into (metrics.jsonl, TensorBoard, W&B), opened where the run
starts: a resume continues the records it finds, sets aside those past its step and says so."""

from __future__ import annotations

import os

from nsa_titan.config.toml_io import tomllib
from nsa_titan.observe.metrics_log import METRICS_FILE, MetricsLog, TensorBoardLog, WandbLog
from nsa_titan.observe.tensorboard_pictures import holds_events, picture_sources, pictures


def open_metrics_log(dump: str, start: int, last_logged: dict | None, say) -> MetricsLog:
    """metrics.jsonl, opened at the step the run starts from; what was set aside or brought back is said."""
    metrics = MetricsLog(os.path.join(dump, METRICS_FILE), start, last_logged)
    if metrics.set_aside:
        say(f"metrics.jsonl held steps after {start}, the step this run starts from: they are moved "
            f"to {metrics.set_aside}")
    history = metrics.history
    if history is not None and history.restored_from:
        moved = (f"held another run's records (a run without checkpoints in this folder, say), moved to "
                 f"{history.foreign}, and " if history.foreign else "")
        say(f"metrics.jsonl {moved}lacked the resumed run's records up to step {start}: they came back "
            f"from {history.restored_from}")
    elif history is not None:
        say(f"note: metrics.jsonl lacks the last record logged before the checkpoint of step {start} "
            f"(step {last_logged['step']}), and no set-aside metrics file holds it: its earlier "
            f"records may be another run's")
    return metrics


def open_tensorboard(dump: str, save_tb_folder: str, start: int, saved_tensorboard: str | None,
                     metrics: MetricsLog) -> TensorBoardLog:
    """The TensorBoard events, opened at the step the run starts from (`saved_tensorboard`: the folder the resumed
    checkpoint's run logged into)."""
    history = metrics.history
    folder = os.path.join(dump, save_tb_folder)
    # The events hold another run's steps as well (records restored), or were not written up to the resumed
    # step (the run that saved it logged elsewhere or without TensorBoard, so a branch it abandoned may
    # still be drawn there; or the folder was deleted or emptied): hide every earlier one, draw the records again.
    other_events = start > 0 and saved_tensorboard not in (None, save_tb_folder)
    lost_events = start > 0 and not holds_events(folder)
    if (history is not None and history.restored_from) or other_events or lost_events:
        records = metrics.records()
        # The attention pictures are in no record: found in the events they were drawn into (this folder's, or
        # the one the resumed run logged into), before this writer's own file joins them.
        folders = [folder] + ([os.path.join(dump, saved_tensorboard)] if other_events and saved_tensorboard else [])
        sources = picture_sources(folders, records)
        tensorboard = TensorBoardLog(folder, 0)
        for record in records:
            tensorboard.write(record)
        tensorboard.write_pictures(pictures(sources))
        return tensorboard
    return TensorBoardLog(folder, start)


def open_wandb(dump: str, recipe, resolved, extra: dict, step: int) -> WandbLog:
    """The W&B run this run logs into; its id goes into `extra`, which every checkpoint keeps."""
    # A resumed run logs into its own W&B run (its checkpoint says which); a run from step 0 starts
    # another, even in a folder an earlier run logged from (W&B would drop steps it already has).
    # "" in the checkpoint: saved with W&B off (a new run); absent: saved before checkpoints kept the id.
    saved = extra.get("wandb_run_id")
    resumed = (saved if saved is not None else WandbLog.folder_run_id(dump)) if step else None
    run_id = resumed or WandbLog.new_run_id()
    extra["wandb_run_id"] = run_id
    return WandbLog(dump, run_id=run_id, project=recipe.metrics.wandb_project, name=recipe.job.name,
                    mode=recipe.metrics.wandb_mode,
                    config={"recipe_hash": resolved.hash, **tomllib.loads(resolved.toml)})
