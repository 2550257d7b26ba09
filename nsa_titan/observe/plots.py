"""Pictures of what a trained NSA model does on a text, as PNGs with a JSON legend beside them.

selection_layer{N}.png  rows = query positions (top = first token), columns = selection blocks
                        (left = block 0). A cell's blue is how many key/value groups (each
                        serving n_heads / n_kv_heads query heads) selected that block for that
                        query: white none, darkest all. Grey cells lie in the future (causally
                        invisible). Digits: block indices below, query positions at the left.
gates.png               per layer a group of three bars, the mean gate of cmp, sel and win over
                        all positions and heads (0..1, grid lines every 0.25); layer numbers below.
plots.json              the legend: colours, geometry and the plotted numbers.
"""

from __future__ import annotations

import json
import os

import torch
from torch import nn

from components.errors import UserError
from components.models.nsa_attention import BRANCHES, NSAAttention
from nsa_titan.observe.png import GLYPH_HEIGHT, Canvas

WHITE, BLACK = (255, 255, 255), (0, 0, 0)
FUTURE = (224, 224, 224)
DARKEST = (8, 48, 107)  # all groups selected the block
GRID = (210, 210, 210)
BRANCH_COLORS = {"cmp": (230, 126, 34), "sel": (41, 98, 255), "win": (39, 174, 96)}
MARGIN_LEFT, MARGIN_TOP, MARGIN_BOTTOM = 24, 4, 12
BAR_WIDTH, BAR_GAP, GROUP_GAP, CHART_HEIGHT = 8, 1, 10, 200


