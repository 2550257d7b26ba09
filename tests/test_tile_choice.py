"""bench.tile_choice: from tile_variants' rows, the fastest shape that is deterministic and as exact as the shipped
one, where it gains enough; every other shape passed over with its reason. Then the file it writes is a launch
shapes file, and bench.report tables it. The last test runs the measurement itself under the interpreter."""

from __future__ import annotations

import json
import math

import pytest
import torch

from bench import tile_choice
from bench.launch_shapes import LaunchShape, read_shapes
from bench.report import render
from components.nsa.triton.tile_configs import Tiles
from tests.test_bench_smoke import TINY_NSA

SHIPPED = [32, 64, 8, 1]


def _row(tiles, ms, branch="compressed", kernel="interval_dkdv", **extra):
    shipped = list(tiles) == SHIPPED
    row = {"seq_len": 65536, "kernel": kernel, "branch": branch, "tiles": list(tiles), "shipped": shipped, "ms": ms,
           "deterministic": True, "rel_rms": 0.0 if shipped else 1e-3, "rel_rms_exact": 3e-3}
    row.update(extra)
    return row


def _report(rows, dtype="bf16", head_dim=128):
    return {"benchmark": "tile_variants", "config": {"dtype": dtype, "head_dim": head_dim}, "results": rows}


def _choose(rows, min_gain=0.03, **report):
    changes, summaries = tile_choice.choose([("run.json", _report(rows, **report))], min_gain)
    assert len(summaries) == 1
    return changes, summaries[0]


def _both_branches(tiles, compressed_ms, window_ms, **extra):
    return [_row(tiles, compressed_ms, **extra), _row(tiles, window_ms, branch="window", **extra)]


def test_the_fastest_qualifying_shape_over_all_workloads_is_chosen():
    rows = (_both_branches(SHIPPED, 10.0, 4.0) + _both_branches([32, 64, 8, 2], 7.0, 4.0)
            + _both_branches([64, 64, 8, 1], 6.0, 9.0))  # fastest on one branch, slower summed
    changes, summary = _choose(rows)
    assert changes == [LaunchShape("interval_dkdv", 128, 2, Tiles(32, 64, 8, 2))]
    assert summary["verdict"] == "changed" and summary["chosen_ms"] == 11.0 and summary["shipped_ms"] == 14.0
    assert summary["rejected"] == []


@pytest.mark.parametrize("extra, why", [
    ({"deterministic": False}, "not deterministic"),
    ({"rel_rms_exact": 4.6e-3}, "relative RMS 4.6e-03 from the exact result (the shipped shape's: 3.0e-03)"),
    ({"rel_rms_exact": 6e-3}, "relative RMS 6.0e-03 from the exact result"),
    ({"rel_rms_exact": None}, "no exact (fp32) result"),
    ({"error": "OutOfResources: shared memory"}, "did not build or launch (OutOfResources: shared memory)"),
])
def test_a_faster_shape_that_is_wrong_is_passed_over_with_its_reason(extra, why):
    bad = _both_branches([32, 64, 8, 2], 5.0, 2.0)
    bad[1].update(extra)  # one branch of two is enough to refuse the shape
    bad[1] = {k: v for k, v in bad[1].items() if v is not None}
    changes, summary = _choose(_both_branches(SHIPPED, 10.0, 4.0) + bad)
    assert changes == [] and summary["verdict"].startswith("kept: no shape 3% faster")
    assert [r["tiles"] for r in summary["rejected"]] == [[32, 64, 8, 2]] and why in summary["rejected"][0]["why"]


def test_a_shape_not_measured_on_every_workload_is_passed_over():
    rows = _both_branches(SHIPPED, 10.0, 4.0) + [_row([32, 64, 8, 2], 1.0)]
    changes, summary = _choose(rows)
    assert changes == [] and summary["rejected"][0]["why"] == "not measured on 1 of the 2 workloads"


def test_a_gain_below_the_least_keeps_the_shipped_shape():
    rows = _both_branches(SHIPPED, 10.0, 4.0) + _both_branches([32, 64, 8, 2], 9.8, 3.9)
    changes, summary = _choose(rows)
    assert changes == [] and summary["verdict"] == "kept: no shape 3% faster (the best, 32,64,8,2, 13.700 ms)"
    assert _choose(rows, min_gain=0.01)[0] == [LaunchShape("interval_dkdv", 128, 2, Tiles(32, 64, 8, 2))]


