"""The training loop: accumulate, clip, step, log, validate, checkpoint."""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import sys
import time
import warnings

import torch

from components.errors import UserError
from components.sequence_shard import SequenceShard

from components.data import (DeathsInFinalizers, death_hidden_in, restore_worker_deaths, signal_that_ended,
                             stop_hearing_worker_deaths, worker_died)
from nsa_titan import assemble, held_out, registry
from nsa_titan.attention_probe import AttentionProbe
from nsa_titan.checkpoint import Checkpointer, RunState
from nsa_titan.config import ResolvedRecipe
from nsa_titan.config.rules import data_parallel_degrees
from nsa_titan.graceful_stop import GracefulStop, set_aside_stale_halt_file
from nsa_titan.loss import IGNORE_INDEX, token_cross_entropy_sum
from nsa_titan.missed_results import (log_missed_telemetry, log_missed_validation, take_missed_telemetry,
                                      take_missed_validation)
from nsa_titan.observe.console import say, step_line, warn
from nsa_titan.observe.heartbeat import Heartbeat
from nsa_titan.observe.manifest import MANIFEST_FILE, write_manifest
from nsa_titan.observe.metrics_log import MetricsLog, TensorBoardLog
from nsa_titan.observe.mfu import peak_flops_per_second
from nsa_titan.observe.nan_guard import OK, SKIP, STOP, NanGuard, nonfinite_flag
from nsa_titan.observe.run_sinks import open_metrics_log, open_tensorboard, open_wandb
from nsa_titan.observe.stack_dump import dump_file, install_sigusr1, remove_empty_dump_files, uninstall_sigusr1
from nsa_titan.observe.telemetry_log import telemetry_line
from nsa_titan.observe.step_profiler import StepProfiler
from nsa_titan.observe.step_record import StepRecorder
from nsa_titan.observe.watchdog import Watchdog, describe_stall
from nsa_titan.parallel.compile import graph_break_message
from nsa_titan.parallel.data_parallel import set_gradient_sync
from nsa_titan.parallel.distributed import (NUMERICAL_FAULT_EXIT, all_reduce_mean, any_rank, build_mesh,
                                            collective_seconds, describe_data_parallel, init_process_group,
                                            set_collective_timeout)
from nsa_titan.parallel.grad_clip import clip_grad_norm
from nsa_titan.parallel.start_agreement import refuse_other_recipes, refuse_unshared_folder
from nsa_titan.resume import data_layout, restore
from nsa_titan.resume_notes import way_on
from nsa_titan.run_folder import RunFolderLock, create_run_folder, model_fields_of, toml_differences, write_run_recipe
from nsa_titan.scheduled_gc import ScheduledGC
from nsa_titan.start_up import StoppedWhileStarting, process_started_at
from nsa_titan.runtime import Runtime
from nsa_titan.training_faults import (OUT_OF_MEMORY_EXIT, TrainingFault, nan_fixes, out_of_memory_message,
                                       worker_lost_message)
from nsa_titan.training_model import build_training_model, check_logits, check_split_sequence_hooks
from nsa_titan.validation_set import Batch, ValidationSet, next_batch


