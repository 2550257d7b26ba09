"""Time NSA backends against dense causal SDPA (its best CUDA backend) on one GPU; write JSON.

    python -m bench.attention [--preset 125m|paper] [--seq-lens 2048 4096 ...] [--backends triton]
                              [--modes fwd bwd fwd+bwd] [--heads H --kv-heads Hkv --head-dim D]
                              [--packed MIN MAX] [--tiles FILE]

Presets: 125m = 12 query heads, 4 KV heads, head dim 64 (recipes/nsa_125m.toml; the default); paper = 64 query heads,
4 KV heads, head dim 128. --heads/--kv-heads/--head-dim override the preset. NSA uses the paper's
hyperparameters unless overridden. SDPA is timed with cuDNN and with flash attention separately
(each where it runs) and the faster one is reported as "sdpa". --packed MIN MAX also times NSA on
each length as one packed row of documents MIN to MAX tokens long (cu_seqlens; seeded lengths),
reported as "nsa-<backend>-packed" with the number of documents; SDPA stays the dense causal baseline. --tiles
FILE launches the Triton kernels with a launch shapes file's shapes (bench.tile_choice) in place of the shipped
ones. Results go to bench/results/attention-<gpu>-<time>.json with the GPU name, torch/triton/CUDA versions and the
git commit. Needs CUDA: exits with status 2 and a message otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

from bench import environment
from bench.arguments import positive_int
from bench.environment import describe_environment, write_report
from bench.launch_shapes import add_tiles_arg, applied, config_of, finish_tiles_arg

PRESETS = {"125m": (12, 4, 64), "paper": (64, 4, 128)}
SEQ_LENS = (2048, 4096, 8192, 16384, 32768, 65536)
MODES = ("fwd", "bwd", "fwd+bwd")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def add_shape_args(p: argparse.ArgumentParser) -> None:
    """Head layout (a preset, each part overridable), batch and NSA hyperparameters (the paper's)."""
    p.add_argument("--preset", choices=sorted(PRESETS), default="125m", help="head layout (default 125m)")
    p.add_argument("--heads", type=positive_int, help="query heads (overrides the preset)")
    p.add_argument("--kv-heads", type=positive_int, help="key/value heads (overrides the preset)")
    p.add_argument("--head-dim", type=positive_int, help="head dim (overrides the preset)")
    p.add_argument("--batch", type=positive_int, default=1)
    add_nsa_args(p)
    p.add_argument("--rep-ms", type=positive_int, default=200,
                   help="time budget per measurement (triton.testing.do_bench)")


def add_nsa_args(p: argparse.ArgumentParser) -> None:
    """The NSA block sizes, the paper's by default; nsa_hyper() reads them back."""
    p.add_argument("--block-size", type=positive_int, default=32)
    p.add_argument("--block-stride", type=positive_int, default=16)
    p.add_argument("--sel-block-size", type=positive_int, default=64)
    p.add_argument("--num-selected", type=positive_int, default=16)
    p.add_argument("--window-size", type=positive_int, default=512)


def finish_shape_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """Fill heads, kv_heads and head_dim from the preset where not given; check the grouping."""
    h, hkv, d = PRESETS[args.preset]
    args.heads, args.kv_heads, args.head_dim = args.heads or h, args.kv_heads or hkv, args.head_dim or d
    if args.heads % args.kv_heads:
        p.error(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")
    return args


def nsa_hyper(args) -> dict:
    return dict(block_size=args.block_size, block_stride=args.block_stride, sel_block_size=args.sel_block_size,
                num_selected=args.num_selected, window_size=args.window_size)


def packed_lengths(total: int, low: int, high: int, seed: int = 0) -> list[int]:
    """Document lengths in [low, high] (seeded, uniform) that fill `total` tokens exactly."""
    if not 1 <= low <= high or total < low:
        raise ValueError(f"documents of {low} to {high} tokens cannot fill a row of {total}")
    gen = torch.Generator().manual_seed(seed)
    lengths, left = [], total
    while left > high:  # each draw leaves at least `low` tokens for the documents after it
        top = min(high, left - low)
        lengths.append(int(torch.randint(low, top + 1, (1,), generator=gen)))
        left -= lengths[-1]
    return lengths + [left]


def cu_seqlens_of(lengths: list[int], device: str = "cuda") -> torch.Tensor:
    """Document starts of `lengths`, marked written once as a model marks its own (documents.written_once): the
    Triton backend keeps its kernel tables with them, so a packed call is timed as the model's layers make it."""
    from components.nsa.documents import written_once

    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=device)
    written_once(cu_seqlens)
    return cu_seqlens


def nsa_inputs(args, T: int, dtype: torch.dtype, device: str = "cuda",
               lengths: list[int] | None = None) -> list[torch.Tensor]:
    """Leaf tensors (q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates) of the op, random; with
    document lengths (B = 1), k_cmp / v_cmp hold the documents' compressed blocks."""
    from components.nsa import num_compressed_blocks

    B, H, Hkv, D = args.batch, args.heads, args.kv_heads, args.head_dim
    tc = sum(num_compressed_blocks(n, args.block_size, args.block_stride) for n in (lengths or [T]))
    shapes = [(B, T, H, D), (B, tc, Hkv, D), (B, tc, Hkv, D)] + [(B, T, Hkv, D)] * 4
    xs = [torch.randn(*s, device=device, dtype=dtype).requires_grad_() for s in shapes]
    xs.append(torch.rand(B, T, H, 3, device=device, dtype=dtype).requires_grad_())
    return xs


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_shape_args(p)
    p.add_argument("--seq-lens", type=positive_int, nargs="+", default=list(SEQ_LENS))
    p.add_argument("--backends", nargs="+", default=["triton"], choices=["triton", "reference"],
                   help="NSA backends to time (the reference is slow at long lengths)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--no-sdpa", action="store_true", help="skip the dense SDPA baseline")
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--packed", type=int, nargs=2, metavar=("MIN", "MAX"),
                   help="also time NSA on a packed row of documents MIN to MAX tokens long (batch 1)")
    p.add_argument("--out", help="output JSON path (default bench/results/attention-<gpu>-<time>.json)")
    add_tiles_arg(p)
    args = finish_tiles_arg(p, finish_shape_args(p, p.parse_args(argv)))
    if args.packed and (args.batch != 1 or not 1 <= args.packed[0] <= args.packed[1]):
        p.error(f"--packed MIN MAX needs 1 <= MIN <= MAX and --batch 1 (one packed row), got {args.packed} "
                f"and --batch {args.batch}")
    return args


