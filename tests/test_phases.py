"""``phases.parse_line`` reads back the ``--timings`` line that ``Phases.line`` prints."""

from __future__ import annotations

import pytest

from mppca_nipype.phases import Phases, parse_line

LINE = ("mppca-denoise: timings: start-up 1.82 s, checks 0.01 s, read 0.69 s, denoise 2.31 s (input check 0.01, "
        "plan 0.02, backend 2.10, output 0.18), write 0.58 s; total 5.41 s")


def test_a_timings_line_gives_each_phase_its_parts_and_the_total():
    assert parse_line(LINE) == {
        "start-up": 1.82, "checks": 0.01, "read": 0.69,
        "denoise": {"seconds": 2.31, "parts": {"input check": 0.01, "plan": 0.02, "backend": 2.10, "output": 0.18}},
        "write": 0.58, "total": 5.41}


def test_what_phases_print_parses_back_to_their_seconds_to_the_hundredth():
    phases = Phases(start_up=1.234)
    phases.add("read", 0.456)
    phases.add("denoise", 2.345)
    phases.parts_of("denoise", {"plan": 0.011, "backend": 2.2})
    phases.add("write", 0.789)
    parsed = parse_line(phases.line())
    assert list(parsed) == ["start-up", "read", "denoise", "write", "total"]
    assert parsed["start-up"] == pytest.approx(1.234, abs=0.006)
    assert parsed["denoise"]["seconds"] == pytest.approx(2.345, abs=0.006)
    assert parsed["denoise"]["parts"] == pytest.approx({"plan": 0.011, "backend": 2.2}, abs=0.006)
    assert parsed["total"] == pytest.approx(phases.as_dict()["total"], abs=0.01)


@pytest.mark.parametrize("text", ["mppca-denoise: denoised 16x16x12x20 in 0.8 s (cpu, 2 processes)",
                                  "read 0.69 s, write 0.58 s", "read 0.69 s,, write 0.58 s; total 1.30 s",
                                  "read fast, write 0.58 s; total 1.30 s"])
def test_any_other_line_is_refused(text):
    with pytest.raises(ValueError):
        parse_line(text)
