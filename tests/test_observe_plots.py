"""NSA plots: selection counts, the two pictures, and the `plot` command on an exported model."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from nsa_titan import assemble
from nsa_titan.cli import main
from nsa_titan.config import resolve
from nsa_titan.export import FORMAT
from nsa_titan.observe import plots
from tests.launch import DEBUG
from tests.test_observe_png import decode_png, pixel_at


def test_selection_counts_match_a_direct_count():
    T, groups, n, num_blocks = 9, 3, 4, 5
    selected = torch.randint(-1, num_blocks, (T, groups, n))
    counts = plots.selection_counts(selected, num_blocks)
    for t in range(T):
        for j in range(num_blocks):
            assert counts[t, j] == sum(1 for g in range(groups) if j in selected[t, g].tolist())


def test_selection_image_cells(tmp_path):
    # 4 queries, blocks of 2 tokens: queries 0-1 see block 0, queries 2-3 blocks 0 and 1
    counts = torch.tensor([[2, 0], [1, 0], [0, 2], [2, 1]])
    canvas, geo = plots.selection_image(counts, num_groups=2, block_tokens=2)
    decoded = decode_png(open(canvas.save(str(tmp_path / "s.png")), "rb").read())
    assert decoded[:2] == (canvas.width, canvas.height)
    expected = {(0, 0): plots.DARKEST, (0, 1): plots.FUTURE, (1, 0): plots.shade(0.5), (1, 1): plots.FUTURE,
                (2, 0): (255, 255, 255), (2, 1): plots.DARKEST, (3, 0): plots.DARKEST, (3, 1): plots.shade(0.5)}
    for (t, j), color in expected.items():
        for dx in range(geo["cell_width"]):
            for dy in range(geo["cell_height"]):
                x, y = geo["origin_x"] + j * geo["cell_width"] + dx, geo["origin_y"] + t * geo["cell_height"] + dy
                assert pixel_at(decoded, x, y) == color, (t, j)
    assert plots.shade(0.5) == (132, 152, 181)  # halfway between white and (8, 48, 107)


def test_gate_chart_bar_heights(tmp_path):
    means = torch.tensor([[0.5, 0.25, 1.0], [0.0, 0.75, 0.1]])
    canvas, geo = plots.gate_chart(means, [0, 3])
    decoded = decode_png(open(canvas.save(str(tmp_path / "g.png")), "rb").read())
    group = 3 * (geo["bar_width"] + geo["bar_gap"]) + geo["group_gap"]
    for g in range(2):
        for b, branch in enumerate(plots.BRANCHES):
            x = geo["first_bar_x"] + g * group + b * (geo["bar_width"] + geo["bar_gap"]) + geo["bar_width"] // 2
            height = sum(1 for y in range(canvas.height) if pixel_at(decoded, x, y) == plots.BRANCH_COLORS[branch])
            assert height == round(means[g, b].item() * geo["height_of_1"]), (g, branch)


TINY = ["--model.dim=32", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2",
        "--model.max_seq_len=96", "--training.seq_len=64", "--model.nsa.block_size=8", "--model.nsa.block_stride=4",
        "--model.nsa.sel_block_size=8", "--model.nsa.num_selected=5", "--model.nsa.window_size=16"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """An export-format file of a freshly initialised tiny NSA model (what `nsa-titan export` writes)."""
    resolved = resolve([DEBUG, *TINY])
    recipe = resolved.recipe
    tokenizer = assemble.build_tokenizer(recipe)
    model = assemble.build_model_on_meta(recipe, tokenizer.vocab_size)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    with torch.no_grad():  # sharper selection scores than the small initial weights give
        for layer in model.layers:
            layer.attention.wq.weight.mul_(20)
    path = tmp_path_factory.mktemp("export") / "model.pt"
    torch.save({"format": FORMAT, "model_name": recipe.model.name, "model_args": dataclasses.asdict(recipe.model.args),
                "vocab_size": tokenizer.vocab_size, "step": 0, "state_dict": model.state_dict(),
                "recipe_toml": resolved.toml, "recipe_hash": resolved.hash}, path)
    return path


def test_plot_command(exported, tmp_path, capsys):
    text = "def square(x):\n    return x * x\n" * 4  # 128 bytes: cut to max_seq_len = 96
    out = tmp_path / "plots"
    assert main(["plot", str(exported), "--text", text, "--layer", "1", "--out", str(out)]) == 0
    assert "first 96 of 128 tokens" in capsys.readouterr().out
    legend = json.loads((out / "plots.json").read_text())
    sel = legend["selection"]
    decoded = decode_png((out / sel["file"]).read_bytes())
    T, nb, groups, n, ls = 96, 12, 2, 5, 8
    assert (sel["rows"], sel["columns"], sel["groups"], sel["layer"]) == (T, nb, groups, 1)
    colors = {plots.shade(k / groups): k for k in range(groups + 1)}
    for t in range(T):
        row = []
        for j in range(nb):
            color = pixel_at(decoded, sel["origin_x"] + j * sel["cell_width"], sel["origin_y"] + t * sel["cell_height"])
            row.append(None if color == plots.FUTURE else colors[color])
        current = t // ls
        assert row[current + 1:] == [None] * (nb - current - 1)  # the future is grey
        # NSA_SPEC: each group selects min(n, visible blocks), always block 0 and the current block
        assert sum(row[:current + 1]) == groups * min(n, current + 1), t
        assert row[0] == groups and row[current] == groups
    gates = legend["gates"]
    assert gates["layers"] == [0, 1] and all(0 < v < 1 for b in plots.BRANCHES for v in gates["mean_gate"][b])
    width, height, _, _ = decode_png((out / gates["file"]).read_bytes())
    assert height == gates["baseline_y"] + plots.MARGIN_BOTTOM and width > 0


def test_plot_command_errors(exported, tmp_path, capsys):
    assert main(["plot", str(exported), "--text", "abc", "--layer", "7", "--out", str(tmp_path)]) == 2
    assert "--layer 7 is not an NSA layer" in capsys.readouterr().err
    assert main(["plot", str(exported), "--out", str(tmp_path)]) == 2
    assert "exactly one of --text" in capsys.readouterr().err
    assert main(["plot", str(exported), "--text-file", str(tmp_path / "missing.txt"), "--out", str(tmp_path)]) == 2
    assert "cannot read --text-file" in capsys.readouterr().err
    assert main(["plot", str(tmp_path / "nothing.pt"), "--text", "a", "--out", str(tmp_path)]) == 2
    assert "cannot read exported model" in capsys.readouterr().err
