"""Markdown tables (for the README) from benchmark JSON files, with the speed targets checked.

    python -m bench.report bench/results/attention-*.json bench/results/train_throughput-*.json ...

Reads what bench.attention, bench.attention_stages, bench.train_throughput and bench.loss_memory write
and prints, per file, where it was measured (GPU, versions, commit) and one table of its numbers. Targets (checked
where the file has the lengths): the NSA op's forward + backward at least 6x SDPA's speed at 64k
tokens and at least SDPA's speed at 8k or below; nsa_125m at least 0.8x dense_125m's tokens/s at
2k and at least 2x at 32k. Nothing here measures anything.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

OP_TARGET_64K, OP_BREAK_EVEN_BY = 6.0, 8192
TRAIN_TARGETS = {2048: 0.8, 32768: 2.0}


def _ms(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def _speedup(row: dict | None) -> str:
    return "-" if row is None else f"{row['speedup_vs_sdpa']:.2f}x"


def _verdict(met: bool) -> str:
    return "met" if met else "MISSED"


def environment_line(env: dict) -> str:
    where = env.get("gpu") or f"CPU ({env.get('cpu')}, {env.get('cpu_count')} cores)"
    commit = str(env.get("commit", "unknown"))
    code = f"commit {commit.removesuffix('-dirty')[:12]}"
    if commit.endswith("-dirty"):  # the code measured was not that commit's: say so, with the files if recorded
        changed = env.get("changed_files") or []
        code += f" with changes to {', '.join(changed)}" if changed else " with uncommitted changes"
    return (f"Measured on {where}; torch {env.get('torch')}, Triton {env.get('triton')}, CUDA {env.get('cuda')}, "
            f"{code}, {env.get('time', '')[:10]}.")


def attention_tables(report: dict) -> list[str]:
    """NSA against SDPA per length: forward + backward times, speedups, peak memory; the op targets."""
    config = report.get("config", {})
    heads = f"{config.get('heads')} / {config.get('kv_heads')} heads, D = {config.get('head_dim')}"
    results = [r for r in report["results"] if "ms" in r]
    by = {(r["seq_len"], r["backend"], r["mode"]): r for r in results}
    speed = {(s["seq_len"], s["backend"], s["mode"]): s for s in report.get("speedups", [])}
    backends = sorted({r["backend"] for r in results if r["backend"].startswith("nsa-")})
    lines = [f"NSA op vs SDPA ({heads}, {config.get('dtype', 'bf16')}):", "",
             "| tokens | op | fwd ms | fwd+bwd ms | SDPA fwd+bwd ms | speedup fwd | speedup fwd+bwd | peak GiB |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for T in sorted({r["seq_len"] for r in report["results"]}):
        sdpa = by.get((T, "sdpa", "fwd+bwd"))
        for backend in backends:
            both = by.get((T, backend, "fwd+bwd"))
            if both is None:
                continue
            fwd = by.get((T, backend, "fwd"))
            base = "-" if sdpa is None else f"{_ms(sdpa['ms'])} ({sdpa.get('kernel')})"
            lines.append(f"| {T} | {backend} | {_ms(fwd and fwd['ms'])} | {_ms(both['ms'])} | {base} | "
                         f"{_speedup(speed.get((T, backend, 'fwd')))} | {_speedup(speed.get((T, backend, 'fwd+bwd')))} "
                         f"| {both['peak_gib']:.2f} |")
        for r in report["results"]:
            if r["seq_len"] == T and "error" in r:
                lines.append(f"| {T} | {r['backend']} | {r['error']} | | | | | |")
    lines += [""] + op_targets(report.get("speedups", []))
    return lines


def op_targets(speedups: list[dict]) -> list[str]:
    """The op's targets on the unpacked NSA rows' forward + backward speedups."""
    rows = {s["seq_len"]: s["speedup_vs_sdpa"] for s in speedups
            if s["mode"] == "fwd+bwd" and not s["backend"].endswith("-packed")}
    lines = []
    if 65536 in rows:
        lines.append(f"- target: forward + backward >= {OP_TARGET_64K:.0f}x SDPA at 65536 tokens: "
                     f"{rows[65536]:.2f}x, {_verdict(rows[65536] >= OP_TARGET_64K)}")
    short = [T for T in rows if T <= OP_BREAK_EVEN_BY]
    if short:
        even = min((T for T in sorted(rows) if rows[T] >= 1.0 and all(rows[u] >= 1.0 for u in rows if u >= T)),
                   default=None)
        lines.append(f"- target: break-even at {OP_BREAK_EVEN_BY} tokens or below: "
                     + ("never reached" if even is None else f"from {even} tokens on")
                     + f", {_verdict(even is not None and even <= OP_BREAK_EVEN_BY)}")
    return lines


def stage_tables(report: dict) -> list[str]:
    lines = ["NSA op stages (ms; share of the op's forward / backward):", "",
             "| tokens | stage | fwd ms | bwd ms | share fwd | share bwd |", "| --- | --- | --- | --- | --- | --- |"]
    for r in report["results"]:
        share_bwd = f"{r['share_of_bwd']:.0%}" if "share_of_bwd" in r else "-"
        lines.append(f"| {r['seq_len']} | {r['stage']} | {_ms(r['fwd_ms'])} | {_ms(r.get('bwd_ms'))} | "
                     f"{r['share_of_fwd']:.0%} | {share_bwd} |")
    layouts = report.get("selected_layouts", [])
    if layouts:
        lines += ["", "Selected branch, both layouts (tile_configs.selected_layout):", "",
                  "| tokens | layout | fwd ms | bwd ms | lists ms (one build: block in fwd and bwd, query in bwd) | "
                  "extra GiB fwd / bwd |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for r in layouts:
            extra = (f"{r['fwd_extra_gib']:.2f} / {r['bwd_extra_gib']:.2f}" if "fwd_extra_gib" in r else "-")
            lines.append(f"| {r['seq_len']} | {r['layout']}-major | {_ms(r['fwd_ms'])} | {_ms(r['bwd_ms'])} | "
                         f"{_ms(r.get('lists_ms'))} | {extra} |")
    host = report.get("host_overhead", [])
    if host:
        lines += ["", "The whole op, forward + backward, against the host's time to issue it:", "",
                  "| tokens | op ms | host issue ms | share | kernels |", "| --- | --- | --- | --- | --- |"]
        for r in host:
            lines.append(f"| {r['seq_len']} | {_ms(r['total_ms'])} | {_ms(r['issue_ms'])} | {r['issue_share']:.0%} | "
                         f"{r.get('kernels', '-')} |")
    return lines


def _model(recipe: str) -> str:
    return os.path.splitext(os.path.basename(recipe))[0]


def train_tables(report: dict) -> list[str]:
    results = report["results"]
    lines = ["Training throughput (median tokens/s after warmup):", "",
             "| recipe | tokens | rows (micro-batch x accumulation) | tokens/s | peak GiB | overrides |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in results:
        if "error" in r:
            lines.append(f"| {_model(r['recipe'])} | {r['seq_len']} | {r.get('local_batch_size')} | {r['error'][:60]} "
                         f"| | |")
            continue
        peak = "-" if r.get("peak_memory_gib") is None else f"{r['peak_memory_gib']:.2f}"
        rate = "-" if r.get("tokens_per_second") is None else f"{r['tokens_per_second']:,.0f}"
        accumulation = r.get("gradient_accumulation", 1)
        batch = f"{r['local_batch_size']} x {accumulation}" if accumulation > 1 else f"{r['local_batch_size']}"
        if r.get("out_of_memory_micro_batches"):
            batch += f" ({', '.join(map(str, r['out_of_memory_micro_batches']))}: out of memory)"
        lines.append(f"| {_model(r['recipe'])} | {r['seq_len']} | {batch} | {rate} | {peak} | "
                     f"{' '.join(o for o in r.get('overrides', []) if 'activation_checkpoint' not in o) or '-'} |")
    plain = {(_model(r["recipe"]), r["seq_len"]): r.get("tokens_per_second") for r in results
             if "error" not in r and not [o for o in r.get("overrides", []) if "activation_checkpoint" not in o]}
    lines.append("")
    for T, target in TRAIN_TARGETS.items():
        nsa, dense = plain.get(("nsa_125m", T)), plain.get(("dense_125m", T))
        if nsa and dense:
            lines.append(f"- target: nsa_125m >= {target}x dense_125m at {T} tokens: {nsa / dense:.2f}x, "
                         f"{_verdict(nsa / dense >= target)}")
    return lines


def loss_tables(report: dict) -> list[str]:
    lines = ["Training loss, forward + backward on bf16 logits (peak memory above the logits):", "",
             "| way | tokens | vocab | logits GiB | peak GiB above | seconds |", "| --- | --- | --- | --- | --- | --- |"]
    for r in report["results"]:
        lines.append(f"| {r['way']} | {r['tokens']} | {r['vocab_size']} | {r['logits_gib']:.2f} | "
                     f"{r['peak_above_logits_gib']:.2f} | {r['seconds']:.3f} |")
    return lines


TABLES = {"attention": attention_tables, "attention_stages": stage_tables, "train_throughput": train_tables,
          "loss_memory": loss_tables}


def render(report: dict) -> str:
    kind = report.get("benchmark")
    if kind not in TABLES:
        what = "no benchmark report (it names no 'benchmark')" if kind is None else f"a {kind!r} report"
        raise ValueError(f"{what}; this tool makes tables of {', '.join(TABLES)} reports (read the others' JSON "
                         f"as it is)")
    return "\n".join([environment_line(report.get("environment", {})), "", *TABLES[kind](report)])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("files", nargs="+", help="JSON files written by the benchmarks")
    args = p.parse_args(argv)
    failed = 0
    for path in args.files:
        try:
            with open(path, encoding="utf-8") as fh:
                text = render(json.load(fh))
        except (OSError, ValueError, KeyError) as exc:  # one unreadable file: say so, go on
            print(f"error: {path}: {type(exc).__name__}: {exc}", file=sys.stderr)
            failed += 1
            continue
        print(f"## {os.path.basename(path)}\n\n{text}\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
