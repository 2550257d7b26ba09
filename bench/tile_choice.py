"""Pick each kernel's launch shape from bench.tile_variants' measurements; write a launch shapes file.

    python -m bench.tile_choice TILE_VARIANTS.json [...] [--min-gain 0.03] [--out FILE]

For every kernel, padded head dim and element size measured, a shape qualifies when it was measured on
every workload the shipped shape was (each file's lengths and branches) and every one of its rows
built, gave the same bits twice and, for bf16 and fp16, lies within EXACT_BOUND of the exact (fp32)
result and within EXACT_SLACK times the shipped shape's own distance from it (block selections:
SELECTION_AGREEMENT of the shipped shape's indices; fp32 inputs: FP32_BOUND of the shipped result), and
keeps the selected branch in the shipped shape's layout (selected dK/dV's key tile sizes the block
layout's partials, so it can move the forward, which its rows do not time, to the other layout).
The times are those of the launcher calls tile_variants makes (the interval backward's dQ and dK/dV
kernels run in one call), so a gain is a gain of the call. The qualifying shape with the least time
summed over the workloads is chosen where it beats the shipped shape's by --min-gain; otherwise the
shipped shape stays, and a kernel a run cut short did not reach, or reached with the shipped shape
only, is said to be. The file (bench/results/tile_choice-<gpu>-<time>.json by default) lists the
changed shapes under "shapes", which bench.attention --tiles, bench.attention_stages --tiles,
bench.kernel_resources --tiles and the tests' --nsa-tiles read (bench/launch_shapes.py), and why each
other shape was passed over. Nothing here changes what training runs: a shape ships when it is
written into components/nsa/triton/tile_configs.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict

from bench import environment
from bench.attention import DTYPES
from bench.environment import describe_environment, write_report
from bench.launch_shapes import LaunchShape
from components.nsa.triton.tile_configs import Tiles, head_block, table_head_block

EXACT_BOUND = 5e-3  # the GPU tests' bound on bf16 results against the reference
EXACT_SLACK = 1.5
SELECTION_AGREEMENT = 0.999
FP32_BOUND = 1e-5


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("files", nargs="+", help="JSON files written by bench.tile_variants")
    p.add_argument("--min-gain", type=float, default=0.03,
                   help="the least speed-up over the shipped shape (summed over the workloads) that changes it")
    p.add_argument("--out", help="output JSON path (default bench/results/tile_choice-<gpu>-<time>.json)")
    args = p.parse_args(argv)
    if not 0 <= args.min_gain < 10:
        p.error(f"--min-gain {args.min_gain} is not in [0, 10)")
    return args


def read_report(path: str) -> dict:
    """A tile_variants report; ValueError naming the problem."""
    try:
        with open(path, encoding="utf-8") as fh:
            report = json.load(fh)
    except OSError as exc:
        raise ValueError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    except ValueError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None
    if not isinstance(report, dict) or report.get("benchmark") != "tile_variants":
        raise ValueError(f"{path}: not a bench.tile_variants report; give the files it wrote")
    config = report.get("config", {})
    if config.get("dtype") not in DTYPES or not isinstance(config.get("head_dim"), int):
        raise ValueError(f"{path}: its config names no dtype and head dim; give a file bench.tile_variants wrote")
    return report


def _group_key(row: dict, config: dict) -> tuple[str, int, int]:
    """(kernel, the shape table's head dim entry, element bytes) the row measured."""
    return row["kernel"], table_head_block(head_block(config["head_dim"])), DTYPES[config["dtype"]].itemsize


def row_problem(row: dict, shipped: dict, element_bytes: int) -> str | None:
    """Why this row's shape cannot be used, or None. shipped: the shipped shape's row of the same workload."""
    if "error" in row:
        return f"did not build or launch ({row['error']})"
    if not row["deterministic"]:
        return "not deterministic (two calls gave different bits)"
    if row is shipped:
        return _own_problem(row, element_bytes)
    if row.get("selected_layout") != shipped.get("selected_layout"):
        return (f"moves the selected branch to the {row.get('selected_layout')} layout (the shipped shape's: "
                f"{shipped.get('selected_layout')}), which changes its forward too; compare the whole op "
                f"(bench.attention_stages) before choosing it")
    # Comparisons are written `not (x <= bound)`: a NaN distance fails them.
    if row["kernel"] == "selection":
        share = row.get("equal_share")
        if share is None or not share >= SELECTION_AGREEMENT:
            return f"selects {'?' if share is None else f'{share:.2%}'} of the shipped shape's blocks"
        return None
    if element_bytes == 4:
        if not row.get("rel_rms", float("nan")) <= FP32_BOUND:
            return f"relative RMS {row.get('rel_rms', float('nan')):.1e} from the shipped fp32 result"
        return None
    own, base = row.get("rel_rms_exact"), shipped.get("rel_rms_exact")
    if own is None or base is None:
        return "no exact (fp32) result to hold it to"
    if not own <= min(EXACT_BOUND, EXACT_SLACK * base):
        return f"relative RMS {own:.1e} from the exact result (the shipped shape's: {base:.1e})"
    return None


def _own_problem(row: dict, element_bytes: int) -> str | None:
    """The shipped shape's row held to the exact result where there is one."""
    exact = row.get("rel_rms_exact")
    if row["kernel"] != "selection" and element_bytes == 2:
        if exact is None:
            return "no exact (fp32) result to hold it to"
        if not exact <= EXACT_BOUND:
            return f"relative RMS {exact:.1e} from the exact result, above {EXACT_BOUND:.0e}"
    return None


def choose(reports: list[tuple[str, dict]], min_gain: float) -> tuple[list[LaunchShape], list[dict]]:
    """(the shapes to change, one summary per kernel, head dim and element size)."""
    groups: dict[tuple, dict] = defaultdict(lambda: defaultdict(dict))  # key -> shape -> workload -> row
    for name, report in reports:
        for row in report["results"]:
            workload = (name, row["seq_len"], row["branch"])
            groups[_group_key(row, report["config"])][tuple(row["tiles"])][workload] = row
    changes, summaries = [], []
    for key, by_shape in groups.items():
        summary = _choose_one(key, by_shape, min_gain)
        summaries.append(summary)
        if summary["verdict"] == "changed":
            changes.append(LaunchShape(*key, Tiles(*summary["chosen"])))
    for name, report in reports:  # kernels a run asked for but ended before (cut at its time limit)
        config = report["config"]
        for kernel in config.get("kernels", []):
            key = _group_key({"kernel": kernel}, config)
            if key not in groups:
                summaries.append({"kernel": kernel, "head_block": key[1], "element_bytes": key[2], "rejected": [],
                                  "verdict": f"kept: not measured ({name} ended before it)"})
                groups[key] = {}
    return changes, summaries


def _choose_one(key: tuple[str, int, int], by_shape: dict, min_gain: float) -> dict:
    kernel, block_d, element_bytes = key
    summary = {"kernel": kernel, "head_block": block_d, "element_bytes": element_bytes, "rejected": []}
    shipped_shape = next((s for s, rows in by_shape.items() if any(r["shipped"] for r in rows.values())), None)
    if shipped_shape is None:
        return {**summary, "verdict": "kept: the shipped shape was not measured"}
    shipped_rows = by_shape[shipped_shape]
    summary["shipped"] = list(shipped_shape)
    problems = [p for r in shipped_rows.values() if (p := row_problem(r, r, element_bytes))]
    if problems:
        return {**summary, "verdict": f"kept: the shipped shape itself {problems[0]}; look at it before any other"}
    summary["shipped_ms"] = sum(r["ms"] for r in shipped_rows.values())
    timed = {}
    for shape, rows in by_shape.items():
        if shape == shipped_shape:
            continue
        missing = set(shipped_rows) - set(rows)
        problem = (f"not measured on {len(missing)} of the {len(shipped_rows)} workloads" if missing else
                   next((p for w, r in rows.items() if (p := row_problem(r, shipped_rows[w], element_bytes))), None))
        if problem:
            summary["rejected"].append({"tiles": list(shape), "why": problem})
        else:
            timed[shape] = sum(rows[w]["ms"] for w in shipped_rows)
    best = min(timed, key=timed.get, default=None)
    if best is None and not summary["rejected"]:
        return {**summary, "verdict": "kept: no other shape measured (the run ended after the shipped one)"}
    if best is None or summary["shipped_ms"] / timed[best] - 1 < min_gain:
        best_note = "" if best is None else f" (the best, {','.join(map(str, best))}, {timed[best]:.3f} ms)"
        return {**summary, "verdict": f"kept: no shape {min_gain:.0%} faster{best_note}"}
    return {**summary, "verdict": "changed", "chosen": list(best), "chosen_ms": timed[best],
            "speedup": summary["shipped_ms"] / timed[best]}


def _line(s: dict) -> str:
    head = f"{s['kernel']:19s} D {s['head_block']:3d} {s['element_bytes']} B"
    if s["verdict"] != "changed":
        return f"{head}  {s['verdict']}"
    return (f"{head}  {','.join(map(str, s['shipped']))} {s['shipped_ms']:.3f} ms -> "
            f"{','.join(map(str, s['chosen']))} {s['chosen_ms']:.3f} ms ({s['speedup']:.2f}x)")


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        reports = [(os.path.basename(path), read_report(path)) for path in args.files]
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    changes, summaries = choose(reports, args.min_gain)
    for summary in summaries:
        print(_line(summary))
    report = {"benchmark": "tile_choice", "environment": describe_environment(),
              "config": {"files": args.files, "min_gain": args.min_gain},
              "shapes": [s.as_json() for s in changes], "kernels": summaries}
    write_report(report, "tile_choice", args.out or environment.results_path("tile_choice"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
