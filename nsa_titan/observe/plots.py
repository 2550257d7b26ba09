"""Pictures of what a model's sparse attention does on a text, drawn with matplotlib, with a JSON legend.

selection_layer{N}.png  rows = query positions (top = first token), columns = selection blocks
                        (left = block 0). A cell's blue is how many key/value groups (each
                        serving n_heads / n_kv_heads query heads) selected that block for that
                        query: white none, darkest all. Grey cells lie in the future (causally
                        invisible).
gates.png               per layer a group of bars, the mean gate of each of the layer's branches
                        (as the model names them) over all positions and heads (0..1).
plots.json              the legend: colours and the plotted numbers.

The model part's attention_maps hook says what each layer chose; this module only draws.
matplotlib is an optional dependency (the `plots` extra); only drawing needs it.
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch
from torch import nn

from components.errors import UserError
from components.install_hint import install_extra
from components.model_hooks import AttentionMap
from nsa_titan import registry
from nsa_titan.command_options import write_results

WHITE = (255, 255, 255)
FUTURE = (224, 224, 224)
DARKEST = (8, 48, 107)  # all groups selected the block
# The gate bars' colours, one per branch in the order the model lists its branches.
BRANCH_PALETTE = ((230, 126, 34), (41, 98, 255), (39, 174, 96), (142, 68, 173), (192, 57, 43))


def branch_colors(branches: tuple[str, ...]) -> dict[str, tuple[int, int, int]]:
    return {b: BRANCH_PALETTE[i % len(BRANCH_PALETTE)] for i, b in enumerate(branches)}


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend, or a UserError saying how to install it."""
    try:
        import matplotlib
    except ImportError:
        raise UserError(f"plots need matplotlib, which is not installed. Fix: {install_extra('plots')} (or pip "
                        "install matplotlib).") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def whole_number_ticks(*axes) -> None:
    """Ticks at whole numbers only on token and block axes: matplotlib's default ticks a short axis at fractions
    (-0.4..0.4 for one block), and its integer mode alone falls back to them where one whole number fits."""
    from matplotlib.ticker import MaxNLocator

    for axis in axes:
        axis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))


def require_matplotlib() -> None:
    """A training run's check at start-up, when TensorBoard is to get the telemetry steps' pictures."""
    try:
        pyplot()
    except UserError:
        raise UserError("TensorBoard gets the telemetry steps' attention pictures, drawn with matplotlib, which is "
                        f"not installed. Fix: {install_extra('plots')}, or set --metrics.telemetry_freq=0 or "
                        "--metrics.enable_tensorboard=false.") from None


