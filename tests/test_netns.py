"""The link emulator (cgx_ucx.bench.netns): namespaces, shaping, teardown, crash clean-up.

Tests that build namespaces need root and iproute2; without them they skip and say why
(CI runs as root, so there they run). Each one checks that nothing is left behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from cgx_ucx.bench import netns
from cgx_ucx.bench.iproute import COMMAND_TIMEOUT_S
from cgx_ucx.bench.netns import LinkEmulator, cleanup_stale, parse_rate
from cgx_ucx.errors import CGXError, CGXTimeoutError, ConfigError, TransportError

MISSING = netns.missing_prerequisites()
needs_netns = pytest.mark.skipif(
    bool(MISSING), reason="link emulation needs " + ", ".join(MISSING or ["nothing"])
)
#: A prefix of our own, so these tests never touch the namespaces of a benchmark running now.
PREFIX = "cgxtest"


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10)
    return {line.split()[0] for line in out.stdout.splitlines() if line.strip()}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie child of ours is dead for this purpose.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# ------------------------------------------------------------------ no root needed


@pytest.mark.parametrize(
    ("text", "bps"),
    [
        ("1gbit", 10**9),
        ("25Gbit", 25 * 10**9),
        ("2.5gbit", 2_500_000_000),
        ("100mbit", 10**8),
        (" 5 gbit ", 5 * 10**9),
        (10**9, 10**9),
        ("12000", 12000),
    ],
)
def test_parse_rate(text: str | int, bps: int) -> None:
    assert parse_rate(text) == bps
    assert parse_rate(netns.format_rate(bps)) == bps


@pytest.mark.parametrize("bad", ["1gbps", "fast", "", "-1gbit", "1000bit", True, "1 gbit/s"])
def test_parse_rate_rejects(bad: object) -> None:
    with pytest.raises(ConfigError):
        parse_rate(bad)  # type: ignore[arg-type]


def test_tbf_sizes_follow_the_rate() -> None:
    # 1 ms at line rate, never below the 128 KiB that lets 64 KiB GSO packets through whole.
    assert netns.tbf_burst_bytes(10**8) == netns.BURST_FLOOR_BYTES
    assert netns.tbf_burst_bytes(10 * 10**9) == 1_250_000
    assert netns.tbf_limit_bytes(10**9) == netns.BURST_FLOOR_BYTES + 2_500_000


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"world_size": 0}, "world_size"),
        ({"world_size": 255}, "world_size"),
        ({"world_size": 2, "mtu": 100}, "mtu"),
        ({"world_size": 2, "prefix": "Bad-Prefix"}, "prefix"),
        ({"world_size": 2, "delay": -1.0}, "delay"),
    ],
)
def test_bad_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        LinkEmulator(**kwargs)


def test_names_fit_the_interface_limit() -> None:
    link = LinkEmulator(254, "1gbit", prefix=PREFIX)
    assert all(len(d) <= 15 for d in link.devices)
    assert len(set(link.namespaces)) == 254
    assert link.addresses[0] == "10.213.0.1" and link.addresses[-1] == "10.213.0.254"
    other = LinkEmulator(2, "1gbit", prefix=PREFIX)
    assert not set(other.namespaces) & set(link.namespaces)


def test_missing_root_or_tools_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(netns.shutil, "which", lambda tool: None if tool == "tc" else "/bin/x")
    with pytest.raises(ConfigError, match=r"root.*'tc'") as info:
        LinkEmulator(2, "1gbit", prefix=PREFIX).start()
    assert isinstance(info.value, CGXError)


def test_rank_helpers_need_a_started_emulator() -> None:
    with pytest.raises(ConfigError, match="not started"):
        LinkEmulator(2, prefix=PREFIX).rank_env(0)


# ------------------------------------------------------------------ root + iproute2


_RESOLVE_HOSTNAME = "import socket; print(socket.gethostbyname(socket.gethostname()))"


@needs_netns
@pytest.mark.netns
@pytest.mark.timeout(30)
def test_setup_and_teardown_leave_nothing_behind() -> None:
    before = _namespaces()
    with LinkEmulator(2, "1gbit", prefix=PREFIX) as link:
        assert set(link.namespaces) <= _namespaces()
        for rank in range(2):
            ns, dev = link.namespaces[rank], link.devices[rank]
            shown = subprocess.run(
                ["ip", "-n", ns, "-o", "addr", "show"], capture_output=True, text=True
            ).stdout
            assert f"{link.addresses[rank]}/24" in shown and " lo " in shown
            qdisc = subprocess.run(
                ["tc", "-n", ns, "qdisc", "show", "dev", dev], capture_output=True, text=True
            ).stdout
            assert "tbf" in qdisc and "rate 1Gbit" in qdisc
        env = link.rank_env(1, master_port=1234)
        assert env["UCX_TLS"] == "tcp" and env["UCX_NET_DEVICES"] == link.devices[1]
        assert env["GLOO_SOCKET_IFNAME"] == link.devices[1]
        assert env["MASTER_ADDR"] == link.addresses[0] and env["RANK"] == "1"
        # A process inside the namespace sees only lo and its veth, and is ended on exit.
        sleeper = link.popen(1, ["sleep", "60"])
        seen = subprocess.run(
            link.command(1, ["ip", "-o", "link", "show"]), capture_output=True, text=True
        ).stdout
        assert {line.split(":")[1].strip().split("@")[0] for line in seen.splitlines()} == {
            "lo",
            link.devices[1],
        }
        assert link.netem_available in (True, False)
        # The hostname is the rank's own address inside its namespace (as on a node).
        resolved = subprocess.run(
            link.command(1, [sys.executable, "-c", _RESOLVE_HOSTNAME]),
            capture_output=True,
            text=True,
        ).stdout.strip()
        assert resolved == link.addresses[1]
        assert all((netns.NETNS_ETC / ns / "hosts").is_file() for ns in link.namespaces)
    assert _namespaces() == before
    assert not any((netns.NETNS_ETC / ns).exists() for ns in link.namespaces)
    assert not _alive(sleeper.pid)
    assert link.close() == []  # idempotent


@needs_netns
@pytest.mark.netns
@pytest.mark.timeout(30)
def test_failure_inside_the_block_still_cleans_up() -> None:
    before = _namespaces()
    with pytest.raises(ZeroDivisionError), LinkEmulator(3, "1gbit", prefix=PREFIX) as link:
        assert link.hub in _namespaces()
        _ = 1 / 0
    assert _namespaces() == before


@needs_netns
@pytest.mark.netns
@pytest.mark.timeout(30)
def test_delay_without_netem_is_refused() -> None:
    before = _namespaces()
    probe = LinkEmulator(2, "1gbit", prefix=PREFIX)
    with probe:
        has_netem = probe.netem_available
    if has_netem:
        with LinkEmulator(2, "1gbit", delay=0.001, prefix=PREFIX) as link:
            assert link.delay == 0.001
    else:
        with pytest.raises(ConfigError, match="netem"):
            LinkEmulator(2, "1gbit", delay=0.001, prefix=PREFIX).start()
    assert _namespaces() == before


_CRASHING_CHILD = """
import os, signal, sys, time
# A suite started in the background (`cmd &` in a script) hands its children SIGINT
# ignored, and the emulator rightly leaves an ignored signal alone: undo that here.
signal.signal(signal.SIGINT, signal.default_int_handler)
from cgx_ucx.bench.netns import LinkEmulator
link = LinkEmulator(2, "1gbit", prefix=sys.argv[1])
link.start()
p = link.popen(1, ["sleep", "60"])
try:  # announced inside the try: the parent's signal may come at once
    print(" ".join(link.namespaces), p.pid, flush=True)
    # "kill": the parent SIGKILLs us, no handler and no finally runs. "signal": the
    # handler tears down, then re-raises (KeyboardInterrupt for SIGINT).
    time.sleep(60)
