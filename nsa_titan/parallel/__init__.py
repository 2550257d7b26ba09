"""How a model is spread and sped up: activation checkpointing, per-block compile, data parallelism."""
