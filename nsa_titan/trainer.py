"""The training loop: accumulate, clip, step, log, validate."""

from __future__ import annotations

import math
import os
import time

import torch
import torch.nn.functional as F

from nsa_titan import assemble
from nsa_titan.config import ResolvedRecipe
from nsa_titan.observe.console import say, step_line
from nsa_titan.observe.metrics_log import MetricsLog, TensorBoardLog
from nsa_titan.parallel.activation_checkpoint import apply_activation_checkpointing
from nsa_titan.parallel.compile import compile_blocks
from nsa_titan.run_folder import prepare_run_folder
from nsa_titan.runtime import Runtime


class Trainer:
    def __init__(self, resolved: ResolvedRecipe, runtime: Runtime):
        self.resolved = resolved
        self.recipe = recipe = resolved.recipe
        self.runtime = runtime
        t = recipe.training

        self.dp_rank, self.dp_size = runtime.rank, runtime.world_size
        self.global_batch = t.global_batch_size if t.global_batch_size != -1 else t.local_batch_size * self.dp_size
        self.grad_accum = self.global_batch // (t.local_batch_size * self.dp_size)
        self.tokens_per_step = self.global_batch * t.seq_len

        if runtime.is_main:
            prepare_run_folder(recipe.job.dump_folder, resolved)
        self.tokenizer = assemble.build_tokenizer(recipe)
        self.source = assemble.build_source(recipe)

        self.model = assemble.build_model_on_meta(recipe, self.tokenizer.vocab_size)
        self.num_params = assemble.count_parameters(self.model)
        apply_activation_checkpointing(self.model.layers, recipe.activation_checkpoint.mode,
                                       recipe.activation_checkpoint.selective_every)
        if recipe.compile.enable:
            compile_blocks(self.model.layers, fullgraph=recipe.compile.fullgraph, backend=recipe.compile.backend)
        assemble.materialize(self.model, runtime.device, recipe.job.seed)

        self.optimizer = assemble.build_optimizer(recipe, self.model)
        self.lr_scheduler = assemble.build_lr_scheduler(recipe, self.optimizer)
        self.train_loader = assemble.build_loader(recipe, runtime, self.source, self.tokenizer, dp_rank=self.dp_rank,
                                                  dp_size=self.dp_size, split="train",
                                                  batch_size=t.local_batch_size)
        self.step = 0
        self.tokens_seen = 0
        self.metrics = MetricsLog(os.path.join(recipe.job.dump_folder, "metrics.jsonl")) if runtime.is_main else None
        self.tensorboard = None
        if runtime.is_main and recipe.metrics.enable_tensorboard:
            self.tensorboard = TensorBoardLog(os.path.join(recipe.job.dump_folder, recipe.metrics.save_tb_folder))

    # -- one optimizer step ----------------------------------------------------------------------
    def _next_batch(self, iterator) -> tuple[torch.Tensor, torch.Tensor]:
        batch = next(iterator)
        device = self.runtime.device
        return (batch["input"].to(device, non_blocking=True), batch["target"].to(device, non_blocking=True))

    def train_step(self, iterator) -> tuple[torch.Tensor, torch.Tensor, float]:
        """Returns (summed loss over this rank's tokens / global tokens, grad norm, seconds waiting for data)."""
        self.model.train()
        loss_total = torch.zeros((), device=self.runtime.device, dtype=torch.float32)
        data_wait = 0.0
        for _ in range(self.grad_accum):
            start = time.perf_counter()
            inputs, targets = self._next_batch(iterator)
            data_wait += time.perf_counter() - start
            with self.runtime.autocast():
                logits = self.model(inputs)
            # Normalised by the global token count, so summing over micro-batches and ranks gives the mean.
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")
            loss = loss / self.tokens_per_step
            loss.backward()
            loss_total += loss.detach()
        max_norm = self.recipe.training.max_norm
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm if max_norm > 0 else math.inf,
                                                   foreach=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.lr_scheduler.step()
        return loss_total, grad_norm, data_wait

    # -- validation ------------------------------------------------------------------------------
    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        recipe = self.recipe
        loader = assemble.build_loader(recipe, self.runtime, self.source, self.tokenizer, dp_rank=self.dp_rank,
                                       dp_size=self.dp_size, split="validation",
                                       batch_size=recipe.training.local_batch_size)
        self.model.eval()
        total = torch.zeros((), device=self.runtime.device, dtype=torch.float64)
        count = 0
        iterator = iter(loader)
        for _ in range(recipe.validation.steps):
            inputs, targets = self._next_batch(iterator)
            with self.runtime.autocast():
                logits = self.model(inputs)
            total += F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum").double()
            count += targets.numel()
        loss = total.item() / count
        return {"val_loss": loss, "val_perplexity": math.exp(min(loss, 700.0))}

    # -- the loop --------------------------------------------------------------------------------
    def run(self) -> None:
        recipe, t = self.recipe, self.recipe.training
        if self.runtime.is_main:
            say(f"model {recipe.model.name}: {self.num_params:,} parameters | recipe {self.resolved.hash} | "
                f"{self.runtime.world_size} process(es) on {self.runtime.device.type} | "
                f"global batch {self.global_batch} x {t.seq_len} tokens, {self.grad_accum} micro-batch(es)/step")
        iterator = iter(self.train_loader)
        run_start = time.perf_counter()
        window_start, window_tokens, window_wait = run_start, 0, 0.0
        while self.step < t.steps:
            step_start = time.perf_counter()
            lr = self.optimizer.param_groups[0]["lr"]
            loss, grad_norm, data_wait = self.train_step(iterator)
            self.step += 1
            self.tokens_seen += self.tokens_per_step
            window_tokens += self.tokens_per_step
            window_wait += data_wait
            if self.step % recipe.metrics.log_freq == 0 or self.step in (1, t.steps):
                now = time.perf_counter()
                elapsed = now - window_start
                record = {
                    "step": self.step,
                    "loss": loss.item(),
                    "lr": lr,
                    "grad_norm": grad_norm.item(),
                    "tokens_per_second": window_tokens / elapsed,
                    "tokens_per_second_per_device": window_tokens / elapsed / self.runtime.world_size,
                    "tokens_seen": self.tokens_seen,
                    "step_time_s": now - step_start,
                    "data_wait_s": data_wait,
                    "elapsed_s": now - run_start,
                    "eta_s": (now - run_start) / self.step * (t.steps - self.step),
                }
                self._log(record)
                window_start, window_tokens, window_wait = now, 0, 0.0
            if recipe.validation.enable and (self.step % recipe.validation.freq == 0 or self.step == t.steps):
                self._log({"step": self.step, **self.validate()}, console=False)

    def _log(self, record: dict, console: bool = True) -> None:
        if not self.runtime.is_main:
            return
        if console and "loss" in record:
            say(step_line(record, self.recipe.training.steps))
        elif "val_loss" in record:
            say(f"validation at step {record['step']}: loss {record['val_loss']:.4f} | "
                f"perplexity {record['val_perplexity']:.2f}")
        self.metrics.write(record)
        if self.tensorboard is not None:
            self.tensorboard.write(record)

    def close(self) -> None:
        for sink in (self.metrics, self.tensorboard):
            if sink is not None:
                sink.close()