except KeyboardInterrupt:
    sys.exit(42)
"""


def _start_child(mode: str) -> tuple[subprocess.Popen[str], list[str], int]:
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_CRASHING_CHILD), PREFIX, mode],
        stdout=subprocess.PIPE,
        text=True,
    )
    line = child.stdout.readline().split()  # type: ignore[union-attr]
    assert line, "child did not start its emulator"
    return child, line[:2], int(line[2])


@needs_netns
@pytest.mark.netns
@pytest.mark.timeout(30)
def test_leftovers_of_a_killed_run_are_removed_at_next_start() -> None:
    child, names, sleeper = _start_child("kill")
    child.kill()
    child.wait(timeout=10)
    assert set(names) <= _namespaces() and _alive(sleeper)  # really left behind
    removed = cleanup_stale(PREFIX)  # what every start does first
    assert set(names) <= set(removed)
    assert not set(names) & _namespaces()
    assert not any((netns.NETNS_ETC / ns).exists() for ns in names)
    deadline = time.monotonic() + 5
    while _alive(sleeper) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(sleeper)


@needs_netns
@pytest.mark.netns
@pytest.mark.timeout(90)
@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 42), (signal.SIGTERM, -signal.SIGTERM)])
def test_signals_tear_down_and_reraise(sig: signal.Signals, code: int) -> None:
    child, names, sleeper = _start_child("signal")
    child.send_signal(sig)
    # The teardown's ip calls may each take up to iproute.COMMAND_TIMEOUT_S on a loaded
    # host; a child whose handler never ran sleeps on past this wait (60 s) and fails it.
    assert child.wait(timeout=2 * COMMAND_TIMEOUT_S + 5) == code
    assert not set(names) & _namespaces()
    assert not _alive(sleeper)


@needs_netns
@pytest.mark.netns
@pytest.mark.timeout(30)
def test_shaped_link_limits_throughput() -> None:
    rate = 100 * 10**6
    with LinkEmulator(2, rate, prefix=PREFIX) as link:
        m = link.measure_tcp(0, 1, seconds=0.6)
        sent_before = link.egress_bytes(1)
    # TCP payload is at most 1448/1514 = 95.6% of the frame rate tbf counts.
    assert 0.5 * rate <= m.bits_per_s <= 1.05 * rate, m
    assert sent_before > 0  # the ACKs went back across rank 1's shaped device


@needs_netns
@pytest.mark.netns
@pytest.mark.timeout(30)
def test_bridge_links_every_pair_and_shapes_each_port() -> None:
    rate = 200 * 10**6
    with LinkEmulator(4, rate, prefix=PREFIX) as link:
        m = link.measure_tcp(3, 1, seconds=0.4)
        assert 0.5 * rate <= m.bits_per_s <= 1.05 * rate, m
        # Every rank reaches every other one through the bridge (and rank 0's store).
        results = link.run_ranks(
            lambda r: [
                sys.executable,
                "-c",
                "import socket, os; a = os.environ['MASTER_ADDR']; "
                "s = socket.socket(); s.settimeout(3); "
                f"print(s.connect_ex(('{link.addresses[(r + 1) % 4]}', 9)))",
            ],
            timeout=20,
        )
        # 111 = ECONNREFUSED: the peer's kernel answered, so the path exists.
        assert [r.stdout.strip() for r in results] == ["111"] * 4


@needs_netns
@pytest.mark.netns
@pytest.mark.timeout(30)
def test_run_ranks_forwards_child_tracebacks_and_deadlines() -> None:
    with LinkEmulator(2, "1gbit", prefix=PREFIX) as link:
        code = "import os; r = int(os.environ['RANK']); assert r == 0, f'rank {r} fails'"
        with pytest.raises(
            TransportError, match=r"(?s)rank\(s\) \[1\].*AssertionError: rank 1 fails"
        ):
            link.run_ranks([sys.executable, "-c", code], timeout=20, grace=1)
        with pytest.raises(CGXTimeoutError, match="within 1"):
            link.run_ranks(["sleep", "30"], timeout=1)
        ok = link.run_ranks([sys.executable, "-c", "print('hi')"], timeout=20)
        assert [r.stdout for r in ok] == ["hi\n", "hi\n"]


_ALLREDUCE_RANK = """
import asyncio, datetime, hashlib, os, sys
import numpy as np
import torch.distributed as dist
from cgx_ucx.collectives import connect

