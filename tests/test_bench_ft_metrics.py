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


def test_diloco_phases_of_the_last_arrival_and_the_target_on_communication():
    def timed(step, sync_s, quorum, wait, outer):
        phases = {"quorum": quorum, "prepare": 0.05, "wait": wait, "commit": 0.0, "outer": outer}
        return {**_sync(step, sync_s, participants=2), "phases": phases}

    def metrics(group0, group1):
        first = timed(1, 20.0, 0.0, 9.0, 1.0)  # forms the first quorum: left out
        final = {"final": True, "digest": "d", "eval_loss": 1.5}
        reports = {0: [first, *group0, final], 1: [first, *group1, final]}
        return _diloco_metrics({"reports": reports, "link_bytes": None, "codes": {0: 0, 1: 0}}, 2)

    # Group 1 arrives last at step 2 (the shorter sync: no quorum wait), group 0 at step 3.
    fp32 = metrics(
        [timed(2, 13.0, 2.0, 10.0, 0.25), timed(3, 10.3, 0.0, 10.0, 0.25)],
        [timed(2, 10.4, 0.1, 10.0, 0.25), timed(3, 12.0, 2.0, 9.0, 0.5)],
    )
    assert fp32["sync_s"] == pytest.approx(10.35)
    assert fp32["comm_s"] == pytest.approx(10.1)  # the median of 10.15 and 10.05
    assert fp32["outer_s"] == pytest.approx(0.25)
    d4 = metrics(
        [timed(2, 1.8, 0.0, 1.45, 0.3), timed(3, 1.9, 0.0, 1.55, 0.3)],
        [timed(2, 2.5, 0.7, 1.45, 0.3), timed(3, 2.6, 0.7, 1.55, 0.3)],
    )
    assert d4["comm_s"] == pytest.approx(1.55)

    def check(d4_metrics):
        runs = {"DiLoCo fp32 (gloo)": fp32, "DiLoCo cgx 4-bit": d4_metrics}
        (c,) = [c for c in targets({}, runs) if c["target"].startswith("DiLoCo 4-bit outer sync")]
        return c

    c = check(d4)
    assert "quorum, all-reduce, commit" in c["target"]
    assert c["met"] is True  # 10.1 / 1.55
    assert "6.52x" in c["detail"] and "5.59x" in c["detail"]  # whole syncs: 10.35 / 1.85
    assert check({**d4, "comm_s": 1.8})["met"] is False
    # Reports without phases (older workers): the whole sync is checked.
    bare = check({k: v for k, v in d4.items() if k not in ("comm_s", "outer_s", "phases_s")})
    assert bare["target"] == "DiLoCo 4-bit outer sync >= 6x faster than fp32 gloo"
    assert bare["met"] is False


def test_worker_phases_split_a_sync_into_quorum_wait_commit_and_outer(monkeypatch):
    from cgx_ucx.bench import ft_worker

    clock = [0.0]
    monkeypatch.setattr(ft_worker.time, "perf_counter", lambda: clock[0])

    class Manager:
        def start_quorum(self):
            clock[0] += 0.5

        def should_commit(self):
            clock[0] += 0.1
            return True

    manager = Manager()

    class Fragment:
        def prepare_sync(self):
            clock[0] += 0.2

        def _save_local_parameters(self):
            clock[0] += 0.3

        def perform_sync(self):
            clock[0] += 2.0  # the wait for the all-reduce
            self._save_local_parameters()
            manager.should_commit()
            clock[0] += 0.4

    fragment = Fragment()
    phases = ft_worker._Phases(manager, [fragment])
    manager.start_quorum()
    fragment.prepare_sync()
    assert fragment.perform_sync() is None
    spent = phases.take()
    assert spent == pytest.approx(
        {"quorum": 0.5, "prepare": 0.2, "wait": 2.0, "commit": 0.1, "outer": 0.7}
    )
    assert phases.take() == {"outer": 0.0}


def test_the_compute_floor_is_the_median_step_past_the_warm_up_and_sits_beside_the_target():
    from cgx_ucx.bench.ft import FLOOR_WARMUP_STEPS, _floor_metrics, floor_line
    from cgx_ucx.bench.sections import _ft

    def steps(dts):
        return [{"event": "step", "step": i, "dt": dt} for i, dt in enumerate(dts)]

    warm = [9.0] * FLOOR_WARMUP_STEPS
    run = {"reports": {0: steps([*warm, 0.3, 0.5]), 1: steps([*warm, 0.4]), 2: steps(warm)}}
    floor = _floor_metrics(run)
    assert floor == {"step_s": 0.4, "steps": 3}
    ddp = {"torchft+gloo": {"step_s": 1.6}, "torchft+cgx 4-bit": {"step_s": 0.5}}
    (check,) = [c for c in targets(ddp, {}, None, floor) if "3x" in c["target"]]
    assert check["met"] is True
    assert check["detail"] == (
        "3.20x (the compute floor, 0.40 s a step: gloo's step 4.00x it, cgx 4-bit's 1.25x)"
    )
    assert "0.40 s a step (median of 3)" in floor_line(floor, 3)
    data = {"config": {"groups": 3}, "ddp": ddp, "ddp_floor": floor}
    assert any("Compute floor" in part for part in _ft(data))


@pytest.mark.timeout(120)
def test_the_local_worker_trains_without_a_process_group(tmp_path):
    """``ft_worker --mode local``: the DDP run's steps with no Manager, no Lighthouse and no
    process group, each reported with its time."""
    import json
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "cgx_ucx.bench.ft_worker", "--replica-id", "0"]
    cmd += ["--lighthouse", "http://127.0.0.1:1", "--mode", "local", "--steps", "5"]
    cmd += ["--hidden", "64", "--batch", "8", "--out", str(tmp_path)]
    subprocess.run(cmd, check=True, timeout=100)
    rows = [json.loads(line) for line in (tmp_path / "replica0.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r.get("event") == "step"]
    assert [r["step"] for r in steps] == list(range(5))
    assert all(r["dt"] > 0 for r in steps)
    assert rows[-1]["final"] and rows[-1]["step"] == 5
