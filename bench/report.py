"""Markdown tables (for the README) from benchmark JSON files, with the speed targets checked.

    python -m bench.report bench/results/attention-*.json bench/results/train_throughput-*.json ...

Reads what every benchmark writes (bench.attention, attention_stages, selected_flex, tile_variants, tile_choice,
train_throughput, loss_memory, context_parallel, data_resume, data_throughput, decode, reference_vs_sdpa_cpu and kernel_resources
--json) and prints, per file, where it was measured (GPU, versions, commit; a GPU benchmark run on the CPU, or with
Triton interpreted, is marked as a smoke run) and one table of its numbers. Targets (checked where the file has the
lengths): the NSA op's forward + backward at least 6x SDPA's speed at 64k tokens and at least SDPA's speed at 8k or
below; nsa_125m at least 0.8x dense_125m's tokens/s at 2k and at least 2x at 32k. Nothing here measures anything.
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


def _tflops(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def _speedup(row: dict | None) -> str:
    return "-" if row is None else f"{row['speedup_vs_sdpa']:.2f}x"


def _verdict(met: bool) -> str:
    return "met" if met else "MISSED"


# Benchmarks that measure the CPU, or compile without a GPU: a result from a machine without one is what they are for
# (loss_memory measures either: the process's peak resident set on the CPU; tile_choice measures nothing, it reads
# tile_variants' files).
CPU_BENCHMARKS = ("data_resume", "data_throughput", "decode", "nsa_reference_vs_sdpa_cpu", "kernel_resources",
                  "loss_memory", "tile_choice")


def environment_line(env: dict, kind: str | None = None) -> str:
    where = env.get("gpu") or f"CPU ({env.get('cpu')}, {env.get('cpu_count')} cores)"
    if not env.get("gpu") and kind not in CPU_BENCHMARKS:
        where += " - a CPU smoke run, not a GPU measurement"
    triton = f"Triton {env.get('triton')}" + (" (interpreted: TRITON_INTERPRET=1)" if env.get("triton_interpret")
                                              else "")
    cuda = f", CUDA {env.get('cuda')}" if env.get("cuda") else ""
    commit = str(env.get("commit", "unknown"))
    code = f"commit {commit.removesuffix('-dirty')[:12]}"
    if commit.endswith("-dirty"):  # the code measured was not that commit's: say so, with the files if recorded
        changed = env.get("changed_files") or []
        code += f" with changes to {', '.join(changed)}" if changed else " with uncommitted changes"
    return f"Measured on {where}; torch {env.get('torch')}, {triton}{cuda}, {code}, {env.get('time', '')[:10]}."


def attention_tables(report: dict) -> list[str]:
    """NSA against SDPA per length: forward + backward times, speedups, peak memory; the op targets."""
    config = report.get("config", {})
    heads = f"{config.get('heads')} / {config.get('kv_heads')} heads, D = {config.get('head_dim')}"
    batch = config.get("batch", 1)
    results = [r for r in report["results"] if "ms" in r]
    by = {(r["seq_len"], r["backend"], r["mode"]): r for r in results}
    speed = {(s["seq_len"], s["backend"], s["mode"]): s for s in report.get("speedups", [])}
    backends = sorted({r["backend"] for r in results if r["backend"].startswith("nsa-")})
    lines = [f"NSA op vs SDPA ({heads}, {config.get('dtype', 'bf16')}{_rows(batch)}){_launch_shapes(config)}:", "",
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
    if batch == 1:
        lines += [""] + op_targets(report.get("speedups", []))
    else:
        lines += ["", "- not checked: the op's targets are set for one row"]
    return lines


def _launch_shapes(config: dict) -> str:
    """', launch shapes from FILE (kernel D shape; ...)' for a run with --tiles; '' for the shipped shapes."""
    shapes = config.get("launch_shapes") or []
    if not shapes:
        return ""
    listed = "; ".join(f"{s['kernel']} D {s['head_block']} {','.join(map(str, s['tiles']))}" for s in shapes)
    return f", launch shapes from {os.path.basename(str(config.get('tiles')))} ({listed})"


def _rows(batch: int) -> str:
    return "" if batch == 1 else f", {batch} rows"


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
    batch = report.get("config", {}).get("batch", 1)
    lines = [f"NSA op stages{_rows(batch)}{_launch_shapes(report.get('config', {}))} (ms; share of the op's forward / "
             f"backward; TFLOP/s of the keys each query sees, the backward counted as 2.5 forwards):", "",
             "| tokens | stage | fwd ms | bwd ms | share fwd | share bwd | fwd TFLOP/s | bwd TFLOP/s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in report["results"]:
        share_bwd = f"{r['share_of_bwd']:.0%}" if "share_of_bwd" in r else "-"
        lines.append(f"| {r['seq_len']} | {r['stage']} | {_ms(r['fwd_ms'])} | {_ms(r.get('bwd_ms'))} | "
                     f"{r['share_of_fwd']:.0%} | {share_bwd} | {_tflops(r.get('fwd_tflops'))} | "
                     f"{_tflops(r.get('bwd_tflops'))} |")
    layouts = report.get("selected_layouts", [])
    if layouts:
        lines += ["", "Selected branch, each layout (tile_configs.selected_layout_for):", "",
                  "| tokens | layout | fwd ms | bwd ms | lists ms (one build: block in fwd and bwd, query in bwd; "
                  "masked: its narrow copy of the selection, in both) | extra GiB fwd / bwd |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for r in layouts:
            extra = (f"{r['fwd_extra_gib']:.2f} / {r['bwd_extra_gib']:.2f}" if "fwd_extra_gib" in r else "-")
            name = r["layout"] if r["layout"] == "masked" else f"{r['layout']}-major"
            lines.append(f"| {r['seq_len']} | {name} | {_ms(r['fwd_ms'])} | {_ms(r['bwd_ms'])} | "
                         f"{_ms(r.get('lists_ms'))} | {extra} |")
    host = report.get("host_overhead", [])
    if host:
        lines += ["", "The whole op, forward + backward, against the host's time to issue it:", "",
                  "| tokens | op ms | host issue ms | share | kernels |", "| --- | --- | --- | --- | --- |"]
        for r in host:
            lines.append(f"| {r['seq_len']} | {_ms(r['total_ms'])} | {_ms(r['issue_ms'])} | {r['issue_share']:.0%} | "
                         f"{r.get('kernels', '-')} |")
        for r in host:
            if r.get("busiest_kernels"):
                lines += ["", f"The busiest kernels of one forward + backward at {r['seq_len']} tokens (GPU time):", "",
                          "| kernel | ms | launches | share |", "| --- | --- | --- | --- |"]
                lines += [f"| {k['name'].replace('|', '/')} | {_ms(k['ms'])} | {k['calls']} | {k['share']:.0%} |"
                          for k in r["busiest_kernels"]]
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
    for r in results:
        if r.get("step_profile"):
            lines += [""] + step_profile_lines(r)
    return lines


STEP_PROFILE_KERNELS = 10
KERNEL_NAME_LIMIT = 100


def _short(name: str) -> str:
    """A templated kernel's name cut for a table (the JSON keeps it whole)."""
    return name if len(name) <= KERNEL_NAME_LIMIT else name[:KERNEL_NAME_LIMIT - 3] + "..."


