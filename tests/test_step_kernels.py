"""bench.step_kernels: a profiled step's GPU kernels summed by name and kind, per step; bench.train_throughput
--profile records it for one step after the timed ones, and bench.report tables it."""

from __future__ import annotations

import gzip
import json

from bench import step_kernels, train_throughput
from bench.report import render
from tests.test_bench_smoke import _TRAIN_SMOKE


def _kernel(name, dur_us, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": 0, "dur": dur_us}


def _trace(tmp_path, events):
    path = tmp_path / "trace_rank0.json.gz"
    with gzip.open(path, "wt", encoding="utf-8") as fh:
        json.dump({"traceEvents": events}, fh)
    return str(path)


def test_a_trace_is_summed_by_kernel_and_kind_per_step(tmp_path):
    long_name = "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_nn_align8>" + "x" * 99
    events = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#21", "ts": 0, "dur": 500_000},
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#22", "ts": 600_000, "dur": 300_000},
        # CUDA traces copy each step onto the GPU's timeline, once per stream: no step of its own.
        {"ph": "X", "cat": "gpu_user_annotation", "name": "ProfilerStep#21", "ts": 1_000, "dur": 450_000},
        {"ph": "X", "cat": "gpu_user_annotation", "name": "ProfilerStep#22", "ts": 601_000, "dur": 250_000},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 10, "dur": 90_000},  # host time: not a kernel
        _kernel("_selected_attn_fwd_kernel", 120_000), _kernel("_selected_attn_fwd_kernel", 100_000),
        _kernel("_interval_attn_bwd_dkdv_kernel", 40_000),
        _kernel(long_name, 160_000),
        _kernel("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", 20_000),
        _kernel("triton_per_fused__to_copy_mul_sum_3", 30_000),
        _kernel("void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128>>", 50_000),
        _kernel("ncclDevKernel_AllGather_RING_LL", 10_000),
        _kernel("Memcpy DtoD (Device -> Device)", 6_000, cat="gpu_memcpy"),
        _kernel("void at::native::radixSortKVInPlace<int>", 14_000),
    ]
    summary = step_kernels.summarize(_trace(tmp_path, events), top=3)
    assert summary["steps"] == [21, 22] and summary["step_ms"] == 400.0
    assert summary["kinds"] == {"nsa_triton": 130.0, "attention": 25.0, "matmul": 90.0, "compiled": 15.0,
                                "communication": 5.0, "memory": 3.0, "other": 7.0}
    assert summary["gpu_ms"] == sum(summary["kinds"].values()) == 275.0
    assert summary["kernels"] == [
        {"name": "_selected_attn_fwd_kernel", "kind": "nsa_triton", "ms": 110.0, "calls": 1.0},
        {"name": long_name, "kind": "matmul", "ms": 80.0, "calls": 0.5},
        {"name": "void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128>>", "kind": "attention", "ms": 25.0,
         "calls": 0.5},
    ]


def test_a_missing_trace_is_said_and_the_benchmark_goes_on(tmp_path):
    case = {"recipe": "recipes/nsa_125m.toml", "seq_len": 2048, "local_batch_size": 32, "tokens_per_second": 1.0,
            "step_profile": train_throughput.profile_of(str(tmp_path / "absent.json.gz"))}
    assert render({"benchmark": "train_throughput", "results": [case]}).endswith(
        "GPU time of nsa_125m at 2048 tokens: no trace written: the run ended before its profiled step")


def test_every_nsa_triton_kernel_is_known_by_name():
    names = step_kernels.nsa_kernel_names()
    assert {"_interval_attn_fwd_kernel", "_interval_attn_bwd_dq_kernel", "_interval_attn_bwd_dkdv_kernel",
            "_select_blocks_kernel", "_selected_attn_fwd_kernel", "_selected_fwd_blocks_kernel",
            "_selected_attn_bwd_dq_kernel", "_selected_attn_bwd_dkdv_kernel", "_gate_fwd_kernel",
            "_gate_bwd_kernel", "_softmax_delta_kernel"} <= names
    assert all(name.endswith("_kernel") for name in names)


def test_train_throughput_profiles_one_step_after_the_timed_ones(tmp_path):
    """Steps 2-3 are timed (1 is warmup), 4 warms the profiler up and 5 is profiled: neither is in the median."""
    out = tmp_path / "train_throughput.json"
    assert train_throughput.main([*_TRAIN_SMOKE, "--profile", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    (case,) = report["results"]
    assert case["steps"] == 3 and case["timed_steps"] == [2, 3] and case["tokens_per_second"] > 0
    assert case["final_loss"] is not None
    profile = case["step_profile"]
    assert profile["steps"] == [5] and profile["step_ms"] > 0
    assert profile["gpu_ms"] == 0 and profile["kernels"] == []  # a CPU trace holds no GPU kernels
    assert "GPU time of step 5 of debug at 64 tokens: 0.0 ms of kernels in a " in render(report)


def test_train_throughput_refuses_to_have_its_profiling_overridden(tmp_path, capsys):
    assert train_throughput.main([*_TRAIN_SMOKE, "--override=--profiling.enable=true",
                                  "--out", str(tmp_path / "x.json")]) == 2
    assert "sets profiling.enable, which this benchmark sets itself" in capsys.readouterr().err


def test_report_tables_a_gpu_step_profile():
    case = {"recipe": "recipes/nsa_125m.toml", "seq_len": 2048, "local_batch_size": 32, "tokens_per_second": 1.0,
            "step_profile": {"steps": [22], "step_ms": 512.0, "gpu_ms": 500.0,
                             "kinds": {"nsa_triton": 200.0, "matmul": 250.0, "other": 50.0, "memory": 0.0},
                             "kernels": [{"name": "_selected_attn_bwd_dkdv_kernel", "kind": "nsa_triton", "ms": 90.0,
                                          "calls": 12.0},
                                         {"name": "void at::native::elementwise_kernel<" + "x" * 150, "kind": "other",
                                          "ms": 1.0, "calls": 2.0}]}}
    table = render({"benchmark": "train_throughput", "results": [case]})
    assert ("GPU time of step 22 of nsa_125m at 2048 tokens: 500.0 ms of kernels in a 512.0 ms step: matmul 250.0 ms "
            "(50%), nsa_triton 200.0 ms (40%), other 50.0 ms (10%).") in table
    assert "| _selected_attn_bwd_dkdv_kernel | nsa_triton | 90.00 | 12 |" in table
    cut = ("void at::native::elementwise_kernel<" + "x" * 150)[:97] + "..."  # 100 characters in the table
    assert f"| {cut} | other | 1.00 | 2 |" in table
