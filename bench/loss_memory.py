"""Peak memory and time of the training loss's forward + backward: nsa_titan.loss (way "nsa_titan": its
Triton kernels on CUDA, row chunks on the CPU; "chunked" in results before the kernels) against
F.cross_entropy on an fp32 copy of the logits (the plain way).

    python -m bench.loss_memory --tokens 16384 --vocab-size 50257       # CUDA if present, else CPU

Each way runs in its own process on the same bf16 logits. On CUDA the peak is
torch.cuda.max_memory_allocated above the logits; on the CPU it is the growth of the process's peak
resident set (ru_maxrss) above the logits, which the allocator's caching can only make larger.
JSON goes to bench/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from bench.arguments import positive_int
from bench.environment import describe_environment, write_report

WAYS = ("fp32_copy", "nsa_titan")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _peak_bytes(device: str) -> int:
    if device == "cuda":
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure(way: str, tokens: int, vocab: int, device: str) -> dict:
    from nsa_titan.loss import token_cross_entropy_sum

    torch.manual_seed(0)  # the same logits in each way's process
    logits = torch.randn(tokens, vocab, device=device, dtype=torch.bfloat16).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), device=device)

    def loss_of(rows: slice) -> torch.Tensor:
        if way == "nsa_titan":
            return token_cross_entropy_sum(logits[rows], targets[rows])
        return F.cross_entropy(logits[rows].float(), targets[rows], reduction="sum")

    loss_of(slice(0, 2)).backward()  # the same kernels on two rows: their compile (Triton's, on CUDA) is not timed
    logits.grad = None
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = _peak_bytes(device)
    start = time.perf_counter()
    loss = loss_of(slice(None))
    loss.backward()
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return {"way": way, "tokens": tokens, "vocab_size": vocab, "device": device, "seconds": seconds,
            "logits_gib": logits.numel() * logits.element_size() / 2**30,
            "peak_above_logits_gib": (_peak_bytes(device) - base) / 2**30, "loss": loss.item()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=positive_int, default=16384)
    p.add_argument("--vocab-size", type=positive_int, default=50257)
    p.add_argument("--out", help="output JSON path (default bench/results/loss_memory-<device>-<time>.json)")
    p.add_argument("--one", choices=WAYS, help=argparse.SUPPRESS)  # the child process: measure one way
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.one:
        print(json.dumps(measure(args.one, args.tokens, args.vocab_size, device)))
        return 0
    results = []
    for way in WAYS:
        child = subprocess.run([sys.executable, "-m", "bench.loss_memory", "--one", way, "--tokens", str(args.tokens),
                                "--vocab-size", str(args.vocab_size)], capture_output=True, text=True, cwd=REPO_ROOT)
        if child.returncode != 0:
            print(child.stderr, file=sys.stderr)
            return 1
        results.append(json.loads(child.stdout.strip().splitlines()[-1]))
        r = results[-1]
        print(f"{way:10s} {r['tokens']} tokens x {r['vocab_size']} vocab ({r['logits_gib']:.2f} GiB of bf16 logits): "
              f"peak {r['peak_above_logits_gib']:.2f} GiB above them, {r['seconds']:.2f} s, loss {r['loss']:.1f}")
    write_report({"benchmark": "loss_memory", "environment": describe_environment(), "results": results},
                 "loss_memory", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
