"""`nsa-titan inspect` on tiny recipes on the CPU, mostly with backend aot_eager (one Inductor case: its C++
compile costs 10-20 s even for one small block).

Each case builds and compiles a real model through the command line and checks the report, the
exit code and the files against facts known independently: the seq_lens asked for, the source
line written in the plugin, the number of graphs in the TORCH_TRACE file.
"""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

from components.nsa.triton.launch import interpreting
from nsa_titan import cli
from nsa_titan.inspect.command import CONSOLE_ENTRIES
from nsa_titan.inspect.report import VERDICT_PROBLEMS
from tests.conftest import REPO_ROOT
from tests.launch import DEBUG

PLUGIN = os.path.join(REPO_ROOT, "tests", "plugins", "breaking_model.py")
TINY_NSA = ["--model.dim=32", "--model.n_layers=2", "--model.n_heads=2", "--model.n_kv_heads=1",
            "--model.max_seq_len=64", "--model.nsa.window_size=16", "--training.seq_len=32",
            "--training.local_batch_size=2", "--data.logical_shards=4", "--compile.backend=aot_eager"]

DENSE_RECIPE = """
[job]
name = "dense_tiny"
[model]
name = "transformer"
dim = 32
n_layers = 2
n_heads = 2
n_kv_heads = 1
max_seq_len = 64
attention = "dense"
[data]
source = "python_stdlib"
tokenizer = "byte"
logical_shards = 4
[training]
seq_len = 32
local_batch_size = 2
[compile]
backend = "aot_eager"
"""


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def dense_recipe(tmp_path):
    path = tmp_path / "dense_tiny.toml"
    path.write_text(DENSE_RECIPE)
    return str(path)