class Trainer:
    def __init__(self, resolved: ResolvedRecipe, runtime: Runtime):
        self.resolved = resolved
        self.recipe = recipe = resolved.recipe
        self.runtime = runtime
        self.gc: ScheduledGC | None = None  # from run() on
        self.folder_lock: RunFolderLock | None = None  # the main process's, from start-up on
        self.stop: GracefulStop | None = None  # SIGINT/SIGTERM/HALT, from set-up on
        self._sigchld: list | None = None  # [the SIGCHLD handler close restores] once worker deaths are not heard
        self._made_folder = False  # the main process made the run folder (a refused start removes it)
        t, dump = recipe.training, recipe.job.dump_folder
        if recipe.profiling.memory_snapshot and runtime.device.type != "cuda":  # training.device = auto: known now
            raise UserError(f"profiling.memory_snapshot records the CUDA allocator, but this run trains on "
                            f"{runtime.device.type}. Fix: set --profiling.memory_snapshot=false, or train on CUDA.")
        assemble.refuse_what_cannot_run_here(recipe, runtime.device, compiling=recipe.compile.enable)
        self.model_part = registry.get("model", recipe.model.name)

        fault = recipe.fault
        single = recipe.parallelism.fsdp_single_process
        init_process_group(runtime, recipe.parallelism.init_timeout_seconds, single)
        refuse_other_recipes(resolved.hash, resolved.toml, toml_differences)  # before the first layout collective
        replicate, shard = data_parallel_degrees(recipe, runtime.world_size)
        cp = recipe.parallelism.context_parallel_degree
        self.mesh, cp_mesh = build_mesh(runtime, replicate, shard, cp, single)
        set_collective_timeout(collective_seconds(fault.step_timeout_seconds, fault.first_step_timeout_seconds),
                               self.mesh, cp_mesh)
        # Ranks are (replicate, shard, cp) with cp varying fastest: a cp group shares one data rank.
        self.dp_rank, self.dp_size = runtime.rank // cp, runtime.world_size // cp
        self.shard = None if cp_mesh is None else SequenceShard(cp_mesh.get_group(), cp_mesh.get_local_rank(), cp,
                                                                t.seq_len)
        self.global_batch = t.global_batch_size if t.global_batch_size != -1 else t.local_batch_size * self.dp_size
        self.grad_accum = self.global_batch // (t.local_batch_size * self.dp_size)
        self.tokens_per_step = self.global_batch * t.seq_len
        # Each rank holds 1/world of a step's tokens (its cp share of its data rank's rows).
        self.local_tokens_per_step = self.tokens_per_step // runtime.world_size

        # What the run is, in recipe.toml and manifest.json: at once in a new folder (a crash at start-up
        # still says what crashed); in a folder of an earlier run only once this one is known to start
        # (below), so a resume refused at start-up leaves that run's records as they were.
        records_pending = False
        if runtime.is_main:
            outputs = {"checkpoint.folder": recipe.checkpoint.folder if recipe.checkpoint.enable else None,
                       "metrics.save_tb_folder": recipe.metrics.save_tb_folder if recipe.metrics.enable_tensorboard
                       else None,
                       "profiling.folder": recipe.profiling.folder if recipe.profiling.enable else None}
            made = create_run_folder(dump, {field: name for field, name in outputs.items() if name is not None})
            self.folder_lock = RunFolderLock(dump, warn)  # refused: another run's folder, left alone
            if runtime.world_size == 1:  # (run_train.sh's launch check does both for several, before they start)
                stale = set_aside_stale_halt_file(dump, process_started_at())
                if stale:
                    self._say(f"note: {stale}")
                remove_empty_dump_files(dump)  # a killed run's, which could not remove them itself
            self._made_folder = made
            records_pending = os.path.exists(os.path.join(dump, MANIFEST_FILE))
            if not records_pending:
                self._write_records()
        try:
            self._set_up(records_pending)
        except BaseException as exc:
            self._undo_handlers()  # a process that goes on (a caller of cli.main) keeps its own handlers
            if isinstance(exc, (UserError, StoppedWhileStarting)):  # a stop now has saved nothing in it
                self._remove_made_folder()
            raise

    def _set_up(self, records_pending: bool) -> None:
        """Everything after the run folder and its lock: parts, model, data, optimizer, the resume."""
        resolved, recipe, runtime = self.resolved, self.recipe, self.runtime
        t, dump = recipe.training, recipe.job.dump_folder
        if recipe.checkpoint.enable:  # every rank writes a checkpoint's files; the rest is rank 0's own
            refuse_unshared_folder(dump, runtime.is_main)
        cp = recipe.parallelism.context_parallel_degree
        self.stacks_path = dump_file(dump, runtime.rank)
        install_sigusr1(self.stacks_path)
        self.heartbeat = Heartbeat(dump, runtime.rank, runtime.device, min_interval_s=5.0,
                                   world_size=runtime.world_size)
        self.nan_guard = NanGuard(recipe.fault.max_bad_steps)
        self.profiler = StepProfiler(recipe.profiling, dump, runtime.rank, runtime.device, self._say)

        self.tokenizer = assemble.build_tokenizer(recipe)
        self.source = assemble.build_source(recipe)
        for note in assemble.source_notes(recipe, self.source) if runtime.is_main else ():
            warn(note)
        balance = assemble.reader_balance_note(recipe, self.source, self.dp_size) if runtime.is_main else None
        if balance:
            warn(balance)
        for note in assemble.tokenizer_notes(self.tokenizer):
            self._say(f"note: {note}")
        lost = assemble.lost_text_note(recipe, self.source, self.tokenizer) if runtime.is_main else None
        if lost:
            self._say(f"note: {lost}")
        self.model, self.num_params, self.checkpointed_blocks, self.num_blocks = build_training_model(
            recipe, runtime, self.model_part, self.tokenizer.vocab_size, self.mesh)
        self._draw_attention = (recipe.metrics.enable_tensorboard and recipe.metrics.telemetry_freq > 0
                                and self.model_part.attention_maps is not None)
        if self.shard is not None:  # the model says now, not at step 1, when it cannot split its sequences
            check_split_sequence_hooks(recipe, self.model_part, self.model, self.shard, self._draw_attention)

        self.peak_flops = peak_flops_per_second(runtime.device, recipe.metrics.peak_tflops)
        self.flops_per_token = None
        if self.model_part.flops_per_token is not None:
            self.flops_per_token = self.model_part.flops_per_token(recipe.model.args, self.tokenizer.vocab_size,
                                                                   t.seq_len)

        self.optimizer = assemble.build_optimizer(recipe, self.model)
        self.lr_scheduler = assemble.build_lr_scheduler(recipe, self.optimizer)
        self.train_loader = self._loader("train")
        self.state = RunState(self.model, self.optimizer, self.lr_scheduler, self.train_loader)
        self.state.extra["recipe_hash"] = resolved.hash  # in every checkpoint: the recipe that wrote it
        # and the model fields its weights mean, which a moved step folder (without the run's recipe.toml) keeps
        self.state.extra["model"] = model_fields_of(resolved.toml)
        self.state.extra["global_batch_size"] = self.global_batch  # what -1 meant at the world size that saved
        self.state.extra["local_batch_size"] = t.local_batch_size  # with loader workers, what each batch draws
        if recipe.validation.enable:  # the held-out set's size, which global_batch_size = -1 ties to the local batch
            self.state.extra["held_out_set"] = {"rows": held_out.held_out_rows(recipe), "seq_len": t.seq_len}
        self.checkpointer = None
        ckpt = recipe.checkpoint
        if ckpt.enable or ckpt.initial_load_path:
            self.checkpointer = Checkpointer(os.path.join(dump, ckpt.folder), keep_latest_k=ckpt.keep_latest_k,
                                             async_mode=ckpt.async_mode, rank=runtime.rank,
                                             world_size=runtime.world_size, say=self._say, context_parallel=cp)
        self.validation_set = ValidationSet(recipe, runtime, self.source, self.tokenizer, self.dp_rank, self.dp_size)
        if recipe.validation.enable:
            self.validation_set.check_not_empty()
        metrics = recipe.metrics
        self.state.extra["tensorboard_folder"] = metrics.save_tb_folder if metrics.enable_tensorboard else ""
        self._applied_lr: float | None = None  # the learning rate of the last step taken, which a save records
        # The generator a model's own randomness (dropout) draws from: seeded, so the run repeats; a resume restores
        # the checkpoint's state over it.
        torch.manual_seed(recipe.job.seed)
        # What the resumed checkpoint says of its run (resume.FRESH: none), read at the first step, logs and saves
        self.resumed = restore(recipe, resolved, self.checkpointer, self.state, self.nan_guard,
                               self.tokenizer.vocab_size, self.global_batch, self.dp_size, self._loader, self._say)
        if self.resumed.step is not None:
            self.train_loader, self.lr_scheduler = self.state.dataloader, self.state.lr_scheduler
        # What changes an earlier run's folder (its newer checkpoints and metrics set aside, its records
        # replaced) waits for this run's first step to succeed (_begin): a start that fails, at start-up or
        # in its first step, leaves the folder as it was.
        self._records_pending = records_pending
        self._begun = False
        self.metrics: MetricsLog | None = None
        self.tensorboard: TensorBoardLog | None = None
        self.stop = GracefulStop(dump, saves=recipe.checkpoint.enable, world_size=runtime.world_size)
        self._stop_agreed = False
        if self._draw_attention:
            from nsa_titan.observe.plots import require_matplotlib

            require_matplotlib()
        self.wandb = None
        if not recipe.metrics.enable_wandb:  # checkpoints say no W&B run was logged into (unless one is carried)
            self.state.extra.setdefault("wandb_run_id", "")
        if runtime.is_main and recipe.metrics.enable_wandb:  # rank 0 logs, and writes train_state.json
            self.wandb = open_wandb(dump, recipe, resolved, self.state.extra, self.state.step)
        self.watchdog: Watchdog | None = None
        self.probe = AttentionProbe(recipe, runtime, self.source, self.tokenizer, self.model_part, self.model,
                                    self.shard, self._autocast, self._documents, self._context)
        self._validated = False  # whether this process validated yet (its first validation compiles)
        self._held_out_size_said = False  # whether the first validation told of a held-out set short of rows
        self._output_checked = False  # whether a training forward's logits were seen to keep the contract

    def _undo_handlers(self) -> None:
        """The signal handlers the set-up installed, put back as they were."""
        uninstall_sigusr1()
        if self.stop is not None:
            self.stop.restore()

    def _remove_made_folder(self) -> None:
        """A start refused for bad input (weights of another model, say), or stopped by a signal before the trainer
        answers one, leaves no run folder behind where this process made it and holds its lock: else the corrected
        run would keep the refused one's records as an earlier session's. One process only: with several, a peer
        may still be writing its files into it."""
        if self._made_folder and self.runtime.world_size == 1 and self.folder_lock is not None:
            self.folder_lock.release()
            self.folder_lock = None
            shutil.rmtree(self.recipe.job.dump_folder, ignore_errors=True)

    def _loader(self, split: str, shard_states: dict | None = None):
        """This rank's loader of one split, at the recipe's batch size (shard_states: continue from those)."""
        return assemble.build_loader(self.recipe, self.runtime, self.source, self.tokenizer, dp_rank=self.dp_rank,
                                     dp_size=self.dp_size, split=split,
                                     batch_size=self.recipe.training.local_batch_size, shard_states=shard_states)

    def _begin(self) -> None:
        """Once the first step has succeeded, on every rank: set aside what an older-step resume leaves
        behind, write this run's records, and open the metrics sinks at the step the run started from
        (records past it, logged before a crash, are set aside)."""
        if self._begun:
            return
        self._begun = True
        if self.resumed.step is not None:
            self.checkpointer.abandon_after(self.resumed.step)  # a barrier: every rank comes here
        if not self.runtime.is_main:
            return
        if self._records_pending:
            self._write_records()
        dump, start = self.recipe.job.dump_folder, self.state.step
        self.metrics = open_metrics_log(dump, start, self.resumed.last_logged, self._say)
        if self.recipe.metrics.enable_tensorboard:
            self.tensorboard = open_tensorboard(dump, self.recipe.metrics.save_tb_folder, start,
                                                self.resumed.tensorboard_folder, self.metrics)

    # -- one optimizer step ----------------------------------------------------------------------
    def _documents(self, batch: Batch):
        """The forward's document layout when the model masks documents (its part's documents hook), else None."""
        if self.model_part.documents is None or batch.document_starts is None:
            return None
        return self.model_part.documents(self.model, batch.document_starts, batch.inputs.device)

    def _forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, the targets they predict): of the whole rows, or under context parallelism of this
        rank's share of every row (the model gathers what its share needs from the others)."""
        if self.shard is not None:
            inputs, targets = self.shard.split(batch.inputs), self.shard.split(batch.targets)
            extra = {"context": self._context(batch)}
        else:
            documents = self._documents(batch)
            inputs, targets, extra = batch.inputs, batch.targets, {} if documents is None else {"documents": documents}
        with self._autocast():
            logits = self.model(inputs, **extra)
        if not self._output_checked:
            check_logits(logits, self.tokenizer.vocab_size, self.model.training)
            self._output_checked = self.model.training
        return logits, targets

    def train_step(self, iterator) -> tuple[torch.Tensor, torch.Tensor, float, str]:
        """Returns (this rank's mean loss, global grad norm, seconds waiting for data, NaN-guard decision)."""
        self.model.train()
        loss_total = torch.zeros((), device=self.runtime.device, dtype=torch.float32)
        data_wait = 0.0
        for micro in range(self.grad_accum):
            start = time.perf_counter()
            batch = next_batch(iterator, self.runtime.device)
            data_wait += time.perf_counter() - start
            set_gradient_sync(self.model, self.mesh, last_micro_batch=micro == self.grad_accum - 1)
            # Every rank sees the same number of tokens, so dividing by the rank's token count and
            # averaging gradients over ranks (as data parallelism does) gives the global token mean.
            # The logits are never bound to a name: they die with the backward, not during the next
            # micro-batch's forward and the optimizer step (B x T x V each).
            loss = token_cross_entropy_sum(*self._forward(batch)) / self.local_tokens_per_step
            loss.backward()
            loss_total += loss.detach()
        grad_norm = clip_grad_norm(self.model.parameters(), self.recipe.training.max_norm)
        bad, self._stop_agreed = self._agree(loss_total, grad_norm)
        decision = self.nan_guard.decide(bad, step=self.state.step + 1)
        if decision == OK:
            self.optimizer.step()
        # A skipped step still uses its batch and its place in the LR schedule (the factor comes from the
        # step count, so torch's warning about a schedule stepped before its optimizer does not apply).
        self.optimizer.zero_grad(set_to_none=True)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
            self.lr_scheduler.step()
        return loss_total, grad_norm, data_wait, decision

    def _agree(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> tuple[bool, bool]:
        """Once per step, every rank learns whether any rank's loss or gradient norm is NaN/Inf, any
        rank was asked to stop, and any rank is still writing a background checkpoint: one small MAX
        all-reduce and one host sync carry the three answers."""
        writing = self.checkpointer is not None and self.checkpointer.save_in_flight()
        flags = torch.tensor([0.0, float(self.stop.local_request()), float(writing)], device=loss.device)
        flags[0] = nonfinite_flag(loss, grad_norm).reshape(())
        if self.mesh is not None:
            torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
        bad, stop, writing_anywhere = flags.tolist()
        if self.checkpointer is not None:
            self.checkpointer.complete_if_written(bool(writing_anywhere))
        return bool(bad), self.stop.agree(bool(stop))

    # -- validation and telemetry ----------------------------------------------------------------
    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        """Loss over every token of the held-out set (held_out.py: validation.steps global batches of rows,
        the same ones at every layout and every validation)."""
        self.model.eval()
        self._validated = True
        sums = torch.zeros(2, device=self.runtime.device, dtype=torch.float64)  # loss, tokens counted
        for batch in self.validation_set.batches():
            logits, targets = self._forward(batch)  # this rank's share of the rows under context parallelism
            sums[0] += token_cross_entropy_sum(logits, targets).double()
            sums[1] += (targets != IGNORE_INDEX).sum()  # a rank's filler rows count nothing
            del logits  # not held through the next batch's forward
            if self.watchdog is not None:  # a first validation reads its set too: no step is due meanwhile
                self.watchdog.beat(self.state.step)
        total, count = all_reduce_mean(sums).tolist()  # the ratio of the means is the ratio of the sums
        if not self._held_out_size_said:
            self._held_out_size_said = True
            self._say_short_held_out_set(count * self.runtime.world_size)
        loss = total / count
        return {"val_loss": loss, "val_perplexity": math.exp(min(loss, 700.0))}

    def _say_short_held_out_set(self, tokens: float) -> None:
        """A held-out set its shards cannot fill (few held-out documents, most shards holding none) gives a loss
        over far fewer tokens than validation.steps asks for: said once."""
        note = held_out.short_set_note(self.recipe, round(tokens))
        if note:
            self._say(f"note: {note}")

    def _context(self, batch: Batch):
        """The forward's `context` for this rank's share of the batch's rows (context parallelism)."""
        return self.model_part.context_shard(self.model, batch.document_starts, batch.inputs.shape[0], self.shard,
                                             batch.inputs.device)

    def _telemetry_now(self) -> tuple[dict[str, float], dict]:
        """The telemetry records of the weights now, and their attention pictures when TensorBoard draws them."""
        return self.probe.telemetry(), self.probe.attention_figures() if self._draw_attention else {}

    def _log_telemetry(self, step: int, records: dict[str, float], figures: dict) -> None:
        self._say(telemetry_line(step, records))
        self._log({"step": step, **records}, console=False)
        if figures and self.tensorboard is not None:
            self.tensorboard.write_figures(step, figures)

    # -- the loop --------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _memory_fault(self, what: str, step: int):
        """A device out of memory ends the run with one message: what ran out, the allocator's numbers,
        what is kept and the recipe fields that lower the memory."""
        try:
            yield
        except torch.OutOfMemoryError as exc:
            raise TrainingFault(out_of_memory_message(what, step, exc, self.recipe, self.runtime, self.checkpointer,
                                                      self.global_batch, self.dp_size), OUT_OF_MEMORY_EXIT,
                                every_rank=False) from None

    def _validation_due(self, step: int) -> bool:
        """Whether the run validates after `step`: every validation.freq steps and at its last step."""
        validation = self.recipe.validation
        return validation.enable and (step % validation.freq == 0 or step == self.recipe.training.steps)

    def run(self) -> None:
        """Train to training.steps (or a stop request). A loader worker's death reaches this process as a
        RuntimeError wherever it happens to be (torch's SIGCHLD handler raises it): a step, a save, a
        validation; it ends the run as one message. So does a graph break under compile.fullgraph = true,
        which Dynamo raises from a block's first call."""
        try:
            with DeathsInFinalizers() as self._deaths:
                self._train()
        except (RuntimeError, ConnectionError, EOFError) as exc:
            # The run ends either way. A worker's socket breaks before its exit is signalled: torch's handler would
            # raise the death here, while this error is read, as a second error and a traceback (or again, anywhere)
            self._stop_hearing_worker_deaths()
            died = worker_died(exc, self.train_loader)
            graph_break = graph_break_message(exc) if self.recipe.compile.fullgraph else None
            if graph_break is not None:
                raise UserError(graph_break) from None
            if not died:
                raise
            ended_by = signal_that_ended(exc, self.train_loader)
            way = way_on(self.recipe, self.resolved, self.checkpointer, self.nan_guard.consecutive_bad)
            raise TrainingFault(worker_lost_message(str(exc), ended_by, self.runtime.rank, self.state.step, way),
                                OUT_OF_MEMORY_EXIT if ended_by == "SIGKILL" else 1, every_rank=False) from None

    def _train(self) -> None:
        recipe, t, state, fault = self.recipe, self.recipe.training, self.state, self.recipe.fault
        layout = f" ({self.shard.size}-way context parallel)" if self.shard is not None else ""
        if self.mesh is not None:
            layout += ", " + describe_data_parallel(self.mesh, self.recipe.parallelism.context_parallel_degree)
        self._say(f"run {recipe.job.name} | model {recipe.model.name}: {self.num_params:,} parameters | recipe "
                  f"{self.resolved.hash} | "
                  f"{self.runtime.world_size} process(es) on {self.runtime.device.type}{layout} | "
                  f"global batch {self.global_batch} x {t.seq_len} tokens, {self.grad_accum} micro-batch(es)/step"
                  + (f" | activations recomputed in {self.checkpointed_blocks} of {self.num_blocks} blocks"
                     if self.checkpointed_blocks else ""))
        rank = self.runtime.rank
        self.watchdog = Watchdog(fault.step_timeout_seconds, fault.first_step_timeout_seconds, self.stacks_path,
                                 on_timeout_message=lambda stall: f"rank {rank}: {describe_stall(stall)}",
                                 start_step=state.step)
        dump, device, is_main = recipe.job.dump_folder, self.runtime.device, self.runtime.is_main
        missed = take_missed_validation(dump, state.step, self._validation_due(state.step), device, self.validate,
                                        self._memory_fault)
        missed_telemetry = take_missed_telemetry(dump, state.step, recipe.metrics.telemetry_freq, device,
                                                 self._telemetry_now)
        if state.step >= t.steps:
            if missed is not None or missed_telemetry is not None:  # the run ended between its last save and them
                self._begin()
            if missed is not None:
                log_missed_validation(missed, self.metrics, is_main, self._log)
            if missed_telemetry is not None:
                log_missed_telemetry(*missed_telemetry, self.metrics, is_main, self._log_telemetry)
            past = (f" (it is at step {state.step}; --checkpoint.load_step=N resumes an earlier checkpoint)"
                    if state.step > t.steps else "")
            self._say(f"nothing to do: the run already reached training.steps = {t.steps}{past}. Fix: raise "
                      f"--training.steps to train on, or use another --job.dump_folder to start afresh.")
            return
        iterator = iter(self.train_loader)
        self.gc = ScheduledGC(t.gc_freq)
        run_start = time.perf_counter()
        first_step = state.step
        recorder = StepRecorder(run_start, first_step, t.steps, self.resumed.elapsed_s, self.runtime.world_size,
                                self.runtime.device, self.peak_flops, self.flops_per_token, recipe.compile.enable)

        def step_record(now: float) -> dict:
            """The record of the step just taken, timed at `now`, its end (a record logged after the step's save or
            validation keeps the step's own times). Every rank calls it: the loss is averaged over the ranks."""
            return recorder.record(now, state.step, all_reduce_mean(loss).item(), lr, grad_norm.item(),
                                   state.tokens_seen, now - step_start - profiled_s, data_wait,
                                   self.nan_guard.total_bad)

        while state.step < t.steps:
            self._deaths.raise_heard()  # a worker's death heard inside a finalizer, in the last step or its save
            step_start = time.perf_counter()
            lr = self.optimizer.param_groups[0]["lr"]
            self.profiler.before_step(state.step + 1)
            with self._memory_fault("step", state.step + 1):
                loss, grad_norm, data_wait, decision = self.train_step(iterator)
            self._applied_lr = lr
            if decision != STOP:  # agreed by every rank: all of them begin (a collective) or none
                self._begin()
                if missed is not None:
                    log_missed_validation(missed, self.metrics, is_main, self._log)
                    missed = None
                if missed_telemetry is not None:
                    log_missed_telemetry(*missed_telemetry, self.metrics, is_main, self._log_telemetry)
                    missed_telemetry = None
            state.step += 1
            phase = time.perf_counter()
            self.profiler.after_step(state.step)
            profiled_s = time.perf_counter() - phase
            recorder.set_aside(profiled_s, once=True)
            recorder.step_taken(self.tokens_per_step, time.perf_counter())
            state.tokens_seen += self.tokens_per_step
            if decision == STOP:
                if self.checkpointer is not None:  # a background save of a good step completes first; every
                    self.checkpointer.finish_pending()  # rank stops here (the guard's answer is agreed)
                fixes = nan_fixes(recipe, self.runtime, state.step, self.nan_guard.total_bad)
                way = way_on(recipe, self.resolved, self.checkpointer, self.nan_guard.consecutive_bad)
                raise TrainingFault(self.nan_guard.stop_message(state.step, way, fixes),
                                    NUMERICAL_FAULT_EXIT,
                                    every_rank=True)
            if decision == SKIP and self.runtime.is_main:
                warn(self.nan_guard.skip_message(state.step))
            self.watchdog.beat(state.step)
            self.heartbeat.beat(state.step, force=state.step == t.steps)
            self.gc.after_step(state.step)

            # A stop agreed at this step makes it the run's last: its record is logged whatever log_freq says.
            log_now = (state.step % recipe.metrics.log_freq == 0 or state.step in (first_step + 1, t.steps)
                       or self._stop_agreed)
            step_end = time.perf_counter()
            if log_now:
                record = step_record(step_end)  # reads the step's results: the device's work on it is counted
                written = time.perf_counter()
                self._log(record)
                # Writing the record (console, metrics file, TensorBoard, W&B) is no training: set aside, or every
                # window would hold one, which at log_freq = 1 is each step's
                recorder.new_window(step_end, time.perf_counter() - written)
            phase = time.perf_counter()
            self._handle_halt_file()
            stopping = self._stop_agreed and state.step < t.steps
            saving = self.checkpointer is not None and recipe.checkpoint.enable
            saved = saving and (state.step % recipe.checkpoint.interval == 0 or state.step == t.steps or stopping)
            if saved:
                self._save(run_start, wait=stopping or state.step == t.steps)
            # After the save: a validation that runs out of memory must not cost the step's checkpoint.
            validated = self._validation_due(state.step)
            if validated:
                # A process's first validation under compile compiles each block once more (no autograd): once.
                warm_up, began = recipe.compile.enable and not self._validated, time.perf_counter()
                with self._memory_fault("validation after step", state.step):
                    self._log({"step": state.step, **self.validate()})
                recorder.recurring("validation", time.perf_counter() - began, warm_up)
                self.watchdog.beat(state.step)
            if (saved or validated) and not stopping and state.step < t.steps and self._stop_asked_meanwhile():
                # A preemption's SIGTERM often lands in a save, which can take minutes: this step is the last
                # one, rather than one more step and one more save eating into the grace period.
                stopping = True
                if not log_now:  # the run's last step, logged once (a resume goes on from the next)
                    self._log(step_record(step_end))
                if saved:  # a background save completes before the stop line names it
                    self.checkpointer.finish_pending()
                elif saving:
                    self._save(run_start, wait=True)
            if recipe.metrics.telemetry_freq and state.step % recipe.metrics.telemetry_freq == 0:
                self._log_telemetry(state.step, *self._telemetry_now())
            recorder.set_aside(time.perf_counter() - phase)
            if stopping:
                self._say(f"stopping after step {state.step} ({self.stop.reason})"
                          + ("; the checkpoint above resumes it" if recipe.checkpoint.enable else
                             "; checkpoint.enable is false, so nothing was saved"))
                break
        if self.checkpointer is not None:
            self.checkpointer.finish_pending()

    def _save(self, run_start: float, wait: bool) -> None:
        state = self.state
        state.extra["nan_guard"] = self.nan_guard.state_dict()
        state.extra["applied_lr"] = self._applied_lr  # the rate of the step saved, for a resume's schedule note
        state.extra["elapsed_s"] = self.resumed.elapsed_s + time.perf_counter() - run_start
        # A step that ends a run of skipped (NaN/Inf) steps is saved (a resume goes on past its batches), but
        # retention keeps the newest checkpoint of a good step beside it, which a run that then stops needs.
        try:
            self.checkpointer.save(state, data_layout=data_layout(self.dp_size, self.recipe.data), wait=wait,
                                   good=self.nan_guard.consecutive_bad == 0)
        except UserError as exc:  # a loader worker's death raised inside the writer reads as a failed write
            death = death_hidden_in(exc, self.train_loader)
            if death is not None:
                raise death from None
            raise
        self.watchdog.beat(state.step)

    def _stop_asked_meanwhile(self) -> bool:
        """Whether any rank was asked to stop after this step's agreement (during its save or validation):
        one more small collective, at steps that save or validate only. A halt file is then handled."""
        if not self.stop.agree(any_rank(self.stop.local_request(), self.runtime.device)):
            return False
        self._stop_agreed = True
        self._handle_halt_file()
        return True

    def _handle_halt_file(self) -> None:
        """Once a stop is agreed, the halt file (if that was the request) is renamed, not to stop the resume."""
        if self._stop_agreed and self.runtime.is_main:
            note = self.stop.consume_halt_file()
            if note:
                self._say(f"note: {note}")

    # -- helpers ---------------------------------------------------------------------------------
    def _write_records(self) -> None:
        dump, resolved = self.recipe.job.dump_folder, self.resolved
        write_run_recipe(dump, resolved)
        write_manifest(dump, recipe_toml=resolved.toml, recipe_hash=resolved.hash, argv=sys.argv,
                       world_size=self.runtime.world_size, device=self.runtime.device)

    def _autocast(self):
        # With data parallelism the mixed-precision policy casts parameters; autocast is for one process.
        return self.runtime.autocast() if self.mesh is None else contextlib.nullcontext()

    def _say(self, message: str) -> None:
        if self.runtime.is_main:
            say(message)

    def _log(self, record: dict, console: bool = True) -> None:
        if not self.runtime.is_main:
            return
        if console and "loss" in record:
            say(step_line(record, self.recipe.training.steps))
        elif console and "val_loss" in record:
            say(f"validation at step {record['step']}: loss {record['val_loss']:.4f} | "
                f"perplexity {record['val_perplexity']:.2f}")
        self.metrics.write(record)
        if "loss" in record:  # saved with each checkpoint: a resume checks the metrics file holds its history
            self.state.extra["last_logged"] = {"step": record["step"], "loss": record["loss"]}
        for sink in (self.tensorboard, self.wandb):
            if sink is not None:
                sink.write(record)

    def _stop_hearing_worker_deaths(self) -> None:
        if self._sigchld is None:
            self._sigchld = [stop_hearing_worker_deaths()]

    def close(self) -> None:
        self._stop_hearing_worker_deaths()  # a worker that dies now (or died) must not raise inside the clean-up
        if self.gc is not None:
            self.gc.close()
        self.profiler.close()
        if self.watchdog is not None:
            self.watchdog.stop()
        self._undo_handlers()
        for sink in (self.metrics, self.tensorboard, self.wandb):
            if sink is not None:
                sink.close()
        if self.folder_lock is not None:
            self.folder_lock.release()
        # Torch's handler comes back once the loader's workers are shut down (a dead one still registered with
        # it would be raised at any later child's exit); where they cannot be, the default action stays.
        iterator = getattr(getattr(self, "train_loader", None), "_iterator", None)
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if not getattr(iterator, "_workers", None) or callable(shutdown):  # none started, or they can be ended
            if callable(shutdown):
                shutdown()
            restore_worker_deaths(self._sigchld[0])
        self._sigchld = None
