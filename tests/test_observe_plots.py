"""NSA plots: selection counts, the two pictures, and the `plot` command on an exported model."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess

import matplotlib.image
import numpy as np
import pytest
import torch

from components.errors import UserError
from components.model_hooks import AttentionMap
from nsa_titan import assemble
from nsa_titan.cli import main
from nsa_titan.config import resolve
from nsa_titan.export import FORMAT
from nsa_titan.observe import plots
from tests.launch import DEBUG


def test_selection_counts_match_a_direct_count():
    T, groups, n, num_blocks = 9, 3, 4, 5
    selected = torch.randint(-1, num_blocks, (T, groups, n))
    counts = plots.selection_counts(selected, num_blocks)
    for t in range(T):
        for j in range(num_blocks):
            assert counts[t, j] == sum(1 for g in range(groups) if j in selected[t, g].tolist())


def test_selection_colors_cells():
    # 4 queries, blocks of 2 tokens: queries 0-1 see block 0, queries 2-3 blocks 0 and 1
    counts = torch.tensor([[2, 0], [1, 0], [0, 2], [2, 1]])
    colors = plots.selection_colors(counts, num_groups=2, block_tokens=2)
    expected = {(0, 0): plots.DARKEST, (0, 1): plots.FUTURE, (1, 0): plots.shade(0.5), (1, 1): plots.FUTURE,
                (2, 0): (255, 255, 255), (2, 1): plots.DARKEST, (3, 0): plots.DARKEST, (3, 1): plots.shade(0.5)}
    assert colors.shape == (4, 2, 3) and colors.dtype == np.uint8
    for (t, j), color in expected.items():
        assert tuple(colors[t, j]) == color, (t, j)
    assert plots.shade(0.5) == (132, 152, 181)  # halfway between white and (8, 48, 107)


def test_the_pictures_draw_those_numbers(tmp_path):
    counts = torch.tensor([[2, 0], [1, 0], [0, 2], [2, 1]])
    colors = plots.selection_colors(counts, num_groups=2, block_tokens=2)
    chosen = AttentionMap(gates=torch.zeros(1, 4, 2, 3), selected=torch.zeros(1, 4, 2, 3, dtype=torch.long),
                          block_tokens=2, groups=2, branches=("cmp", "sel", "win"))
    fig = plots.selection_figure(colors, 0, chosen)
    assert np.array_equal(fig.axes[0].images[0].get_array(), colors)
    assert fig.axes[0].get_xlabel() == "selection block (2 tokens)"
    low, high = fig.axes[0].get_xlim()
    shown = [t for t in fig.axes[0].get_xticks() if low <= t <= high]
    assert shown == [0, 1], shown  # one tick per block number, none between
    assert "(n = 3)" in fig.axes[0].get_title() and "all 2 key/value groups" in fig.axes[0].get_title()
    means = torch.tensor([[0.5, 0.25, 1.0], [0.0, 0.75, 0.1]])
    branches = ("cmp", "sel", "win")
    fig = plots.gate_figure(means, [0, 3], branches)
    bars = fig.axes[0].patches
    colors = plots.branch_colors(branches)
    assert len(set(colors.values())) == 3
    for b, branch in enumerate(branches):  # bars are added branch by branch, one per layer
        for g in range(2):
            bar = bars[b * 2 + g]
            assert bar.get_height() == pytest.approx(means[g, b].item())
            assert tuple(round(c * 255) for c in bar.get_facecolor()[:3]) == colors[branch]
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == list(branches)
    path = str(tmp_path / "g.tmp")  # write_results hands writers temporary names: the format is PNG all the same
    plots.figure_writer(lambda: fig)(path)
    assert matplotlib.image.imread(path, format="png").shape[2] in (3, 4)


def _ticks_shown(axis) -> list[float]:
    low, high = sorted(axis.get_view_interval())
    return [t for t in axis.get_ticklocs() if low <= t <= high]


@pytest.mark.parametrize("tokens, blocks", [(1, 1), (3, 1), (4, 2)])
def test_token_and_block_axes_of_a_short_text_are_ticked_at_whole_numbers(tokens, blocks):
    """`plot --text ab` ticked the selection picture's block axis at -0.4..0.4 and its query axis at halves, and
    eval's loss picture ticked context positions at quarters: every tick is now a token or block number."""
    from nsa_titan.evaluate.plots import position_loss_figure

    colors = plots.selection_colors(torch.zeros(tokens, blocks, dtype=torch.long), num_groups=2, block_tokens=2)
    chosen = AttentionMap(gates=torch.zeros(1, tokens, 2, 3), selected=torch.zeros(1, tokens, 2, 1, dtype=torch.long),
                          block_tokens=2, groups=2, branches=("cmp", "sel", "win"))
    selection = plots.selection_figure(colors, 0, chosen).axes[0]
    assert _ticks_shown(selection.xaxis) == list(range(blocks))
    assert _ticks_shown(selection.yaxis) == list(range(tokens))
    loss = position_loss_figure({"positions": list(range(tokens)), "mean_loss": [1.0] * tokens,
                                 "tokens": [1] * tokens}, "t").axes[0]
    assert _ticks_shown(loss.xaxis) == list(range(tokens))