@pytest.mark.parametrize("extra, why", [({"rel_rms_exact": 7e-3}, "relative RMS 7.0e-03 from the exact result"),
                                        ({"deterministic": False}, "not deterministic"),
                                        ({"error": "RuntimeError: x"}, "did not build")])
def test_a_shipped_shape_that_is_itself_wrong_changes_nothing(extra, why):
    rows = _both_branches(SHIPPED, 10.0, 4.0) + _both_branches([32, 64, 8, 2], 5.0, 2.0)
    rows[0].update(extra)
    changes, summary = _choose(rows)
    assert changes == [] and summary["verdict"].startswith("kept: the shipped shape itself") and why in summary[
        "verdict"]


def test_selections_must_agree_with_the_shipped_shape():
    rows = [_row(SHIPPED, 10.0, kernel="selection", branch="selection", rel_rms_exact=None),
            _row([32, 0, 8, 1], 5.0, kernel="selection", branch="selection", equal_share=0.995),
            _row([128, 0, 8, 1], 8.0, kernel="selection", branch="selection", equal_share=0.9995)]
    changes, summary = _choose(rows)
    assert changes == [LaunchShape("selection", 128, 2, Tiles(128, 0, 8, 1))]
    assert summary["rejected"] == [{"tiles": [32, 0, 8, 1], "why": "selects 99.50% of the shipped shape's blocks"}]


def test_a_selected_dkdv_shape_that_moves_the_forward_to_another_layout_is_passed_over():
    """Its key tile sizes the block layout's partials: past their limit training runs the forward query-major,
    which the backward's rows do not time."""
    rows = [_row(SHIPPED, 10.0, kernel="selected_dkdv", branch="selected", selected_layout="block"),
            _row([32, 32, 8, 1], 6.0, kernel="selected_dkdv", branch="selected", selected_layout="query"),
            _row([32, 64, 4, 1], 9.0, kernel="selected_dkdv", branch="selected", selected_layout="block")]
    changes, summary = _choose(rows)
    assert changes == [LaunchShape("selected_dkdv", 128, 2, Tiles(32, 64, 4, 1))]
    assert summary["rejected"][0]["tiles"] == [32, 32, 8, 1]
    assert summary["rejected"][0]["why"].startswith("moves the selected branch to the query layout (the shipped "
                                                    "shape's: block)")


def test_a_distance_that_is_not_a_number_qualifies_nothing():
    nan = float("nan")
    changes, summary = _choose(_both_branches(SHIPPED, 10.0, 4.0) + _both_branches([32, 64, 8, 2], 5.0, 2.0,
                                                                                     rel_rms_exact=nan))
    assert changes == [] and "relative RMS nan from the exact result" in summary["rejected"][0]["why"]
    rows = _both_branches(SHIPPED, 10.0, 4.0, rel_rms_exact=nan) + _both_branches([32, 64, 8, 2], 5.0, 2.0)
    changes, summary = _choose(rows)
    assert changes == [] and summary["verdict"].startswith("kept: the shipped shape itself relative RMS nan")


def test_fp32_shapes_are_held_to_the_shipped_fp32_result():
    rows = [_row(SHIPPED, 10.0, rel_rms_exact=None), _row([32, 64, 8, 2], 5.0, rel_rms=2e-5, rel_rms_exact=None),
            _row([16, 64, 8, 1], 8.0, rel_rms=1e-6, rel_rms_exact=None)]
    for row in rows:
        del row["rel_rms_exact"]
    changes, summary = _choose(rows, dtype="fp32", head_dim=100)
    assert changes == [LaunchShape("interval_dkdv", 128, 4, Tiles(16, 64, 8, 1))]
    assert summary["rejected"][0]["why"] == "relative RMS 2.0e-05 from the shipped fp32 result"


