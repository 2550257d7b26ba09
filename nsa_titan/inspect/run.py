"""Build the recipe's model as the trainer does, compile its blocks, run steps and collect what happened.

Same functions, same order as training: build on meta -> activation checkpointing -> per-block
compile (`compile_blocks`) -> materialize. Two deliberate differences, both reported:
- the blocks compile with fullgraph=False, so that every graph break is listed instead of the
  first one raising, and with a recording backend that wraps the recipe's backend;
- compile caches (FX graph, AOTAutograd, Dynamo's saved dynamic-shape profile) are off, so the
  report shows a cold compile that does not depend on earlier runs on this machine.
Single process, no data parallelism (it wraps the compiled blocks without changing their graphs).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
import warnings
from dataclasses import dataclass

import torch

from components.errors import UserError
from nsa_titan import assemble, registry
from nsa_titan.config import ResolvedRecipe
from nsa_titan.inspect import artifacts, findings
from nsa_titan.inspect.recorder import BlockTracker, GraphRecord, RecordingBackend
from nsa_titan.inspect.trace_capture import StructuredTrace
from nsa_titan.loss import token_cross_entropy_sum
from nsa_titan.parallel.activation_checkpoint import apply_activation_checkpointing
from nsa_titan.parallel.compile import compile_blocks
from nsa_titan.runtime import make_runtime


@dataclass
class StepResult:
    seq_len: int
    data: str  # where the tokens came from
    seconds: float
    new_graphs: int
    error: str | None = None


@dataclass
class InspectResult:
    recipe_path: str | None
    recipe_hash: str
    model: str
    attention: str
    backend: str
    mode: str
    compile_enabled_in_recipe: bool
    fullgraph_in_recipe: bool
    activation_checkpoint: str
    device: str
    dtype: str
    num_blocks: int
    blocks_attributed: bool
    folder: str
    steps: list[StepResult]
    graphs: list[GraphRecord]
    breaks: list[findings.GraphBreak]
    recompiles: list[findings.Recompile]
    specializations: list[findings.Specialization]
    symbols: list[tuple[str, str, str]]
    failures: list[findings.CompileFailure]
    compile_time: findings.CompileTime
    custom_ops: list[str]
    higher_order_ops: list[str]
    eager_kernels: dict
    extern_kernels: dict
    files: dict
    trace_files: list[str]
    trace_error: str | None

    @property
    def crashed(self) -> StepResult | None:
        return next((s for s in self.steps if s.error), None)

    def eager_blocks(self) -> list[int]:
        """Blocks that ran no compiled graph at all: compile had no effect on them."""
        if not self.blocks_attributed or self.crashed:
            return []
        ran = set()
        for graph in self.graphs:
            ran |= {b for b, n in graph.runs_by_block.items() if n}
        return [b for b in range(self.num_blocks) if b not in ran]


def _check_lengths(seq_lens: list[int], recipe) -> None:
    limit = getattr(recipe.model.args, "max_seq_len", None)
    for length in seq_lens:
        if length < 1 or (isinstance(limit, int) and length > limit):
            raise UserError(f"--seq-lens value {length} is outside 1..max_seq_len ({limit}). Fix: use lengths up to "
                            f"{limit}, or raise --model.max_seq_len.")


@contextlib.contextmanager
def _cold_compiles():
    config = torch.compiler.config
    if not hasattr(config, "force_disable_caches"):  # where older torch kept the switch
        import torch._inductor.config as config
    with warnings.catch_warnings(), config.patch(force_disable_caches=True):
        # It says that it does what was asked: Dynamo's saved dynamic-shape profile is off too.
        warnings.filterwarnings("ignore", message="dynamo_pgo force disabled")
        yield


def _fresh_folder(folder: str) -> None:
    """Remove what an earlier inspection wrote here (only the entries this command creates)."""
    for name in ("graphs", "trace", "report.txt"):
        path = os.path.join(folder, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create the inspection folder {folder!r}: {exc.strerror}. Fix: choose a writable "
                        f"folder with --job.dump_folder=PATH.") from None


def _compiled_model(recipe, runtime, vocab_size: int):
    """The trainer's sequence, with the recording backend in place of the backend's name."""

    def build_on_meta():
        return assemble.build_model_on_meta(recipe, vocab_size)

    torch._dynamo.reset()  # start from no compiled code, counters or cached guards
    model = build_on_meta()
    blocks = assemble.parallel_plan(registry.get("model", recipe.model.name), model).blocks
    apply_activation_checkpointing(blocks, recipe.activation_checkpoint.mode,
                                   recipe.activation_checkpoint.selective_every)
    tracker = BlockTracker()
    recorder = RecordingBackend(recipe.compile.backend, tracker, recipe.compile.mode)
    compile_blocks(blocks, fullgraph=False, backend=recorder)
    part = registry.get("model", recipe.model.name)
    if part.compiled is not None:  # the model picks its kernels as it does for the backend in training
        part.compiled(model, recipe.compile.backend)
    tracker.attach(blocks)
    assemble.materialize(model, runtime.device, recipe.job.seed, build_reference=build_on_meta, distributed=False)
    model.train()
    return model, len(blocks), tracker, recorder


def _step(model, part, runtime, inputs: torch.Tensor, targets: torch.Tensor,
          document_starts: torch.Tensor) -> str | None:
    """One forward and backward as the trainer runs them; a compiler error comes back as text."""
    try:
        inputs = inputs.to(runtime.device)
        documents = None if part.documents is None else part.documents(model, document_starts, runtime.device)
        with runtime.autocast():
            logits = model(inputs) if documents is None else model(inputs, documents=documents)
        token_cross_entropy_sum(logits, targets.to(runtime.device)).backward()
        if runtime.device.type == "cuda":
            torch.cuda.synchronize()
    except UserError:
        raise
    except Exception as exc:  # a compiler error is the finding: report it, do not hide it in a traceback
        message = " ".join(str(exc).split()).split(" Set TORCHDYNAMO_VERBOSE=1")[0]  # drop torch's boilerplate
        return f"{type(exc).__name__}: {message[:2000]}"
    finally:
        model.zero_grad(set_to_none=True)
    return None


def inspect_recipe(resolved: ResolvedRecipe, seq_lens: list[int] | None = None) -> InspectResult:
    recipe = resolved.recipe
    lengths = list(seq_lens or [recipe.training.seq_len])
    _check_lengths(lengths, recipe)
    runtime = make_runtime(recipe.training.device, recipe.training.dtype)
    assemble.refuse_what_cannot_run_here(recipe, runtime.device, compiling=True)  # as training would refuse it
    folder = os.path.join(recipe.job.dump_folder, "inspect")

    tokenizer = assemble.build_tokenizer(recipe)
    source = assemble.build_source(recipe)
    model, num_blocks, tracker, recorder = _compiled_model(recipe, runtime, tokenizer.vocab_size)
    if num_blocks == 0:
        raise UserError(f"model {recipe.model.name!r} names no blocks (its part has no parallel_plan hook), so there "
                        f"is nothing to compile or inspect. Fix: register the model with a parallel_plan hook naming "
                        f"its blocks")
    _fresh_folder(folder)  # an earlier inspection's report stays until this one can run
    batch_size = recipe.training.local_batch_size
    loader = assemble.build_loader(recipe, runtime, source, tokenizer, dp_rank=0, dp_size=1, split="train",
                                   batch_size=batch_size)
    batches = iter(loader)
    generator = torch.Generator().manual_seed(recipe.job.seed)
    part = registry.get("model", recipe.model.name)

    def tokens_for(length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, str]:
        if length == recipe.training.seq_len:
            batch = next(batches)
            return (batch["input"], batch["target"], batch["document_starts"],
                    f"a batch of the recipe's data ({batch_size} x {length}, "
                    f"{int(batch['document_starts'].sum())} documents)")
        # Compilation depends on shapes and dtypes only, so other lengths need no real text; documents
        # start at random places (about 3 a row) as packed data has them.
        ids = torch.randint(0, tokenizer.vocab_size, (batch_size, length + 1), generator=generator)
        starts = torch.rand(batch_size, length, generator=generator) < 3 / length
        return ids[:, :-1], ids[:, 1:], starts, f"random token ids ({batch_size} x {length})"

    # The last step repeats the first length with other data (other document boundaries): it shows the
    # warm step time and any guard that new data would fail.
    plan = lengths + [lengths[0]]
    steps: list[StepResult] = []
    with StructuredTrace(os.path.join(folder, "trace"), tracker.tags) as trace, _cold_compiles():
        for index, length in enumerate(plan):
            inputs, targets, starts, data = tokens_for(length)
            tracker.step, before, start = index, len(recorder.graphs), time.perf_counter()
            try:
                error = _step(model, part, runtime, inputs, targets, starts)
            finally:
                tracker.step = None
            data = f"step 1's length again, other data: {data}" if index == len(plan) - 1 else data
            steps.append(StepResult(length, data, time.perf_counter() - start, len(recorder.graphs) - before, error))
            if error:
                break

    graphs = recorder.graphs
    texts = artifacts.graph_texts(graphs, trace)
    eager, extern = artifacts.inductor_calls(trace)
    attention = part.describe(recipe.model.args) if part.describe is not None else "not described by the model"
    return InspectResult(
        recipe_path=resolved.path, recipe_hash=resolved.hash, model=recipe.model.name, attention=attention,
        backend=recipe.compile.backend, mode=recipe.compile.mode, compile_enabled_in_recipe=recipe.compile.enable,
        fullgraph_in_recipe=recipe.compile.fullgraph, activation_checkpoint=recipe.activation_checkpoint.mode,
        device=str(runtime.device),
        dtype=str(runtime.autocast_dtype or torch.get_default_dtype()).replace("torch.", ""),
        num_blocks=num_blocks, blocks_attributed=tracker.attached == num_blocks, folder=folder,
        steps=steps, graphs=graphs, breaks=findings.graph_breaks(graphs, trace),
        recompiles=findings.recompiles(trace), specializations=findings.specializations(trace),
        symbols=findings.symbols_created(trace), failures=findings.failures(trace),
        compile_time=findings.compile_time(trace), custom_ops=artifacts.custom_ops(texts),
        higher_order_ops=artifacts.higher_order_ops(texts), eager_kernels=dict(eager), extern_kernels=dict(extern),
        files=artifacts.write_graphs(os.path.join(folder, "graphs"), graphs, trace),
        trace_files=trace.log_files(), trace_error=trace.file_error,
    )