async def main():
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          rank == 0, timeout=datetime.timedelta(seconds=20))
    comm = await asyncio.wait_for(connect(store, rank, world), 20)
    try:
        n = 300_001  # not a multiple of the bucket
        base = (np.arange(n) % 1000).astype(np.float32)
        x = base + rank  # integers: every float32 sum order is exact
        await asyncio.wait_for(comm.allreduce(x, op="sum", bits=32), 20)
        assert np.array_equal(x, world * base + world * (world - 1) / 2), "bits=32 not exact"
        for bits in (2, 4, 8):
            c = np.full(n, rank + 1.0, dtype=np.float32)  # constant buckets decode exactly
            await asyncio.wait_for(comm.allreduce(c, op="sum", bits=bits, bucket_size=1024), 20)
            assert np.array_equal(c, np.full(n, world * (world + 1) / 2, dtype=np.float32)), bits
            r = np.arange(n, dtype=np.float32) * (rank + 1)
            want = np.arange(n, dtype=np.float64) * world * (world + 1) / 2
            await asyncio.wait_for(comm.allreduce(r, op="sum", bits=bits, bucket_size=1024), 20)
            # CGX's bound: each rank's slope is at most `world`.
            bound = 2 * world * 1024 / (2**bits - 1) * world * (world + 1)
            err = float(np.max(np.abs(r - want)))
            assert err < bound, (bits, err, bound)
            print(bits, hashlib.sha256(r.tobytes()).hexdigest(), flush=True)
    finally:
        await asyncio.wait_for(comm.close(), 20)