def test_a_run_cut_short_says_what_it_did_not_measure():
    """A step cut at its time limit: a kernel with only its shipped shape timed, and one never reached."""
    rows = _both_branches(SHIPPED, 10.0, 4.0) + [_row(SHIPPED, 3.0, kernel="interval_dq")]
    config = {"dtype": "bf16", "head_dim": 128, "kernels": ["interval_dkdv", "interval_dq", "interval_fwd"]}
    changes, summaries = tile_choice.choose([("run.json", {"config": config, "results": rows})], 0.03)
    assert changes == []
    assert {s["kernel"]: s["verdict"] for s in summaries} == {
        "interval_dkdv": "kept: no other shape measured (the run ended after the shipped one)",
        "interval_dq": "kept: no other shape measured (the run ended after the shipped one)",
        "interval_fwd": "kept: not measured (run.json ended before it)"}


def test_a_reference_with_nothing_finite_holds_no_shape_to_anything():
    import torch

    from bench.tile_variants import compare, relative_rms

    assert math.isnan(relative_rms(torch.ones(3), torch.full((3,), float("inf"))))
    # Whichever output's reference is broken (max() keeps a NaN only where it comes first).
    good, broken = torch.ones(4) * 1.01, torch.full((4,), float("nan"))
    ones = (torch.ones(4), torch.ones(4))
    assert math.isnan(compare(ones, ones, None, (good, broken))["rel_rms_exact"])
    assert math.isnan(compare(ones, ones, (good, broken), None)["rel_rms"])
    assert relative_rms(torch.ones(0), torch.ones(0)) == 0.0
    assert relative_rms(torch.tensor([1.0, 5.0]), torch.tensor([1.0, float("inf")])) == 0.0  # +inf entries left out


def test_main_writes_a_launch_shapes_file_and_report_tables_it(tmp_path, capsys):
    source = tmp_path / "tile_variants-x.json"
    rows = _both_branches(SHIPPED, 10.0, 4.0) + _both_branches([32, 64, 8, 2], 7.0, 4.0) + _both_branches(
        [32, 64, 4, 1], 1.0, 1.0, deterministic=False)
    source.write_text(json.dumps(_report(rows)))
    out = tmp_path / "choice.json"
    assert tile_choice.main([str(source), "--out", str(out)]) == 0
    line = "interval_dkdv       D 128 2 B  32,64,8,1 14.000 ms -> 32,64,8,2 11.000 ms (1.27x)"
    assert line in capsys.readouterr().out
    assert read_shapes(str(out)) == [LaunchShape("interval_dkdv", 128, 2, Tiles(32, 64, 8, 2))]
    table = render(json.loads(out.read_text()))
    assert "| interval_dkdv | 128 | 2 | 32,64,8,1 | 14.000 | 32,64,8,2 | 11.000 | 1.27x | changed |" in table
    assert "- interval_dkdv (D 128) 32,64,4,1: not deterministic (two calls gave different bits)" in table
    assert "smoke run" not in table  # it measures nothing itself


@pytest.mark.parametrize("content, message", [("[]", "not a bench.tile_variants report"),
                                              ('{"benchmark": "tile_variants", "config": {}}', "names no dtype"),
                                              ("{", "not JSON")])
def test_main_refuses_a_file_that_is_no_tile_variants_report(tmp_path, capsys, content, message):
    source = tmp_path / "x.json"
    source.write_text(content)
    assert tile_choice.main([str(source), "--out", str(tmp_path / "out.json")]) == 2
    assert message in capsys.readouterr().err and not (tmp_path / "out.json").exists()