@pytest.mark.parametrize("add_bos", [False, True])
def test_the_plotted_text_is_a_document_as_the_run_trained_on(monkeypatch, add_bos):
    """With data.add_bos, training put BOS before each document: the plotted positions and block 0 hold it."""
    from types import SimpleNamespace

    from components.data import ByteTokenizer

    walked = []
    monkeypatch.setattr(plots.registry, "get", lambda kind, name: SimpleNamespace(
        attention_maps=lambda model, tokens: walked.append(tokens[0].tolist()) or {}))
    monkeypatch.setattr(plots, "render_plots", lambda maps, length, layer, out, overwrite: {})
    tokenizer = ByteTokenizer()
    section = SimpleNamespace(name="transformer", args=SimpleNamespace(max_seq_len=64))
    plots.plot_model(None, section, tokenizer, "hi", 0, "unused", add_bos=add_bos)
    assert walked == [([tokenizer.bos_id] if add_bos else []) + tokenizer.encode("hi")]


def test_a_text_the_tokenizer_reads_nothing_of_is_not_called_empty(monkeypatch):
    """A tokenizer that drops what its vocabulary lacks may read no token from a text: said so, where it was told
    the text was empty."""
    from types import SimpleNamespace

    from components.data import ByteTokenizer

    monkeypatch.setattr(plots.registry, "get", lambda kind, name: SimpleNamespace(attention_maps=lambda *a: {}))
    monkeypatch.setattr(ByteTokenizer, "encode", lambda self, text: [b for b in text.encode() if b < 128])
    section = SimpleNamespace(name="transformer", args=SimpleNamespace(max_seq_len=64))
    for text, message in (("日本", "tokenizer 'byte' reads no token from the text. Fix: pass some text the "
                                   "tokenizer knows with --text or --text-file."),
                          ("", "the text to plot is empty. Fix: pass some text with --text or --text-file.")):
        with pytest.raises(UserError) as caught:
            plots.plot_model(None, section, ByteTokenizer(), text, 0, "unused")
        assert str(caught.value) == message


def test_without_matplotlib_the_plot_command_says_how_to_install_it(hide_package):
    hide_package("matplotlib")
    with pytest.raises(UserError, match=r"pip install -e '\.\[plots\]' in the nsa_titan checkout"):
        plots.pyplot()


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
    T, nb, groups, n, ls = 96, 12, 2, 5, 8
    assert (sel["rows"], sel["columns"], sel["groups"], sel["layer"]) == (T, nb, groups, 1)
    counts = sel["counts_by_query"]
    for t in range(T):
        current = t // ls
        row = counts[t]
        assert row[current + 1:] == [0] * (nb - current - 1)  # nothing from the future
        # NSA_SPEC: each group selects min(n, visible blocks), always block 0 and the current block
        assert sum(row[:current + 1]) == groups * min(n, current + 1), t
        assert row[0] == groups and row[current] == groups
    picture = matplotlib.image.imread(out / sel["file"])
    assert picture.shape[0] > 100 and picture.shape[1] > 100
    gates = legend["gates"]
    assert gates["layers"] == [0, 1] and all(0 < v < 1 for b in ("cmp", "sel", "win") for v in gates["mean_gate"][b])
    assert set(gates["branch_colors"]) == {"cmp", "sel", "win"}
    assert matplotlib.image.imread(out / gates["file"]).shape[0] > 100

    # A second plot into the folder is refused, the first's files untouched; --overwrite replaces them all,
    # so no picture of another layer stays beside a legend that no longer describes it.
    earlier = (out / "plots.json").read_text()
    again = ["plot", str(exported), "--text", "def f(x):", "--layer", "0", "--out", str(out)]
    assert main(again) == 2
    assert "holds an earlier plot's results (selection_layer1.png, gates.png, plots.json)" in capsys.readouterr().err
    assert (out / "plots.json").read_text() == earlier
    assert main([*again, "--overwrite"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["gates.png", "plots.json", "selection_layer0.png"]


def test_plot_command_errors(exported, tmp_path, capsys):
    assert main(["plot", str(exported), "--text", "abc", "--layer", "7", "--out", str(tmp_path)]) == 2
    assert "--layer 7 is not a sparse attention layer" in capsys.readouterr().err
    assert main(["plot", str(exported), "--out", str(tmp_path)]) == 2
    assert "exactly one of --text" in capsys.readouterr().err
    assert main(["plot", str(exported), "--text", "abc"]) == 2  # it gave another model's command as the fix
    assert "plot needs --out DIR for the pictures. Fix: add --out DIR (e.g. --out plots) to the command." in \
        capsys.readouterr().err
    assert main(["plot", str(exported), "--text-file", str(tmp_path / "missing.txt"), "--out", str(tmp_path)]) == 2
    assert "cannot read --text-file" in capsys.readouterr().err
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\u00e9".encode("latin-1"))
    assert main(["plot", str(exported), "--text-file", str(latin1), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "is not UTF-8 text (byte 3" in err
    # The conversion it names works (it said `iconv -t UTF-8`, which reads the locale's UTF-8 and stops at byte 3).
    command = re.search(r"`(iconv [^`]+)`", err).group(1)
    if shutil.which("iconv"):
        subprocess.run(command, shell=True, check=True, cwd=tmp_path)
        assert (tmp_path / "latin1.txt.utf8").read_text(encoding="utf-8") == "caf\u00e9"
        assert main(["plot", str(exported), "--text-file", str(tmp_path / "latin1.txt.utf8"), "--out",
                     str(tmp_path / "converted")]) == 0
    assert main(["plot", str(tmp_path / "nothing.pt"), "--text", "a", "--out", str(tmp_path)]) == 2
    assert "cannot read exported model" in capsys.readouterr().err
    assert main(["plot", str(exported), "--text", "a", "--layr", "1", "--out", str(tmp_path)]) == 2
    assert "plot has no option '--layr' (did you mean '--layer'?)" in capsys.readouterr().err
