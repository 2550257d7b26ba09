"""bench.report: the README's tables from the benchmarks' JSON, targets checked (no GPU needed: the
reports are built here in the benchmarks' own format)."""

from __future__ import annotations

import json

from bench import report
from bench.attention import speedups

ENV = {"gpu": "NVIDIA H100 80GB HBM3", "torch": "2.11.0", "triton": "3.6.0", "cuda": "12.8",
       "commit": "0123456789abcdef", "time": "2026-11-25T12:00:00+00:00"}


def _attention_report(nsa_ms: dict[int, float]) -> dict:
    """SDPA at 1 ms per 1k tokens (fwd+bwd); NSA at the given fwd+bwd times (and half of them forward)."""
    results = []
    for T, ms in nsa_ms.items():
        results += [{"seq_len": T, "backend": "nsa-triton", "mode": "fwd", "ms": ms / 2, "peak_gib": 1.0},
                    {"seq_len": T, "backend": "nsa-triton", "mode": "fwd+bwd", "ms": ms, "peak_gib": 1.5},
                    {"seq_len": T, "backend": "sdpa", "mode": "fwd", "ms": T / 2048, "peak_gib": 1.0,
                     "kernel": "cudnn"},
                    {"seq_len": T, "backend": "sdpa", "mode": "fwd+bwd", "ms": T / 1024, "peak_gib": 2.0,
                     "kernel": "flash"}]
    results.append({"seq_len": 131072, "backend": "sdpa", "error": "out of memory"})
    return {"benchmark": "attention", "environment": ENV, "results": results, "speedups": speedups(results),
            "config": {"heads": 12, "kv_heads": 4, "head_dim": 64, "dtype": "bf16"}}


def test_the_op_table_and_its_targets():
    text = report.render(_attention_report({2048: 4.0, 8192: 6.0, 65536: 8.0}))
    assert text.startswith("Measured on NVIDIA H100 80GB HBM3; torch 2.11.0, Triton 3.6.0, CUDA 12.8, commit "
                           "0123456789ab, 2026-11-25.")
    assert "| 65536 | nsa-triton | 4.000 | 8.000 | 64.000 (flash) | 8.00x | 8.00x | 1.50 |" in text
    assert "| 131072 | sdpa | out of memory |" in text
    assert "- target: forward + backward >= 6x SDPA at 65536 tokens: 8.00x, met" in text
    assert "- target: break-even at 8192 tokens or below: from 8192 tokens on, met" in text  # 2k: 0.5x
    missed = report.render(_attention_report({2048: 1.0, 8192: 10.0, 16384: 8.0, 65536: 16.0}))
    assert "65536 tokens: 4.00x, MISSED" in missed
    assert "break-even at 8192 tokens or below: from 16384 tokens on, MISSED" in missed


def test_a_batch_of_rows_is_named_and_not_checked_against_the_one_row_targets():
    """The training shape (32 rows of 2k) is timed beside the one-row lengths the op's targets are set for."""
    batched = _attention_report({2048: 4.0})
    batched["config"]["batch"] = 32
    text = report.render(batched)
    assert "NSA op vs SDPA (12 / 4 heads, D = 64, bf16, 32 rows):" in text
    assert "target" not in text.replace("targets are set for one row", "")
    assert "the op's targets are set for one row" in text
    one_row = report.render(_attention_report({2048: 4.0}))
    assert "NSA op vs SDPA (12 / 4 heads, D = 64, bf16):" in one_row and "- target: break-even" in one_row
    stages = {"benchmark": "attention_stages", "environment": ENV, "config": {"batch": 32},
              "results": [{"seq_len": 2048, "stage": "selected", "fwd_ms": 1.0, "bwd_ms": 2.0, "share_of_fwd": 1.0,
                           "share_of_bwd": 1.0, "fwd_flops": 9e10, "fwd_tflops": 90.0, "bwd_tflops": 112.5},
                          {"seq_len": 2048, "stage": "gating", "fwd_ms": 0.1, "bwd_ms": 0.2, "share_of_fwd": 0.1,
                           "share_of_bwd": 0.1}]}  # no products: no TFLOP/s, as in a result written before them
    text = report.render(stages)
    assert "NSA op stages, 32 rows (ms; share of the op's forward / backward; TFLOP/s" in text
    assert "| 2048 | selected | 1.000 | 2.000 | 100% | 100% | 90.0 | 112.5 |" in text
    assert "| 2048 | gating | 0.100 | 0.200 | 10% | 10% | - | - |" in text


