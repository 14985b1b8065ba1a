"""The contention benchmark's summary: step time, CPU and sleeps per method and condition."""

from __future__ import annotations

import pytest

from cgx_ucx.bench.contention import summarize


def _run(method: str, hog: bool, rank: int, step: float, cpu: float, sleeps: int) -> dict:
    return {"method": method, "hog": hog, "repeat": 0, "rank": rank, "median_s": step,
            "cpu_s": cpu, "switches": sleeps}  # fmt: skip


def test_the_slowest_rank_sets_the_step_and_cpu_is_the_median_over_ranks() -> None:
    runs = [
        _run("gloo", False, 0, 0.004, 0.003, 18),
        _run("gloo", False, 1, 0.005, 0.004, 20),
        _run("gloo", True, 0, 0.020, 0.0035, 12),
        _run("gloo", True, 1, 0.018, 0.0035, 14),
        _run("cgx4", False, 0, 0.003, 0.003, 1),
        _run("cgx4", False, 1, 0.003, 0.003, 1),
        _run("cgx4", True, 0, 0.021, 0.004, 5),
        _run("cgx4", True, 1, 0.024, 0.005, 7),
    ]
    s = summarize(runs)
    assert s["gloo"]["quiet_ms"] == pytest.approx(5.0)
    assert s["gloo"]["hog_ms"] == pytest.approx(20.0)
    assert s["cgx4"]["hog_ms"] == pytest.approx(24.0)
    assert s["cgx4"]["hog_cpu_ms"] == pytest.approx(4.5)
    assert s["gloo"]["quiet_switches"] == pytest.approx(19)
    assert s["cgx_vs_gloo_slowdown"] == pytest.approx((24 / 3) / (20 / 5))


def test_results_without_cpu_figures_still_summarize() -> None:
    runs = [{k: v for k, v in r.items() if k not in ("cpu_s", "switches")} for r in [
        _run(m, h, 0, 0.01 if h else 0.005, 0, 0) for m in ("gloo", "cgx4") for h in (False, True)
    ]]  # fmt: skip
    s = summarize(runs)
    assert "hog_cpu_ms" not in s["gloo"] and s["cgx_vs_gloo_slowdown"] == pytest.approx(1.0)
