"""Candidate launch shapes of the NSA kernels, timed side by side against the shapes they ship with.

    python -m bench.tile_variants [--preset 125m|paper] [--seq-lens 65536] [--batch N]
                                  [--kernels interval_dkdv ...] [--candidates interval_dkdv=32,64,8,2 ...]

Every kernel's launch shape (rows, keys, warps, stages: components/nsa/triton/tile_configs.py) is tried as
shipped, then as any --candidates given for it, then as each of its neighbours (one field doubled or halved,
the other warp count, a pipeline stage more or less). Each try runs the launcher that uses the kernel (the
compressed and the window branch for the interval kernels, and the selected branch where the length takes its
masked layout; the selected branch's forward or backward) on the same inputs, and records its time, whether
two calls give the same bits (every kernel here is meant to be deterministic: a shape that is not, was built
wrong) and how far its result lies from the shipped shape's (relative RMS; for the selection, the share of
equal block indices) and, for bf16 and fp16, from the exact result: the same call on the inputs in fp32, which
runs the fp32 kernels (true fp32 products). A shape the GPU cannot build (shared memory, registers) is
recorded with its error and the next one runs. Results go to bench/results/tile_variants-<gpu>-<time>.json,
after every row. Needs CUDA; --allow-cpu runs it under Triton's interpreter at tiny sizes as a smoke test
(times mean nothing there). bench.tile_choice picks from the results.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Callable, NamedTuple

import torch

from bench import environment
from bench.arguments import non_negative_int
from bench.attention import DTYPES, add_shape_args, finish_shape_args, nsa_inputs
from bench.attention_stages import kernel_device, timer
from bench.environment import describe_environment, write_report
from components.nsa.triton import tile_configs
from components.nsa.triton.tile_configs import KERNELS


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_shape_args(p)
    p.add_argument("--seq-lens", type=int, nargs="+", default=[65536])
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--kernels", nargs="+", choices=KERNELS, default=list(KERNELS))
    p.add_argument("--candidates", nargs="+", default=[], metavar="KERNEL=ROWS,KEYS,WARPS,STAGES",
                   help="more shapes to try, beside the shipped one and its neighbours")
    p.add_argument("--precompile-workers", type=non_negative_int, default=0, metavar="N",
                   help="first compile every shape's kernels in N processes at once (bench.tile_warmup); 0: none")
    p.add_argument("--allow-cpu", action="store_true", help="smoke test under TRITON_INTERPRET=1 (not a benchmark)")
    p.add_argument("--out", help="output JSON path (default bench/results/tile_variants-<gpu>-<time>.json)")
    args = finish_shape_args(p, p.parse_args(argv))
    try:
        args.extra = parse_candidates(args.candidates)
    except ValueError as exc:
        p.error(str(exc))
    return args


def parse_candidates(texts: list[str]) -> dict[str, list[tuple[int, int, int, int]]]:
    """{kernel: [shape, ...]} from KERNEL=ROWS,KEYS,WARPS,STAGES texts; ValueError naming a bad one."""
    extra: dict[str, list[tuple[int, int, int, int]]] = {}
    for text in texts:
        kernel, _, shape = text.partition("=")
        parts = shape.split(",")
        if kernel not in KERNELS or len(parts) != 4 or not all(x.isdigit() for x in parts):
            raise ValueError(f"--candidates {text!r}: give KERNEL=ROWS,KEYS,WARPS,STAGES with KERNEL one of "
                             f"{', '.join(KERNELS)}, e.g. interval_dkdv=32,64,8,2")
        extra.setdefault(kernel, []).append(tuple(int(x) for x in parts))
    return extra


def neighbours(shape: tuple[int, int, int, int]) -> list[tuple[int, int, int, int]]:
    """The shipped shape first, then each one-field change of it: rows and keys doubled and halved (not
    below 16; a 0, which the launcher sizes itself, stays), the other warp count, one stage more or less."""
    rows, keys, warps, stages = shape
    out = [shape]
    for r in (rows * 2, rows // 2):
        if rows and r >= 16:
            out.append((r, keys, warps, stages))
    for k in (keys * 2, keys // 2):
        if keys and k >= 16:
            out.append((rows, k, warps, stages))
    out.append((rows, keys, 4 if warps == 8 else 8, stages))
    for s in (stages + 1, stages - 1):
        if s >= 1:
            out.append((rows, keys, warps, s))
    return out


class Workload(NamedTuple):
    """One launcher call that runs the kernel: fn(*inputs, **options) returns its result tensors."""
    fn: Callable[..., tuple]
    inputs: tuple
    options: dict

    def __call__(self) -> tuple:
        return self.fn(*self.inputs, **self.options)

    def in_fp32(self) -> tuple:
        """The same call on the inputs in fp32: the fp32 kernels, whose products are true fp32 (launch.dot_precision),
        the exact result a half-type shape is held to."""
        return self.fn(*(x.float() if isinstance(x, torch.Tensor) and x.is_floating_point() else x
                         for x in self.inputs), **self.options)


def workloads(kernel: str, args, T: int, dtype: torch.dtype, device: str) -> dict[str, Workload]:
    """{branch: call}: the launcher calls that run `kernel`, on inputs made once (the selection and the
    forward results a backward needs, with shipped shapes)."""
    from components.nsa.triton.interval_attention import interval_attention_bwd, interval_attention_fwd
    from components.nsa.triton.selected_attention_bwd import selected_attention_bwd
    from components.nsa.triton.selected_attention_fwd import selected_attention_fwd
    from components.nsa.triton.selected_attention_fwd_blocks import selected_attention_fwd_blocks
    from components.nsa.triton.selection_kernel import select_blocks_kernel
    from components.nsa.triton.selection_mask import Chosen

    l, d, lp, n, w = args.block_size, args.block_stride, args.sel_block_size, args.num_selected, args.window_size
    scale = args.head_dim ** -0.5
    with torch.no_grad():
        q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, _ = (x.detach() for x in nsa_inputs(args, T, dtype, device))
        _, lse2_cmp = interval_attention_fwd(q, k_cmp, k_cmp, d, l - 1, 0, scale)
        hyper = dict(block_size=l, block_stride=d, sel_block_size=lp, num_selected=n, sm_scale=scale)
        branches = {"compressed": ((k_cmp, v_cmp), (d, l - 1, 0), {}), "window": ((k_win, v_win), (1, 0, w), {})}
        if kernel.startswith("interval") and tile_configs.masked_layout_pays(T, n, lp):
            # Rows this short run the selected branch on the interval kernels too (the masked layout).
            chosen = Chosen.of(select_blocks_kernel(q, k_cmp, lse2_cmp, **hyper), lp, T)
            branches["selected"] = ((k_sel, v_sel), (1, 0, 0), {"chosen": chosen})
        if kernel == "interval_fwd":
            return {name: Workload(interval_attention_fwd, (q, *kv, *mask, scale), options)
                    for name, (kv, mask, options) in branches.items()}
        if kernel in ("interval_dq", "interval_dkdv"):
            calls = {}
            for name, (kv, mask, options) in branches.items():
                o, lse2 = interval_attention_fwd(q, *kv, *mask, scale, **options)
                calls[name] = Workload(interval_attention_bwd, (torch.randn_like(o), q, *kv, o, lse2, *mask, scale),
                                       options)
            return calls
        if kernel == "selection":
            return {"selection": Workload(lambda *x, **kw: (select_blocks_kernel(*x, **kw),), (q, k_cmp, lse2_cmp),
                                          hyper)}
        selection = select_blocks_kernel(q, k_cmp, lse2_cmp, **hyper)
        if kernel == "selected_fwd":
            return {"selected": Workload(selected_attention_fwd, (q, k_sel, v_sel, selection, lp, scale), {})}
        if kernel == "selected_fwd_blocks":
            return {"selected": Workload(selected_attention_fwd_blocks, (q, k_sel, v_sel, selection, lp, scale), {})}
        o, lse2 = selected_attention_fwd(q, k_sel, v_sel, selection, lp, scale)
        backward = (torch.randn_like(o), q, k_sel, v_sel, o, lse2, selection, lp, scale)
        if kernel == "selected_dq":  # the query-major dQ kernel runs in the query layout only
            return {"selected": Workload(selected_attention_bwd, backward, {"dq_layout": "query"})}
        # dK/dV in the layout training would take with the shape tried (its key tile sizes the block layout's
        # partials, which past their limit send training to the query layout).
        return {"selected": Workload(selected_attention_bwd, backward, {})}


def relative_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    """RMS of a - b over RMS of b, in fp32; entries not finite in b (an lse2 of +inf) are left out. NaN where b
    has entries but none finite (a broken reference holds no shape to anything); 0 where both are empty."""
    a, b = a.float(), b.float()
    keep = torch.isfinite(b)
    if not keep.any():
        return float("nan") if b.numel() else 0.0
    diff, ref = (a - b)[keep], b[keep]
    return float(diff.square().mean().sqrt() / ref.square().mean().sqrt().clamp_min(1e-30))


def compare(result: tuple, again: tuple, shipped: tuple | None, exact: tuple | None) -> dict:
    """deterministic (two calls, the same bits), the distance from the shipped shape's result and from the
    exact (fp32) one where there is one."""
    row = {"deterministic": all(torch.equal(x, y) for x, y in zip(result, again))}
    if shipped is not None:
        if result[0].dtype == torch.int64:  # a selection: block indices, equal up to ties
            row["equal_share"] = float((result[0] == shipped[0]).float().mean())
        else:
            row["rel_rms"] = _largest(relative_rms(x, y) for x, y in zip(result, shipped))
    if exact is not None:
        row["rel_rms_exact"] = _largest(relative_rms(x, y) for x, y in zip(result, exact))
    return row


def _largest(distances) -> float:
    """The largest of the outputs' distances, NaN if any is (max() keeps a NaN only where it comes first)."""
    values = list(distances)
    return float("nan") if any(math.isnan(v) for v in values) else max(values)


