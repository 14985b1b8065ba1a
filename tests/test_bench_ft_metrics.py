"""bench ft's DiLoCo figures from the groups' reports (no processes)."""

from __future__ import annotations

import pytest

pytest.importorskip("torchft")

from cgx_ucx.bench.ft import _diloco_metrics, _sync_costs


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