def _inspect(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main(["inspect", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _verdict(out: str) -> str:
    lines = [line for line in out.splitlines() if line.startswith("verdict:")]
    assert len(lines) == 1, out
    return lines[0]


def _trace_records(folder: str) -> list[dict]:
    """The JSON head of every TORCH_TRACE record (payload lines start with a tab)."""
    logs = [os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".log")]
    assert len(logs) == 1, logs
    records = []
    with open(logs[0], encoding="utf-8") as fh:
        for line in fh:
            if line.startswith("\t") or not line.strip():
                continue
            records.append(json.loads(line[line.index("{"):]))
    return records


def test_nsa_blocks_compile_whole_and_a_new_seq_len_recompiles(tmp_path, capsys):
    """A second length recompiles once with the length symbolic, which a third then reuses: nothing in the
    blocks fixes the length to a traced value (formatting the model's max_seqlen hint once did: a recompile
    for every length)."""
    out_dir = tmp_path / "run"
    code, out, _ = _inspect(capsys, DEBUG, *TINY_NSA, f"--job.dump_folder={out_dir}", "--seq-lens", "32,48,64",
                            "--fail-on-break")
    assert code == 0, out
    assert _verdict(out) == "verdict: 0 graph breaks, 2 graphs, 1 recompile"
    assert "graph breaks: none" in out
    # The recompile names the guard that failed: the sequence dimension went from 32 to 48.
    recompile = re.search(r"compile (\d+/\d+) \(block 0, step 2\); failed guard: (.*)", out)
    assert recompile, out
    assert "size mismatch at index 1" in recompile.group(2) and "expected 32, actual 48" in recompile.group(2)
    # Both blocks ran compiled code (block 1 reuses what block 0 compiled: same code, same guards).
    assert "(eager)" not in out and "ran eagerly" not in out
    for block in (0, 1):
        assert re.search(rf"block {block}: compiled .*; ran graph \d", out), out

    inspect_dir = out_dir / "inspect"
    assert (inspect_dir / "report.txt").read_text() == out
    graphs = os.listdir(inspect_dir / "graphs")
    dynamo = [g for g in graphs if g.endswith(".dynamo.txt")]
    assert len(dynamo) == 2
    assert all("class GraphModule" in (inspect_dir / "graphs" / g).read_text() for g in dynamo)
    assert sum(g.endswith(".aot_forward.txt") for g in graphs) == 2
    assert sum(g.endswith(".aot_backward.txt") for g in graphs) == 2
    # The structured trace is the TORCH_TRACE format: it holds the same two Dynamo graphs.
    records = _trace_records(str(inspect_dir / "trace"))
    assert sum("dynamo_output_graph" in r for r in records) == 2
    assert any("compilation_metrics" in r for r in records)
    trace_line = next(line for line in out.splitlines() if line.startswith("trace: "))
    assert str(inspect_dir / "trace") in trace_line and "tlparse" in trace_line


def test_debug_recipe_compiles_whole_under_inductor(tmp_path, capsys):
    """What a user runs: the shipped debug recipe as it is, with compile's default backend."""
    code, out, _ = _inspect(capsys, DEBUG, f"--job.dump_folder={tmp_path}", "--fail-on-break")
    assert code == 0, out
    assert _verdict(out) == "verdict: 0 graph breaks, 1 graph, 0 recompiles"
    assert "compile: backend inductor in mode default per block" in out
    assert "ran eagerly" not in out
    ops = next(line for line in out.splitlines() if line.startswith("custom ops in the graphs: "))
    assert "nsa_reference::attention" in ops and "nsa_reference::attention_backward" in ops, ops


def test_shipped_dense_recipe_compiles_whole_under_inductor(tmp_path, capsys):
    """recipes/debug_dense.toml as it is: document masking on, compile's default backend (FlexAttention's
    kernels under inductor)."""
    code, out, _ = _inspect(capsys, os.path.join(REPO_ROOT, "recipes", "debug_dense.toml"),
                            f"--job.dump_folder={tmp_path}", "--fail-on-break")
    assert code == 0, out
    assert _verdict(out) == "verdict: 0 graph breaks, 1 graph, 0 recompiles"
    assert "compile: backend inductor in mode default per block" in out and "attention dense" in out
    assert "ran eagerly" not in out


def test_dense_blocks_compile_whole(dense_recipe, tmp_path, capsys):
    code, out, _ = _inspect(capsys, dense_recipe, f"--job.dump_folder={tmp_path}", "--fail-on-break")
    assert code == 0, out
    assert _verdict(out) == "verdict: 0 graph breaks, 1 graph, 0 recompiles"
    assert "attention dense" in out
    assert "custom ops in the graphs: none" in out


def test_inductor_reports_its_fallbacks_and_writes_its_code(dense_recipe, tmp_path, capsys):
    code, out, _ = _inspect(capsys, dense_recipe, "--model.n_layers=1", "--compile.backend=inductor",
                            f"--job.dump_folder={tmp_path}", "--fail-on-break")
    assert code == 0, out
    assert _verdict(out) == "verdict: 0 graph breaks, 1 graph, 0 recompiles"
    # Inductor has no lowering for the fused attention kernels behind F.scaled_dot_product_attention:
    # the generated code calls the ATen kernel, forward and backward.
    fallbacks = next(line for line in out.splitlines() if line.startswith("inductor fallbacks"))
    assert fallbacks.count("aten::_scaled_dot_product") == 2, fallbacks
    graphs = tmp_path / "inspect" / "graphs"
    code_files = [f for f in os.listdir(graphs) if ".inductor_output_code." in f]
    assert len(code_files) == 2  # the forward and the backward graph
    for name in code_files:
        text = (graphs / name).read_text()
        compile(text, name, "exec")  # Python source, as Inductor wrote it
        assert "def call(" in text


def test_a_graph_break_is_reported_with_its_reason_and_line(dense_recipe, tmp_path, capsys):
    argv = [dense_recipe, f"--job.plugins={PLUGIN}", "--model.name=breaking_transformer",
            f"--job.dump_folder={tmp_path}"]
    code, out, _ = _inspect(capsys, *argv, "--fail-on-break")
    assert code == 1, out
    with open(PLUGIN, encoding="utf-8") as fh:
        line = next(n for n, text in enumerate(fh, 1) if "the deliberate graph break" in text)
    where = f"breaking_model.py:{line}"
    verdict = _verdict(out)
    assert verdict.startswith("verdict: 1 problem") and re.search(rf"graph break at \S*{where} ", verdict), verdict
    assert "Tensor.item()" in verdict
    breaks = out.split("graph breaks: ", 1)[1].splitlines()
    assert breaks[0] == "1"
    assert re.match(rf"  \S*{where} .* in blocks 0, 1: ", breaks[1]), breaks[1]
    # Each block's graphs create the same symbol again: it is listed once, not once per graph.
    dynamic = next(line for line in out.splitlines() if line.startswith("dynamic shapes:"))
    entries = dynamic.split("): ", 1)[1].split(", L[")
    assert len(entries) == len(set(entries)), dynamic
    # The break is reported, not fatal: without the flag the command succeeds.
    assert _inspect(capsys, *argv)[0] == 0


def test_many_breaks_print_the_first_ones_and_the_report_file_keeps_them_all(dense_recipe, tmp_path, capsys):
    """A block that breaks at 12 lines: the console lists the first CONSOLE_ENTRIES breaks and graphs, says how many
    more and where they all are; report.txt lists every one; the verdict names the first few. (Before, every list
    and the verdict held them all: a model breaking at a few hundred lines printed thousands of lines.)"""
    code, out, _ = _inspect(capsys, dense_recipe, f"--job.plugins={PLUGIN}", "--model.name=many_breaks_transformer",
                            f"--job.dump_folder={tmp_path}")
    assert code == 0
    report_path = tmp_path / "inspect" / "report.txt"
    report = report_path.read_text()

    def breaks(text):
        return re.findall(r"^  \S*breaking_model.py:(\d+) `torch._dynamo.graph_break\(\)` in blocks 0, 1: ", text, re.M)

    def graphs(text):
        return re.findall(r"^  graph (\d+) \[", text, re.M)

    assert "graph breaks: 12\n" in out and "graphs (13):\n" in out
    assert len(set(breaks(report))) == 12 and len(graphs(report)) == 13 and "... and" not in report
    assert breaks(out) == breaks(report)[:CONSOLE_ENTRIES] and graphs(out) == graphs(report)[:CONSOLE_ENTRIES]
    assert f"  ... and {12 - CONSOLE_ENTRIES} more graph breaks: all in {report_path}\n" in out
    assert f"  ... and {13 - CONSOLE_ENTRIES} more graphs: all in {report_path}\n" in out
    verdict = _verdict(out)
    assert verdict == _verdict(report) and verdict.startswith("verdict: 12 problems (13 graphs, 0 recompiles): ")
    assert verdict.count("graph break at") == VERDICT_PROBLEMS, verdict
    assert verdict.endswith(f"; and {12 - VERDICT_PROBLEMS} more, all in {report_path}"), verdict


def test_blocks_that_run_eagerly_are_a_problem(dense_recipe, tmp_path, capsys):
    code, out, _ = _inspect(capsys, dense_recipe, f"--job.plugins={PLUGIN}", "--model.name=eager_transformer",
                            f"--job.dump_folder={tmp_path}", "--fail-on-break")
    assert code == 1, out
    assert "graphs (0):" in out
    assert "verdict: 1 problem (0 graphs, 0 recompiles): blocks 0, 1 ran eagerly" in out


@pytest.mark.parametrize("lengths, message", [("32,x", "--seq-lens '32,x'"), ("0", "--seq-lens '0'"),
                                              ("32,,48", "--seq-lens '32,,48'"),
                                              ("32,48,32", "--seq-lens '32,48,32' names 32 twice"),
                                              ("32,65", "--seq-lens value 65 is outside 1..max_seq_len (64)")])
def test_bad_seq_lens_are_input_errors(tmp_path, capsys, lengths, message):
    code, _, err = _inspect(capsys, DEBUG, *TINY_NSA, f"--job.dump_folder={tmp_path}", f"--seq-lens={lengths}")
    assert code == 2
    assert message in err and "Fix:" in err


@pytest.mark.parametrize("world_size", [None, "2"])
def test_a_context_parallel_recipe_is_refused_naming_the_flag_that_inspects_it(tmp_path, capsys, monkeypatch,
                                                                                world_size):
    """One process cannot run context parallelism's exchange: inspect told the user to launch 8 processes (which
    run_train.sh does not do for inspect), and with WORLD_SIZE set it inspected the model without it in
    silence."""
    if world_size:
        monkeypatch.setenv("WORLD_SIZE", world_size)
    code, _, err = _inspect(capsys, DEBUG, *TINY_NSA, f"--job.dump_folder={tmp_path}",
                            "--parallelism.context_parallel_degree=2")
    assert code == 2 and "inspect compiles the model in one process, and parallelism.context_parallel_degree = 2" in err
    assert "Fix: inspect the blocks without it, adding --parallelism.context_parallel_degree=1" in err, err


def test_a_misspelled_option_is_named_as_one(tmp_path, capsys):
    code, _, err = _inspect(capsys, DEBUG, *TINY_NSA, f"--job.dump_folder={tmp_path}", "--seq-len", "64")
    assert code == 2 and "inspect has no option '--seq-len' (did you mean '--seq-lens'?)" in err, err


@pytest.mark.skipif(not (torch.cuda.is_available() or interpreting()),
                    reason="the Triton backend needs a CUDA GPU or TRITON_INTERPRET=1 (tests/conftest.py sets it)")
@pytest.mark.parametrize("masking", [True, False])
def test_triton_backend_shows_its_custom_ops(tmp_path, capsys, masking):
    one_block = [a for a in TINY_NSA if not a.startswith("--model.n_layers=")] + ["--model.n_layers=1"]
    argv = [DEBUG, *one_block, "--model.nsa.backend=triton", f"--model.document_masking={str(masking).lower()}",
            f"--job.dump_folder={tmp_path}"]
    code, out, _ = _inspect(capsys, *argv, "--fail-on-break")
    assert code == 0, out
    assert _verdict(out) == "verdict: 0 graph breaks, 1 graph, 0 recompiles"
    ops = next(line for line in out.splitlines() if line.startswith("custom ops in the graphs: "))
    # The kernels registered by components/nsa/triton/ops.py, forward ones in the Dynamo graph and
    # backward ones in AOTAutograd's backward graph; packed documents reach the same kernels (cu_seqlens).
    expected = ("interval_attention", "select_blocks", "selected_attention", "interval_attention_backward",
                "selected_attention_backward")
    for op in expected:
        assert f"nsa_triton::{op}" in ops.split(": ", 1)[1].split(", "), ops


def test_activation_checkpointed_blocks_still_compile(dense_recipe, tmp_path, capsys):
    code, out, _ = _inspect(capsys, dense_recipe, "--activation_checkpoint.mode=full", f"--job.dump_folder={tmp_path}",
                            "--fail-on-break")
    assert code == 0, out
    assert "0 graph breaks" in out and "ran eagerly" not in out


def _branch_line() -> int:
    with open(PLUGIN, encoding="utf-8") as fh:
        return next(n for n, text in enumerate(fh, 1) if "the deliberate data-dependent branch" in text)


def test_training_stops_at_a_graph_break_under_fullgraph_with_one_message(dense_recipe, tmp_path, capsys):
    """compile.fullgraph = true (the default) with the default backend: a break Dynamo cannot capture is an
    input error naming its line and the ways on, not Dynamo's traceback."""
    code = cli.main(["train", dense_recipe, f"--job.plugins={PLUGIN}", "--model.name=branching_transformer",
                     f"--job.dump_folder={tmp_path}", "--compile.enable=true", "--compile.backend=inductor",
                     "--training.steps=2"])
    err = capsys.readouterr().err
    assert code == 2, err
    errors = [text for text in err.splitlines() if text.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert re.search(rf"graph break at \S*breaking_model.py:{_branch_line()} `if x.detach", errors[0]), errors[0]
    assert "Data-dependent branching" in errors[0] and "compile.fullgraph = false" in errors[0], errors[0]


def test_training_with_a_graph_break_under_fullgraph_false_logs_it(dense_recipe, tmp_path, capsys):
    """The same model trains with compile.fullgraph = false, and its metrics count the break (Dynamo files this
    kind under another counter than most breaks)."""
    code = cli.main(["train", dense_recipe, f"--job.plugins={PLUGIN}", "--model.name=branching_transformer",
                     f"--job.dump_folder={tmp_path}", "--compile.enable=true", "--compile.fullgraph=false",
                     "--compile.backend=aot_eager", "--training.steps=2"])
    assert code == 0, capsys.readouterr().err
    with open(tmp_path / "metrics.jsonl", encoding="utf-8") as fh:
        records = [json.loads(line) for line in fh if '"loss"' in line]
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["graph_breaks"] >= 1 and r["compiled_graphs"] >= 2 for r in records), records


def test_an_error_the_compiled_code_raises_is_not_called_a_graph_break():
    """Dynamo reports an exception raised by the traced code as Unsupported too: the message says the code raised
    it (and what it said), not that a graph break needs removing."""
    from components.errors import UserError
    from nsa_titan.parallel.compile import graph_break_message

    class Refusing(torch.nn.Module):
        def forward(self, x):
            if x.shape[-1] > 2:
                raise UserError("too wide for this module")
            return x * 2

    module = Refusing()
    module.compile(fullgraph=True, backend="eager")
    with pytest.raises(Exception) as raised:
        module(torch.ones(4))
    message = graph_break_message(raised.value)
    assert "own code raises" in message and "too wide for this module" in message and "graph break" not in message


def test_inspect_refuses_what_training_refuses_and_keeps_the_last_report(dense_recipe, tmp_path, capsys):
    """A CUDA-graph mode off CUDA, or a model without blocks: input errors (exit 2) found before the folder is
    touched, so the last inspection's report stays; training refuses both the same way."""
    code, out, _ = _inspect(capsys, dense_recipe, f"--job.dump_folder={tmp_path}")
    assert code == 0, out
    report = (tmp_path / "inspect" / "report.txt").read_text()
    code, _, err = _inspect(capsys, dense_recipe, f"--job.dump_folder={tmp_path}", "--compile.backend=inductor",
                            "--compile.mode=reduce-overhead")
    assert code == 2 and "compile.mode = 'reduce-overhead' replays CUDA graphs, but this run is on cpu" in err, err
    code, _, err = _inspect(capsys, dense_recipe, f"--job.dump_folder={tmp_path}", f"--job.plugins={PLUGIN}",
                            "--model.name=blockless_transformer", "--model.document_masking=false")
    assert code == 2 and "names no blocks" in err and "nothing to compile or inspect" in err, err
    assert (tmp_path / "inspect" / "report.txt").read_text() == report


def test_training_a_model_whose_blocks_dynamo_skips_under_fullgraph_is_one_message(dense_recipe, tmp_path, capsys):
    code = cli.main(["train", dense_recipe, f"--job.plugins={PLUGIN}", "--model.name=eager_transformer",
                     "--model.document_masking=false", f"--job.dump_folder={tmp_path}", "--compile.enable=true",
                     "--compile.backend=inductor", "--training.steps=1"])  # compile's default, as users run it
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert "torch.compile compiled nothing in a block" in err and "compile.fullgraph = false" in err, err