def exact_results(kernel: str, calls: dict[str, Workload], dtype: torch.dtype) -> tuple[dict[str, tuple], str | None]:
    """({branch: the fp32 kernels' result}, None), for half-type inputs: what every shape is held to, so that a
    shape built wrong shows even where it is deterministic and near the shipped one. ({}, why) where there is
    none: fp32 inputs (the shipped shape's result is the reference then), the selection (block indices, near
    ties decided by rounding), or an fp32 call that failed (said in every row)."""
    if dtype == torch.float32 or kernel == "selection":
        return {}, None
    try:
        return {branch: call.in_fp32() for branch, call in calls.items()}, None
    except Exception as exc:  # out of memory, say: the shapes are still timed and compared with the shipped one
        return {}, _failure(exc)


def _failure(exc: Exception) -> str:
    """The exception's type and first line, for a row of the report."""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]


def distinct_launches(kernel: str, shapes: list[tuple[int, int, int, int]],
                      sel_block_size: int) -> list[tuple[int, int, int, int]]:
    """shapes less those that launch as an earlier one does: the selected kernels take at most a selection
    block's keys a tile (tile_configs.key_tile), so more keys than that change nothing."""
    seen, kept = set(), []
    for shape in shapes:
        rows, keys, warps, stages = shape
        keys = tile_configs.key_tile(sel_block_size, keys) if kernel.startswith("selected") else keys
        launch = (rows, keys, warps, stages)
        if launch not in seen:
            seen.add(launch)
            kept.append(shape)
    return kept