def step_profile_lines(case: dict) -> list[str]:
    """Where one profiled step of a case spent its GPU time (bench.train_throughput --profile), by kind and kernel."""
    p = case["step_profile"]
    if "error" in p:
        return [f"GPU time of {_model(case['recipe'])} at {case['seq_len']} tokens: {p['error']}"]
    step = f"step {', '.join(map(str, p['steps']))}" if p["steps"] else "a step"
    wall = f" in a {p['step_ms']:.1f} ms step" if p.get("step_ms") else ""
    head = (f"GPU time of {step} of {_model(case['recipe'])} at {case['seq_len']} tokens: {p['gpu_ms']:.1f} ms of "
            f"kernels")
    if not p["gpu_ms"]:
        return [f"{head}{wall} (no GPU kernels recorded: a CPU run)"]
    kinds = ", ".join(f"{kind} {ms:.1f} ms ({ms / p['gpu_ms']:.0%})"
                      for kind, ms in sorted(p["kinds"].items(), key=lambda item: -item[1]) if ms > 0)
    lines = [f"{head}{wall}: {kinds}.", "", "| kernel | kind | ms | calls |", "| --- | --- | --- | --- |"]
    lines += [f"| {_short(k['name']).replace('|', '/')} | {k['kind']} | {k['ms']:.2f} | {k['calls']:g} |"
              for k in p["kernels"][:STEP_PROFILE_KERNELS]]
    return lines


