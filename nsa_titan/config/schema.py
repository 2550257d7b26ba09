"""The recipe schema: one dataclass per TOML section, every field typed and documented.

Field names follow torchtitan's where the concept is the same. Parts chosen by name (model, data
source, tokenizer, optimizer, LR schedule) bring their own argument dataclasses from the registry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nsa_titan.config.fields import f


@dataclass
class JobConfig:
    name: str = f("debug", "Run name: on the run's start line, in its recipe.toml and manifest, and the W&B "
                           "run's name. Unset in the recipe itself (a file it extends does not name it): the "
                           "recipe file's name (my_run.toml: my_run).")
    description: str = f("", "Free text describing the run.")
    dump_folder: str = f("./outputs/debug", "Folder for this run's recipe, metrics, checkpoints and logs. Unset in "
                                            "the recipe itself: ./outputs/<job.name>.")
    seed: int = f(0, "Seed for model init, data order and torch's global generator (a model's dropout; a checkpoint "
                     "restores its state).", ge=0)
    plugins: list[str] = f([], "Python modules imported before the recipe is checked; they may register parts.")


@dataclass
class ModelConfig:
    name: str = f("transformer", "Registered model builder.", component="model")
    args: Any = f(None, "The chosen model's arguments, written inline in [model].",
                  args_for="name", placement="inline")


@dataclass
class ParallelismConfig:
    data_parallel_shard_degree: int = f(-1, "FSDP shard degree; -1 fills what the replicate degree leaves.", ge=-1)
    data_parallel_replicate_degree: int = f(1, "Replicas (DDP, or HSDP when sharding too); -1 fills the rest.", ge=-1)
    context_parallel_degree: int = f(1, "Ranks sharing each sequence (context parallelism): each holds 1/cp of every "
                                        "row and gathers the keys it needs; FSDP shards over dp_shard x cp.", ge=1)
    fsdp_single_process: bool = f(False, "Wrap the model in FSDP2 even when the job is one process (a mesh of one "
                                         "rank): the mixed-precision policy, collectives and sharded state of "
                                         "multi-device runs, on one device. Off: one process trains under autocast.")
    fsdp_reshard_after_forward: str = f("default", "Free gathered parameters after forward: default, always or never.",
                                        choices=("default", "always", "never"))
    init_timeout_seconds: int = f(300, "Seconds to wait for all ranks to join at start-up. Later collectives wait "
                                       "a minute past the fault timeouts (a day where one is 0).", gt=0)


@dataclass
class DataConfig:
    source: str = f("python_stdlib", "Registered document source.", component="data_source")
    tokenizer: str = f("byte", "Registered tokenizer; its vocabulary size sets the model's.", component="tokenizer")
    logical_shards: int = f(64, "Fixed shards of the corpus; data-parallel ranks own disjoint ones; the "
                               "data-parallel size must divide it.", ge=1,
                            le=65536)
    num_workers: int = f(0, "Data loader worker processes per rank (0 reads in the training process); the rank's "
                            "shards are dealt out among them, so like the world size (and, with 2 or more, "
                            "training.local_batch_size) it is part of the batch order.", ge=0)
    prefetch_factor: int = f(2, "Batches each worker prepares ahead (needs num_workers > 0).", ge=1)
    pin_memory: bool = f(True, "Pin host batches for faster copies to a CUDA device (no effect on CPU).")
    add_bos: bool = f(False, "Start every document with the tokenizer's BOS token (documents always end with EOS).")
    min_document_tokens: int = f(0, "Skip documents shorter than this many tokens (BOS and EOS included), in training "
                                    "and validation: long-context training on long documents. 0 keeps every one.",
                                 ge=0)
    source_args: Any = f(None, "The chosen source's arguments, in the table [data.<source>].",
                         args_for="source", placement="table")
    tokenizer_args: Any = f(None, "The chosen tokenizer's arguments, in the table [data.<tokenizer>].",
                            args_for="tokenizer", placement="table")


@dataclass
class TrainingConfig:
    steps: int = f(100, "Optimizer steps to train for.", ge=1)
    seq_len: int = f(256, "Tokens per sample.", ge=1)
    local_batch_size: int = f(8, "Samples per micro-batch on each data-parallel rank.", ge=1)
    global_batch_size: int = f(-1, "Samples per optimizer step over all ranks; -1 means local x data-parallel "
                                   "size.", ge=-1)
    max_norm: float = f(1.0, "Clip the global gradient norm to this; 0 disables clipping (the logged grad_norm is "
                             "the norm before clipping).", ge=0.0)
    device: str = f("auto", "Where to train: auto (CUDA when present, else CPU), cpu or cuda.",
                    choices=("auto", "cpu", "cuda"))
    dtype: str = f("auto", "Compute dtype: auto (bf16 autocast on CUDA, fp32 on CPU), float32 or bfloat16.",
                   choices=("auto", "float32", "bfloat16"))
    gc_freq: int = f(50, "Run Python's garbage collector every this many steps on every rank, instead of "
                         "when allocations trigger it (one rank's pause stalls all); 0 leaves it automatic.", ge=0)


@dataclass
class OptimizerConfig:
    name: str = f("adamw", "Registered optimizer: adamw, or muon (Muon for the hidden matrices, AdamW for the "
                           "rest).", component="optimizer")
    lr: float = f(3e-4, "Peak learning rate.", gt=0.0)
    betas: list[float] = f([0.9, 0.95], "Adam betas (beta1, beta2); with muon, for the parameters AdamW updates.")
    eps: float = f(1e-8, "Adam epsilon.", gt=0.0)
    weight_decay: float = f(0.1, "Decoupled weight decay for matrices; norms, biases and embeddings get none.", ge=0.0)
    args: Any = f(None, "The chosen optimizer's own arguments, in the table [optimizer.<name>].",
                  args_for="name", placement="table")


@dataclass
class LRSchedulerConfig:
    warmup_steps: int = f(0, "Steps of linear warmup from 0 to the peak learning rate.", ge=0)
    decay_type: str = f("cosine", "Decay shape, a registered schedule: cosine, linear, sqrt (1 - sqrt of the "
                        "progress), constant or a plugin's.",
                        component="lr_schedule")
    decay_steps: int = f(-1, "Decay over the run's last this many steps, at the peak before them "
                             "(warmup-stable-decay); -1 decays over every step after warmup.", ge=-1)
    min_lr_factor: float = f(0.1, "Final learning rate as a fraction of the peak.", ge=0.0, le=1.0)


@dataclass
class CheckpointConfig:
    enable: bool = f(False, "Save distributed checkpoints and resume from them.")
    folder: str = f("checkpoint", "Checkpoint folder inside job.dump_folder.")
    interval: int = f(500, "Save every this many steps (and always at the last step).", ge=1)
    keep_latest_k: int = f(3, "Keep this many newest checkpoints (>= 2); 0 keeps all.", ge=0)
    load_step: int = f(-1, "Resume from this step's checkpoint; -1 resumes from the newest complete one.", ge=-1)
    initial_load_path: str = f("", "Start from these weights only (a checkpoint step folder, or a Hugging Face "
                                   "folder of `nsa-titan export --format hf`) when no checkpoint exists.")
    async_mode: str = f("disabled", "disabled, or async to overlap saving with training.",
                        choices=("disabled", "async"))
    data_mismatch: str = f("error", "When a resume finds the checkpoint's data stream is not this recipe's (another "
                                    "source, mixture, tokenizer or seed): error, or restart (train on the new data "
                                    "from its beginning, resuming the model, optimizer, LR schedule and step).",
                           choices=("error", "restart"))


@dataclass
class MetricsConfig:
    log_freq: int = f(10, "Log metrics every this many steps, and at a run's first and last step.", ge=1)
    enable_tensorboard: bool = f(False, "Also write TensorBoard event files.")
    save_tb_folder: str = f("tb", "TensorBoard folder inside job.dump_folder.")
    enable_wandb: bool = f(False, "Also log to Weights & Biases (pip install wandb); a resumed run continues "
                               "the same W&B run.")
    wandb_project: str = f("nsa_titan", "W&B project to log into.")
    wandb_mode: str = f("online", "online, or offline to keep the W&B run in job.dump_folder/wandb for a later "
                        "`wandb sync`.", choices=("online", "offline"))
    telemetry_freq: int = f(0, "Collect attention telemetry every this many steps; 0 disables.", ge=0)
    peak_tflops: float = f(0.0, "Peak dense bf16 TFLOP/s per device for MFU; 0 looks the GPU up (no MFU on CPU).",
                           ge=0.0)


@dataclass
class FaultConfig:
    step_timeout_seconds: float = f(900.0, "Dump every thread's stack and exit when no step completes this long; "
                                    "0 disables.", ge=0.0)
    first_step_timeout_seconds: float = f(3600.0, "The same for the first step, which includes compilation; "
                                          "0 disables.", ge=0.0)
    max_bad_steps: int = f(0, "Skip up to this many steps in a row whose loss or gradient norm is NaN/Inf before "
                              "stopping (a good step starts the count again).", ge=0)


@dataclass
class ValidationConfig:
    enable: bool = f(False, "Evaluate on the held-out stream during training.")
    freq: int = f(100, "Validate every this many steps, and at the last step.", ge=1)
    steps: int = f(10, "Batches of training.global_batch_size held-out rows per validation (of local_batch_size rows "
                       "when the global batch is -1), an equal share from each logical shard: the same rows at every "
                       "world size, micro-batch size and worker count.", ge=1)


CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")  # compile modes that capture CUDA graphs


@dataclass
class CompileConfig:
    enable: bool = f(False, "torch.compile each transformer block in place.")
    fullgraph: bool = f(True, "Require one graph per block: a graph break is an error.")
    backend: str = f("inductor", "torch.compile backend.", choices=("inductor", "aot_eager", "eager"))
    mode: str = f("default", "Inductor's mode: default; max-autotune-no-cudagraphs (autotuned kernels); "
                             "reduce-overhead (CUDA graphs replay each block's kernels) or max-autotune (both): "
                             "those two need CUDA and one process.",
                  choices=("default", "max-autotune-no-cudagraphs") + CUDA_GRAPH_MODES)


@dataclass
class ActivationCheckpointConfig:
    mode: str = f("none", "Recompute activations in backward: none, full (every block) or selective.",
                  choices=("none", "full", "selective"))
    selective_every: int = f(2, "With mode = selective, checkpoint every this many blocks.", ge=1)


@dataclass
class ProfilingConfig:
    enable: bool = f(False, "Record a torch.profiler trace of a few training steps (after one warmup step): per "
                            "rank a Chrome trace and an op table in job.dump_folder/<folder>.")
    start_step: int = f(10, "The first profiled step (a global step number: past compilation and warmup).", ge=1)
    steps: int = f(3, "How many steps to profile.", ge=1)
    folder: str = f("profile", "Folder inside job.dump_folder for the traces, op tables and memory snapshots.")
    memory_snapshot: bool = f(False, "Also record the CUDA allocator's history over the profiled steps "
                                     "(memory_rank{r}.pickle, for pytorch.org/memory_viz); CUDA only.")


@dataclass
class Recipe:
    job: JobConfig = f(JobConfig, "The run's identity and output folder.")
    model: ModelConfig = f(ModelConfig, "The model and its arguments.")
    parallelism: ParallelismConfig = f(ParallelismConfig, "Data- and context-parallel layout.")
    data: DataConfig = f(DataConfig, "Documents, tokenizer and loading.")
    training: TrainingConfig = f(TrainingConfig, "Steps, batch, sequence length, precision.")
    optimizer: OptimizerConfig = f(OptimizerConfig, "The optimizer.")
    lr_scheduler: LRSchedulerConfig = f(LRSchedulerConfig, "Learning-rate warmup and decay.")
    checkpoint: CheckpointConfig = f(CheckpointConfig, "Distributed checkpoints and resume.")
    metrics: MetricsConfig = f(MetricsConfig, "Logging.")
    validation: ValidationConfig = f(ValidationConfig, "Held-out evaluation.")
    compile: CompileConfig = f(CompileConfig, "torch.compile.")
    activation_checkpoint: ActivationCheckpointConfig = f(ActivationCheckpointConfig, "Activation checkpointing.")
    fault: FaultConfig = f(FaultConfig, "Hangs and numerical faults.")
    profiling: ProfilingConfig = f(ProfilingConfig, "torch.profiler traces of a window of steps.")
