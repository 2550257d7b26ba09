"""The Triton backend's host-side rules: how work is cut up, and what is refused where the kernels cannot
run. None of it launches a kernel, so it runs everywhere (test_nsa_triton.py runs the kernels)."""

import pytest
import torch

from components.errors import UserError
from components.nsa.triton import launch, nsa_attention_triton
from components.nsa.triton.launch import check_kernel_device, interpreter_problem
from components.nsa.triton.offline_compile import compile_only, target_for
from tests.test_nsa_triton import _hyper, _make_inputs


def test_work_items_are_short_for_short_rows_and_long_for_long_ones():
    from components.nsa.triton.selection_lists import MAX_ITEM_STEPS, MIN_ITEM_STEPS, work_item_segment

    queries = 10  # queries per step: 32 (query, head) rows / a group of 3 (dkdv_step_rows)
    assert work_item_segment(queries, 2048 * 4 * 16) == queries * MIN_ITEM_STEPS  # 2k tokens, 4 groups, n = 16
    assert work_item_segment(queries, 65536 * 4 * 16) == queries * 204  # about 2048 items: 4M entries / (10 * 204)
    assert work_item_segment(queries, 2**30) == queries * MAX_ITEM_STEPS


def test_selected_dkdv_steps_hold_whole_head_groups_back_to_back():
    from components.nsa.triton.selected_attention_bwd import dkdv_step_rows

    assert dkdv_step_rows(32, 3) == (32, 10)  # the 125M layout: 30 of 32 rows used, not 24
    assert dkdv_step_rows(32, 4) == (32, 8)
    assert dkdv_step_rows(32, 16) == (32, 2)
    assert dkdv_step_rows(16, 17) == (32, 1)  # a group wider than the tile takes a step of its own
    for tile_rows in (16, 32, 64):
        for group in range(1, 40):
            rows, queries = dkdv_step_rows(tile_rows, group)
            assert rows & (rows - 1) == 0 and rows >= tile_rows  # tl.arange needs a power of two
            assert queries >= 1 and queries * group <= rows < (queries + 1) * group


def test_dkdv_query_splits_only_where_programs_are_few_and_loops_long():
    from components.nsa.triton.interval_attention import (DKDV_MIN_SPLIT_QUERIES, DKDV_TARGET_PROGRAMS,
                                                          dkdv_query_split)

    assert dkdv_query_split(639, 48) == 639  # the window branch: short loops stay whole
    assert dkdv_query_split(65536, 4096) == 65536  # programs enough
    for span, programs in [(8192, 48), (32768, 192), (65536, 384), (65536, 1), (5000, 7)]:
        per_program = dkdv_query_split(span, programs)
        splits = -(-span // per_program)
        assert splits > 1 and per_program >= DKDV_MIN_SPLIT_QUERIES and splits * programs <= DKDV_TARGET_PROGRAMS


def test_rejects_cpu_tensors_without_interpreter(monkeypatch):
    xs = [x.detach().cpu() for x in _make_inputs(1, 16, 2, 1, 16, 8, 4, torch.float32)]
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(UserError, match="CUDA"):
        nsa_attention_triton(*xs, **_hyper(8, 4, 8, 2, 4))


def test_training_with_the_triton_backend_on_the_cpu_is_refused_at_start(tmp_path, monkeypatch, capsys):
    """Before the model is built, data read or the run folder written, not in the first step's forward."""
    from nsa_titan import cli
    from tests.launch import DEBUG, TINY

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    code = cli.main(["train", DEBUG, *TINY, "--model.nsa.backend=triton", f"--job.dump_folder={tmp_path}/run"])
    assert not (tmp_path / "run").exists()
    err = capsys.readouterr().err
    assert code == 2 and err.count("error:") == 1 and "Traceback" not in err, err
    assert "model.nsa.backend = 'triton' runs CUDA kernels, but this run is on cpu" in err
    assert "--model.nsa.backend=reference" in err


@pytest.mark.parametrize("triton_version, numpy_version, refused", [
    ("3.6.0", "2.4.6", True), ("3.3.1", "2.4.0rc1", True),
    ("3.6.0", "2.3.5", False), ("3.7.0", "2.4.6", False), ("3.10.1", "2.4.0", False), ("4.0.0", "3.0.0", False),
])
def test_interpreter_refuses_the_triton_numpy_pair_it_cannot_run(triton_version, numpy_version, refused):
    problem = interpreter_problem(triton_version, numpy_version)
    if refused:
        assert f"NumPy {numpy_version}" in problem and "install numpy<2.4 or triton>=3.7" in problem
    else:
        assert problem is None


def test_interpreter_problem_stops_the_interpreter_but_not_offline_compilation(monkeypatch):
    monkeypatch.setattr(launch, "INTERPRETER_PROBLEM", "Triton 3.6.0's interpreter cannot run with NumPy 2.4.6")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(UserError, match="cannot run with NumPy"):
        check_kernel_device(torch.zeros(1))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with compile_only(target_for(90)):
        check_kernel_device(torch.zeros(1))  # compiles only: the interpreter's trouble does not apply
    with pytest.raises(UserError, match="needs CUDA tensors"):
        check_kernel_device(torch.zeros(1))