def shapes_to_try(kernel: str, args, dtype: torch.dtype) -> list[tuple[int, int, int, int]]:
    """The shipped shape first (the others are held to its result), then the candidates asked for, then the
    neighbours: a run cut short at its time limit loses neighbours first."""
    shipped = tuple(tile_configs.tiles(kernel, tile_configs.head_block(args.head_dim), dtype.itemsize))
    shapes = [shipped, *args.extra.get(kernel, []), *neighbours(shipped)[1:]]
    return distinct_launches(kernel, shapes, args.sel_block_size)


def try_kernel(kernel: str, args, T: int, dtype: torch.dtype, device: str):
    """Each shape's rows (one per branch), as they are measured."""
    block_d = tile_configs.head_block(args.head_dim)
    element_bytes = dtype.itemsize
    shapes = shapes_to_try(kernel, args, dtype)
    shipped_shape = shapes[0]
    calls = workloads(kernel, args, T, dtype, device)
    measure = timer(device, args.rep_ms)
    exact, exact_error = exact_results(kernel, calls, dtype)
    if exact_error:
        print(f"T={T:6d} {kernel}: no exact (fp32) result to hold the shapes to: {exact_error}", flush=True)
    shipped_results: dict[str, tuple] = {}
    for shape in shapes:
        for branch, call in calls.items():
            row = {"seq_len": T, "kernel": kernel, "branch": branch, "tiles": list(shape),
                   "shipped": shape == shipped_shape}
            if exact_error:
                row["exact_error"] = exact_error
            try:
                with tile_configs.overridden(kernel, block_d, element_bytes, tile_configs.Tiles(*shape)):
                    if kernel.startswith("selected"):
                        row["selected_layout"] = gather_layout(args, T, element_bytes)
                    result, again = call(), call()
                    row["ms"] = measure(call)
            except Exception as exc:  # a shape this GPU cannot build or launch: recorded, the next one runs
                row["error"] = _failure(exc)
            else:
                row.update(compare(result, again, shipped_results.get(branch), exact.get(branch)))
                if row["shipped"]:
                    shipped_results[branch] = result
            print(_line(row), flush=True)
            yield row
            if device == "cuda":
                torch.cuda.empty_cache()


