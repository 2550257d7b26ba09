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
    other.write_text(json.dumps({"benchmark": "context_parallel"}))
    unnamed = tmp_path / "unnamed.json"
    unnamed.write_text(json.dumps({"documents": 10}))
    assert report.main([str(good), str(other), str(unnamed), str(tmp_path / "missing.json")]) == 1
    captured = capsys.readouterr()
    assert "## attention.json" in captured.out and "8.00x, met" in captured.out
    assert "other.json: ValueError: a 'context_parallel' report; this tool makes tables of attention, " \
           "attention_stages, train_throughput, loss_memory reports (read the others' JSON as it is)" in captured.err
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