asyncio.run(main())
"""


@needs_netns
@pytest.mark.netns
@pytest.mark.timeout(60)
def test_cgx_allreduce_across_a_shaped_link_is_correct() -> None:
    before = _namespaces()
    with LinkEmulator(2, "1gbit", prefix=PREFIX) as link:
        sent = [link.egress_bytes(r) for r in range(2)]
        results = link.run_ranks([sys.executable, "-c", _ALLREDUCE_RANK], timeout=45)
        crossed = [link.egress_bytes(r) - sent[r] for r in range(2)]
    # Bit-identical replicas on both ranks, at every width (UCX may print warnings too).
    digests = [
        [ln for ln in r.stdout.splitlines() if ln[:2] in ("2 ", "4 ", "8 ")] for r in results
    ]
    assert digests[0] == digests[1] and len(digests[0]) == 3, digests
    # The 1.2 MB of the exact allreduce alone went through each rank's shaped device.
    assert min(crossed) > 300_001 * 4, crossed
    assert _namespaces() == before


# ------------------------------------------------------------------ the benchmark's checks


def _row(method: str, size: int, time_s: float, tx: float | None, **extra: object) -> dict:
    return {"method": method, "size": size, "time_s": time_s, "tx_bytes": tx, **extra}


def test_benchmark_refuses_traffic_that_did_not_cross_the_link() -> None:
    from cgx_ucx.bench.link_checks import verify_allreduce as _verify

    link = LinkEmulator(2, "1gbit", prefix=PREFIX)  # not started: only its settings are read
    honest = netns.TcpMeasurement(0, 1, 119_000_000, 1.0, link.rate_bps)
    mib64 = 64 << 20
    # 64 MiB on 2 ranks: each rank sends >= 64 MiB, >= 0.53 s at 1 Gbit/s.
    good = [
        _row("gloo", mib64, 0.564, 67.2e6),
        _row("cgx32", mib64, 0.6, 67.2e6, rel_l2_err=0.0, finite=True),
        _row("cgx4", mib64, 0.1, 8.5e6, rel_l2_err=0.15, finite=True),
    ]
    assert _verify(good, link, honest, 2) == []
    shm = [_row("cgx32", mib64, 0.036, 67.2e6, rel_l2_err=0.0, finite=True)]  # 1.86 GB/s
    assert "faster than the shaped link" in _verify(shm, link, honest, 2)[0]
    elsewhere = [_row("gloo", mib64, 0.6, 1e5)]  # slow, but not through the shaped device
    assert "traffic went elsewhere" in _verify(elsewhere, link, honest, 2)[0]
    wrong = [_row("cgx32", mib64, 0.6, 67.2e6, rel_l2_err=0.01, finite=False)]
    assert len(_verify(wrong, link, honest, 2)) == 2
    fast_probe = netns.TcpMeasurement(0, 1, 1_000_000_000, 1.0, link.rate_bps)
    assert "raw TCP" in _verify([], link, fast_probe, 2)[0]


@needs_netns
@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.timeout(90)
def test_link_benchmark_end_to_end(tmp_path: Path) -> None:
    from cgx_ucx.bench.link import main

    before = _namespaces()
    args = ["--world", "2", "--rates", "100mbit", "--sizes", "1", "--bits", "4", "32"]
    args += ["--min-iters", "1", "--max-iters", "1", "--budget", "0", "--out", str(tmp_path)]
    assert main(args) == 0
    record = json.loads((tmp_path / "link.json").read_text())
    (config,) = record["configs"]
    assert config["violations"] == [] and config["link"]["rate_bps"] == 10**8
    rows = {r["method"]: r for r in config["allreduce"]}
    assert set(rows) == {"gloo", "cgx4", "cgx32"}
    assert rows["cgx32"]["rel_l2_err"] == 0.0 and rows["cgx4"]["rel_l2_err"] < 0.3
    # 4 bits put about 8x fewer bytes on the wire than gloo did.
    assert rows["cgx4"]["tx_bytes"] < rows["gloo"]["tx_bytes"] / 6
    assert (tmp_path / "link.png").stat().st_size > 0
    # On 100 Mbit/s the auto policy's cost model compresses a 1 MiB layer.
    assert rows["cgx4"]["auto_bits"] == 4 and rows["cgx32"]["auto_bits"] is None
    (versus,) = record["compressed_vs_raw"]
    assert versus["method"] == "cgx4" and versus["auto_bits"] == 4
    assert versus["ok"] == (versus["time_vs_cgx32"] <= 1.10)
    assert _namespaces() == before


def test_compressed_vs_raw_rule_and_auto_choice() -> None:
    from cgx_ucx.bench import link as bench_link

    # Two ranks' link probes (bandwidth B/s, encode B/s, decode B/s, overhead s per call),
    # averaged as the auto policy averages them.
    records = [
        {"auto_probe": {"4": [1.25e9, 4e9, 6e9, 40e-6]}},
        {"auto_probe": {"4": [1.15e9, 4e9, 6e9, 60e-6]}},
    ]
    auto = bench_link._auto_costs(records)
    bw, cost = auto["4"]
    assert bw == pytest.approx(1.2e9) and cost.overhead_s == pytest.approx(50e-6)
    picks = {}
    for size in (4 << 10, 64 << 20):
        picks[size] = bench_link._auto_bits({"method": "cgx4", "size": size}, 2, auto, 1024)
    # 10 Gbit/s: a 4 KiB layer is not worth three codec calls, a 64 MiB one is.
    assert picks == {4 << 10: 32, 64 << 20: 4}
    for method in ("cgx32", "gloo", "cgx8"):
        assert bench_link._auto_bits({"method": method, "size": 1 << 20}, 2, auto, 1024) is None
    assert bench_link._auto_costs([{"auto_probe": {"4": [float("nan"), 1, 1, 0]}}]) == {}

    def config(t4: float, auto: int) -> dict:
        rows = [
            {"method": "cgx32", "size": 1 << 20, "time_s": 1.0},
            {"method": "cgx4", "size": 1 << 20, "time_s": t4, "auto_bits": auto},
            {"method": "gloo", "size": 1 << 20, "time_s": 2.0},
        ]
        return {"world_size": 2, "link": {"rate": "10gbit"}, "allreduce": rows}

    (slow_picked,) = bench_link._compressed_vs_raw([config(1.2, 4)])
    assert not slow_picked["ok"] and slow_picked["time_vs_cgx32"] == pytest.approx(1.2)
    assert bench_link._compressed_vs_raw([config(1.2, 32)])[0]["ok"]
    assert bench_link._compressed_vs_raw([config(1.05, 4)])[0]["ok"]


# ------------------------------------------------------------------ nodes x ranks per node


def test_node_layouts_place_consecutive_ranks_per_node() -> None:
    link = LinkEmulator(4, "1gbit", nodes=[3, 1], prefix=PREFIX)  # not started
    assert link.node_sizes == [3, 1] and link.nodes == 2 and not link.force_tcp
    assert link.node_of == [0, 0, 0, 1] and link.local_rank == [0, 1, 2, 0]
    assert link.namespaces[:3] == [link.node_namespaces[0]] * 3
    assert link.devices[3] == link.node_devices[1] != link.node_devices[0]
    assert link.node_namespaces[1].endswith("-n1")
    assert LinkEmulator(4, nodes=2, prefix=PREFIX).node_sizes == [2, 2]
    per_rank = LinkEmulator(3, prefix=PREFIX)
    assert per_rank.node_sizes == [1, 1, 1] and per_rank.force_tcp
    assert per_rank.namespaces[2].endswith("-r2")
    for bad in (3, [2, 1], [4, 0], True):
        with pytest.raises(ConfigError, match="nodes"):
            LinkEmulator(4, nodes=bad, prefix=PREFIX)  # type: ignore[arg-type]


def test_interface_counter_deltas() -> None:
    before = netns.InterfaceCounters(({"a": (10, 5), "lo": (7, 7)}, {"b": (1, 2)}), ("a", "b"))
    after = netns.InterfaceCounters(({"a": (110, 25), "lo": (7, 7)}, {"b": (41, 2)}), ("a", "b"))
    d = after.delta(before)
    assert (d.link_tx(0), d.link_rx(0), d.loopback_tx(0)) == (100, 20, 0)
    assert (d.link_tx(1), d.loopback_tx(1)) == (40, 0)
    with pytest.raises(ConfigError):
        after.delta(netns.InterfaceCounters(({},), ("a",)))


_WHERE_AM_I = (
    "import os; print(os.environ['GROUP_RANK'], os.environ['LOCAL_RANK'], "
    "os.environ['LOCAL_WORLD_SIZE'], os.environ.get('UCX_TLS'), "
    "os.stat('/proc/self/ns/net').st_ino)"
)


@needs_netns
@pytest.mark.netns
@pytest.mark.timeout(60)
def test_nodes_share_a_namespace_and_the_counters_see_the_link() -> None:
    before = _namespaces()
    rate = 200 * 10**6
    with LinkEmulator(4, rate, nodes=2, prefix=PREFIX) as link:
        assert set(link.node_namespaces) <= _namespaces() and link.hub is None
        got = [
            r.stdout.split()
            for r in link.run_ranks([sys.executable, "-c", _WHERE_AM_I], timeout=30)
        ]
        assert [g[:4] for g in got] == [
            ["0", "0", "2", "None"],
            ["0", "1", "2", "None"],
            ["1", "0", "2", "None"],
            ["1", "1", "2", "None"],
        ]
        assert got[0][4] == got[1][4] != got[2][4] == got[3][4]  # one namespace per node
        with pytest.raises(ConfigError, match="different nodes"):
            link.measure_tcp(0, 1)
        c0 = link.interface_counters()
        m = link.measure_tcp(1, 3, seconds=0.4)
        d = link.interface_counters().delta(c0)
    assert 0.5 * rate <= m.bits_per_s <= 1.05 * rate, m
    # Everything the probe sent crossed node 0's shaped device and arrived on node 1's.
    assert d.link_tx(0) >= m.bytes and d.link_rx(1) >= m.bytes
    assert d.loopback_tx(0) == 0 and d.loopback_tx(1) == 0
    assert _namespaces() == before


_FLAT_ALLREDUCE_RANK = """
import asyncio, datetime, hashlib, os
import numpy as np
import torch.distributed as dist
from cgx_ucx.collectives import connect