def gather_layout(args, T: int, element_bytes: int) -> str:
    """The layout ("query" or "block") the selected branch's launchers take by default for this call with the
    shapes in force: the one whose kernels a selected kernel's workload runs (training takes the masked layout
    instead for short rows). Selected dK/dV's key tile sizes the block layout's partials, so a shape of it can
    move the forward (not timed here) to the other layout; bench.tile_choice keeps to the shipped shape's."""
    return tile_configs.gather_layout_for(args.batch * T, args.heads, args.kv_heads, args.num_selected,
                                          args.head_dim, args.sel_block_size, element_bytes)


def _line(row: dict) -> str:
    shape = ",".join(map(str, row["tiles"]))
    head = f"T={row['seq_len']:6d} {row['kernel']:19s} {row['branch']:10s} {shape:14s}"
    if "error" in row:
        return f"{head} failed: {row['error']}"
    close = (f"rel RMS {row['rel_rms']:.1e}" if "rel_rms" in row else
             f"equal {row['equal_share']:.1%}" if "equal_share" in row else
             "shipped" if row["shipped"] else "(the shipped shape gave no result)")
    exact = f"  vs fp32 {row['rel_rms_exact']:.1e}" if "rel_rms_exact" in row else ""
    return (f"{head} {row['ms']:9.3f} ms  {'deterministic' if row['deterministic'] else 'NOT DETERMINISTIC'}  "
            f"{close}{exact}")


def main(argv=None) -> int:
    args = parse_args(argv)
    device = kernel_device("bench.tile_variants", args.allow_cpu)
    if device is None:
        return 2
    dtype = DTYPES[args.dtype]
    if args.precompile_workers:
        from bench.tile_warmup import precompile

        precompile(sys.argv[1:] if argv is None else argv, args.precompile_workers)
    config = {k: v for k, v in vars(args).items() if k != "extra"}
    report = {"benchmark": "tile_variants", "environment": describe_environment(), "config": config, "results": []}
    path = args.out or environment.results_path("tile_variants")
    for T in args.seq_lens:
        for kernel in args.kernels:
            for row in try_kernel(kernel, args, T, dtype, device):
                report["results"].append(row)
                write_report(report, "tile_variants", path, quiet=True)  # a run cut short keeps what ran
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
