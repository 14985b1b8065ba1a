"""``python -m cgx_ucx.bench nodes``: its formulas and refusals, and its smallest case end to
end on emulated nodes (root and iproute2; skipped without them)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from cgx_ucx.bench import netns
from cgx_ucx.bench.netns import LinkEmulator, TcpMeasurement
from cgx_ucx.bench.nodes import formula_bytes_per_node, main
from cgx_ucx.compression import encoded_nbytes

MISSING = netns.missing_prerequisites()
needs_netns = pytest.mark.skipif(
    bool(MISSING), reason="link emulation needs " + ", ".join(MISSING or ["nothing"])
)
MIB = 1 << 20


def test_formulas_per_node() -> None:
    s = 64 * MIB
    c = encoded_nbytes(s // 4, 4, 1024)
    # 2 nodes x 2 ranks: gloo's ring 1.5 S, flat 2 C, two levels C per node.
    assert formula_bytes_per_node("gloo", s, 32, [2, 2]) == [1.5 * s, 1.5 * s]
    assert formula_bytes_per_node("flat", s, 4, [2, 2]) == [2 * c, 2 * c]
    assert formula_bytes_per_node("hier", s, 4, [2, 2]) == [c, c]
    assert formula_bytes_per_node("hier", s, 32, [2, 2]) == [s, s]
    # 3 nodes x 2 ranks: flat 2 x 2 x 4/6 C = 8/3 C, two levels 4/3 C.
    assert formula_bytes_per_node("flat", s, 4, [2, 2, 2]) == pytest.approx([8 / 3 * c] * 3)
    assert formula_bytes_per_node("hier", s, 4, [2, 2, 2]) == pytest.approx([4 / 3 * c] * 3)


def _row(method: str, scheme: str, bits: int, time_s: float, tx: float, **extra: object) -> dict:
    return {
        "method": method,
        "scheme": scheme,
        "bits": bits,
        "size": 64 * MIB,
        "iters": 3,
        "time_s": time_s,
        "link_tx_per_node": [tx, tx],
        **extra,
    }


def test_refuses_what_did_not_cross_the_link() -> None:
    from cgx_ucx.bench.nodes import _verify

    link = LinkEmulator(4, "1gbit", nodes=2, prefix="cgxtest")  # settings only, not started
    honest = TcpMeasurement(0, 2, 119_000_000, 1.0, link.rate_bps)
    two_levels = [{"plan": "sharded", "topology": "2 nodes [2, 2] (launcher)"}] * 4
    job = [500 * MIB, 500 * MIB]
    good = [
        _row("gloo", "gloo", 32, 0.6, 67.5e6),
        _row("hier32", "hier", 32, 0.6, 67.5e6, rel_l2_err=1e-7, finite=True),
        _row("hier4", "hier", 4, 0.08, 8.6e6, rel_l2_err=0.15, finite=True),
    ]
    assert _verify(good, link, honest, two_levels, job) == []
    # gloo beating the shaped link: 64 MiB per node need >= 0.53 s at 1 Gbit/s.
    fast = [_row("gloo", "gloo", 32, 0.1, 67.5e6)]
    assert "faster than the shaped link" in _verify(fast, link, honest, two_levels, job)[0]
    elsewhere = [_row("gloo", "gloo", 32, 0.6, 1e5)]
    assert "traffic went elsewhere" in _verify(elsewhere, link, honest, two_levels, job)[0]
    flat_topology = [{"plan": "flat", "topology": "4 nodes [1, 1, 1, 1] (host)"}] * 4
    assert "would have run flat" in _verify(good, link, honest, flat_topology, job)[0]
    assert "counters are not the link's" in _verify(good, link, honest, two_levels, [MIB, MIB])[0]
    wrong = [_row("flat32", "flat", 32, 0.6, 67.5e6, rel_l2_err=0.01, finite=False)]
    assert len(_verify(wrong, link, honest, two_levels, job)) == 2
    fast_probe = TcpMeasurement(0, 2, 1_000_000_000, 1.0, link.rate_bps)
    assert "raw TCP" in _verify([], link, fast_probe, two_levels, job)[0]


def test_bad_arguments_exit_2() -> None:
    for argv in (["--ranks-per-node", "1"], ["--bits", "5", "33"], ["--budget", "-1"]):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10)
    return {line.split()[0] for line in out.stdout.splitlines() if line.strip()}


@needs_netns
@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_smallest_case_end_to_end(tmp_path: Path) -> None:
    """2 nodes x 2 ranks at 1 Gbit/s, 1 MiB, 4 bits: every method's cross-node bytes per node
    are the formula's (two levels half of flat's), node-local bytes stay off TCP, and the
    ranks learned two nodes from the launcher's variables."""
    before = _namespaces()
    args = ["--sizes", "1", "--rates", "1gbit", "--bits", "4", "--no-train"]
    args += ["--min-iters", "1", "--max-iters", "1", "--budget", "0", "--probe-seconds", "0.3"]
    assert main([*args, "--out-dir", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "nodes.json").read_text())
    (config,) = record["configs"]
    assert config["violations"] == [] and config["nodes"] == [2, 2]
    assert config["plan"] == "sharded" and "(launcher)" in config["topology"]
    assert len(record["loadavg_start"]) == 3 and len(config["loadavg_after"]) == 3
    rows = {r["method"]: r for r in config["allreduce"]}
    assert set(rows) == {"gloo", "flat4", "hier4"}
    for row in rows.values():
        # Headers, ACKs and the per-iteration barriers come on top of the formula.
        pairs = zip(row["link_tx_per_node"], row["formula_per_node"], strict=True)
        assert all(0.95 * f <= m <= 1.2 * f for m, f in pairs), row
    assert rows["hier4"]["rel_l2_err"] < 0.3 and rows["flat4"]["rel_l2_err"] < 0.3
    for name in ("flat4", "hier4"):  # node-local bytes in shared memory, not over lo
        assert max(rows[name]["lo_tx_per_node"]) < 0.05 * MIB, rows[name]
    assert (tmp_path / "nodes.png").stat().st_size > 0
    assert _namespaces() == before


def test_merge_keeps_each_ranks_cpu_per_call() -> None:
    """The rows carry each rank's median CPU time per call (the worker's ``cpu_s``): on a
    host with fewer cores than ranks their sum over the cores bounds the call's time."""
    from types import SimpleNamespace

    from cgx_ucx.bench.nodes import _merge

    link = SimpleNamespace(nodes=2, node_devices=["n0", "n1"], node_sizes=(2, 2))
    records = [
        {
            "group_rank": rank // 2,
            "local_rank": rank % 2,
            "results": [
                {
                    "size": 1 << 20,
                    "method": "cgx4-hierarchical",
                    "times": [0.01, 0.02, 0.03],
                    "cpu_s": [0.004 + rank / 1000, 0.005 + rank / 1000, 0.1],
                    "iface_bytes": {"n0": [1000, 0], "n1": [1000, 0]},
                }
            ],
        }
        for rank in range(4)
    ]
    (row,) = _merge(records, link, 1024)
    assert row["cpu_s_per_rank"] == pytest.approx([0.005, 0.006, 0.007, 0.008])
    records[0]["results"][0].pop("cpu_s")  # a rank that did not count: no figure at all
    (row,) = _merge(records, link, 1024)
    assert row["cpu_s_per_rank"] == []