def test_measured_under_the_interpreter_in_fp16_every_shape_is_held_to_the_fp32_kernels(tmp_path):
    """tile_variants in a half type records each shape's distance from the fp32 kernels' result (the exact one),
    and tile_choice reads what it wrote. No time is asserted: the interpreter's times mean nothing."""
    from bench import tile_variants
    from components.nsa.triton.launch import interpreting

    if not interpreting():
        pytest.skip("needs TRITON_INTERPRET=1 (set by tests/conftest.py without a GPU)")
    variants = tmp_path / "tile_variants.json"
    code = tile_variants.main([*TINY_NSA, "--dtype", "fp16", "--kernels", "interval_fwd", "selection", "selected_dkdv",
                               "--rep-ms", "1", "--out", str(variants)])
    assert code == 0
    rows = json.loads(variants.read_text())["results"]
    interval = [r for r in rows if r["kernel"] == "interval_fwd"]
    assert len(interval) > 2 and all(r["deterministic"] for r in interval)
    # fp16 products against true fp32 ones: within fp16's rounding, for every shape alike.
    assert all(0 < r["rel_rms_exact"] < 2e-3 for r in interval), [r["rel_rms_exact"] for r in interval]
    assert all("rel_rms_exact" not in r for r in rows if r["kernel"] == "selection")
    dkdv = [r for r in rows if r["kernel"] == "selected_dkdv"]
    assert len(dkdv) > 2 and all(r["deterministic"] and 0 < r["rel_rms_exact"] < 2e-3 for r in dkdv)
    assert {r["selected_layout"] for r in dkdv} == {"block"}  # 40 tokens: partials far below the limit
    shipped = next(r for r in interval if r["shipped"] and r["branch"] == "window")
    assert (f"| 40 | interval_fwd | window | {','.join(map(str, shipped['tiles']))} (shipped) | {shipped['ms']:.3f} | "
            f"1.00x | yes | - | {shipped['rel_rms_exact']:.1e} |") in render(json.loads(variants.read_text()))
    out = tmp_path / "choice.json"
    assert tile_choice.main([str(variants), "--out", str(out), "--min-gain", "0"]) == 0
    summaries = json.loads(out.read_text())["kernels"]
    assert {(s["kernel"], s["head_block"], s["element_bytes"]) for s in summaries} == {
        ("interval_fwd", 32, 2), ("selection", 32, 2), ("selected_dkdv", 32, 2)}
    assert all(s["verdict"] == "changed" or s["verdict"].startswith("kept: no shape") for s in summaries), summaries
    read_shapes(str(out))  # what it wrote is a launch shapes file the tools take


def test_rows_that_take_the_masked_layout_time_the_interval_kernels_on_the_selected_branch_too(tmp_path):
    """Where the length takes the selected branch's masked layout (l' = 16 at 40 tokens), the interval kernels'
    workloads add that branch, held like the others to the fp32 kernels' result."""
    from bench import tile_variants
    from components.nsa.triton.launch import interpreting

    if not interpreting():
        pytest.skip("needs TRITON_INTERPRET=1 (set by tests/conftest.py without a GPU)")
    variants = tmp_path / "tile_variants.json"
    code = tile_variants.main([*TINY_NSA, "--sel-block-size", "16", "--dtype", "fp16", "--kernels", "interval_dq",
                               "--rep-ms", "1", "--out", str(variants)])
    assert code == 0
    rows = json.loads(variants.read_text())["results"]
    assert {r["branch"] for r in rows} == {"compressed", "window", "selected"}
    selected = [r for r in rows if r["branch"] == "selected"]
    assert len(selected) > 2 and all(r["deterministic"] and 0 < r["rel_rms_exact"] < 2e-3 for r in selected)


def test_the_selected_workload_is_the_selected_branch():
    """The interval kernels' "selected" workload computes the selected branch (the masked layout of the selection
    it made), not causal attention: with SELECTED a constant of the kernels' build, tuning it would otherwise time
    another kernel."""
    from bench import tile_variants
    from components.nsa.triton.launch import interpreting
    from components.nsa.triton.selected_attention_fwd import selected_attention_fwd
    from components.nsa.triton.selected_attention_masked import CAUSAL
    from components.nsa.triton.interval_attention import interval_attention_fwd

    if not interpreting():
        pytest.skip("needs TRITON_INTERPRET=1 (set by tests/conftest.py without a GPU)")
    args = tile_variants.parse_args([*TINY_NSA, "--sel-block-size", "16", "--dtype", "fp32"])
    work = tile_variants.workloads("interval_fwd", args, 40, torch.float32, "cpu")["selected"]
    q, k, v, *_, scale = work.inputs
    selection = work.options["chosen"].selection.long()
    o, lse2 = work()
    o_ref, lse2_ref = selected_attention_fwd(q, k, v, selection, 16, scale)
    torch.testing.assert_close(o, o_ref, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(lse2, lse2_ref, rtol=2e-6, atol=2e-6)
    causal, _ = interval_attention_fwd(q, k, v, sm_scale=scale, **CAUSAL)
    assert not torch.allclose(o, causal)  # the selection hides some blocks from some queries
