"""bench link's per-rank merge and its CPU column (no processes, no links)."""

from __future__ import annotations

from cgx_ucx.bench.link import _merge_ranks
from cgx_ucx.bench.link_tables import _cpu_range


def _rank(times, cpu, wakeups=None):
    result = {"size": 1 << 20, "method": "cgx32", "times": times, "tx_bytes": [10, 10, 10]}
    result["cpu_s"] = cpu
    if wakeups is not None:
        result["wakeups"] = wakeups
    return {"results": [result]}


def test_merge_keeps_each_ranks_median_cpu_and_wakeups():
    rows = _merge_ranks(
        [
            _rank([0.1, 0.3, 0.2], [0.010, 0.030, 0.020], [5, 9, 7]),
            _rank([0.2, 0.1, 0.4], [0.050, 0.040, 0.060], [1, 3, 2]),
        ]
    )
    (row,) = rows
    assert row["times"] == [0.2, 0.3, 0.4]  # the slowest rank per iteration
    assert row["cpu_s_per_rank"] == [0.020, 0.050]
    assert row["wakeups_per_rank"] == [7, 2]


def test_merge_gives_no_cpu_figure_unless_every_rank_has_one():
    rows = _merge_ranks([_rank([0.1], [0.01]), _rank([0.1], [])])
    assert "cpu_s_per_rank" not in rows[0]
    assert "wakeups_per_rank" not in rows[0]  # gloo rows: no progress driver


def test_cpu_range_shows_least_and_most_busy_rank():
    assert _cpu_range(None) == "-"
    assert _cpu_range([0.0204, 0.0196]) == "20"
    assert _cpu_range([0.028, 0.0351, 0.030]) == "28-35"
