"""Where the Triton NSA op spends its time: each stage's forward and backward, timed on its own.

    python -m bench.attention_stages [--preset 125m|paper] [--seq-lens 8192 65536] [--dtype bf16] [--tiles FILE]

Stages, in the order the op runs them: the compressed branch (interval attention over the
compressed keys), block selection, the selected branch, the window branch, and the gating. Each is
timed forward, and backward from a random output gradient (selection has no backward). The selected
branch's launchers are also timed in each of its layouts (query- and block-major forward and dQ, and masked:
causal flash attention hiding the unselected blocks; tile_configs.selected_layout_for), side by side; and the
whole op's forward + backward against the host's time to issue it (and the kernels it launches), which shows a
length where launches, not kernels, set the pace (the masked layout up to twice the rows it is chosen for). Each
branch and the selection also get their FLOPs, counted from the keys every query really sees (stage_flops), and
the TFLOP/s that makes: how far each kernel is from the GPU's peak. Results go to
bench/results/attention_stages-<gpu>-<time>.json with the environment. --tiles FILE launches the kernels with a
launch shapes file's shapes (bench.tile_choice) in place of the shipped ones. Needs CUDA; --allow-cpu
runs it under Triton's interpreter at tiny sizes as a smoke test (times mean nothing there).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from bench import environment
from bench.attention import BACKWARD_FLOPS, DTYPES, add_shape_args, finish_shape_args, nsa_inputs
from bench.environment import describe_environment, write_report
from bench.launch_shapes import add_tiles_arg, applied, config_of, finish_tiles_arg


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_shape_args(p)
    p.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 65536])
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--allow-cpu", action="store_true", help="smoke test under TRITON_INTERPRET=1 (not a benchmark)")
    p.add_argument("--out", help="output JSON path (default bench/results/attention_stages-<gpu>-<time>.json)")
    add_tiles_arg(p)
    return finish_tiles_arg(p, finish_shape_args(p, p.parse_args(argv)))


def timer(device: str, rep_ms: int):
    """Milliseconds per call: do_bench on CUDA, one wall-clock call on the CPU smoke path."""
    if device == "cuda":
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, rep=rep_ms)

    def once(fn):
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    return once


def kernel_device(benchmark: str, allow_cpu: bool) -> str | None:
    """Where the kernels run: "cuda", or "cpu" for a smoke test under Triton's interpreter (--allow-cpu);
    None, said on stderr, where neither can."""
    from components.nsa.triton.launch import interpreting

    if torch.cuda.is_available():
        return "cuda"
    if allow_cpu and interpreting():
        return "cpu"
    print(f"{benchmark} needs a CUDA GPU (or --allow-cpu with TRITON_INTERPRET=1 for a smoke test)", file=sys.stderr)
    return None


def stage_flops(args, T: int, selection: torch.Tensor) -> dict[str, float]:
    """Forward FLOPs of one call per stage, counted from the keys each (query, head) really sees: 4 * D per key
    (q.k and p.v) in the branches, 2 * D per compressed key in selection (its q.k; the small product folding
    the compressed blocks onto selection blocks is left out). The selected branch counts the keys of
    `selection` [B, T, Hkv, n] at or before each query (the call's own, not the count a full one would
    have: components.models.flops.visible_keys); the gates do no products."""
    from components.models.flops import visible_keys

    lp = args.sel_block_size
    rows = args.batch * args.heads  # (row, head) pairs, each over the T queries
    seen = visible_keys(args, T)
    compressed, window = float(seen["cmp"].sum()), float(seen["win"].sum())
    t = torch.arange(T, dtype=torch.float64)
    blocks = selection.detach().to("cpu", torch.int64)
    keys = (t.view(1, T, 1, 1) - blocks * lp + 1).clamp(0, lp)  # keys of each chosen block at or before t
    selected = torch.where(blocks >= 0, keys, 0.0).sum().item() * (args.heads // args.kv_heads)
    D = args.head_dim
    return {"compressed": 4.0 * D * rows * compressed, "selection": 2.0 * D * rows * compressed,
            "selected": 4.0 * D * selected, "window": 4.0 * D * rows * window}


def stage_times(args, T: int, dtype: torch.dtype, device: str) -> list[dict]:
    from components.nsa.triton import ops

    l, d, lp, n, w = args.block_size, args.block_stride, args.sel_block_size, args.num_selected, args.window_size
    scale = args.head_dim ** -0.5
    q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates = nsa_inputs(args, T, dtype, device)
    o_cmp, lse_cmp = ops.interval_attention(q, k_cmp, v_cmp, d, l - 1, 0, scale)
    selection = ops.select_blocks(q.detach(), k_cmp.detach(), lse_cmp.detach(), l, d, lp, n, scale)
    o_sel, _ = ops.selected_attention(q, k_sel, v_sel, selection, lp, scale)
    o_win, _ = ops.interval_attention(q, k_win, v_win, 1, 0, w, scale)

    stages = {
        "compressed": (lambda: ops.interval_attention(q, k_cmp, v_cmp, d, l - 1, 0, scale)[0], [q, k_cmp, v_cmp]),
        "selection": (lambda: ops.select_blocks(q.detach(), k_cmp.detach(), lse_cmp.detach(), l, d, lp, n, scale),
                      None),
        "selected": (lambda: ops.selected_attention(q, k_sel, v_sel, selection, lp, scale)[0], [q, k_sel, v_sel]),
        "window": (lambda: ops.interval_attention(q, k_win, v_win, 1, 0, w, scale)[0], [q, k_win, v_win]),
        # Its backward is one kernel giving every input's gradient (those of the branch outputs too).
        "gating": (lambda: ops.gate(o_cmp, o_sel, o_win, gates), [gates]),
    }
    measure = timer(device, args.rep_ms)
    flops = stage_flops(args, T, selection)
    rows = []
    for name, (fn, inputs) in stages.items():
        with torch.no_grad():
            row = {"seq_len": T, "stage": name, "fwd_ms": measure(fn)}
        if inputs is not None:
            out = fn()
            grad = torch.randn_like(out)
            row["bwd_ms"] = measure(lambda: torch.autograd.grad(out, inputs, grad, retain_graph=True))
        if name in flops:
            row["fwd_flops"] = flops[name]
            row["fwd_tflops"] = flops[name] / row["fwd_ms"] / 1e9
            if "bwd_ms" in row:
                row["bwd_tflops"] = BACKWARD_FLOPS * flops[name] / row["bwd_ms"] / 1e9
        rows.append(row)
    total_fwd = sum(r["fwd_ms"] for r in rows)
    total_bwd = sum(r.get("bwd_ms", 0.0) for r in rows)
    for r in rows:
        r["share_of_fwd"] = r["fwd_ms"] / total_fwd
        if "bwd_ms" in r:
            r["share_of_bwd"] = r["bwd_ms"] / total_bwd
    return rows


def host_overhead(args, T: int, dtype: torch.dtype, device: str, calls: int = 20) -> dict:
    """Whether the whole op (forward + backward, as training calls it) is bound by the host: the time Python
    takes to issue one call (no synchronisation inside it, so the GPU works behind it) against the GPU time of
    one, and on CUDA the kernels one call launches. Issue time near the GPU time means the GPU waits for
    launches: fewer kernels or CUDA graphs help there, faster kernels do not."""
    from components.nsa.op import nsa_attention

    inputs = nsa_inputs(args, T, dtype, device)
    hyper = dict(block_size=args.block_size, block_stride=args.block_stride, sel_block_size=args.sel_block_size,
                 num_selected=args.num_selected, window_size=args.window_size, backend="triton")
    grad = torch.randn_like(inputs[0])

    def call():
        torch.autograd.grad(nsa_attention(*inputs, **hyper), inputs, grad)

    call()  # warm: compiled kernels, allocator
    issue = []
    for _ in range(calls if device == "cuda" else 1):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        call()
        issue.append((time.perf_counter() - start) * 1e3)
    row = {"seq_len": T, "issue_ms": sorted(issue)[len(issue) // 2], "total_ms": timer(device, args.rep_ms)(call)}
    if device == "cuda":
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            call()
            torch.cuda.synchronize()
        kernels = [(e.name, e.time_range.elapsed_us() / 1e3) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset"))]
        row["kernels"] = len(kernels)
        row["busiest_kernels"] = busiest_kernels(kernels)
    row["issue_share"] = row["issue_ms"] / row["total_ms"]
    return row


def busiest_kernels(kernels: list[tuple[str, float]], top: int = 8) -> list[dict]:
    """The kernels (name, GPU ms of one launch) that took the most GPU time, summed by name: where a
    faster kernel would pay."""
    by_name: dict[str, list[float]] = {}
    for name, ms in kernels:
        by_name.setdefault(name, []).append(ms)
    total = sum(ms for _, ms in kernels) or 1.0
    rows = [{"name": name, "ms": sum(times), "calls": len(times), "share": sum(times) / total}
            for name, times in by_name.items()]
    return sorted(rows, key=lambda r: -r["ms"])[:top]


def selected_layout_times(args, T: int, dtype: torch.dtype, device: str) -> list[dict]:
    """The selected branch's forward and backward launchers, once per layout, on one selection."""
    from components.nsa.triton import ops, tile_configs
    from components.nsa.triton.selected_attention_bwd import selected_attention_bwd
    from components.nsa.triton.selected_attention_fwd import selected_attention_fwd
    from components.nsa.triton.selected_attention_fwd_blocks import selected_attention_fwd_blocks
    from components.nsa.triton.selected_attention_masked import (selected_attention_bwd_masked,
                                                                  selected_attention_fwd_masked)
    from components.nsa.triton.selection_lists import selection_lists, work_item_segment
    from components.nsa.triton.selection_mask import Chosen

    l, d, lp, n = args.block_size, args.block_stride, args.sel_block_size, args.num_selected
    scale = args.head_dim ** -0.5
    with torch.no_grad():
        q, k_cmp, _, k, v, *_ = (x.detach() for x in nsa_inputs(args, T, dtype, device))
        _, lse_cmp = ops.interval_attention(q, k_cmp, k_cmp, d, l - 1, 0, scale)
        selection = ops.select_blocks(q, k_cmp, lse_cmp, l, d, lp, n, scale)
        o, lse2 = selected_attention_fwd(q, k, v, selection, lp, scale)
        do = torch.randn_like(o)
    forward = {"query": selected_attention_fwd, "block": selected_attention_fwd_blocks,
               "masked": selected_attention_fwd_masked}
    measure = timer(device, args.rep_ms)
    rows = []
    # The masked layout where it fits, up to twice the rows it is chosen for: past them it is dense attention.
    masked = tile_configs.masked_layout_pays(T // 2, n, lp)
    for layout in ("query", "block", "masked") if masked else ("query", "block"):
        def run_forward():
            return forward[layout](q, k, v, selection, lp, scale)

        def run_backward():
            if layout == "masked":
                return selected_attention_bwd_masked(do, q, k, v, o, lse2, selection, lp, scale)
            return selected_attention_bwd(do, q, k, v, o, lse2, selection, lp, scale, dq_layout=layout)

        def build_lists():  # what each of the layout's passes builds before its kernels run (the segment
            # only sizes the item table: 10 queries a step stands in for the launchers' own)
            if layout == "masked":
                return Chosen.of(selection, lp, k.shape[1])
            return selection_lists(selection, lp, k.shape[1], work_item_segment(10, selection.numel()),
                                   entries=layout == "block")

        row = {"seq_len": T, "layout": layout, "fwd_ms": measure(run_forward), "bwd_ms": measure(run_backward),
               "lists_ms": measure(build_lists)}
        if device == "cuda":  # the layout's own workspace: peak memory of a call above what was held before
            for name, fn in (("fwd", run_forward), ("bwd", run_backward)):
                torch.cuda.synchronize()
                held = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                fn()
                torch.cuda.synchronize()
                row[f"{name}_extra_gib"] = (torch.cuda.max_memory_allocated() - held) / 2**30
        rows.append(row)
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    device = kernel_device("bench.attention_stages", args.allow_cpu)
    if device is None:
        return 2
    with applied(args.shapes):
        return measure(args, device)


def measure(args, device: str) -> int:
    dtype = DTYPES[args.dtype]
    report = {"benchmark": "attention_stages", "environment": describe_environment(), "config": config_of(args),
              "results": [], "selected_layouts": [], "host_overhead": []}
    path = args.out or environment.results_path("attention_stages")
    for T in args.seq_lens:
        for row in stage_times(args, T, dtype, device):
            report["results"].append(row)
            bwd = f"{row['bwd_ms']:9.3f} ms bwd" if "bwd_ms" in row else " " * 16
            print(f"T={T:6d} {row['stage']:11s} {row['fwd_ms']:9.3f} ms fwd ({row['share_of_fwd']:5.1%})  {bwd}",
                  flush=True)
        for row in selected_layout_times(args, T, dtype, device):
            report["selected_layouts"].append(row)
            memory = (f"  (+{row['fwd_extra_gib']:.2f} / +{row['bwd_extra_gib']:.2f} GiB during fwd / bwd)"
                      if "fwd_extra_gib" in row else "")
            print(f"T={T:6d} selected, {row['layout']} layout: {row['fwd_ms']:9.3f} ms fwd  "
                  f"{row['bwd_ms']:9.3f} ms bwd{memory}", flush=True)
        write_report(report, "attention_stages", path)  # the stages first: the whole op may not fit in memory
        try:
            row = host_overhead(args, T, dtype, device)
        except torch.OutOfMemoryError as exc:
            print(f"T={T:6d} whole op fwd+bwd: out of memory ({str(exc).splitlines()[0]})", flush=True)
        else:
            report["host_overhead"].append(row)
            kernels = f", {row['kernels']} kernels" if "kernels" in row else ""
            print(f"T={T:6d} whole op fwd+bwd: {row['total_ms']:9.3f} ms, of which the host takes "
                  f"{row['issue_ms']:.3f} ms to issue ({row['issue_share']:.0%}{kernels})", flush=True)
        if device == "cuda":
            torch.cuda.empty_cache()
        write_report(report, "attention_stages", path)  # after every length: a run cut short keeps what ran
    return 0


if __name__ == "__main__":
    sys.exit(main())