# Backward FLOPs per forward FLOP, the usual convention for attention (SDPA's rows count the same): dQ, dK and
# dV take five products of the forward's size against its two. The NSA kernels do more (dQ and dK/dV each
# recompute P), so a backward's TFLOP/s is useful work, not what the tensor cores ran.
BACKWARD_FLOPS = 2.5


def nsa_flops(args, T: int) -> float:
    """Forward FLOPs NSA really does (two matmuls per visible key), counting causal halves."""
    l, d, lp, n, w = args.block_size, args.block_stride, args.sel_block_size, args.num_selected, args.window_size
    tc = max(0, (T - l) // d + 1)
    keys_per_query = tc / 2 + min(n * lp, T / 2) + min(w, T / 2)
    return 4.0 * args.batch * args.heads * T * keys_per_query * args.head_dim


def dense_flops(args, T: int) -> float:
    return 4.0 * args.batch * args.heads * T * (T / 2) * args.head_dim


def nsa_case(args, T: int, backend: str, dtype: torch.dtype, lengths: list[int] | None = None):
    """The op on random inputs; with document lengths, as one packed row (cu_seqlens)."""
    from components.nsa import nsa_attention

    xs = nsa_inputs(args, T, dtype, lengths=lengths)
    packed = {} if lengths is None else {"cu_seqlens": cu_seqlens_of(lengths)}
    return (lambda: nsa_attention(*xs, **nsa_hyper(args), backend=backend, **packed)), xs


def sdpa_case(args, T: int, dtype: torch.dtype, gqa: bool):
    B, H, Hkv, D = args.batch, args.heads, args.kv_heads, args.head_dim
    q = torch.randn(B, H, T, D, device="cuda", dtype=dtype).requires_grad_()
    kv_heads = Hkv if gqa else H
    k, v = (torch.randn(B, kv_heads, T, D, device="cuda", dtype=dtype).requires_grad_() for _ in range(2))
    extra = {"enable_gqa": True} if gqa and Hkv != H else {}
    return (lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, **extra)), [q, k, v]


