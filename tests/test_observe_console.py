"""The console's step line."""

from __future__ import annotations

from nsa_titan.observe.console import step_line

RECORD = {"step": 3, "loss": 2.5, "lr": 3e-4, "grad_norm": 0.9, "tokens_per_second": 12345.0, "step_time_s": 0.25,
          "data_wait_s": 0.001}


def test_eta_reads_as_a_duration():
    assert step_line({**RECORD, "eta_s": 3725.4}, 10).endswith("eta 1:02:05")


def test_an_eta_past_any_date_arithmetic_is_capped():
    """A run of 2**62 steps (a valid recipe) has an ETA past what timedelta holds; the line still prints."""
    assert step_line({**RECORD, "eta_s": 2.0**62 * 0.25}, 2**62).endswith("eta > 100 years")


def test_a_first_step_without_an_eta_says_so():
    """The first step of a run or a resume holds compilation and warm-up: its record has no ETA, and the line does
    not print one of 0 s."""
    assert step_line(RECORD, 10).endswith("eta not yet (first step)")
