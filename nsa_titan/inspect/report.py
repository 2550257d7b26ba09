"""The inspection as text: what compiled where, what broke, what recompiled and why, and a verdict."""

from __future__ import annotations

import os

from nsa_titan.inspect.findings import SourceLine
from nsa_titan.inspect.run import InspectResult


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _at(where: SourceLine | None) -> str:
    if where is None:
        return "(no user source line)"
    text = where.text
    return f"{where}" + (f" `{text}`" if text else "")


def _where(failure) -> str:
    return f" at {_at(failure.where)}" if failure.where else ""


def _blocks(blocks) -> str:
    blocks = sorted(b for b in blocks if b is not None)
    return "block " + ", ".join(map(str, blocks)) if len(blocks) == 1 else "blocks " + ", ".join(map(str, blocks))


def _runs(counter, limit: int | None) -> str:
    return _first([f"{g} ({n}x)" for g, n in counter], limit)


VERDICT_PROBLEMS = 3  # the verdict names the first ones, and how many more


def _entries(groups: list[list[str]], limit: int | None, what: str, report_path: str) -> list[str]:
    """The lines of each entry (an entry and its hint lines), the first `limit` of them and a line saying how many
    more `report_path` holds."""
    shown = groups if limit is None else groups[:limit]
    lines = [line for group in shown for line in group]
    if len(shown) < len(groups):
        lines.append(f"  ... and {len(groups) - len(shown)} more {what}: all in {report_path}")
    return lines


def _first(items: list, limit: int | None) -> str:
    """The items, comma-separated; with `limit`, the first ones and how many more."""
    if limit is None or len(items) <= limit:
        return ", ".join(map(str, items))
    return ", ".join(map(str, items[:limit])) + f" and {len(items) - limit} more"


def problems(result: InspectResult) -> list[str]:
    """What makes the compile not one clean graph per block: each one line."""
    out = [f"graph break at {_at(b.where)}: {b.reason}" for b in result.breaks]
    out += [f"frame compile failed ({f.kind}){_where(f)}: {f.message[:300]}" for f in result.failures]
    eager = result.eager_blocks()
    if eager:
        out.append(f"{_blocks(eager)} ran eagerly: no compiled graph ran in them")
    return out


def verdict(result: InspectResult, report_path: str | None = None) -> str:
    """One line: the counts and the first problems (the others: listed above, all in `report_path`)."""
    crashed = result.crashed
    if crashed:
        return f"verdict: compilation FAILED at seq_len {crashed.seq_len}: {crashed.error[:500]}"
    counts = f"{_plural(len(result.graphs), 'graph')}, {_plural(len(result.recompiles), 'recompile')}"
    found = problems(result)
    if not found:
        return f"verdict: 0 graph breaks, {counts}"
    more = len(found) - VERDICT_PROBLEMS
    return (f"verdict: {_plural(len(found), 'problem')} ({counts}): " + "; ".join(found[:VERDICT_PROBLEMS])
            + (f"; and {more} more" + (f", all in {report_path}" if report_path else "") if more > 0 else ""))


def _dynamic_lines(result: InspectResult, limit: int | None, report_path: str) -> list[str]:
    symbolic = [g for g in result.graphs if g.symbolic_inputs]
    if not result.symbols:
        return ["dynamic shapes: not used (every graph has static sizes; torch.compile's default "
                "dynamic=None makes a size symbolic only after it changes)"]
    # One entry per symbol and source: each block's graphs (and a recompile) create the same ones again.
    created = dict.fromkeys(result.symbols)
    lines = ["dynamic shapes: sizes and values compiled as symbols (marked dynamic by the model, or by Dynamo "
             "once they changed): " + _first([f"{source} ({symbol}, first value {value})"
                                               for symbol, source, value in created], limit)]
    lines += _entries([[f"  specialized back to {spec.value}: {' '.join(spec.sources) or spec.symbol} "
                        f"by {_at(spec.where)} ({spec.reason}); each new value of it compiles again"]
                       for spec in result.specializations], limit, "specializations", report_path)
    if symbolic:
        lines.append("  graphs with symbolic inputs: " + _first(
            [f"graph {g.index} ({', '.join(g.symbolic_inputs)})" for g in symbolic], limit))
    elif result.specializations:
        lines.append("  no compiled graph kept a symbolic size")
    return lines


