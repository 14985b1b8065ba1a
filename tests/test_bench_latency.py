"""The latency benchmark's verdicts against its targets (no processes: the rows are what
summarize() returns)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from cgx_ucx.bench.latency import targets


def _row(kib, path, method, us, world=2):
    return {"world": world, "kib": kib, "path": path, "method": method, "median_us": us}


def test_targets_judge_each_size_method_and_hop():
    rows = [
        _row(4.0, "torch", "gloo", 400.0),
        _row(4.0, "torch", "cgx32", 190.0),  # 0.475x gloo: held
        _row(4.0, "core", "cgx32", 150.0),  # above 100 us: missed; bridge 40 us: held
        _row(4.0, "torch", "cgx4", 260.0),  # 0.65x: missed
        _row(4.0, "core", "cgx4", 90.0),  # held; bridge 170 us: missed
        _row(4096.0, "torch", "gloo", 1000.0),  # outside 4 KiB - 1 MiB: not judged
        _row(4096.0, "torch", "cgx32", 9000.0),
        _row(4.0, "torch", "cgx32", 10.0, world=4),  # 4 ranks: reported, not judged
        _row(0, "core", "cgx barrier", 120.0),
    ]
    first = {"2": [{"first_s": 3e-3, "warm_s": 1e-3, "warm_after_barrier_s": 2e-3}] * 2}
    got = {c["target"]: (round(c["value"], 3), c["ok"]) for c in targets(rows, first)}
    assert got == {
        "4 KiB cgx32 torch / gloo": (0.475, True),
        "4 KiB cgx32 bridge us": (40.0, True),
        "4 KiB cgx4 torch / gloo": (0.65, False),
        "4 KiB cgx4 bridge us": (170.0, False),
        "4 KiB cgx32 core us": (150.0, False),
        "4 KiB cgx4 core us": (90.0, True),
        "barrier core us": (120.0, False),
        "first call / back-to-back": (3.0, True),
        "first call / later call after barriers": (1.5, True),
    }


def test_no_rows_no_verdicts():
    assert targets([], {}) == []


@pytest.mark.timeout(300)
def test_the_command_measures_every_row_in_turns(tmp_path):
    """The command end to end on 2 ranks, small: every (size, path, method) row is there
    (its calls taken in turns: 30 calls are a turn of 20 and one of 10), with a median
    and a p99, no messages on one host, and the verdicts printed and written."""
    out = tmp_path / "lat"
    proc = subprocess.run(
        [sys.executable, "-m", "cgx_ucx.bench", "latency", "--world", "2", "--sizes-kib", "4",
         "--iters", "30", "--out-dir", str(out)],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads((out / "latency.json").read_text())
    got = {(r["world"], r["kib"], r["path"], r["method"]) for r in data["rows"]}
    want = {(2, 4.0, "torch", "gloo")}
    want |= {(2, 4.0, p, f"cgx{b}") for p in ("torch", "sync", "core") for b in (32, 4)}
    want |= {(2, 0, "torch", "gloo barrier")}
    want |= {(2, 0, p, "cgx barrier") for p in ("torch", "sync", "core")}
    assert got == want
    for r in data["rows"]:
        assert 0 < r["median_us"] <= r["p99_us"], r
        assert r["messages_per_call"] < 0.5  # one host: the cgx rows go through mailboxes
    assert data["iters"] == 30
    assert {c["target"] for c in data["targets"]} >= {"4 KiB cgx32 bridge us", "barrier core us"}
    assert re.search(r"targets \(2 ranks\): \d+ of \d+ held", proc.stdout), proc.stdout