async def main():
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          rank == 0, timeout=datetime.timedelta(seconds=30))
    comm = await asyncio.wait_for(connect(store, rank, world), 30)
    try:
        n = 1 << 20
        base = (np.arange(n) % 1000).astype(np.float32)
        x = base + rank  # integers: every float32 sum order is exact
        await asyncio.wait_for(comm.allreduce(x, op="sum", bits=32, algorithm="sra"), 30)
        assert np.array_equal(x, world * base + world * (world - 1) / 2), "bits=32 not exact"
        print("digest", hashlib.sha256(x.tobytes()).hexdigest(), flush=True)
    finally:
        await asyncio.wait_for(comm.close(), 30)

asyncio.run(main())
"""


@needs_netns
@pytest.mark.netns
@pytest.mark.timeout(120)
# UCX_TLS=tcp (the user forcing TCP) takes 14 s more: run with -m slow.
@pytest.mark.parametrize(
    "force_tcp",
    [pytest.param(True, marks=pytest.mark.slow), False],
    ids=["UCX_TLS=tcp", "UCX_TLS-unset"],
)
def test_flat_allreduce_on_two_nodes_crosses_the_link(force_tcp: bool) -> None:
    """2 nodes x 2 ranks, the existing flat allreduce of 4 MiB (float32, exact).

    Any allreduce between two nodes must move at least the buffer's size out of each node
    (each node sends the other half of the reduced data and the other half of its
    contribution), so each node's shaped device must have sent that much.
    """
    nbytes = 4 << 20
    with LinkEmulator(4, "1gbit", nodes=2, force_tcp=force_tcp, prefix=PREFIX) as link:
        c0 = link.interface_counters()
        results = link.run_ranks([sys.executable, "-c", _FLAT_ALLREDUCE_RANK], timeout=90)
        d = link.interface_counters().delta(c0)
    digests = {ln for r in results for ln in r.stdout.splitlines() if ln.startswith("digest")}
    assert len(digests) == 1, digests  # bit-identical on every rank of both nodes
    sent = [d.link_tx(n) for n in range(2)]
    local = [d.loopback_tx(n) for n in range(2)]
    print(f"UCX_TLS={'tcp' if force_tcp else 'unset'}: link tx per node {sent}, lo tx {local}")
    assert min(sent) >= 0.95 * nbytes, (sent, local)


# ------------------------------------------------------------------ hierarchical: two levels

_TORCHRUN_RANK = """
import datetime, hashlib, logging, os, sys
import numpy as np
import torch, torch.distributed as dist
import cgx_ucx
from cgx_ucx.layout import Layout

