"""Every NSA Triton kernel compiles for Hopper and Ampere and fits their shared memory, checked on CPU.

The interpreter tests prove the kernels' arithmetic; this proves what only the compiler sees: the
kernels of one forward + backward (the selected branch in every layout) are compiled by Triton for
sm_90 (H100/H200) and sm_80 (A100), ptxas included, at head dims 32 to 256 and in bf16, fp16 and
fp32, and none needs more shared memory than the GPU has (that would fail at launch); on sm_90 in
bf16 and fp16 none spills registers to local memory, and the interval kernels' products use
Hopper's warpgroup MMA (wgmma) up to head dim 128; in half types every attention kernel built with
two or more pipeline stages prefetches its loop's loads (asynchronous copies). Runs in subprocesses
without TRITON_INTERPRET.
"""

import json
import subprocess
import sys

from tests.launch import REPO_ROOT, env

KERNELS = {
    "_interval_attn_fwd_kernel", "_select_blocks_kernel", "_selected_attn_fwd_kernel", "_softmax_delta_kernel",
    "_interval_attn_bwd_dq_kernel", "_interval_attn_bwd_dkdv_kernel", "_selected_attn_bwd_dq_kernel",
    "_selected_attn_bwd_dkdv_kernel", "_sum_partials_kernel", "_gate_fwd_kernel", "_gate_bwd_kernel",
    # the selected branch's block layout (tile_configs.selected_layout)
    "_selected_fwd_blocks_kernel", "_merge_partials_kernel", "_sum_dq_partials_kernel",
}
# (arguments, what they cover). The two runs go in parallel: each uses one core.
RUNS = {
    "hopper": (["--arch", "90", "--dtypes", "bf16", "--head-dims", "32", "64", "128", "256",
                "--heads", "12", "--kv-heads", "4"], "the 125M layout (G = 3), every head dim"),
    "ampere": (["--arch", "80", "--dtypes", "fp32", "fp16", "--head-dims", "256", "96",
                "--heads", "16", "--kv-heads", "1", "--num-selected", "7"],
               "the widest fp32 tiles on the smaller shared memory, an odd head dim, G = 16"),
}


def test_kernels_compile_for_hopper_and_ampere_within_shared_memory(tmp_path):
    child_env = {k: v for k, v in env().items() if k != "TRITON_INTERPRET"}
    child_env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")  # compile for real, not from an old cache
    procs = {}
    for name, (args, _) in RUNS.items():
        cmd = [sys.executable, "-m", "bench.kernel_resources", *args, "--json", str(tmp_path / f"{name}.json")]
        procs[name] = subprocess.Popen(cmd, cwd=REPO_ROOT, env=child_env, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True)
    try:
        outputs = {name: proc.communicate(timeout=900) for name, proc in procs.items()}
    finally:
        for proc in procs.values():  # one left compiling would take the cores of every later test
            proc.kill()
    for name, proc in procs.items():
        assert proc.returncode == 0, f"{name} ({RUNS[name][1]}):\n{outputs[name][1][-6000:]}"
        report = json.loads((tmp_path / f"{name}.json").read_text())
        assert report["failures"] == []
        configs = {(r["target"], r["dtype"], r["head_dim"]) for r in report["rows"]}
        args = RUNS[name][0]
        dtypes = args[args.index("--dtypes") + 1:args.index("--head-dims")]
        dims = args[args.index("--head-dims") + 1:args.index("--heads")]
        assert configs == {(f"sm_{args[1]}", d, int(D)) for d in dtypes for D in dims}
        for config in configs:
            rows = [r for r in report["rows"] if (r["target"], r["dtype"], r["head_dim"]) == config]
            assert {r["name"] for r in rows} == KERNELS, config
            # The interval kernels built again with a selection: the selected branch's masked layout.
            masked = {r["name"] for r in rows if r["constants"].get("SELECTED")}
            assert masked == {"_interval_attn_fwd_kernel", "_interval_attn_bwd_dq_kernel",
                              "_interval_attn_bwd_dkdv_kernel"}, config
            for r in rows:
                assert 0 <= r["shared_bytes"] <= r["shared_limit_bytes"], r
                assert r["registers"] is None or 0 < r["registers"] <= 255, r
                if r["target"] == "sm_90" and r["dtype"] in ("bf16", "fp16"):  # the shapes are tuned for Hopper
                    assert r["stack_bytes"] == 0, r
                    if r["name"].startswith("_interval_attn") and r["head_dim"] <= 128:
                        # The compressed and window branches, most of the op's products: Hopper's warpgroup
                        # MMA, not the warp-level one a tile of too few rows falls back to.
                        assert r["tensor_cores"] == "wgmma", r
                if r["target"] == "sm_80" and r["dtype"] == "fp16" and r["name"].startswith("_interval_attn"):
                    assert r["tensor_cores"] == "mma", r  # Ampere's tensor cores: the warp-level MMA only
                if (r["dtype"] in ("bf16", "fp16") and r["name"].startswith(("_interval_attn", "_selected_"))
                        and r["num_stages"] >= 2):
                    # The attention loops' key (or query) tiles are prefetched: a branch in the loop's body, or
                    # the loading loop nested inside another, keeps Triton's pipeliner out with no error.
                    assert r["async_loads"] > 0, r
                if r["name"] in ("_gate_fwd_kernel", "_softmax_delta_kernel", "_sum_partials_kernel"):
                    assert r["tensor_cores"] == "none", r  # no dot in them
