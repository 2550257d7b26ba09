"""What a run shows: console lines, metrics.jsonl, TensorBoard."""
