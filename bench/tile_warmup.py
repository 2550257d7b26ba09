"""Compile the kernels a bench.tile_variants run will time, in several processes at once, before it times them.

    python -m bench.tile_variants ... --precompile-workers 8     (starts this module's workers itself)

Triton compiles a launch shape's kernel on the host the first time it launches: seconds each, one after another
in the timing process, which spent most of a GPU run doing so, while the GPU host's other cores idled. Each
worker takes every N-th (length, kernel, shape) of the run and launches its calls once, so the same kernels land
in Triton's on-disk cache, where the timing process finds them. The selection and the selected branch's kernels
run at a shorter length whose integer arguments Triton specializes alike (warm_length); the interval kernels at
the length itself, since how their dK/dV work is split (per query head or per group, in fp32 partials or not)
follows the number of key tiles. Nothing here is timed or compared; a worker that fails, or is still running
after PRECOMPILE_SECONDS, costs only its time: the timing process compiles whatever it does not find.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import torch

# Triton specializes an integer argument by whether it is 1 and whether 16 divides it. The launchers pass the
# length, its compressed blocks (stride 16) and selection blocks (64 tokens), and products of them with heads and
# dims: a length congruent to T modulo 4096 gives every one of them the class it has at T.
WARM_MODULUS = 4096
PRECOMPILE_SECONDS = 150  # then the timing starts whatever the workers have left


def warm_length(T: int) -> int:
    """A length at most 2 * WARM_MODULUS whose counts Triton specializes as T's; T itself where that is no shorter."""
    return T if T <= 2 * WARM_MODULUS else T % WARM_MODULUS + WARM_MODULUS


def launch_length(kernel: str, T: int, args, element_bytes: int) -> int:
    """The length a worker launches `kernel` at to compile what a run at T launches: the interval kernels' dK/dV
    work split follows T itself (interval_attention_bwd), and so does the selected branch's layout past the
    block layout's partials limit (tile_configs.gather_layout_for); otherwise only T's classes count."""
    from bench.tile_variants import gather_layout

    W = warm_length(T)
    if kernel.startswith("interval"):
        return T
    return W if gather_layout(args, T, element_bytes) == gather_layout(args, W, element_bytes) else T


def tasks(args) -> list[tuple[int, str, tuple | None]]:
    """(length, kernel, shape) of every launch the run makes; shape None: the exact (fp32) reference."""
    from bench.tile_variants import shapes_to_try
    from bench.attention import DTYPES

    dtype = DTYPES[args.dtype]
    out = []
    for T in args.seq_lens:
        for kernel in args.kernels:
            out.append((T, kernel, None))
            out += [(T, kernel, shape) for shape in shapes_to_try(kernel, args, dtype)]
    return out


def run_part(args, part: int, parts: int, device: str) -> int:
    """Launch this worker's share of the run's calls once each; the number launched without an error."""
    from bench.attention import DTYPES
    from bench.tile_variants import exact_results, workloads
    from components.nsa.triton import tile_configs

    dtype = DTYPES[args.dtype]
    block_d = tile_configs.head_block(args.head_dim)
    calls, launched = {}, 0
    for T, kernel, shape in tasks(args)[part::parts]:
        if (T, kernel) not in calls:
            length = launch_length(kernel, T, args, dtype.itemsize)
            calls[(T, kernel)] = workloads(kernel, args, length, dtype, device)
        try:
            if shape is None:
                exact_results(kernel, calls[(T, kernel)], dtype)
            else:
                with tile_configs.overridden(kernel, block_d, dtype.itemsize, tile_configs.Tiles(*shape)):
                    for call in calls[(T, kernel)].values():
                        call()
            launched += 1
        except Exception:  # a shape that cannot build: the timing run records why
            pass
    return launched


def precompile(argv: list[str], workers: int) -> None:
    """Run `workers` processes over the tile_variants run of `argv`, and wait for them."""
    start = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-m", "bench.tile_warmup", *argv, "--part", f"{i}/{workers}"])
             for i in range(workers)]
    failed = 0
    for proc in procs:
        try:
            failed += proc.wait(timeout=max(1.0, start + PRECOMPILE_SECONDS - time.perf_counter())) != 0
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            failed += 1
    note = f"; {failed} failed or ran out of time, their kernels compile as they are timed" if failed else ""
    print(f"compiled the shapes' kernels in {time.perf_counter() - start:.0f} s with {workers} processes{note}",
          flush=True)


def part_of(text: str) -> tuple[int, int]:
    try:
        part, parts = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not I/N") from None
    if not 0 <= part < parts:
        raise argparse.ArgumentTypeError(f"{text!r}: I must be in [0, N)")
    return part, parts


def main(argv=None) -> int:
    from bench.attention_stages import kernel_device
    from bench.tile_variants import parse_args

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], add_help=False)
    p.add_argument("--part", type=part_of, required=True, metavar="I/N")
    own, rest = p.parse_known_args(argv)
    args = parse_args(rest)
    device = kernel_device("bench.tile_warmup", args.allow_cpu)
    if device is None:
        return 2
    share = len(tasks(args)[own.part[0]::own.part[1]])
    with torch.no_grad():
        launched = run_part(args, *own.part, device)
    return 0 if launched or not share else 1  # nothing launched of a share: say so (the timing run says why)


if __name__ == "__main__":
    sys.exit(main())
