"""bench ft's DiLoCo figures from the groups' reports (no processes)."""

from __future__ import annotations

import pytest

pytest.importorskip("torchft")

from cgx_ucx.bench.ft import _diloco_metrics, _sync_costs, _trials, targets, trials_line


def _sync(step, sync_s, participants=3, committed=True, sent=1000):
    return {
        "event": "sync",
        "step": step,
        "sync_s": sync_s,
        "participants": participants,
        "committed": committed,
        "sent": sent,
    }


def test_sync_cost_is_the_last_arrivals_time_over_full_quorums():
    reports = {
        0: [_sync(1, 9.0), _sync(2, 3.0), _sync(3, 2.5), _sync(4, 6.0, participants=2)],
        1: [_sync(1, 8.0), _sync(2, 1.2), _sync(3, 4.0), _sync(4, 5.0, participants=2)],
        2: [_sync(1, 7.0), _sync(2, 2.0), _sync(3, 1.4)],
    }
    # The first sync forms the first quorum; step 4 did not hold all three groups.
    assert _sync_costs(reports, 3) == [1.2, 1.4]


def test_diloco_metrics_report_wall_time_and_syncs_without_every_group():
    reports = {
        0: [_sync(1, 9.0), _sync(2, 3.0), _sync(3, 2.6, participants=2)],
        1: [_sync(1, 8.0), _sync(2, 1.2), _sync(3, 2.4, participants=2)],
        2: [_sync(1, 7.0), _sync(2, 2.0)],
    }
    for rows in reports.values():
        rows.append({"final": True, "digest": "d", "eval_loss": 1.5, "step": 3})
    run = {"reports": reports, "link_bytes": None, "codes": {0: 0, 1: 0, 2: 0}}
    m = _diloco_metrics(run, 3)
    assert m["sync_s"] == 1.2
    assert m["sync_wall_s"] == pytest.approx(2.8)  # replica 0's syncs after the first
    assert (m["syncs"], m["syncs_all_groups"]) == (3, 2)
    assert m["bit_identical"] and m["ok"]


def test_trials_count_right_endings_and_spread_and_the_longest_stall_is_checked():
    good = {"ok": True, "same_step": True, "bit_identical": True, "steps_lost": 0}
    runs = [
        {**good, "stall_s": 1.0, "rejoin_s": 5.0},
        {**good, "stall_s": 3.5, "rejoin_s": 7.0},
        {**good, "stall_s": 2.0, "rejoin_s": None},
        {**good, "bit_identical": False, "stall_s": 1.5, "rejoin_s": 6.0, "steps_lost": 2},
    ]
    trials = _trials(runs)
    assert (trials["trials"], trials["finished"], trials["bit_identical"]) == (4, 4, 3)
    assert trials["stall_s"] == [1.0, 1.75, 3.5]
    assert trials["rejoin_s"] == [5.0, 6.0, 7.0]
    assert trials["steps_lost"] == 2
    gloo = {"stall_s": 3.0}
    checks = {c["target"]: c for c in targets({"torchft+gloo": gloo}, {}, trials)}
    assert (
        checks["cgx 4-bit: 4 of 4 kill-and-rejoin trials end bit-identical at one step"]["met"]
        is False
    )
    assert checks["cgx 4-bit stall within 1 s of gloo's"]["met"] is True  # 3.5 vs 3.0
    trials["stall_s"][2] = 4.5
    checks = {c["target"]: c for c in targets({"torchft+gloo": gloo}, {}, trials)}
    assert checks["cgx 4-bit stall within 1 s of gloo's"]["met"] is False
    assert "4/4 finished" in trials_line(trials)


def test_benchmarks_page_shows_the_trials_line():
    import json
    from pathlib import Path

    from cgx_ucx.bench.sections import _ft

    tracked = Path(__file__).resolve().parents[1] / "benchmarks/results/cpu-2core/ft.json"
    data = json.loads(tracked.read_text())
    data.pop("ddp_trials", None)
    assert not any("finished with every group" in part for part in _ft(data))
    trials = {"trials": 10, "finished": 10, "bit_identical": 10, "steps_lost": 0}
    data["ddp_trials"] = {**trials, "stall_s": [1.0, 1.2, 1.4], "rejoin_s": None}
    assert any("10/10 bit-identical" in part for part in _ft(data))