def render(result: InspectResult, recipe_label: str, limit: int | None = None) -> str:
    """The report; with `limit`, each list's first `limit` entries and where report.txt holds the rest."""
    report_path = os.path.join(result.folder, "report.txt")
    lines = [
        f"inspect {recipe_label} (recipe {result.recipe_hash}): model {result.model}, {result.num_blocks} blocks, "
        f"attention {result.attention}",
        f"compile: backend {result.backend}"
        + (f" in mode {result.mode}" if result.backend == "inductor" else "")
        + " per block, as `compile_blocks` does in training "
        f"(recipe: compile.enable = {str(result.compile_enabled_in_recipe).lower()}, "
        f"fullgraph = {str(result.fullgraph_in_recipe).lower()}); activation checkpointing "
        f"{result.activation_checkpoint}; {result.device}, {result.dtype}",
        "  inspected with fullgraph = false so that every break is listed"
        + ("; with fullgraph = true training stops at the first one Dynamo cannot capture whole (it may capture "
           "some, such as a tensor read into Python, in one graph)" if result.fullgraph_in_recipe else ""),
        "steps (forward + backward):",
    ]
    for n, step in enumerate(result.steps, 1):
        status = (f"FAILED: {step.error}" if step.error else
                  f"{step.seconds:.2f} s, {_plural(step.new_graphs, 'new graph')}")
        lines.append(f"  {n}. seq_len {step.seq_len}, {step.data}: {status}")

    lines.append("blocks:")
    if not result.blocks_attributed:
        lines.append("  (this torch keeps no per-module compiled call; graphs are not attributed to blocks)")
    else:
        for block in range(result.num_blocks):
            compiled = [g.index for g in result.graphs if g.block == block]
            ran = [(g.index, g.runs_by_block[block]) for g in result.graphs if g.runs_by_block.get(block)]
            lines.append(f"  block {block}: compiled "
                         + (f"graph {_first(compiled, limit)}" if compiled else "nothing")
                         + "; ran " + (f"graph {_runs(ran, limit)}" if ran else
                                       "nothing before the failure" if result.crashed else "no compiled graph (eager)"))

    lines.append(f"graphs ({len(result.graphs)}):")
    graphs = []
    for g in result.graphs:
        end = "a graph break" if g.ends_with_break else (g.end_reason or "?")
        shapes = "symbolic inputs " + ", ".join(g.symbolic_inputs) if g.symbolic_inputs else "static shapes"
        graphs.append([f"  graph {g.index} [compile {g.compile_id}, block {g.block}]: {g.op_count} ops, {shapes}, "
                       f"ends at {end}"])
    lines += _entries(graphs, limit, "graphs", report_path)

    lines.append(f"graph breaks: {len(result.breaks) or 'none'}")
    lines += _entries([[f"  {_at(b.where)} in {_blocks(b.blocks) if b.blocks else 'an unknown block'}: {b.reason}",
                        *(f"    hint: {hint}" for hint in b.hints)] for b in result.breaks],
                      limit, "graph breaks", report_path)
    if result.failures:
        lines.append(f"failed frame compiles: {len(result.failures)}")
    lines += _entries([[f"  frame compile {f.compile_id} failed ({f.kind}){_where(f)}: {f.message[:500]}"]
                       for f in result.failures], limit, "failed frame compiles", report_path)
    eager = result.eager_blocks()
    if eager:
        lines.append(f"eager blocks: {_blocks(eager)}: compile was applied but no compiled graph ran")
        if result.activation_checkpoint != "none":
            lines.append("    activation checkpointing wraps each block's forward in torch.utils.checkpoint, which "
                         "disables Dynamo inside it; Module._call_impl, the compiled entry, is itself skipped by "
                         "Dynamo, so no frame is left to trace")

    lines.append(f"recompiles: {len(result.recompiles) or 'none'}")
    recompiled = []
    for r in result.recompiles:
        step = f", step {r.step + 1}" if r.step is not None else ""
        recompiled.append([f"  compile {r.compile_id} (block {r.block}{step}); failed guard: {r.guards[0]}",
                           *(f"    also: {guard}" for guard in r.guards[1:3])])
    lines += _entries(recompiled, limit, "recompiles", report_path)
    lines += _dynamic_lines(result, limit, report_path)

    lines.append("custom ops in the graphs: " + (", ".join(result.custom_ops) or "none"))
    if result.higher_order_ops:
        lines.append("higher-order ops: " + ", ".join(result.higher_order_ops))
    if result.backend != "inductor":
        lines.append(f"inductor fallbacks: not applicable (backend {result.backend} runs every op eagerly)")
    else:
        fallbacks = ", ".join(f"{op} ({n})" for op, n in sorted(result.eager_kernels.items())) or "none"
        extern = ", ".join(f"{op} ({n})" for op, n in sorted(result.extern_kernels.items())) or "none"
        lines.append(f"inductor fallbacks (eager kernels called from the generated code): {fallbacks}")
        lines.append(f"inductor library calls (extern kernels): {extern}")

    ct = result.compile_time
    timing = f"compile time: {_plural(ct.frames, 'frame compile')}, {ct.dynamo_s:.2f} s in Dynamo " \
             f"(backend {ct.backend_s:.2f} s of it)"
    # Inductor also compiles the backward, after Dynamo's frames: its time is not a part of theirs.
    timing += f"; Inductor {ct.inductor_s:.2f} s, forward and backward" if result.backend == "inductor" else ""
    ok_steps = [s for s in result.steps if not s.error]
    if len(ok_steps) >= 2:
        timing += f"; first step {ok_steps[0].seconds:.2f} s vs repeat {ok_steps[-1].seconds:.3f} s (caches off: cold)"
    lines.append(timing)

    graphs_dir = os.path.join(result.folder, "graphs")
    kinds = ", ".join(f"{len(paths)} {kind}" for kind, paths in sorted(result.files.items())) or "none"
    lines.append(f"files: {graphs_dir} ({kinds})")
    if result.trace_files:
        lines.append(f"trace: {', '.join(result.trace_files)} (TORCH_TRACE format: `tlparse {result.trace_files[0]}`)")
    else:
        lines.append(f"trace: not written ({result.trace_error or 'no compile events'})")
    lines.append(verdict(result, report_path))
    return "\n".join(lines) + "\n"