def test_the_training_table_and_its_targets():
    def row(recipe, T, rate, *overrides):
        return {"recipe": f"recipes/{recipe}.toml", "seq_len": T, "local_batch_size": 65536 // T,
                "tokens_per_second": rate, "peak_memory_gib": 10.0, "overrides": list(overrides)}

    results = [row("nsa_125m", 2048, 90_000), row("dense_125m", 2048, 100_000),
               row("nsa_125m", 32768, 30_000, "--activation_checkpoint.mode=full"),
               row("dense_125m", 32768, 20_000, "--activation_checkpoint.mode=full"),
               row("nsa_125m", 2048, 120_000, "--compile.mode=reduce-overhead"),
               {"recipe": "recipes/dense_125m.toml", "seq_len": 65536, "local_batch_size": 1, "error": "OOM: ..."},
               {**row("nsa_125m", 4096, 50_000), "local_batch_size": 4, "gradient_accumulation": 4,
                "out_of_memory_micro_batches": [16, 8]}]
    text = report.render({"benchmark": "train_throughput", "environment": ENV, "results": results})
    assert "| nsa_125m | 2048 | 32 | 90,000 | 10.00 | - |" in text
    assert "| nsa_125m | 2048 | 32 | 120,000 | 10.00 | --compile.mode=reduce-overhead |" in text
    assert "| dense_125m | 65536 | 1 | OOM: ... | | |" in text
    assert "| nsa_125m | 4096 | 4 x 4 (16, 8: out of memory) | 50,000 | 10.00 | - |" in text
    # the plain runs are compared (activation checkpointing is how 32k fits, not another setting)
    assert "- target: nsa_125m >= 0.8x dense_125m at 2048 tokens: 0.90x, met" in text
    assert "- target: nsa_125m >= 2.0x dense_125m at 32768 tokens: 1.50x, MISSED" in text


def test_the_command_reads_files_and_names_what_it_cannot_read(tmp_path, capsys):
    good = tmp_path / "attention.json"
    good.write_text(json.dumps(_attention_report({65536: 8.0})))
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"benchmark": "nonesuch"}))
    unnamed = tmp_path / "unnamed.json"
    unnamed.write_text(json.dumps({"documents": 10}))
    assert report.main([str(good), str(other), str(unnamed), str(tmp_path / "missing.json")]) == 1
    captured = capsys.readouterr()
    assert "## attention.json" in captured.out and "8.00x, met" in captured.out
    assert "other.json: ValueError: a 'nonesuch' report; this tool makes tables of attention, attention_stages, " \
           "train_throughput, loss_memory, context_parallel, data_resume, data_throughput, decode, " \
           "nsa_reference_vs_sdpa_cpu, kernel_resources, tile_variants, tile_choice, selected_flex reports (read the others' JSON as " \
           "it is)" in captured.err
    assert "unnamed.json: ValueError: no benchmark report (it names no 'benchmark')" in captured.err
    assert "missing.json: FileNotFoundError" in captured.err