def loss_tables(report: dict) -> list[str]:
    lines = ["Training loss, forward + backward on bf16 logits (peak memory above the logits):", "",
             "| way | tokens | vocab | logits GiB | peak GiB above | seconds |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in report["results"]:
        lines.append(f"| {r['way']} | {r['tokens']} | {r['vocab_size']} | {r['logits_gib']:.2f} | "
                     f"{r['peak_above_logits_gib']:.2f} | {r['seconds']:.3f} |")
    return lines


def selected_flex_tables(report: dict) -> list[str]:
    c = report.get("config", {})
    lines = [f"The selected branch, the op's kernels against FlexAttention over a block mask ({c.get('heads')} / "
             f"{c.get('kv_heads')} heads, D = {c.get('head_dim')}, {c.get('dtype')}; ms forward / forward + backward):",
             "", "| tokens | rows | op | flex | (flex + mask build) / op fwd+bwd | mask build ms | KV blocks a query tile "
             "(selected) | max relative difference o / dq / dk / dv |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in report["results"]:
        ratio = "-" if r["flex_fwd_bwd_ms"] is None else \
            f"{(r['flex_fwd_bwd_ms'] + r['mask_build_ms']) / r['op_fwd_bwd_ms']:.2f}"
        diff = " / ".join(f"{v:.2e}" for v in r["max_relative_difference"].values())
        lines.append(f"| {r['seq_len']} | {r['batch']} | {_ms(r['op_fwd_ms'])} / {_ms(r['op_fwd_bwd_ms'])} | "
                     f"{_ms(r['flex_fwd_ms'])} / {_ms(r['flex_fwd_bwd_ms'])} | {ratio} | {_ms(r['mask_build_ms'])} | "
                     f"{r['kv_blocks_per_q_tile']:.1f} ({r['selected_blocks_as_kv_blocks']:.1f}) | {diff} |")
    return lines


def _s(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def context_parallel_tables(report: dict) -> list[str]:
    overrides = " ".join(report.get("overrides", [])) or "no overrides"
    lines = [f"Context parallelism, {report.get('recipe')} ({overrides}): per cp size, the largest of the ranks' "
             f"peak memory and median step time:", "",
             "| cp | tokens | tokens per rank | max peak GiB | max median step s | memory |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in report.get("memory_and_time", []):
        if "error" in r:
            lines.append(f"| {r['cp']} | {r.get('seq_len')} | {_one_line(r['error'])} | | | |")
            continue
        kinds = sorted({rank.get("memory_kind", "-") for rank in r.get("ranks", [])})
        lines.append(f"| {r['cp']} | {r['seq_len']} | {r['tokens_per_rank']} | {r['max_peak_memory_gib']:.2f} | "
                     f"{_s(r['max_median_step_seconds'])} | {', '.join(kinds) or '-'} |")
    balance = report.get("balance", [])
    if balance:
        lines += ["", "Work balance of the split (the op's forward + backward on each rank's queries; imbalance = "
                  "slowest rank / mean):", "",
                  "| cp | split | tokens | backend | rank seconds | imbalance |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for b in balance:
            lines.append(f"| {b['cp']} | {b['split']} | {b['seq_len']} | {b.get('backend')} | "
                         f"{' / '.join(_s(t) for t in b['rank_seconds'])} | {b['imbalance']:.2f} |")
    return lines


def _one_line(text: str, limit: int = 200) -> str:
    line = " ".join(str(text).split()).replace("|", "/")
    return line if len(line) <= limit else line[:limit - 3] + "..."


def data_resume_tables(report: dict) -> list[str]:
    first = report["seconds_to_first_document"]
    return ["Huggingface-source resume late in an epoch (seconds to the first document after the cursor):", "",
            "| documents | row group | shards | shuffle buffer | resumed after | stream-state cursor s | "
            "count-cursor replay s | reaching the cursor from the start s |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
            f"| {report['documents']} | {report['row_group']} | {report['shards']} | {report['shuffle_buffer']} | "
            f"{report['resumed_after_documents']} | {_s(first['stream_state_cursor'])} | "
            f"{_s(first['count_cursor_replay'])} | {_s(report['seconds_to_reach_cursor_from_start'])} |"]


def data_throughput_tables(report: dict) -> list[str]:
    resume = report["resume"]
    overrides = " ".join(report.get("overrides", [])) or "none"
    return [f"A recipe's data in one reader ({report['recipe']}, overrides: {overrides}):", "",
            "| source | tokenizer | rows x seq_len | logical shards | tokens/s | first batch s | resume after tokens | "
            "resume s | same batch |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
            f"| {report['source']} | {report['tokenizer']} | {report['rows_per_batch']} x {report['seq_len']} | "
            f"{report['logical_shards']} | {report['tokens_per_second']:,} | {_s(report['seconds_to_first_batch'])} | "
            f"{resume['after_tokens']:,} | {_s(resume['seconds_to_first_batch'])} | "
            f"{'yes' if resume['same_batch'] else 'NO'} |"]

def decode_tables(report: dict) -> list[str]:
    overrides = " ".join(report.get("overrides", [])) or "none"
    form = " as its --format hf folder runs it" if report.get("form") == "hf" else ""
    lines = [f"Cached decoding, ms per token ({report['recipe']}{form}, overrides: {overrides}; batch 1, "
             f"{report['threads']} thread(s); median of {report['repeats']} runs of {report['steps']} tokens):", "",
             "| context | CPU time | wall time |", "| --- | --- | --- |"]
    lines += [f"| {r['context']:,} | {r['cpu_ms_per_token']:.2f} | {r['wall_ms_per_token']:.2f} |"
              for r in report["results"]]
    return lines


def reference_tables(report: dict) -> list[str]:
    lines = [f"NSA reference vs dense causal SDPA on the CPU ({report.get('seq_len')} tokens, {report.get('heads')} "
             f"heads, D = {report.get('head_dim')}, {report.get('dtype')}, {report.get('threads')} threads; seconds, "
             f"best of the repeats):", "",
             "| kv heads | NSA fwd | SDPA fwd | ratio | NSA fwd+bwd | SDPA fwd+bwd | ratio | NSA fwd parts |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in report["results"]:
        parts = ", ".join(f"{name} {_s(t)}" for name, t in r.get("nsa_forward_parts_s", {}).items()) or "-"
        lines.append(f"| {r['kv_heads']} | {_s(r['nsa_forward_s'])} | {_s(r['sdpa_forward_s'])} | "
                     f"{r['forward_ratio']:.2f} | {_s(r['nsa_forward_backward_s'])} | "
                     f"{_s(r['sdpa_forward_backward_s'])} | {r['forward_backward_ratio']:.2f} | {parts} |")
    return lines


def kernel_tables(report: dict) -> list[str]:
    lines = ["NSA Triton kernels compiled offline (no kernel ran):", "",
             "| target | dtype | D | kernel | warps | stages | shared KiB | limit KiB | registers | stack B "
             "| tensor cores | async loads |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in report["rows"]:
        over = " (OVER)" if r["shared_bytes"] > r["shared_limit_bytes"] else ""
        lines.append(f"| {r['target']} | {r['dtype']} | {r['head_dim']} | {r['name']} | {r['num_warps']} | "
                     f"{r.get('num_stages', '-')} | {r['shared_bytes'] / 1024:.1f}{over} | "
                     f"{r['shared_limit_bytes'] / 1024:.0f} | "
                     f"{'-' if r.get('registers') is None else r['registers']} | "
                     f"{'-' if r.get('stack_bytes') is None else r['stack_bytes']} | {r.get('tensor_cores', '-')} | "
                     f"{r.get('async_loads', '-')} |")
    lines += [""] + [f"- failed: {_one_line(f)}" for f in report.get("failures", [])]
    return lines


def tile_tables(report: dict) -> list[str]:
    """Each kernel's candidate launch shapes against the shipped one, per length and branch."""
    config = report.get("config", {})
    lines = [f"Launch shapes (rows, keys, warps, stages), {config.get('heads')} / {config.get('kv_heads')} heads, "
             f"D = {config.get('head_dim')}{_rows(config.get('batch', 1))}; against the shipped shape:", "",
             "| tokens | kernel | branch | shape | ms | vs shipped | deterministic | result vs shipped | vs fp32 |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    shipped = {(r["seq_len"], r["kernel"], r["branch"]): r.get("ms") for r in report["results"] if r["shipped"]}
    for r in report["results"]:
        shape = ",".join(map(str, r["tiles"])) + (" (shipped)" if r["shipped"] else "")
        if "error" in r:
            lines.append(f"| {r['seq_len']} | {r['kernel']} | {r['branch']} | {shape} | failed: "
                         f"{_one_line(r['error']).replace('|', '/')} | - | - | - | - |")
            continue
        base = shipped.get((r["seq_len"], r["kernel"], r["branch"]))
        ratio = f"{base / r['ms']:.2f}x" if base and r["ms"] else "-"
        close = (f"rel RMS {r['rel_rms']:.1e}" if "rel_rms" in r else
                 f"{r['equal_share']:.1%} equal" if "equal_share" in r else "-")
        exact = f"{r['rel_rms_exact']:.1e}" if "rel_rms_exact" in r else "-"
        lines.append(f"| {r['seq_len']} | {r['kernel']} | {r['branch']} | {shape} | {_ms(r['ms'])} | {ratio} | "
                     f"{'yes' if r['deterministic'] else 'NO'} | {close} | {exact} |")
    errors = sorted({r["exact_error"] for r in report["results"] if "exact_error" in r})
    lines += [f"- no exact (fp32) result: {_one_line(e)}" for e in errors]
    return lines


def _shape(tiles) -> str:
    return ",".join(map(str, tiles)) if tiles else "-"


def tile_choice_tables(report: dict) -> list[str]:
    """The launch shape chosen for each kernel from tile_variants' measurements, and why others were passed over."""
    files = ", ".join(os.path.basename(f) for f in report.get("config", {}).get("files", []))
    lines = [f"Launch shapes chosen from {files} (times summed over the workloads measured):", "",
             "| kernel | head dim | bytes | shipped | ms | chosen | ms | speed-up | verdict |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for k in report["kernels"]:
        speedup = f"{k['speedup']:.2f}x" if k["verdict"] == "changed" else "-"
        lines.append(f"| {k['kernel']} | {k['head_block']} | {k['element_bytes']} | {_shape(k.get('shipped'))} | "
                     f"{_ms(k.get('shipped_ms'))} | {_shape(k.get('chosen'))} | {_ms(k.get('chosen_ms'))} | "
                     f"{speedup} | {k['verdict'].replace('|', '/')} |")
    for k in report["kernels"]:
        lines += [f"- {k['kernel']} (D {k['head_block']}) {_shape(r['tiles'])}: {_one_line(r['why'])}"
                  for r in k["rejected"]]
    return lines


TABLES = {"attention": attention_tables, "attention_stages": stage_tables, "train_throughput": train_tables,
          "loss_memory": loss_tables, "context_parallel": context_parallel_tables, "data_resume": data_resume_tables,
          "data_throughput": data_throughput_tables, "decode": decode_tables,
          "nsa_reference_vs_sdpa_cpu": reference_tables, "kernel_resources": kernel_tables,
          "tile_variants": tile_tables, "tile_choice": tile_choice_tables, "selected_flex": selected_flex_tables}


def report_kind(report) -> str:
    """Which benchmark wrote `report`; ValueError naming what it is otherwise."""
    if not isinstance(report, dict):
        raise ValueError(f"not a benchmark report (a JSON {type(report).__name__}, not an object); this tool reads "
                         f"the files the benchmarks write")
    kind = report.get("benchmark")
    if kind is None and "seconds_to_first_document" in report:
        return "data_resume"  # written before data_resume named itself
    if kind is None and {"rows", "failures"} <= set(report):
        return "kernel_resources"  # written before kernel_resources named itself (rows and failures only)
    if kind not in TABLES:
        what = "no benchmark report (it names no 'benchmark')" if kind is None else f"a {kind!r} report"
        raise ValueError(f"{what}; this tool makes tables of {', '.join(TABLES)} reports (read the others' JSON "
                         f"as it is)")
    return kind


def render(report: dict) -> str:
    kind = report_kind(report)
    env = report.get("environment")
    where = (environment_line(env, kind) if env is not None else
             "The machine, versions and commit were not recorded (a result of an older release).")
    return "\n".join([where, "", *TABLES[kind](report)])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("files", nargs="+", help="JSON files written by the benchmarks")
    args = p.parse_args(argv)
    failed = 0
    for path in args.files:
        try:
            with open(path, encoding="utf-8") as fh:
                text = render(json.load(fh))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:  # one unreadable file: say so, go on
            print(f"error: {path}: {type(exc).__name__}: {exc}", file=sys.stderr)
            failed += 1
            continue
        print(f"## {os.path.basename(path)}\n\n{text}\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