logging.basicConfig(level=logging.INFO, stream=sys.stderr)
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group("cgx", timeout=datetime.timedelta(seconds=60))
n, bucket, bits = int(sys.argv[1]), 1024, 4
xs = [np.random.default_rng(100 + r).uniform(-1, 1, n).astype(np.float32) for r in range(world)]
t = torch.from_numpy(xs[rank].copy())
dist.all_reduce(t)
got = t.numpy().astype(np.float64)
exact = sum(x.astype(np.float64) for x in xs)
# Bound of `world` quantizations (>= the two stages across nodes), per bucket.
bound = np.zeros(n)
for b in range(0, n, bucket):
    total = sum(float(x[b:b + bucket].max() - x[b:b + bucket].min()) for x in xs)
    err = 0.0
    for _ in range(world):
        err += 0.5 * (total + 2 * err) / (2**bits - 1)
    bound[b:b + bucket] = err
assert np.all(np.abs(got - exact) <= bound * (1 + 1e-5) + 1e-5 * np.abs(exact) + 1e-6), "bound"
print("digest", hashlib.sha256(t.numpy().tobytes()).hexdigest(), flush=True)
dist.destroy_process_group()
"""


def _compressed_nbytes(numel: int) -> int:
    from cgx_ucx.compression import encoded_nbytes

    return encoded_nbytes(numel, 4, 1024, np.dtype(np.float32))


@needs_netns
@pytest.mark.netns
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("nodes", "scheme", "per_node"),
    [([2, 2], "hierarchical", [1.0, 1.0]), ([3, 1], "flat", [1.5, 1.5])],
    ids=["2x2", "3+1"],
)
def test_torchrun_layout_on_emulated_nodes(nodes: list[int], scheme: str, per_node: list) -> None:
    """Launched as torchrun would (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
    GROUP_RANK; no UCX variables, only CGX_COMPRESSION_QUANTIZATION_BITS=4): the result is
    within the bound, bit-identical on every rank of every node, the cross-node bytes
    cross the shaped link (as many as the scheme's formula: 1 x the compressed size C per
    node for two levels on 2 x 2, 1.5 C for the flat fallback of 3 + 1, against 2 C for
    flat on 2 x 2) and the node-local bytes do not (shared memory, not TCP over lo)."""
    numel = 2 << 20  # 8 MiB of float32
    c = _compressed_nbytes(numel)
    env = {"CGX_COMPRESSION_QUANTIZATION_BITS": "4"}
    with LinkEmulator(sum(nodes), "1gbit", nodes=nodes, prefix=PREFIX) as link:
        c0 = link.interface_counters()
        results = link.run_ranks(
            [sys.executable, "-c", _TORCHRUN_RANK, str(numel)], timeout=200, env=env
        )
        d = link.interface_counters().delta(c0)
    digests = {ln for r in results for ln in r.stdout.splitlines() if ln.startswith("digest")}
    assert len(digests) == 1 and all("digest" in r.stdout for r in results), digests
    sent = [d.link_tx(n) for n in range(len(nodes))]
    local = [d.loopback_tx(n) for n in range(len(nodes))]
    print(f"{nodes}: link tx per node {sent} (C = {c}), lo tx {local}")
    for n, factor in enumerate(per_node):
        # Frames, TCP/IP headers, the store and the control channel come on top.
        assert 0.95 * factor * c <= sent[n] <= (factor + 0.3) * c, (n, sent, c)
    # The intra-node share (uncompressed, numel * 4 / ranks per node and more) stays off lo.
    assert max(local) < 0.05 * numel * 4, local
    logs = "\n".join(r.stderr for r in results)
    assert "cross-node peers on tcp/" in logs, logs[-2000:]
    if min(nodes) > 1:
        assert "node-local peers on " in logs and "cross-node peers on sysv" not in logs


_NODE_DIES_RANK = """
import asyncio, os, sys, time
import numpy as np
from cgx_ucx.collectives import connect
from cgx_ucx.config import CommConfig
from cgx_ucx.errors import CGXError