def test_a_result_of_uncommitted_code_says_so_with_the_files(tmp_path, monkeypatch):
    """The commit alone would claim code that was not measured: the JSON lists the tracked files that
    differed and the report names them."""
    import subprocess

    from bench import environment

    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "kernel.py").write_text("x = 1\n")
    (tmp_path / "results").mkdir()
    git("add", "kernel.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    monkeypatch.setattr(environment, "RESULTS_DIR", str(tmp_path / "results"))
    (tmp_path / "untracked.txt").write_text("not code of the commit, not a change to it\n")
    commit, changed = environment.git_commit()
    assert not commit.endswith("-dirty") and changed == []
    (tmp_path / "kernel.py").write_text("x = 2\n")
    commit, changed = environment.git_commit()
    assert commit.endswith("-dirty") and changed == ["kernel.py"]
    line = report.environment_line({**ENV, "commit": commit, "changed_files": changed})
    assert f"commit {commit[:12]} with changes to kernel.py, 2026-11-25." in line
    assert "with uncommitted changes" in report.environment_line({**ENV, "commit": "0123456789abcdef-dirty"})


CPU_ENV = {"cpu": "x86_64", "cpu_count": 2, "torch": "2.13.0+cpu", "triton": "3.9.0", "commit": "0123456789abcdef",
           "time": "2026-11-25T12:00:00+00:00"}


def _every_kind() -> dict[str, dict]:
    """A small report of each kind the benchmarks write, in their own format."""
    rank = {"rank": 0, "cp": 1, "step_seconds": [2.0, 1.0], "median_step_seconds": 1.0, "peak_memory_gib": 1.5,
            "memory_kind": "process peak resident set"}
    return {
        "context_parallel": {
            "benchmark": "context_parallel", "environment": CPU_ENV, "recipe": "recipes/debug.toml",
            "overrides": ["--training.device=cpu"],
            "memory_and_time": [{"cp": 1, "seq_len": 128, "tokens_per_rank": 128, "ranks": [rank],
                                 "max_peak_memory_gib": 1.5, "max_median_step_seconds": 1.0},
                                {"cp": 2, "seq_len": 128, "error": "error: rank 1: the recipe\nhas | a problem"}],
            "balance": [{"cp": 2, "split": "head-tail", "seq_len": 128, "backend": "reference",
                         "rank_seconds": [1.0, 3.0], "imbalance": 1.5}]},
        "data_resume": {
            "benchmark": "data_resume", "environment": CPU_ENV, "documents": 600, "row_group": 50, "shards": 2,
            "shuffle_buffer": 16, "resumed_after_documents": 240, "seconds_to_reach_cursor_from_start": 0.5,
            "seconds_to_first_document": {"stream_state_cursor": 0.031, "count_cursor_replay": 0.25}},
        "data_throughput": {
            "benchmark": "data_throughput", "environment": CPU_ENV, "recipe": "recipes/debug.toml", "overrides": [],
            "source": "PythonStdlibSource", "tokenizer": "byte", "logical_shards": 64, "rows_per_batch": 8,
            "seq_len": 256, "seconds_to_first_batch": 0.029, "batches_timed": 300, "tokens_timed": 614400,
            "tokens_per_second": 6889576,
            "resume": {"after_tokens": 616448, "seconds_to_first_batch": 0.003, "same_batch": True}},
        "decode": {
            "benchmark": "decode", "environment": CPU_ENV, "recipe": "recipes/debug.toml", "overrides": [],
            "vocab_size": 258, "threads": 1, "steps": 16, "repeats": 2,
            "results": [{"context": 8000, "cpu_ms_per_token": 2.754, "wall_ms_per_token": 3.1,
                         "cpu_ms_runs": [2.7, 2.8], "wall_ms_runs": [3.0, 3.2]}]},
        "nsa_reference_vs_sdpa_cpu": {
            "benchmark": "nsa_reference_vs_sdpa_cpu", "environment": CPU_ENV, "threads": 2, "batch": 1,
            "seq_len": 512, "heads": 2, "head_dim": 16, "dtype": "float32",
            "results": [{"kv_heads": 1, "group_size": 2, "nsa_forward_s": 0.4, "sdpa_forward_s": 0.2,
                         "forward_ratio": 2.0, "nsa_forward_parts_s": {"selection": 0.05},
                         "nsa_forward_backward_s": 1.2, "sdpa_forward_backward_s": 0.6,
                         "forward_backward_ratio": 2.0}]},
        "kernel_resources": {
            "benchmark": "kernel_resources", "environment": CPU_ENV,
            "rows": [{"dtype": "bf16", "head_dim": 64, "name": "window_fwd", "target": "sm_90", "constants": {},
                      "num_warps": 4, "num_stages": 2, "shared_bytes": 300 * 1024, "registers": 128,
                      "stack_bytes": 0, "tensor_cores": "wgmma", "async_loads": 6,
                      "shared_limit_bytes": 227 * 1024}],
            "failures": ["sm_90 bf16 D=64: window_fwd needs 307200 B of shared memory, the limit is 232448 B"]},
    }


def test_every_kind_of_result_the_benchmarks_write_is_rendered():
    tables = {kind: report.render(r) for kind, r in _every_kind().items()}
    assert "| 1 | 128 | 128 | 1.50 | 1.000 | process peak resident set |" in tables["context_parallel"]
    assert "| 2 | 128 | error: rank 1: the recipe has / a problem | | | |" in tables["context_parallel"]
    assert "| 2 | head-tail | 128 | reference | 1.000 / 3.000 | 1.50 |" in tables["context_parallel"]
    assert "| 600 | 50 | 2 | 16 | 240 | 0.031 | 0.250 | 0.500 |" in tables["data_resume"]
    assert "| PythonStdlibSource | byte | 8 x 256 | 64 | 6,889,576 | 0.029 | 616,448 | 0.003 | yes |" \
        in tables["data_throughput"]
    assert "| 8,000 | 2.75 | 3.10 |" in tables["decode"]
    assert "(recipes/debug.toml as its --format hf folder runs it, overrides" in \
        report.render({**_every_kind()["decode"], "form": "hf"})
    assert "| 1 | 0.400 | 0.200 | 2.00 | 1.200 | 0.600 | 2.00 | selection 0.050 |" \
        in tables["nsa_reference_vs_sdpa_cpu"]
    assert "| sm_90 | bf16 | 64 | window_fwd | 4 | 2 | 300.0 (OVER) | 227 | 128 | 0 | wgmma | 6 |" \
        in tables["kernel_resources"]
    assert "- failed: sm_90 bf16 D=64: window_fwd needs" in tables["kernel_resources"]
    # data_resume's results written before it named itself are still recognised by their numbers
    unnamed = {k: v for k, v in _every_kind()["data_resume"].items() if k != "benchmark"}
    assert "| 600 | 50 | 2 |" in report.render(unnamed)


def test_a_kernel_resources_result_of_an_older_release_is_rendered(tmp_path, capsys):
    """Written before kernel_resources named itself (rows and failures, nothing else; no tensor-core, stages or
    async-load columns): its table, with '-' for what was not recorded."""
    old = {k: v for k, v in _every_kind()["kernel_resources"].items() if k in ("rows", "failures")}
    unrecorded = ("tensor_cores", "num_stages", "async_loads")
    old["rows"] = [{k: v for k, v in row.items() if k not in unrecorded} for row in old["rows"]]
    path = tmp_path / "k.json"
    path.write_text(json.dumps(old))
    assert report.main([str(path)]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "The machine, versions and commit were not recorded (a result of an older release)." in out
    assert "| sm_90 | bf16 | 64 | window_fwd | 4 | - | 300.0 (OVER) | 227 | 128 | 0 | - | - |" in out
    path.write_text(json.dumps({"rows": [], "failures": []}))
    assert report.main([str(path)]) == 0 and "NSA Triton kernels compiled offline" in capsys.readouterr().out


def test_a_gpu_benchmark_run_on_the_cpu_or_interpreted_is_marked_as_a_smoke_run():
    train = {"benchmark": "train_throughput", "environment": CPU_ENV, "results": []}
    line = report.render(train).splitlines()[0]
    assert "a CPU smoke run, not a GPU measurement" in line and "CUDA" not in line, line
    interpreted = report.environment_line({**CPU_ENV, "triton_interpret": True}, "attention_stages")
    assert "Triton 3.9.0 (interpreted: TRITON_INTERPRET=1)" in interpreted
    # the CPU benchmarks measure the CPU: no mark; a GPU result names its CUDA
    assert "smoke" not in report.render(_every_kind()["data_resume"]).splitlines()[0]
    assert "smoke" not in report.environment_line(CPU_ENV, "loss_memory")  # the README's CPU measurement
    assert "smoke" not in report.environment_line(ENV, "attention") and "CUDA 12.8" in report.environment_line(ENV)


def test_the_results_kept_in_the_repository_all_render(capsys):
    import glob
    import os

    files = sorted(glob.glob(os.path.join(os.path.dirname(report.__file__), "results", "*.json")))
    assert files and report.main(files) == 0, capsys.readouterr().err


def test_a_file_that_is_no_report_is_named_in_one_line(tmp_path, capsys):
    listed = tmp_path / "list.json"
    listed.write_text(json.dumps([{"benchmark": "attention"}]))
    assert report.main([str(listed)]) == 1
    err = capsys.readouterr().err
    assert err == f"error: {listed}: ValueError: not a benchmark report (a JSON list, not an object); this tool " \
                  f"reads the files the benchmarks write\n"
