"""Time the NSA reference forward against dense causal SDPA on the CPU; prints one JSON object and writes it to --out.

    python bench/reference_vs_sdpa_cpu.py [--seq-len 4096] [--heads 12] [--kv-heads 12 3] [--repeats 3]
                                          [--threads N] [--out FILE]

Defaults: B=1, D=64, fp32, paper hyperparameters (l=32, d=16, l'=64, n=16, w=512). Times are the
best (minimum) of --repeats runs after one warm-up: on a shared machine the minimum is the
least disturbed by other processes. Also reports each part of the forward (selection and
the three branches) and forward+backward, for both NSA and SDPA. The JSON goes to stdout and to --out
(default bench/results/reference_vs_sdpa_cpu-cpu-<time>.json; where, on stderr).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.arguments import non_negative_int, positive_int  # noqa: E402
from bench.environment import describe_environment, write_report  # noqa: E402
from components.nsa import nsa_attention, num_compressed_blocks  # noqa: E402
from components.nsa.reference import compressed_attention, selected_attention, window_attention  # noqa: E402
from components.nsa.selection import select_blocks_at_reference  # noqa: E402

HYPER = dict(block_size=32, block_stride=16, sel_block_size=64, num_selected=16, window_size=512)


def best_seconds(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def bench_config(T: int, H: int, Hkv: int, D: int, repeats: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    Tc = num_compressed_blocks(T, HYPER["block_size"], HYPER["block_stride"])

    def rand(*shape):
        return torch.randn(*shape, generator=gen).requires_grad_()

    q = rand(1, T, H, D)
    k_cmp, v_cmp = rand(1, Tc, Hkv, D), rand(1, Tc, Hkv, D)
    k_sel, v_sel, k_win, v_win = (rand(1, T, Hkv, D) for _ in range(4))
    gates = torch.rand(1, T, H, 3, generator=gen).requires_grad_()
    args = (q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates)
    # SDPA with the same number of query heads and its own per-head keys/values.
    qs, ks, vs = (torch.randn(1, H, T, D, generator=gen).requires_grad_() for _ in range(3))

    def nsa_fwd():
        with torch.no_grad():
            nsa_attention(*args, **HYPER)

    def sdpa_fwd():
        with torch.no_grad():
            F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)

    def nsa_fwd_bwd():
        nsa_attention(*args, **HYPER).sum().backward()

    def sdpa_fwd_bwd():
        F.scaled_dot_product_attention(qs, ks, vs, is_causal=True).sum().backward()

    sel_hyper = {k: HYPER[k] for k in ("block_size", "block_stride", "sel_block_size", "num_selected")}
    with torch.no_grad():
        selection = select_blocks_at_reference(q, k_cmp, q_start=0, **sel_hyper)
    parts = {
        "selection": lambda: select_blocks_at_reference(q, k_cmp, q_start=0, **sel_hyper),
        "compressed": lambda: compressed_attention(q, k_cmp, v_cmp, q_start=0, block_size=32, block_stride=16),
        "selected": lambda: selected_attention(q, k_sel, v_sel, selection, q_start=0, sel_block_size=64),
        "window": lambda: window_attention(q, k_win, v_win, q_start=0, window_size=512),
    }
    part_times = {}
    for name, fn in parts.items():
        with torch.no_grad():
            part_times[name] = round(best_seconds(fn, repeats), 4)

    nsa_f, sdpa_f = best_seconds(nsa_fwd, repeats), best_seconds(sdpa_fwd, repeats)
    nsa_fb, sdpa_fb = best_seconds(nsa_fwd_bwd, repeats), best_seconds(sdpa_fwd_bwd, repeats)
    return {
        "kv_heads": Hkv,
        "group_size": H // Hkv,
        "nsa_forward_s": round(nsa_f, 4),
        "sdpa_forward_s": round(sdpa_f, 4),
        "forward_ratio": round(nsa_f / sdpa_f, 2),
        "nsa_forward_parts_s": part_times,
        "nsa_forward_backward_s": round(nsa_fb, 4),
        "sdpa_forward_backward_s": round(sdpa_fb, 4),
        "forward_backward_ratio": round(nsa_fb / sdpa_fb, 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=positive_int, default=4096)
    parser.add_argument("--heads", type=positive_int, default=12)
    parser.add_argument("--kv-heads", type=positive_int, nargs="+", default=[12, 3],
                        help="key/value heads, each dividing --heads (one case each)")
    parser.add_argument("--head-dim", type=positive_int, default=64)
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--threads", type=non_negative_int, default=0, help="intra-op threads (0: torch's default)")
    parser.add_argument("--out", default=None, help="output JSON path (default bench/results/reference_vs_sdpa_cpu-"
                                                    "cpu-<time>.json)")
    a = parser.parse_args(argv)
    bad = [hkv for hkv in a.kv_heads if a.heads % hkv]
    if bad:
        parser.error(f"--kv-heads {bad[0]} does not divide --heads {a.heads}: each key/value head serves a whole "
                     f"group of query heads. Pass divisors of {a.heads}.")
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    results = [bench_config(a.seq_len, a.heads, hkv, a.head_dim, a.repeats) for hkv in a.kv_heads]
    report = {
        "benchmark": "nsa_reference_vs_sdpa_cpu",
        "environment": describe_environment(),
        "threads": torch.get_num_threads(),
        "batch": 1, "seq_len": a.seq_len, "heads": a.heads, "head_dim": a.head_dim, "dtype": "float32",
        "hyperparameters": HYPER,
        "results": results,
    }
    print(json.dumps(report, indent=2))
    with contextlib.redirect_stdout(sys.stderr):  # stdout holds the one JSON object; where it was written, apart
        write_report(report, "reference_vs_sdpa_cpu", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