def time_modes(make, modes, rep_ms: int) -> dict:
    """{mode: {"ms": median, "peak_gib": peak memory}} for one case; the forward builds the graph."""
    from triton.testing import do_bench

    fn, inputs = make()
    out = fn()
    grad = torch.randn_like(out)
    results = {}
    for mode in modes:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        if mode == "fwd":
            with torch.no_grad():
                ms = do_bench(fn, rep=rep_ms)
        elif mode == "bwd":
            out = fn()
            ms = do_bench(lambda: out.backward(grad, retain_graph=True), rep=rep_ms, grad_to_none=inputs)
        else:
            ms = do_bench(lambda: fn().backward(grad), rep=rep_ms, grad_to_none=inputs)
        results[mode] = {"ms": ms, "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
    return results


def sdpa_best(args, T: int, dtype: torch.dtype, modes) -> dict:
    """Fastest of cuDNN and flash attention for each mode; GQA natively when supported."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    candidates = {}
    for name, kernel in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        for gqa in (True, False):
            try:
                with sdpa_kernel([kernel]):
                    candidates[(name, gqa)] = time_modes(lambda: sdpa_case(args, T, dtype, gqa), modes, args.rep_ms)
                break
            except RuntimeError as exc:  # this kernel rejects the shape or GQA: try the next form
                print(f"  sdpa {name} (gqa={gqa}) unavailable at T={T}: {str(exc).splitlines()[0]}", file=sys.stderr)
    best = {}
    for mode in modes:
        runs = [(r[mode]["ms"], key, r[mode]) for key, r in candidates.items()]
        if runs:
            ms, (name, gqa), rec = min(runs, key=lambda x: x[0])
            best[mode] = dict(rec, kernel=name, native_gqa=gqa)
    return best


def speedups(results: list[dict]) -> list[dict]:
    """SDPA time / NSA time per (length, NSA backend, mode): above 1, NSA is faster."""
    sdpa = {(r["seq_len"], r["mode"]): r for r in results if r.get("backend") == "sdpa" and "ms" in r}
    rows = []
    for r in results:
        if not r.get("backend", "").startswith("nsa-") or "ms" not in r:
            continue
        base = sdpa.get((r["seq_len"], r["mode"]))
        if base is not None:
            rows.append({"seq_len": r["seq_len"], "backend": r["backend"], "mode": r["mode"],
                         "speedup_vs_sdpa": base["ms"] / r["ms"], "sdpa_kernel": base.get("kernel")})
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.attention needs a CUDA GPU (torch.cuda.is_available() is False); run it on a GPU machine",
              file=sys.stderr)
        return 2
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with applied(args.shapes):
        return measure(args)


def measure(args) -> int:
    dtype = DTYPES[args.dtype]
    report = {"benchmark": "attention", "environment": describe_environment(), "config": config_of(args),
              "results": []}
    path = args.out or environment.results_path("attention")
    for T in args.seq_lens:
        cases = [(f"nsa-{b}", lambda b=b: time_modes(lambda: nsa_case(args, T, b, dtype), args.modes, args.rep_ms),
                  nsa_flops(args, T), {}) for b in args.backends]
        if args.packed and T >= args.packed[0]:
            lengths = packed_lengths(T, *args.packed)
            extra = {"documents": len(lengths), "document_tokens": list(args.packed)}
            cases += [(f"nsa-{b}-packed",
                       lambda b=b: time_modes(lambda: nsa_case(args, T, b, dtype, lengths), args.modes, args.rep_ms),
                       sum(nsa_flops(args, n) for n in lengths), extra) for b in args.backends]
        if not args.no_sdpa:
            cases.append(("sdpa", lambda: sdpa_best(args, T, dtype, args.modes), dense_flops(args, T), {}))
        for name, run, flops, extra in cases:
            try:
                timings = run()
            except torch.cuda.OutOfMemoryError:
                print(f"T={T:6d} {name:14s} out of memory", file=sys.stderr)
                report["results"].append({"seq_len": T, "backend": name, "error": "out of memory"})
                torch.cuda.empty_cache()
                continue
            for mode, rec in timings.items():
                # Backward does about 2.5x the forward's matmul work.
                work = flops * {"fwd": 1.0, "bwd": BACKWARD_FLOPS, "fwd+bwd": 1.0 + BACKWARD_FLOPS}[mode]
                rec = dict(rec, seq_len=T, backend=name, mode=mode, tflops=work / rec["ms"] / 1e9, **extra)
                report["results"].append(rec)
                print(f"T={T:6d} {name:14s} {mode:8s} {rec['ms']:9.3f} ms {rec['tflops']:7.1f} TFLOP/s "
                      f"peak {rec['peak_gib']:6.2f} GiB")
            torch.cuda.empty_cache()
        report["speedups"] = speedups(report["results"])
        write_report(report, "attention", path)  # after every length: a run cut short keeps the lengths it timed

    for row in report["speedups"]:
        print(f"T={row['seq_len']:6d} {row['backend']:14s} {row['mode']:8s} {row['speedup_vs_sdpa']:6.2f}x SDPA's "
              f"speed ({row['sdpa_kernel']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
