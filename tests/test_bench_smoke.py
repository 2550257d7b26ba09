"""The benchmarks run (on the CPU, as smoke tests: no timing is asserted, only that results are written)."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from bench import train_throughput
from tests.conftest import REPO_ROOT

# A tiny NSA layout for the kernel benchmarks' smoke runs under Triton's interpreter.
TINY_NSA = ["--allow-cpu", "--seq-lens", "40", "--heads", "2", "--kv-heads", "1", "--head-dim", "16",
            "--block-size", "8", "--block-stride", "4", "--sel-block-size", "8", "--num-selected", "2",
            "--window-size", "8"]


def _debug_model_parameters(vocab_size: int) -> int:
    from nsa_titan import assemble
    from nsa_titan.config import resolve

    model = assemble.build_model_on_meta(resolve(["recipes/debug.toml"]).recipe, vocab_size)
    return sum(p.numel() for p in model.parameters())


def test_train_throughput_writes_a_result(tmp_path, capsys):
    code = train_throughput.main(["--recipes", "recipes/debug.toml", "--seq-lens", "64", "--steps", "3",
                                  "--warmup", "1", "--tokens-per-step", "128", "--allow-cpu", "--vocab-size", "1000",
                                  "--override=--model.nsa.window_size=16",
                                  "--out", str(tmp_path / "train_throughput.json")])
    assert code == 0
    result = json.loads((tmp_path / "train_throughput.json").read_text())
    (case,) = result["results"]
    assert case["tokens_per_second"] > 0 and case["local_batch_size"] == 2
    assert case["documents"] == "one per row"
    # The stand-in vocabulary sized the model: embedding and output layer of 1000 rows each.
    assert case["vocab_size"] == 1000
    assert case["parameters"] == _debug_model_parameters(vocab_size=1000)
    assert result["environment"]["torch"] and result["environment"]["commit"]


def test_train_throughput_records_an_out_of_memory_case_and_runs_the_next(tmp_path, monkeypatch):
    """The trainer ends an out-of-memory step with a TrainingFault: the benchmark writes it down as the
    case's error and goes on to the next case (here the next length, which runs out of memory too)."""
    monkeypatch.setattr("bench.environment.results_path",
                        lambda name: os.path.join(tmp_path, f"{name}.json"))
    oom = ["--override=--job.plugins=tests.plugins.oom_at_step", "--override=--model.name=oom_at_step",
           "--override=--model.oom_at_step=2"]
    code = train_throughput.main(["--recipes", "recipes/debug.toml", "--seq-lens", "64", "32", "--steps", "3",
                                  "--warmup", "1", "--tokens-per-step", "128", "--allow-cpu", "--vocab-size", "1000",
                                  "--override=--model.nsa.window_size=16", "--no-fit", *oom])
    assert code == 0
    cases = json.loads((tmp_path / "train_throughput.json").read_text())["results"]
    assert [(c["seq_len"], c["local_batch_size"]) for c in cases] == [(64, 2), (32, 4)]
    for case in cases:
        assert case["error"].startswith("OOM: rank 0: out of device memory in step 2 (CUDA out of memory."), case["error"]
        assert "out_of_memory_micro_batches" not in case


def test_train_throughput_halves_the_micro_batch_of_a_case_that_does_not_fit(tmp_path, monkeypatch):
    """By default a case that runs out of memory runs again with smaller micro-batches and gradient
    accumulation, the same rows a step: 6 rows do not fit, nor 3; 1 row, 6 micro-batches a step, does."""
    monkeypatch.setattr("bench.environment.results_path", lambda name: os.path.join(tmp_path, f"{name}.json"))
    oom = ["--override=--job.plugins=tests.plugins.oom_at_step", "--override=--model.name=oom_at_step",
           "--override=--model.oom_above_rows=2"]
    assert train_throughput.main(["--recipes", "recipes/debug.toml", "--seq-lens", "64", "--steps", "3",
                                  "--warmup", "1", "--tokens-per-step", "384", "--allow-cpu", "--vocab-size", "1000",
                                  "--override=--model.nsa.window_size=16", *oom]) == 0
    (case,) = json.loads((tmp_path / "train_throughput.json").read_text())["results"]
    assert "error" not in case and case["tokens_per_second"] > 0
    assert (case["local_batch_size"], case["gradient_accumulation"]) == (1, 6)
    assert case["out_of_memory_micro_batches"] == [6, 3]