def selection_counts(selected: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """selected [T, Hkv, n] (-1 unused) -> [T, num_blocks] int: how many groups selected each block."""
    T, groups, _ = selected.shape
    slots = torch.where(selected >= 0, selected, torch.full_like(selected, num_blocks)).cpu()
    counts = torch.zeros(T, num_blocks + 1, dtype=torch.int16)
    chosen = torch.zeros(T, num_blocks + 1, dtype=torch.bool)  # one group at a time: bytes per cell, not int64 x groups
    for g in range(groups):
        chosen.zero_()
        chosen.scatter_(1, slots[:, g], True)  # a group counts once per block; unused slots land in the extra column
        counts += chosen
    return counts[:, :num_blocks].long()


def shade(fraction: float) -> tuple[int, int, int]:
    """White at 0, DARKEST at 1, linear in between."""
    return tuple(round(w + (d - w) * fraction) for w, d in zip(WHITE, DARKEST))  # type: ignore[return-value]


def selection_colors(counts: torch.Tensor, num_groups: int, block_tokens: int) -> np.ndarray:
    """The selection picture's cells, uint8 RGB [T, num_blocks, 3], from counts [T, num_blocks] (blocks
    of block_tokens tokens): shade(groups that chose the block / num_groups), FUTURE past the
    query's own block."""
    T, nb = counts.shape
    palette = np.array([shade(k / num_groups) for k in range(num_groups + 1)], dtype=np.uint8)
    colors = palette[counts.clamp(max=num_groups).numpy()]
    future = np.arange(nb)[None, :] > (np.arange(T) // block_tokens)[:, None]
    colors[future] = FUTURE
    return colors


def selection_figure(colors: np.ndarray, layer: int, chosen: AttentionMap):
    """The selection picture of selection_colors' cells (of the layer's map `chosen`), one pixel
    block per cell."""
    plt = pyplot()
    T, nb, _ = colors.shape
    fig, ax = plt.subplots(figsize=(max(6, min(3 + nb * 0.25, 14)), max(4, min(2 + T * 0.04, 14))),
                           layout="constrained")
    ax.imshow(colors, interpolation="nearest", aspect="auto", extent=(-0.5, nb - 0.5, T - 0.5, -0.5))
    ax.set_xlabel(f"selection block ({chosen.block_tokens} tokens)")
    ax.set_ylabel("query position")
    whole_number_ticks(ax.xaxis, ax.yaxis)
    ax.set_title(f"layer {layer}: the blocks each query selected (n = {chosen.selected.shape[-1]})\n"
                 f"white: no group, darkest: all {chosen.groups} key/value groups, grey: future",
                 fontsize=9)
    return fig


def gate_figure(gate_means: torch.Tensor, layer_ids: list[int], branches: tuple[str, ...]):
    """Bars of gate_means [L, len(branches)] per layer."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(4, 1 + len(layer_ids) * 0.9), 3.2), layout="constrained")
    width = 0.8 / len(branches)
    x = np.arange(len(layer_ids))
    colors = branch_colors(branches)
    for b, branch in enumerate(branches):
        ax.bar(x + (b - (len(branches) - 1) / 2) * width, gate_means[:, b].numpy(), width, label=branch,
               color=np.array(colors[branch]) / 255)
    ax.set_xticks(x, [str(i) for i in layer_ids])
    ax.set_xlabel("layer")
    ax.set_ylabel("mean gate")
    ax.set_ylim(0, 1)
    ax.grid(axis="y", alpha=0.4)
    ax.legend(ncols=len(branches), fontsize=8, loc="upper center")
    return fig


def figure_writer(make_figure):
    """A write_results writer of the figure make_figure() draws, as PNG (the path it gets is a temporary name)."""
    def save(path: str) -> None:
        fig = make_figure()
        try:
            fig.savefig(path, dpi=100, format="png")
        finally:
            pyplot().close(fig)
    return save


def _selection_colors_of(chosen: AttentionMap, num_tokens: int) -> tuple[torch.Tensor, np.ndarray]:
    """(counts [T, blocks], their picture's cells) for the first row of one layer's map."""
    counts = selection_counts(chosen.selected[0], -(-num_tokens // chosen.block_tokens))
    return counts, selection_colors(counts, chosen.groups, chosen.block_tokens)


def _gate_means(maps: dict[int, AttentionMap]) -> torch.Tensor:
    return torch.stack([maps[i].gates.float().mean(dim=(0, 1, 2)) for i in sorted(maps)]).cpu()


def _branches(maps: dict[int, AttentionMap]) -> tuple[str, ...]:
    """The branches every layer's gates cover (one picture needs one set)."""
    names = {tuple(m.branches) for m in maps.values()}
    if len(names) != 1:
        raise ValueError(f"the model's attention maps name different branches per layer: {sorted(names)}")
    return names.pop()


def attention_figures(maps: dict[int, AttentionMap], num_tokens: int) -> dict[str, object]:
    """The pictures render_plots writes, as figures for TensorBoard: 'attention/gates' and
    'attention/selection_layer{i}' for every sparse attention layer."""
    figures = {"attention/gates": gate_figure(_gate_means(maps), sorted(maps), _branches(maps))}
    for i, chosen in sorted(maps.items()):
        figures[f"attention/selection_layer{i}"] = selection_figure(_selection_colors_of(chosen, num_tokens)[1], i,
                                                                    chosen)
    return figures


PLOT_FILES = ("selection_layer*.png", "gates.png", "plots.json")


def render_plots(maps: dict[int, AttentionMap], num_tokens: int, layer: int, out_dir: str,
                 overwrite: bool = False) -> dict[str, str]:
    """Write selection_layer{layer}.png, gates.png and plots.json from one text's attention maps (batch of
    one); returns their paths. An earlier plot's files in out_dir are refused, or with overwrite removed."""
    if not maps:
        raise UserError("the model has no sparse attention layers (e.g. attention = 'dense'), so there is no "
                        "selection or gate to plot. Fix: plot a model trained with sparse attention (attention = "
                        "'nsa').")
    if layer not in maps:
        raise UserError(f"--layer {layer} is not a sparse attention layer of this model; those are "
                        f"{', '.join(map(str, maps))}. Fix: pass one of them.")
    chosen = maps[layer]
    counts, colors = _selection_colors_of(chosen, num_tokens)
    layer_ids = sorted(maps)
    gate_means = _gate_means(maps)
    branches = _branches(maps)

    paths = {"selection": os.path.join(out_dir, f"selection_layer{layer}.png"),
             "gates": os.path.join(out_dir, "gates.png"), "legend": os.path.join(out_dir, "plots.json")}
    legend = {
        "tokens": num_tokens,
        "selection": {"file": os.path.basename(paths["selection"]), "layer": layer, **chosen.legend,
                      "rows": counts.shape[0], "columns": counts.shape[1],
                      "white": "selected by no group", "darkest": list(DARKEST), "future": list(FUTURE),
                      "shade": "linear from white to darkest in the number of groups that selected the block",
                      "counts": "counts[query][block]: key/value groups that selected the block",
                      "counts_by_query": counts.tolist()},
        "gates": {"file": os.path.basename(paths["gates"]), "branch_colors": {b: list(c) for b, c in
                                                                            branch_colors(branches).items()},
                  "layers": layer_ids,
                  "mean_gate": {b: [round(v, 6) for v in gate_means[:, i].tolist()] for i, b in enumerate(branches)}},
    }

    def write_legend(path: str) -> None:
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(legend, fh, indent=2)
            fh.write("\n")

    write_results(out_dir, "plot", PLOT_FILES, overwrite, {
        paths["selection"]: figure_writer(lambda: selection_figure(colors, layer, chosen)),
        paths["gates"]: figure_writer(lambda: gate_figure(gate_means, layer_ids, branches)),
        paths["legend"]: write_legend})
    return paths


def plot_model(model: nn.Module, model_section, tokenizer, text: str, layer: int,
               out_dir: str, overwrite: bool = False, add_bos: bool = False) -> tuple[dict[str, str], str]:
    """Tokenize text as a document of the run (BOS first with its data.add_bos; cut to the model's
    max_seq_len) and render_plots on the CPU; returns (paths, note). model_section is the recipe's [model]
    (its name picks the part, whose attention_maps hook is used)."""
    hook = registry.get("model", model_section.name).attention_maps
    if hook is None:
        raise UserError(f"model {model_section.name!r} registers no attention_maps hook, so there is nothing to "
                        "plot. Fix: plot a model whose part provides one (the built-in transformer does).")
    from components.data import encode_text

    ids = encode_text(tokenizer, text, "the text to plot")
    if not ids:  # an empty text, or one the tokenizer drops whole (what its vocabulary lacks)
        what = "the text to plot is empty" if not text else f"tokenizer {tokenizer.name!r} reads no token from the text"
        raise UserError(f"{what}. Fix: pass some text {'the tokenizer knows ' if text else ''}with --text or "
                        f"--text-file.")
    ids = [tokenizer.bos_id] + ids if add_bos else ids
    limit = getattr(model_section.args, "max_seq_len", None) or len(ids)
    note = f"{len(ids)} tokens"
    if len(ids) > limit:
        note = f"the text's first {limit} of {len(ids)} tokens (the model's max_seq_len)"
        ids = ids[:limit]
    tokens = torch.tensor([ids], dtype=torch.long)
    return render_plots(hook(model, tokens), tokens.shape[1], layer, out_dir, overwrite), note


def plot_exported(path: str, text: str, layer: int, out_dir: str,
                  overwrite: bool = False) -> tuple[dict[str, str], str]:
    """plot_model on an exported model file."""
    from nsa_titan.export import load_exported_run
    from nsa_titan.rebuild import say_on_stderr

    run = load_exported_run(path, say=say_on_stderr)
    return plot_model(run.model, run.recipe.model, run.tokenizer, text, layer, out_dir, overwrite,
                      run.recipe.data.add_bos)