async def main():
    comm = await connect(config=CommConfig(timeout=float(sys.argv[1]), connect_timeout=60))
    x = np.ones(1 << 18, np.float32)
    await comm.allreduce(x, bits=4, algorithm="hierarchical")
    await comm.barrier()
    if os.environ["GROUP_RANK"] == "1":
        # Every rank is past the barrier by now (it returns on a rank before its last
        # message has reached the others): the node then dies between two calls.
        await asyncio.sleep(1.0)
        os._exit(0)  # the whole node goes away: no goodbye, endpoints left open
    start = time.monotonic()
    try:
        for _ in range(100):
            await comm.allreduce(x, bits=4, algorithm="hierarchical")
        print("no error", flush=True)
    except CGXError as exc:
        print("typed", type(exc).__name__, round(time.monotonic() - start, 2), flush=True)
    await comm.close()

asyncio.run(main())
"""


@needs_netns
@pytest.mark.netns
@pytest.mark.timeout(180)
def test_a_node_that_dies_fails_every_survivor_with_a_typed_error() -> None:
    timeout = 15.0
    with LinkEmulator(4, "1gbit", nodes=2, prefix=PREFIX) as link:
        results = link.run_ranks([sys.executable, "-c", _NODE_DIES_RANK, str(timeout)], timeout=150)
    for r in results[:2]:
        words = r.stdout.split()
        assert words[:1] == ["typed"], (r.rank, r.stdout, r.stderr[-2000:])
        assert words[1] in ("PeerLostError", "CGXTimeoutError"), r.stdout
        assert float(words[2]) <= timeout + 5, r.stdout