def test_train_throughput_records_a_model_too_large_to_build(tmp_path, monkeypatch):
    """A case whose model cannot be placed (the allocator refuses at build time) is recorded too."""
    from nsa_titan import assemble

    def refuse(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 640000000000 bytes")

    monkeypatch.setattr(assemble, "materialize", refuse)
    monkeypatch.setattr("bench.environment.results_path", lambda name: os.path.join(tmp_path, f"{name}.json"))
    assert train_throughput.main(["--recipes", "recipes/debug.toml", "--seq-lens", "64", "32", "--steps", "3",
                                  "--warmup", "1", "--tokens-per-step", "128", "--allow-cpu", "--vocab-size", "1000",
                                  "--override=--model.nsa.window_size=16"]) == 0
    cases = json.loads((tmp_path / "train_throughput.json").read_text())["results"]
    assert [c["seq_len"] for c in cases] == [64, 32]
    assert all(c["error"].startswith("OOM: the model does not fit in cpu memory") for c in cases), cases


@pytest.mark.parametrize("one_per_row", [True, False])
def test_benchmark_rows_are_one_document_each_by_default(tmp_path, one_per_row):
    """--documents row: attention spans each row whole (dense takes plain causal SDPA, NSA one document)."""
    from nsa_titan import assemble
    from nsa_titan.config import resolve
    from nsa_titan.runtime import make_runtime

    argv = train_throughput.synthetic_run_argv("recipes/debug.toml", 128, 2, 2, 1000, str(tmp_path), [],
                                               one_document_per_row=one_per_row)
    recipe = resolve([*argv, "--training.device=cpu", "--data.num_workers=0", "--data.logical_shards=1"]).recipe
    source, tokenizer = assemble.build_source(recipe), assemble.build_tokenizer(recipe)
    loader = assemble.build_loader(recipe, make_runtime("cpu", "float32"), source, tokenizer, dp_rank=0, dp_size=1,
                                   split="train", batch_size=2)
    it = iter(loader)
    batches = [next(it) for _ in range(20)]
    inner_starts = sum(int(b["document_starts"][:, 1:].sum()) for b in batches)
    if one_per_row:
        assert inner_starts == 0 and all(bool((b["input"][:, -1] == tokenizer.eos_id).all()) for b in batches)
    else:
        assert inner_starts > 0


def test_attention_bench_refuses_without_cuda(capsys):
    import torch

    from bench import attention

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the benchmark would run for real")
    assert attention.main(["--seq-lens", "2048"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_attention_stages_times_every_stage(tmp_path):
    """Under the interpreter (the CPU suite's Triton): every stage runs forward and, but for
    selection, backward; the shares add up; the selected branch runs in each layout (l' = 16: the masked one
    too). No time is asserted."""
    from components.nsa.triton.launch import interpreting

    from bench import attention_stages

    if not interpreting():
        pytest.skip("needs TRITON_INTERPRET=1 (set by tests/conftest.py without a GPU)")
    out = tmp_path / "stages.json"
    code = attention_stages.main([*TINY_NSA, "--sel-block-size", "16", "--dtype", "fp32", "--out", str(out)])
    assert code == 0
    rows = json.loads(out.read_text())["results"]
    assert [r["stage"] for r in rows] == ["compressed", "selection", "selected", "window", "gating"]
    assert all(r["fwd_ms"] > 0 for r in rows) and "bwd_ms" not in rows[1]
    assert all(r["bwd_ms"] > 0 for r in rows if r["stage"] != "selection")
    assert abs(sum(r["share_of_fwd"] for r in rows) - 1) < 1e-9
    assert all(r["fwd_flops"] > 0 and r["fwd_tflops"] > 0 for r in rows[:4]) and "fwd_flops" not in rows[4]
    assert all("bwd_tflops" in r for r in rows[:4] if r["stage"] != "selection")
    layouts = json.loads(out.read_text())["selected_layouts"]
    assert [(r["seq_len"], r["layout"]) for r in layouts] == [(40, "query"), (40, "block"), (40, "masked")]
    assert all(r["fwd_ms"] > 0 and r["bwd_ms"] > 0 and r["lists_ms"] > 0 for r in layouts)
    from bench.report import render  # the README's table reads this file

    (host,) = json.loads(out.read_text())["host_overhead"]
    assert host["seq_len"] == 40 and host["total_ms"] > 0 and host["issue_ms"] > 0
    table = render(json.loads(out.read_text()))
    assert "| 40 | selected |" in table and "| 40 | block-major |" in table and "| 40 | masked |" in table
    assert "| 40 | " in table.split("host's time to issue it")[1]


def test_selected_flex_runs_the_selected_branch_both_ways_to_the_same_output(tmp_path):
    """Under the interpreter, FlexAttention eager (no backward on the CPU): the block mask built from the op's
    selection gives the op's selected branch output, over query tiles and KV blocks of two selection blocks."""
    from components.nsa.triton.launch import interpreting

    from bench import selected_flex
    from bench.report import render

    if not interpreting():
        pytest.skip("needs TRITON_INTERPRET=1 (set by tests/conftest.py without a GPU)")
    out = tmp_path / "flex.json"
    tiny = [a if a != "40" else "48" for a in TINY_NSA]  # three query tiles of 16, KV blocks of 16
    assert selected_flex.main([*tiny, "--q-block", "16", "--kv-block", "16", "--rep-ms", "1", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["results"]
    assert row["seq_len"] == 48 and row["flex_fwd_bwd_ms"] is None and list(row["max_abs_difference"]) == ["o"]
    assert row["max_abs_difference"]["o"] < 1e-5
    assert 1 <= row["kv_blocks_per_q_tile"] <= 3
    assert list(row["max_relative_difference"]) == ["o"] and row["max_relative_difference"]["o"] < 1e-5
    (line,) = [line for line in render(json.loads(out.read_text())).splitlines() if line.startswith("| 48 | 1 |")]
    assert line.endswith(f"| {row['max_relative_difference']['o']:.2e} |")  # the table's differences are relative


def test_stage_flops_count_the_keys_each_query_sees():
    """Against a count key by key: compressed blocks ending at or before the query, the window's keys, and the
    keys of each chosen block at or before the query (unused slots -1 count nothing), times 4 D per key."""
    import argparse

    from bench.attention_stages import stage_flops

    args = argparse.Namespace(batch=2, heads=6, kv_heads=2, head_dim=16, block_size=8, block_stride=4,
                              sel_block_size=8, num_selected=3, window_size=5)
    T, G = 30, 3
    gen = torch.Generator().manual_seed(0)
    selection = torch.full((2, T, 2, 3), -1, dtype=torch.int64)
    for b in range(2):
        for t in range(T):
            for h in range(2):
                chosen = torch.randperm(t // 8 + 1, generator=gen)[:int(torch.randint(1, 4, (1,), generator=gen))]
                selection[b, t, h, :len(chosen)] = chosen.sort().values
    compressed = sum(1 for t in range(T) for i in range(T) if i * 4 + 8 <= T and i * 4 + 7 <= t)
    window = sum(1 for t in range(T) for s in range(T) if t - 5 < s <= t)
    selected = sum(1 for b in range(2) for t in range(T) for h in range(2) for blk in selection[b, t, h].tolist()
                   if blk >= 0 for s in range(blk * 8, blk * 8 + 8) if s <= t) * G
    flops = stage_flops(args, T, selection)
    per_key = 4 * 16
    assert flops == {"compressed": per_key * 2 * 6 * compressed, "selection": per_key / 2 * 2 * 6 * compressed,
                     "selected": per_key * selected, "window": per_key * 2 * 6 * window}


def test_the_busiest_kernels_are_summed_by_name_and_ranked_by_gpu_time():
    from bench.attention_stages import busiest_kernels
    from bench.report import render

    launches = [("selected_fwd", 2.0), ("gate_fwd", 0.5), ("selected_fwd", 3.0), ("cumsum", 0.1), ("gate_fwd", 0.5)]
    top = busiest_kernels(launches, top=2)
    assert top == [{"name": "selected_fwd", "ms": 5.0, "calls": 2, "share": 5.0 / 6.1},
                   {"name": "gate_fwd", "ms": 1.0, "calls": 2, "share": 1.0 / 6.1}]
    host = {"seq_len": 2048, "total_ms": 6.5, "issue_ms": 1.0, "issue_share": 0.15, "kernels": 5,
            "busiest_kernels": top}
    table = render({"benchmark": "attention_stages", "environment": {}, "results": [], "host_overhead": [host]})
    assert "The busiest kernels of one forward + backward at 2048 tokens (GPU time):" in table
    assert "| selected_fwd | 5.000 | 2 | 82% |" in table and "| gate_fwd | 1.000 | 2 | 16% |" in table


def test_attention_speedups_pair_each_nsa_timing_with_sdpa_at_the_same_length_and_mode():
    from bench.attention import speedups

    results = [
        {"seq_len": 8192, "backend": "nsa-triton", "mode": "fwd", "ms": 2.0},
        {"seq_len": 8192, "backend": "sdpa", "mode": "fwd", "ms": 3.0, "kernel": "cudnn"},
        {"seq_len": 8192, "backend": "nsa-triton", "mode": "fwd+bwd", "ms": 8.0},
        {"seq_len": 8192, "backend": "sdpa", "mode": "fwd+bwd", "ms": 6.0, "kernel": "flash"},
        {"seq_len": 65536, "backend": "nsa-triton", "mode": "fwd", "ms": 10.0},  # no SDPA row: no ratio
        {"seq_len": 65536, "backend": "sdpa", "error": "out of memory"},
    ]
    assert speedups(results) == [
        {"seq_len": 8192, "backend": "nsa-triton", "mode": "fwd", "speedup_vs_sdpa": 1.5, "sdpa_kernel": "cudnn"},
        {"seq_len": 8192, "backend": "nsa-triton", "mode": "fwd+bwd", "speedup_vs_sdpa": 0.75, "sdpa_kernel": "flash"},
    ]


def test_packed_rows_fill_the_length_with_documents_in_range():
    from bench.attention import packed_lengths, parse_args

    for total in (32768, 65536, 9000, 1024):
        lengths = packed_lengths(total, 1024, 8192)
        assert sum(lengths) == total and all(1024 <= n <= 8192 for n in lengths), lengths
    assert packed_lengths(32768, 1024, 8192) == packed_lengths(32768, 1024, 8192)  # seeded
    assert parse_args(["--packed", "1024", "8192"]).packed == [1024, 8192]
    with pytest.raises(SystemExit):
        parse_args(["--packed", "1024", "8192", "--batch", "2"])


def test_packed_case_builds_inputs_the_op_accepts():
    from bench.attention import cu_seqlens_of, nsa_hyper, nsa_inputs, packed_lengths, parse_args
    from components.nsa import nsa_attention

    args = parse_args(["--packed", "100", "500", "--heads", "2", "--kv-heads", "1", "--head-dim", "16",
                       "--window-size", "64"])
    lengths = packed_lengths(1200, *args.packed)
    xs = [x.detach() for x in nsa_inputs(args, 1200, torch.float32, device="cpu", lengths=lengths)]
    out = nsa_attention(*xs, **nsa_hyper(args), cu_seqlens=cu_seqlens_of(lengths, device="cpu"))
    assert out.shape == xs[0].shape and torch.isfinite(out).all()


def test_context_parallel_bench_reports_every_rank_and_the_balance(tmp_path, monkeypatch):
    """cp = 1 and 2 over gloo on the debug recipe: every rank's peak memory and step time, and the op
    timed on each rank's queries for both splits. No timing is asserted."""
    from bench import context_parallel

    monkeypatch.setattr("bench.environment.results_path", lambda name: os.path.join(tmp_path, f"{name}.json"))
    code = context_parallel.main(["--recipe", "recipes/debug.toml", "--seq-len", "128", "--cp", "1", "2",
                                  "--steps", "2", "--repeats", "1", "--vocab-size", "1000", "--allow-cpu",
                                  "--override=--model.nsa.window_size=16"])
    assert code == 0
    result = json.loads((tmp_path / "context_parallel.json").read_text())
    runs = {run["cp"]: run for run in result["memory_and_time"]}
    assert sorted(runs) == [1, 2] and all("error" not in run for run in runs.values()), runs
    assert [r["rank"] for r in runs[2]["ranks"]] == [0, 1] and runs[2]["tokens_per_rank"] == 64
    assert all(r["peak_memory_gib"] > 0 and len(r["step_seconds"]) == 2 for run in runs.values() for r in run["ranks"])
    assert {(b["cp"], b["split"]) for b in result["balance"]} == {(2, "head-tail"), (2, "contiguous")}
    assert all(len(b["rank_seconds"]) == 2 and b["imbalance"] >= 1 for b in result["balance"])


def test_data_resume_bench_times_both_cursors(tmp_path):
    from bench import data_resume

    out = tmp_path / "data_resume.json"
    assert data_resume.main(["--documents", "600", "--row-group", "50", "--at", "0.8", "--shards", "2",
                             "--shuffle-buffer", "16", "--folder", str(tmp_path), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert (result["documents"], result["row_group"], result["shards"], result["shuffle_buffer"]) == (600, 50, 2, 16)
    assert result["resumed_after_documents"] == 240  # 0.8 of the first shard's 300 documents
    seconds = result["seconds_to_first_document"]
    assert set(seconds) == {"stream_state_cursor", "count_cursor_replay"}
    # Each is a real measurement (opening the parquet stream takes well over the millisecond they are rounded
    # to), not a placeholder; reaching the cursor from the start read 240 documents through the same stream.
    times = [*seconds.values(), result["seconds_to_reach_cursor_from_start"]]
    assert all(isinstance(t, float) and math.isfinite(t) and t > 0 for t in times), result
    assert result["environment"]["torch"]


def test_decode_bench_times_each_context(tmp_path, capsys):
    from bench import decode

    out = tmp_path / "decode.json"
    assert decode.main(["--contexts", "5", "40", "--steps", "2", "--repeats", "2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["context"] for r in result["results"]] == [5, 40] and result["vocab_size"] == 258
    for r in result["results"]:
        assert len(r["cpu_ms_runs"]) == len(r["wall_ms_runs"]) == 2
        assert all(isinstance(t, float) and math.isfinite(t) and t > 0 for t in r["cpu_ms_runs"] + r["wall_ms_runs"])
        assert min(r["cpu_ms_runs"]) <= r["cpu_ms_per_token"] <= max(r["cpu_ms_runs"])
    short, long = (r["cache_mib"] for r in result["results"])
    assert 0 < short < long, result["results"]  # room for more tokens takes more memory
    # max_seq_len is the benchmark's own (the longest run, at least the recipe's)
    assert decode.main(["--override=--model.max_seq_len=64", "--out", str(out)]) == 2
    assert "sets model.max_seq_len, which this benchmark sets itself" in capsys.readouterr().err


def test_decode_bench_times_the_hf_folders_model(tmp_path):
    """--hf: the same model and weights through the modeling file an export --format hf folder ships."""
    pytest.importorskip("transformers", reason="the hf extra (pip install -e '.[hf]')")
    from bench import decode

    out = tmp_path / "decode.json"
    assert decode.main(["--hf", "--contexts", "5", "40", "--steps", "2", "--repeats", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["form"] == "hf" and [r["context"] for r in result["results"]] == [5, 40]
    short, long = (r["cache_mib"] for r in result["results"])
    assert 0 < short < long, result["results"]
    assert all(math.isfinite(t) and t > 0 for r in result["results"] for t in r["cpu_ms_runs"])


def test_data_throughput_bench_times_the_recipes_data_and_an_exact_resume(tmp_path):
    from bench import data_throughput

    out = tmp_path / "data_throughput.json"
    assert data_throughput.main(["recipes/debug.toml", "--batches", "5", "--override=--training.seq_len=32",
                                 "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert (result["source"], result["tokenizer"], result["rows_per_batch"], result["seq_len"]) == \
        ("PythonStdlibSource", "byte", 8, 32)
    assert result["tokens_timed"] == 5 * 8 * 32 and result["tokens_per_second"] > 0
    assert result["resume"]["after_tokens"] == 6 * 8 * 32 and result["resume"]["same_batch"] is True
    times = [result["seconds_to_first_batch"], result["resume"]["seconds_to_first_batch"]]
    assert all(isinstance(t, float) and math.isfinite(t) and t >= 0 for t in times), result


def test_data_throughput_bench_reads_the_checkouts_recipe_from_any_directory(tmp_path, monkeypatch):
    """Its default recipe was read from the working directory (file not found) while results go to the checkout."""
    from bench import data_throughput

    monkeypatch.chdir(tmp_path)
    out = tmp_path / "data_throughput.json"
    assert data_throughput.main(["--batches", "1", "--override=--training.seq_len=32", "--out", str(out)]) == 0
    assert os.path.samefile(json.loads(out.read_text())["recipe"], os.path.join(REPO_ROOT, "recipes", "debug.toml"))


def test_data_throughput_bench_says_what_the_recipe_sets_and_it_does_not_use(tmp_path, capsys):
    """The production recipe over local files: its streamed source's table goes unused, said as training says it."""
    from bench import data_throughput
    from tests.test_data_helpers import unique_texts, write_jsonl

    corpus = write_jsonl(str(tmp_path / "c.jsonl"), unique_texts(50))
    assert data_throughput.main(["recipes/nsa_125m.toml", "--batches", "1", "--override=--data.source=text_files",
                                 f"--override=--data.text_files.paths=['{corpus}']", "--override=--data.tokenizer=byte",
                                 "--override=--training.seq_len=64", "--out", str(tmp_path / "r.json")]) == 0
    err = capsys.readouterr().err
    assert "note: [data.huggingface] from recipes/presets/fineweb_edu.toml is not used" in err, err
    assert json.loads((tmp_path / "r.json").read_text())["source"] == "TextFilesSource"

def test_data_throughput_bench_refuses_a_bad_recipe_in_one_message(tmp_path, capsys):
    from bench import data_throughput

    code = data_throughput.main(["recipes/debug.toml", "--override=--data.nope=1", "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert code == 2 and "data.nope" in err and "Traceback" not in err, err
    assert not (tmp_path / "x").exists()

def test_loss_memory_bench_measures_both_ways_on_the_same_logits(tmp_path):
    from bench import loss_memory

    out = tmp_path / "loss_memory.json"
    assert loss_memory.main(["--tokens", "64", "--vocab-size", "300", "--out", str(out)]) == 0
    old, new = json.loads(out.read_text())["results"]
    assert (old["way"], new["way"]) == ("fp32_copy", "nsa_titan")
    assert new["loss"] == pytest.approx(old["loss"], rel=1e-5)
    assert new["peak_above_logits_gib"] >= 0 and new["seconds"] > 0


@pytest.mark.parametrize("argv, message", [
    (["bench.loss_memory", "--tokens", "-5"], "argument --tokens: -5 is not at least 1"),
    (["bench.data_resume", "--at", "2"], "argument --at: 2.0 is not in [0, 1)"),
    (["bench.attention", "--seq-lens", "0"], "argument --seq-lens: 0 is not at least 1"),
])
def test_a_benchmark_refuses_a_number_out_of_range_in_one_line(argv, message):
    """argparse's usage error (exit 2) before any work, not a traceback from inside the measurement."""
    import subprocess
    import sys

    from tests.launch import REPO_ROOT, env

    done = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, env=env(), cwd=REPO_ROOT,
                          timeout=120)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr, done.stderr


_TRAIN_SMOKE = ["--allow-cpu", "--recipes", "recipes/debug.toml", "--seq-lens", "64", "--tokens-per-step", "128",
                "--steps", "3", "--warmup", "1", "--vocab-size", "300"]


@pytest.mark.parametrize("extra, message", [
    (["--override=--training.steps=9"], "sets training.steps, which this benchmark sets itself"),
    (["--override=--data.synthetic.vocab_size=7"], "Fix: use --vocab-size"),
    (["--override=--job.dump_folder=elsewhere"], "sets job.dump_folder, which this benchmark sets itself (and records "
                                                 "as set). Fix: drop it."),
    (["--warmup", "3"], "--warmup 3 leaves no step to time out of --steps 3"),
    (["--tokens-per-step", "32"], "--tokens-per-step 32 is not a whole number of rows of 64 tokens"),
    (["--tokens-per-step", "96"], "e.g. --tokens-per-step 64"),
    (["--recipes", "nope.toml"], "nope.toml at 64 tokens: the recipe has 1 problem"),
    (["--override=--model.nope=3"], "model.nope: is not a recipe field"),
])
def test_train_throughput_refuses_what_it_would_not_measure_before_any_case_runs(tmp_path, capsys, extra, message):
    """Each would have run something other than the result records (9 steps recorded as 3, one 64-token row
    for 32 tokens a step, no step to time), or ended in a traceback: one error, exit 2, nothing written."""
    out = tmp_path / "train_throughput.json"
    assert train_throughput.main([*_TRAIN_SMOKE, *extra, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err, err
    assert not out.exists()


def test_train_throughput_refuses_a_vocabulary_the_stand_in_cannot_have(capsys):
    with pytest.raises(SystemExit) as exit_:
        train_throughput.main([*_TRAIN_SMOKE, "--vocab-size", "10"])
    assert exit_.value.code == 2 and "argument --vocab-size: 10 is not at least 258" in capsys.readouterr().err


_CP_SMOKE = ["--recipe", "recipes/debug.toml", "--seq-len", "128", "--cp", "1", "2", "--steps", "2", "--repeats", "1",
             "--vocab-size", "1000", "--allow-cpu", "--balance-seq-len", "0", "--override=--model.nsa.window_size=16"]


@pytest.mark.parametrize("extra, message", [
    (["--override=--model.nope=3"], "recipes/debug.toml at cp = 1: the recipe has 1 problem"),
    (["--recipe", "nope.toml"], "nope.toml at cp = 1: the recipe has 1 problem"),
    (["--override=--training.steps=5"], "sets training.steps, which this benchmark sets itself"),
    (["--vocab-size", "10"], "argument --vocab-size: 10 is not at least 258"),
])
def test_context_parallel_bench_refuses_a_bad_recipe_before_launching(tmp_path, monkeypatch, capsys, extra, message):
    """Every launch would fail of it, each recorded as torchrun's stderr: said once, exit 2, nothing launched."""
    from bench import context_parallel

    def launch(*args, **kwargs):
        raise AssertionError("launched")

    monkeypatch.setattr(context_parallel, "measure_cp", launch)
    try:
        code = context_parallel.main([*_CP_SMOKE, *extra, "--out", str(tmp_path / "cp.json")])
    except SystemExit as exit_:  # argparse's own error
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err, err
    assert not (tmp_path / "cp.json").exists()


TORCHRUN_STDERR = """\
/x/_dispatch.py:342: UserWarning: DTensor random operators may not have complete support on cpu device mesh
[rank1]: Traceback (most recent call last):
[rank1]:   File "/x/trainer.py", line 534, in _forward
[rank1]:     return self.model(self.shard.split(batch.inputs), context=context)
[rank1]: TypeError: FaultyTransformer.forward() got an unexpected keyword argument 'context'
[rank0]: Traceback (most recent call last):
[rank0]:   File "/x/trainer.py", line 534, in _forward
[rank0]: TypeError: FaultyTransformer.forward() got an unexpected keyword argument 'context'
[rank1]: error: the recipe has 2 problems:
[rank1]:   - one
[rank1]:   - two
W1127 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1) local_rank: 0 (pid: 1)
Traceback (most recent call last):
  File "/x/run.py", line 383, in launch_agent
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
bench.context_parallel FAILED
""" + "padding line of torchrun's report\n" * 100


def test_a_failed_launch_keeps_the_ranks_own_error_lines():
    """Not the last 2000 characters of stderr (torchrun's report of which child failed, the message cut mid-word)."""
    from bench.context_parallel import failure_summary

    assert failure_summary(TORCHRUN_STDERR) == (
        "rank 0, 1: TypeError: FaultyTransformer.forward() got an unexpected keyword argument 'context'\n"
        "rank 1: error: the recipe has 2 problems:\n  - one\n  - two")
    # nothing recognisable: the end of stderr from the start of a line
    assert failure_summary("x" * 50 + "\nsecond half\n", limit=20) == "second half\n"


def test_context_parallel_bench_exits_non_zero_when_a_cp_size_failed(tmp_path, monkeypatch, capsys):
    from bench import context_parallel

    def measure(recipe, cp, seq_len, *args):
        if cp == 2:
            return {"cp": cp, "seq_len": seq_len, "error": "rank 1: TypeError: boom"}
        return {"cp": cp, "seq_len": seq_len, "tokens_per_rank": seq_len, "ranks": []}

    monkeypatch.setattr(context_parallel, "measure_cp", measure)
    out = tmp_path / "cp.json"
    assert context_parallel.main([*_CP_SMOKE, "--out", str(out)]) == 1
    assert "error: cp = 2 failed: rank 1: TypeError: boom" in capsys.readouterr().err
    assert [run["cp"] for run in json.loads(out.read_text())["memory_and_time"]] == [1, 2]  # written all the same


def test_data_resume_bench_resumes_at_the_start_and_records_the_stream_libraries(tmp_path):
    """--at 0 (in its documented range) walked the whole shard for a cursor it never reached, then asked for the
    document after the end (a StopIteration traceback). The stream state is datasets' own: its version is kept."""
    import datasets
    import pyarrow

    from bench import data_resume

    out = tmp_path / "data_resume.json"
    assert data_resume.main(["--documents", "200", "--row-group", "50", "--at", "0", "--shuffle-buffer", "4",
                             "--folder", str(tmp_path), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["resumed_after_documents"] == 0 and result["seconds_to_first_document"]["count_cursor_replay"] >= 0
    assert (result["environment"]["datasets"], result["environment"]["pyarrow"]) == (datasets.__version__,
                                                                                     pyarrow.__version__)


def test_data_resume_bench_refuses_more_shards_than_documents(tmp_path, capsys):
    from bench import data_resume

    with pytest.raises(SystemExit) as exit_:
        data_resume.main(["--documents", "600", "--shards", "4000", "--folder", str(tmp_path)])
    assert exit_.value.code == 2 and "--shards 4000 is more than --documents 600" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # refused before the corpus is written


def test_reference_vs_sdpa_prints_one_json_object_and_writes_it_to_out(tmp_path, capsys):
    from bench import reference_vs_sdpa_cpu

    out = tmp_path / "reference.json"
    assert reference_vs_sdpa_cpu.main(["--seq-len", "40", "--heads", "2", "--kv-heads", "1", "--head-dim", "8",
                                       "--repeats", "1", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out) == json.loads(out.read_text())  # stdout is the object alone
    assert f"wrote {out}" in captured.err


@pytest.mark.parametrize("argv, message", [
    (["--seq-len", "0"], "argument --seq-len: 0 is not at least 1"),
    (["--heads", "2", "--kv-heads", "3"], "--kv-heads 3 does not divide --heads 2"),
    (["--repeats", "0"], "argument --repeats: 0 is not at least 1"),
])
def test_reference_vs_sdpa_refuses_bad_sizes_in_one_line(capsys, argv, message):
    from bench import reference_vs_sdpa_cpu

    with pytest.raises(SystemExit) as exit_:
        reference_vs_sdpa_cpu.main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--arch", "55"], "argument --arch: sm_55 is not a target this tool knows; choose from 80, 86, 89, 90"),
    (["--head-dims", "1024"], "argument --head-dims: 1024 is more than the Triton kernels' largest head dim, 256"),
    (["--heads", "5"], "--heads 5 must be a multiple of --kv-heads 4"),
])
def test_kernel_resources_refuses_what_it_cannot_compile_in_one_line(capsys, argv, message):
    """sm_55 aborted inside LLVM (exit 134); head dim 1024 was the op's UserError as a traceback."""
    from bench import kernel_resources

    with pytest.raises(SystemExit) as exit_:
        kernel_resources.main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_kernel_resources_json_is_a_report_with_its_environment(tmp_path, monkeypatch, capsys):
    from bench import kernel_resources
    from bench.report import render
    from components.errors import UserError

    monkeypatch.setattr(kernel_resources, "interpreting", lambda: False)
    monkeypatch.setattr(kernel_resources, "compile_one", lambda *args: [])
    out = tmp_path / "kernels.json"
    assert kernel_resources.main(["--head-dims", "64", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["benchmark"] == "kernel_resources" and result["arguments"]["arch"] == [90]
    assert result["environment"]["commit"] and "triton" in result["environment"]
    assert "NSA Triton kernels compiled offline" in render(result)

    def refuse(*args):
        raise UserError("NSA backend 'triton' needs block_size to divide sel_block_size")

    monkeypatch.setattr(kernel_resources, "compile_one", refuse)
    capsys.readouterr()
    assert kernel_resources.main(["--head-dims", "64"]) == 2
    assert capsys.readouterr().err == "error: NSA backend 'triton' needs block_size to divide sel_block_size\n"


def test_kernel_resources_refuses_to_run_under_the_interpreter(monkeypatch, capsys):
    from bench import kernel_resources

    monkeypatch.setattr(kernel_resources, "interpreting", lambda: True)
    assert kernel_resources.main([]) == 2
    assert "TRITON_INTERPRET is set" in capsys.readouterr().err


def test_tile_variants_times_the_shipped_shape_and_its_neighbours(tmp_path):
    """Under the interpreter: each kernel runs as shipped, then as each neighbour and each candidate given;
    every shape that builds gives deterministic results equal to the shipped one's up to fp32 summation
    order; a shape that cannot be built is recorded and the next one runs; the shipped shapes are back
    afterwards, and bench.report tables it. No time is asserted."""
    from components.nsa.triton import tile_configs
    from components.nsa.triton.launch import interpreting

    from bench import tile_variants
    from bench.report import render

    if not interpreting():
        pytest.skip("needs TRITON_INTERPRET=1 (set by tests/conftest.py without a GPU)")
    out = tmp_path / "tiles.json"
    shipped = tuple(tile_configs.tiles("interval_dkdv", 16, 4))
    code = tile_variants.main([*TINY_NSA, "--dtype", "fp32", "--kernels", "interval_dkdv", "selection", "--rep-ms", "1",
                               "--candidates", "interval_dkdv=16,16,4,1", "interval_dkdv=24,16,4,1", "--out", str(out)])
    assert code == 0
    rows = json.loads(out.read_text())["results"]
    dkdv = [r for r in rows if r["kernel"] == "interval_dkdv"]
    shapes = [tuple(r["tiles"]) for r in dkdv if r["branch"] == "compressed"]
    assert shapes == [shipped, (16, 16, 4, 1), (24, 16, 4, 1), *tile_variants.neighbours(shipped)[1:]]
    assert [r["branch"] for r in dkdv[:2]] == ["compressed", "window"] and dkdv[0]["shipped"]
    built = [r for r in dkdv if "error" not in r]
    assert len(built) == len(dkdv) - 2  # rows of 24: tl.arange takes powers of two only
    assert all(r["deterministic"] and r["ms"] > 0 for r in built)
    assert all(r["rel_rms"] < 1e-5 for r in built if not r["shipped"])
    assert all(r["tiles"] == [24, 16, 4, 1] for r in dkdv if "error" in r)
    selection = [r for r in rows if r["kernel"] == "selection"]
    assert all(r["equal_share"] == 1.0 for r in selection if not r["shipped"]) and len(selection) > 1
    assert tuple(tile_configs.tiles("interval_dkdv", 16, 4)) == shipped
    table = render(json.loads(out.read_text()))
    assert f"| 40 | interval_dkdv | compressed | {','.join(map(str, shipped))} (shipped) |" in table
    assert "| 40 | interval_dkdv | window | 24,16,4,1 | failed: " in table


def test_tile_variants_tries_no_launch_twice():
    """The selected kernels take at most a selection block's keys a tile: more keys launch the same kernel."""
    from bench.tile_variants import distinct_launches

    shapes = [(32, 64, 8, 2), (32, 128, 8, 2), (32, 32, 8, 2), (32, 64, 4, 2)]
    assert distinct_launches("selected_dkdv", shapes, 64) == [(32, 64, 8, 2), (32, 32, 8, 2), (32, 64, 4, 2)]
    assert distinct_launches("selected_dkdv", shapes, 128) == shapes
    assert distinct_launches("interval_dkdv", shapes, 64) == shapes


def test_tile_variants_refuses_a_malformed_candidate(capsys):
    from bench import tile_variants

    with pytest.raises(SystemExit) as stop:
        tile_variants.parse_args(["--candidates", "interval_dkdv=32,64,8"])
    assert stop.value.code == 2
    assert "give KERNEL=ROWS,KEYS,WARPS,STAGES" in capsys.readouterr().err