@torch.no_grad()
def nsa_layer_views(model: nn.Module, tokens: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """layer index -> (gates [B, T, H, 3], selected blocks [B, T, Hkv, n], -1 unused) for each NSA layer,
    from one forward of tokens [B, T] through an unsharded Transformer."""
    views = {}
    cos, sin = model.rope.cos, model.rope.sin
    h = model.tok_embeddings(tokens)
    for i, block in enumerate(model.layers):
        if isinstance(block.attention, NSAAttention):
            views[i] = block.attention.gates_and_selection(block.attention_norm(h), cos, sin)
        h = block.forward(h, cos, sin)
    return views


def selection_counts(selected: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """selected [T, Hkv, n] (-1 unused) -> [T, num_blocks] int: how many groups selected each block."""
    T, groups, _ = selected.shape
    chosen = torch.zeros(T, groups, num_blocks + 1, dtype=torch.int64)
    slots = torch.where(selected >= 0, selected, torch.full_like(selected, num_blocks)).cpu()
    chosen.scatter_(2, slots, 1)  # a group counts once per block; unused slots land in the extra column
    return chosen[:, :, :num_blocks].sum(dim=1)


def shade(fraction: float) -> tuple[int, int, int]:
    """White at 0, DARKEST at 1, linear in between."""
    return tuple(round(w + (d - w) * fraction) for w, d in zip(WHITE, DARKEST))  # type: ignore[return-value]


def _cell_size(count: int, budget: int, largest: int) -> int:
    return max(1, min(largest, budget // max(count, 1)))


def selection_image(counts: torch.Tensor, num_groups: int, sel_block_size: int) -> tuple[Canvas, dict]:
    """The selection pattern picture of counts [T, num_blocks]; returns (canvas, geometry for the legend)."""
    T, nb = counts.shape
    cell_w, cell_h = _cell_size(nb, 640, 24), _cell_size(T, 1024, 8)
    canvas = Canvas(MARGIN_LEFT + nb * cell_w + 2, MARGIN_TOP + T * cell_h + MARGIN_BOTTOM)
    colors = [shade(k / num_groups) for k in range(num_groups + 1)]
    rows = counts.tolist()
    for t in range(T):
        y = MARGIN_TOP + t * cell_h
        current = t // sel_block_size
        for j in range(nb):
            color = FUTURE if j > current else colors[min(rows[t][j], num_groups)]
            x = MARGIN_LEFT + j * cell_w
            canvas.fill_rect(x, y, x + cell_w, y + cell_h, color)
    label_every = -(-16 // cell_w)  # block labels at least 16 px apart
    for j in range(0, nb, label_every):
        canvas.text(MARGIN_LEFT + j * cell_w, MARGIN_TOP + T * cell_h + 3, str(j))
    rows_every = sel_block_size * max(1, -(-12 // (sel_block_size * cell_h)))
    for t in range(0, T, rows_every):
        canvas.text(1, MARGIN_TOP + t * cell_h, str(t))
    geometry = {"origin_x": MARGIN_LEFT, "origin_y": MARGIN_TOP, "cell_width": cell_w, "cell_height": cell_h,
                "rows": T, "columns": nb}
    return canvas, geometry


def gate_chart(gate_means: torch.Tensor, layer_ids: list[int]) -> tuple[Canvas, dict]:
    """Bars of gate_means [L, 3] (branches cmp, sel, win) per layer; returns (canvas, geometry)."""
    group_w = len(BRANCHES) * (BAR_WIDTH + BAR_GAP)
    width = MARGIN_LEFT + len(layer_ids) * (group_w + GROUP_GAP) + GROUP_GAP
    base = MARGIN_TOP + CHART_HEIGHT  # the y of value 0
    canvas = Canvas(width, base + MARGIN_BOTTOM)
    for quarter in range(5):
        y = base - round(CHART_HEIGHT * quarter / 4)
        canvas.fill_rect(MARGIN_LEFT, y, width, y + 1, GRID if quarter else BLACK)
    for label, fraction in (("0", 0.0), ("0.5", 0.5), ("1", 1.0)):
        y = base - round(CHART_HEIGHT * fraction)
        canvas.text(1, min(max(y - GLYPH_HEIGHT // 2, 0), base - GLYPH_HEIGHT), label)
    values = gate_means.tolist()
    for g, layer in enumerate(layer_ids):
        x0 = MARGIN_LEFT + GROUP_GAP + g * (group_w + GROUP_GAP)
        for b, branch in enumerate(BRANCHES):
            x = x0 + b * (BAR_WIDTH + BAR_GAP)
            canvas.fill_rect(x, base - round(CHART_HEIGHT * values[g][b]), x + BAR_WIDTH, base, BRANCH_COLORS[branch])
        canvas.text(x0, base + 3, str(layer))
    geometry = {"baseline_y": base, "height_of_1": CHART_HEIGHT, "first_bar_x": MARGIN_LEFT + GROUP_GAP,
                "bar_width": BAR_WIDTH, "bar_gap": BAR_GAP, "group_gap": GROUP_GAP}
    return canvas, geometry


def render_plots(model: nn.Module, tokens: torch.Tensor, layer: int, out_dir: str) -> dict[str, str]:
    """Write selection_layer{layer}.png, gates.png and plots.json for tokens [1, T]; returns their paths."""
    views = nsa_layer_views(model, tokens)
    if not views:
        raise UserError("the model has no NSA layers (attention = 'dense'), so there is no selection or gate to "
                        "plot. Fix: plot a model trained with attention = 'nsa'.")
    if layer not in views:
        raise UserError(f"--layer {layer} is not an NSA layer of this model; its NSA layers are "
                        f"{', '.join(map(str, views))}. Fix: pass one of them.")
    attention = model.layers[layer].attention
    sel_block_size = attention.selection["sel_block_size"]
    T = tokens.shape[1]
    num_blocks = -(-T // sel_block_size)
    counts = selection_counts(views[layer][1][0], num_blocks)
    sel_canvas, sel_geometry = selection_image(counts, attention.n_kv_heads, sel_block_size)
    layer_ids = sorted(views)
    gate_means = torch.stack([views[i][0].float().mean(dim=(0, 1, 2)) for i in layer_ids]).cpu()
    gate_canvas, gate_geometry = gate_chart(gate_means, layer_ids)

    os.makedirs(out_dir, exist_ok=True)
    paths = {"selection": sel_canvas.save(os.path.join(out_dir, f"selection_layer{layer}.png")),
             "gates": gate_canvas.save(os.path.join(out_dir, "gates.png"))}
    legend = {
        "tokens": T,
        "selection": {"file": os.path.basename(paths["selection"]), "layer": layer, "sel_block_size": sel_block_size,
                      "num_selected": attention.selection["num_selected"], "groups": attention.n_kv_heads,
                      "query_heads_per_group": attention.n_heads // attention.n_kv_heads,
                      "rows": "query position", "columns": "selection block",
                      "white": "selected by no group", "darkest": list(DARKEST), "future": list(FUTURE),
                      "shade": "linear from white to darkest in the number of groups that selected the block",
                      **sel_geometry},
        "gates": {"file": os.path.basename(paths["gates"]), "branch_colors": {b: list(c) for b, c in
                                                                            BRANCH_COLORS.items()},
                  "layers": layer_ids,
                  "mean_gate": {b: [round(v, 6) for v in gate_means[:, i].tolist()] for i, b in enumerate(BRANCHES)},
                  **gate_geometry},
    }
    legend_path = os.path.join(out_dir, "plots.json")
    with open(legend_path, "w", encoding="utf-8") as fh:
        json.dump(legend, fh, indent=2)
        fh.write("\n")
    paths["legend"] = legend_path
    return paths


def plot_model(model: nn.Module, tokenizer, text: str, layer: int, out_dir: str) -> tuple[dict[str, str], str]:
    """Tokenize text (cut to max_seq_len) and render_plots on the CPU; returns (paths, note)."""
    for block in model.layers:
        if isinstance(block.attention, NSAAttention):
            block.attention.backend = "reference"  # same results; the model is on the CPU here
    ids = tokenizer.encode(text)
    if not ids:
        raise UserError("the text to plot is empty. Fix: pass some text with --text or --text-file.")
    limit = model.args.max_seq_len
    note = f"{len(ids)} tokens"
    if len(ids) > limit:
        note = f"the text's first {limit} of {len(ids)} tokens (the model's max_seq_len)"
        ids = ids[:limit]
    return render_plots(model, torch.tensor([ids], dtype=torch.long), layer, out_dir), note


def plot_exported(path: str, text: str, layer: int, out_dir: str) -> tuple[dict[str, str], str]:
    """plot_model on an exported model file."""
    from nsa_titan import assemble
    from nsa_titan.config.resolve import resolve_text
    from nsa_titan.export import load_exported

    model, meta = load_exported(path)
    tokenizer = assemble.build_tokenizer(resolve_text(meta["recipe_toml"]).recipe)
    return plot_model(model, tokenizer, text, layer, out_dir)
