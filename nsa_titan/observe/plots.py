"""Pictures of what a trained NSA model does on a text, as PNGs with a JSON legend beside them.

selection_layer{N}.png  rows = query positions (top = first token), columns = selection blocks
                        (left = block 0). A cell's blue is how many key/value groups (each
                        serving n_heads / n_kv_heads query heads) selected that block for that
                        query: white none, darkest all. Grey cells lie in the future (causally
                        invisible). Digits: block indices below, query positions at the left.
gates.png               per layer a group of three bars, the mean gate of cmp, sel and win over
                        all positions and heads (0..1, grid lines every 0.25); layer numbers below.
plots.json              the legend: colours, geometry and the plotted numbers.

The model part's attention_maps hook says what each layer chose; this module only draws.
"""

from __future__ import annotations

import json
import os

import torch
from torch import nn

from components.errors import UserError
from components.model_hooks import AttentionMap
from components.models.nsa_attention import BRANCHES
from nsa_titan import registry
from nsa_titan.observe.png import GLYPH_HEIGHT, Canvas

WHITE, BLACK = (255, 255, 255), (0, 0, 0)
FUTURE = (224, 224, 224)
DARKEST = (8, 48, 107)  # all groups selected the block
GRID = (210, 210, 210)
BRANCH_COLORS = {"cmp": (230, 126, 34), "sel": (41, 98, 255), "win": (39, 174, 96)}
MARGIN_LEFT, MARGIN_TOP, MARGIN_BOTTOM = 24, 4, 12
BAR_WIDTH, BAR_GAP, GROUP_GAP, CHART_HEIGHT = 8, 1, 10, 200


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


def selection_image(counts: torch.Tensor, num_groups: int, block_tokens: int) -> tuple[Canvas, dict]:
    """The selection pattern picture of counts [T, num_blocks] (blocks of block_tokens tokens);
    returns (canvas, geometry for the legend)."""
    T, nb = counts.shape
    cell_w, cell_h = _cell_size(nb, 640, 24), _cell_size(T, 1024, 8)
    canvas = Canvas(MARGIN_LEFT + nb * cell_w + 2, MARGIN_TOP + T * cell_h + MARGIN_BOTTOM)
    colors = [shade(k / num_groups) for k in range(num_groups + 1)]
    rows = counts.tolist()
    for t in range(T):
        y = MARGIN_TOP + t * cell_h
        current = t // block_tokens
        for j in range(nb):
            color = FUTURE if j > current else colors[min(rows[t][j], num_groups)]
            x = MARGIN_LEFT + j * cell_w
            canvas.fill_rect(x, y, x + cell_w, y + cell_h, color)
    label_every = -(-16 // cell_w)  # block labels at least 16 px apart
    for j in range(0, nb, label_every):
        canvas.text(MARGIN_LEFT + j * cell_w, MARGIN_TOP + T * cell_h + 3, str(j))
    rows_every = block_tokens * max(1, -(-12 // (block_tokens * cell_h)))
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


def render_plots(maps: dict[int, AttentionMap], num_tokens: int, layer: int, out_dir: str) -> dict[str, str]:
    """Write selection_layer{layer}.png, gates.png and plots.json from one text's attention maps (batch of
    one); returns their paths."""
    if not maps:
        raise UserError("the model has no NSA layers (attention = 'dense'), so there is no selection or gate to "
                        "plot. Fix: plot a model trained with attention = 'nsa'.")
    if layer not in maps:
        raise UserError(f"--layer {layer} is not an NSA layer of this model; its NSA layers are "
                        f"{', '.join(map(str, maps))}. Fix: pass one of them.")
    chosen = maps[layer]
    num_blocks = -(-num_tokens // chosen.block_tokens)
    counts = selection_counts(chosen.selected[0], num_blocks)
    sel_canvas, sel_geometry = selection_image(counts, chosen.groups, chosen.block_tokens)
    layer_ids = sorted(maps)
    gate_means = torch.stack([maps[i].gates.float().mean(dim=(0, 1, 2)) for i in layer_ids]).cpu()
    gate_canvas, gate_geometry = gate_chart(gate_means, layer_ids)

    os.makedirs(out_dir, exist_ok=True)
    paths = {"selection": sel_canvas.save(os.path.join(out_dir, f"selection_layer{layer}.png")),
             "gates": gate_canvas.save(os.path.join(out_dir, "gates.png"))}
    legend = {
        "tokens": num_tokens,
        "selection": {"file": os.path.basename(paths["selection"]), "layer": layer, **chosen.legend,
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


def plot_model(model: nn.Module, model_section, tokenizer, text: str, layer: int,
               out_dir: str) -> tuple[dict[str, str], str]:
    """Tokenize text (cut to the model's max_seq_len) and render_plots on the CPU; returns (paths, note).
    model_section is the recipe's [model] (its name picks the part, whose attention_maps hook is used)."""
    hook = registry.get("model", model_section.name).attention_maps
    if hook is None:
        raise UserError(f"model {model_section.name!r} registers no attention_maps hook, so there is nothing to "
                        "plot. Fix: plot a model whose part provides one (the built-in transformer does).")
    ids = tokenizer.encode(text)
    if not ids:
        raise UserError("the text to plot is empty. Fix: pass some text with --text or --text-file.")
    limit = getattr(model_section.args, "max_seq_len", None) or len(ids)
    note = f"{len(ids)} tokens"
    if len(ids) > limit:
        note = f"the text's first {limit} of {len(ids)} tokens (the model's max_seq_len)"
        ids = ids[:limit]
    tokens = torch.tensor([ids], dtype=torch.long)
    return render_plots(hook(model, tokens), tokens.shape[1], layer, out_dir), note


def plot_exported(path: str, text: str, layer: int, out_dir: str) -> tuple[dict[str, str], str]:
    """plot_model on an exported model file."""
    from nsa_titan import assemble
    from nsa_titan.config.resolve import resolve_text
    from nsa_titan.export import load_exported

    model, meta = load_exported(path)
    recipe = resolve_text(meta["recipe_toml"]).recipe
    return plot_model(model, recipe.model, assemble.build_tokenizer(recipe), text, layer, out_dir)
