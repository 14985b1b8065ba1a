"""Emulated commodity links: one network namespace per node, veth pairs, ``tc tbf`` shaping.

CGX's claim is about slow links (1-25 Gbit/s Ethernet between nodes); this module builds such
a link on one machine so the claim can be measured and repeated by anyone with root.

Two layouts:

- per rank (``LinkEmulator(4)``): every rank is a node of its own, so every byte between
  ranks crosses a shaped link (the original mode, used by ``bench link``);
- nodes (``LinkEmulator(4, nodes=2)`` or ``nodes=[3, 1]``): one namespace per node holds
  that node's ranks (consecutive ranks, as torchrun places them); ranks of one node talk
  through shared memory or the node's ``lo``, ranks of different nodes through the shaped
  link. The ranks get torchrun's variables (``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
  ``GROUP_RANK``, ``GROUP_WORLD_SIZE``) and, by default, no UCX variables at all: what
  UCX does then is what a user on two hosts gets (see ``force_tcp``).

1. One network namespace per node (``<prefix>-<pid>-<token>-r<rank>`` per rank,
   ``...-n<node>`` per node), each with ``lo`` up and one veth device holding
   ``10.213.0.<node+1>/24``. The subnet is private and exists only inside these
   namespaces: nothing outside them is ever addressed. Inside node i's namespace the
   machine's hostname resolves to node i's address (``/etc/netns/<ns>/hosts``, which
   ``ip netns exec`` mounts over ``/etc/hosts``), as on a cluster node.
2. Two nodes: the two veth ends are joined directly. More nodes: each node's veth goes to a
   bridge in a hub namespace (``...-hub``), i.e. a switch with one port per node.
3. Every egress device (the node's veth, and for the bridge also the hub's port towards the
   node) gets a ``tbf`` qdisc at the asked rate, so each node has an up- and a downlink of
   that rate, as a NIC on a switch does.
4. Everything is removed on exit, on failure (``finally``), on SIGINT/SIGTERM (the handlers
   tear down, restore the previous handler and re-raise), and left-overs of a killed run
   (namespace names carry the owner's pid; the owner is dead) at the next start.

Rank processes are started inside their node's namespace with ``ip netns exec`` and a
per-rank environment (:meth:`LinkEmulator.rank_env`). With ``force_tcp`` (the default of the
per-rank layout) it forces the traffic onto the shaped device:

- ``UCX_TLS=tcp`` and ``UCX_NET_DEVICES=<veth>``: all namespaces share one kernel, so with
  UCX_TLS unset UCX finds shared memory across them and ignores the shaping (measured
  1.86 GB/s on a "1 Gbit" link). In the nodes layout this is exactly what the engine's
  per-level transports must prevent by themselves, so there ``force_tcp`` is off by default.
- ``GLOO_SOCKET_IFNAME=<veth>`` per rank (one name for all ranks failed with a store timeout,
  measured), ``UCXPY_IFNAME=<veth>`` for ``ucxx.get_address``.
- ``MASTER_ADDR`` = rank 0's address: the TCPStore lives in rank 0's namespace and is reached
  over the link by every rank.

Byte counters: :meth:`LinkEmulator.interface_counters` reads every interface's
``/sys/class/net/<if>/statistics/{tx,rx}_bytes`` inside every node namespace; two snapshots
subtracted (:meth:`InterfaceCounters.delta`) show how many bytes crossed each node's shaped
link and how many went over its ``lo`` (shared memory moves no interface bytes at all).

Delay: ``netem`` is not in every kernel (it is not in the one this was built on: ``tc qdisc
add ... netem`` answers "Specified qdisc kind is unknown"). :attr:`LinkEmulator.netem_available`
reports whether it is; asking for a delay without it is a :class:`~cgx_ucx.errors.ConfigError`,
never a silently undelayed link.

Only the standard library and iproute2 (``ip``, ``tc``) are used.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from ..errors import CGXTimeoutError, ConfigError, TransportError

__all__ = [
    "DEFAULT_PREFIX",
    "InterfaceCounters",
    "LinkEmulator",
    "RankResult",
    "TcpMeasurement",
    "cleanup_stale",
    "format_rate",
    "missing_prerequisites",
    "parse_rate",
    "tbf_burst_bytes",
    "tbf_limit_bytes",
]

log = logging.getLogger("cgx_ucx.bench.netns")

#: Namespace names start with this; :func:`cleanup_stale` only ever touches names it matches.
DEFAULT_PREFIX = "cgxlink"
#: The private /24 of the emulated network (only inside our namespaces). Rank i has .i+1.
SUBNET = "10.213.0"
#: .1 .. .254 are usable host addresses of a /24.
MAX_WORLD = 254
#: Linux limits interface names to 15 characters (IFNAMSIZ - 1); ours are at most 12.
IFNAMSIZ = 15
#: Commodity Ethernet's MTU; a 1500-byte frame carries 1448 bytes of TCP payload with
#: timestamps, so TCP sees at most ~95.6% of the shaped rate (measured here: 96% of 1 Gbit/s).
DEFAULT_MTU = 1500
#: ``ip netns exec NS`` bind-mounts ``/etc/netns/NS/*`` over ``/etc``: each rank namespace
#: gets a ``hosts`` file there in which this machine's hostname is the rank's own address,
#: as on a cluster node. Libraries that find "my address" from the hostname (the engine's
#: rendezvous when it sees a PrefixStore, torch's c10d) then pick the veth, not loopback.
NETNS_ETC = Path("/etc/netns")
#: Every ip/tc call returns within this, or the setup fails (they take milliseconds).
COMMAND_TIMEOUT_S = 20.0
#: tbf burst floor: a veth hands GSO packets of up to 64 KiB to the qdisc, and tbf segments
#: (in software, costly on 2 cores) any packet larger than its bucket; 128 KiB passes them whole.
BURST_FLOOR_BYTES = 128 * 1024
#: tbf burst = this much time at line rate (1 ms is the usual rule: it keeps the qdisc's
#: watchdog wake-ups to about one per millisecond at 10-25 Gbit/s, and the burst is only 0.1%
#: of a one-second transfer, so measured rates stay honest).
BURST_TIME_S = 1e-3
#: tbf queue = burst + this much time at line rate: a switch-like buffer deep enough that TCP
#: (UCX and gloo open several connections per peer) is not throttled by tail drops.
QUEUE_TIME_S = 20e-3

_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_RATE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_rate(rate: str | float) -> int:
    """Bits per second of ``rate``: a number (bit/s) or tc's decimal units, e.g. ``"1gbit"``.

    tc's ``bps`` means *bytes* per second, a classic source of 8x errors, so it is refused.
    """
    if isinstance(rate, bool):
        raise ConfigError(f"link rate must be a number or e.g. '1gbit', got {rate!r}")
    if isinstance(rate, int | float):
        value, unit = float(rate), "bit"
    else:
        m = _RATE_RE.match(str(rate))
        if not m:
            raise ConfigError(f"link rate must be e.g. '1gbit', '100mbit' or bits/s, got {rate!r}")
        value, unit = float(m.group(1)), (m.group(2).lower() or "bit")
        if unit not in _RATE_UNITS:
            raise ConfigError(
                f"link rate unit must be one of {sorted(_RATE_UNITS)} (decimal bits per "
                f"second; tc's 'bps' would be bytes), got {rate!r}"
            )
    bps = round(value * _RATE_UNITS[unit])
    # tbf needs at least one MTU per second to make progress at all.
    if bps < 8 * DEFAULT_MTU:
        raise ConfigError(f"link rate must be at least {8 * DEFAULT_MTU} bit/s, got {rate!r}")
    return bps


def format_rate(bps: float) -> str:
    """``1000000000 -> '1gbit'``: the largest unit that keeps the value whole, else 3 decimals."""
    for unit, scale in sorted(_RATE_UNITS.items(), key=lambda kv: -kv[1]):
        if bps >= scale:
            value = bps / scale
            return f"{value:g}{unit}" if value == int(value) else f"{value:.3g}{unit}"
    return f"{bps:g}bit"


def tbf_burst_bytes(rate_bps: int) -> int:
    """The tbf bucket: 1 ms at line rate, at least 128 KiB (see the constants for why)."""
    return max(BURST_FLOOR_BYTES, int(rate_bps / 8 * BURST_TIME_S))


def tbf_limit_bytes(rate_bps: int) -> int:
    """The tbf queue: the bucket plus 20 ms at line rate (see :data:`QUEUE_TIME_S`)."""
    return tbf_burst_bytes(rate_bps) + int(rate_bps / 8 * QUEUE_TIME_S)


def missing_prerequisites() -> list[str]:
    """What this machine lacks to emulate links (empty when all is there)."""
    missing = []
    if os.name != "posix" or not sys.platform.startswith("linux"):
        missing.append("Linux (network namespaces)")
    if os.geteuid() != 0:
        missing.append("root (creating network namespaces needs CAP_SYS_ADMIN and CAP_NET_ADMIN)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            missing.append(f"the '{tool}' command of iproute2 (apt-get install iproute2)")
    return missing


def _run(cmd: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run one ip/tc command with a deadline; failures become TransportError with its stderr."""
    try:
        done = subprocess.run(
            list(cmd), capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False
        )
    except FileNotFoundError as exc:
        raise ConfigError(f"{cmd[0]!r} not found: link emulation needs iproute2") from exc
    except subprocess.TimeoutExpired as exc:
        raise TransportError(f"`{' '.join(cmd)}` did not return in {COMMAND_TIMEOUT_S} s") from exc
    if check and done.returncode != 0:
        raise TransportError(
            f"`{' '.join(cmd)}` failed (exit {done.returncode}): {done.stderr.strip()}"
        )
    return done


def _list_namespaces() -> list[str]:
    done = _run(["ip", "netns", "list"])
    # Lines look like "name" or "name (id: 3)".
    return [line.split()[0] for line in done.stdout.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _namespace_pids(ns: str) -> list[int]:
    done = _run(["ip", "netns", "pids", ns], check=False)
    return [int(tok) for tok in done.stdout.split() if tok.isdigit()]


def _delete_namespace(ns: str) -> str | None:
    """Kill what still runs in ``ns`` (by pid), delete it; the error text, or None."""
    for pid in _namespace_pids(ns):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    # Deleting a namespace deletes its devices; a veth pair dies with either end, a bridge
    # with its namespace, qdiscs with their device. Besides, only its /etc/netns folder.
    done = _run(["ip", "netns", "del", ns], check=False)
    shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)
    if done.returncode != 0 and ns in _list_namespaces():
        return done.stderr.strip() or f"exit {done.returncode}"
    return None


def _name_pattern(prefix: str) -> re.Pattern[str]:
    return re.compile(rf"^{re.escape(prefix)}-(\d+)-([0-9a-f]{{6}})-(?:r\d+|n\d+|hub)$")


def cleanup_stale(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Delete namespaces left by killed runs: name matches ``prefix`` and its owner pid is dead.

    Namespaces of live owners (another emulator running now) are never touched. Returns the
    names removed.
    """
    pattern = _name_pattern(prefix)
    removed = []
    etc = sorted(p.name for p in NETNS_ETC.iterdir()) if NETNS_ETC.is_dir() else []
    for ns in sorted(set(_list_namespaces()) | set(etc)):
        m = pattern.match(ns)
        if m is None or _pid_alive(int(m.group(1))):
            continue
        err = _delete_namespace(ns)
        if err is None:
            removed.append(ns)
            log.info("removed left-over namespace %s (owner pid %s is dead)", ns, m.group(1))
        else:
            log.warning("could not remove left-over namespace %s: %s", ns, err)
    return removed


@dataclass(frozen=True)
class TcpMeasurement:
    """Raw TCP payload throughput from one rank to another across the shaped link."""

    src: int
    dst: int
    bytes: int
    seconds: float
    rate_bps: int

    @property
    def bits_per_s(self) -> float:
        return 8 * self.bytes / self.seconds if self.seconds > 0 else 0.0

    @property
    def fraction_of_rate(self) -> float:
        """Measured payload rate over the shaped rate (about 0.96 at MTU 1500)."""
        return self.bits_per_s / self.rate_bps


@dataclass(frozen=True)
class InterfaceCounters:
    """Byte counters of every interface of every node namespace, at one moment.

    ``bytes[node][ifname] = (tx_bytes, rx_bytes)``, as the kernel counts them (Ethernet
    headers included; ``lo`` counts each byte once each way). ``link`` names each node's
    shaped device.
    """

    bytes: tuple[dict[str, tuple[int, int]], ...]
    link: tuple[str, ...]

    def delta(self, before: InterfaceCounters) -> InterfaceCounters:
        """What was counted between ``before`` and this snapshot."""
        if len(before.bytes) != len(self.bytes):
            raise ConfigError("counter snapshots of different emulators")
        out = []
        for now, then in zip(self.bytes, before.bytes, strict=True):
            out.append(
                {
                    dev: (tx - then.get(dev, (0, 0))[0], rx - then.get(dev, (0, 0))[1])
                    for dev, (tx, rx) in now.items()
                }
            )
        return InterfaceCounters(tuple(out), self.link)

    def link_tx(self, node: int) -> int:
        """Bytes node ``node`` sent over its shaped link."""
        return self.bytes[node][self.link[node]][0]

    def link_rx(self, node: int) -> int:
        """Bytes node ``node`` received over its shaped link."""
        return self.bytes[node][self.link[node]][1]

    def loopback_tx(self, node: int) -> int:
        """Bytes sent over node ``node``'s ``lo`` (node-local TCP; shared memory is not seen)."""
        return self.bytes[node].get("lo", (0, 0))[0]


@dataclass(frozen=True)
class RankResult:
    """What one rank process left behind."""

    rank: int
    returncode: int
    stdout: str
    stderr: str


class LinkEmulator:
    """One network namespace per node joined by shaped veth links; a context manager.

    ``LinkEmulator(2, rate="1gbit")`` builds two namespaces joined by a 1 Gbit/s link in each
    direction. Inside the ``with`` block, :meth:`popen` / :meth:`run_ranks` start processes in
    a rank's namespace with :meth:`rank_env`, and :meth:`measure_tcp` checks the link.
    ``LinkEmulator(4, "1gbit", nodes=2)`` builds two nodes of two ranks each.

    Arguments:
        world_size: ranks (1..254).
        rate: per-direction rate of every node's link: bits/s or e.g. ``"10gbit"``.
        nodes: ``None``: one node per rank (the per-rank layout); an int: that many nodes of
            equal size; a sequence: the ranks of each node (e.g. ``[3, 1]``), consecutive
            ranks per node. 2 nodes give a direct veth pair, more a bridge.
        force_tcp: put ``UCX_TLS=tcp`` and ``UCX_NET_DEVICES=<veth>`` in every rank's
            environment; default: on in the per-rank layout, off with ``nodes``.
        mtu: frame payload size of the veth devices (1500 = commodity Ethernet).
        delay: one-way delay in seconds added on each egress by ``netem``; needs netem in
            the kernel (:class:`ConfigError` otherwise). Not exercised on the machine this
            was written on, whose kernel lacks netem.
        prefix: namespace name prefix; :func:`cleanup_stale` matches on it.
        handle_signals: install SIGINT/SIGTERM handlers that tear down and re-raise (only
            possible from the main thread; elsewhere ``finally`` still cleans up).
    """

    def __init__(
        self,
        world_size: int,
        rate: str | float = "1gbit",
        *,
        nodes: int | Sequence[int] | None = None,
        force_tcp: bool | None = None,
        mtu: int = DEFAULT_MTU,
        delay: float = 0.0,
        prefix: str = DEFAULT_PREFIX,
        handle_signals: bool = True,
    ) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int):
            raise ConfigError(f"world_size must be an int, got {world_size!r}")
        if not 1 <= world_size <= MAX_WORLD:
            raise ConfigError(f"world_size must be 1..{MAX_WORLD} (one /24), got {world_size}")
        if not 576 <= int(mtu) <= 65535:
            raise ConfigError(f"mtu must be 576..65535, got {mtu!r}")
        if not re.fullmatch(r"[a-z][a-z0-9]{0,15}", prefix):
            raise ConfigError(f"prefix must be 1-16 lowercase letters/digits, got {prefix!r}")
        if delay < 0:
            raise ConfigError(f"delay must be >= 0 seconds, got {delay!r}")
        self.world_size = world_size
        #: Ranks of each node; rank r lives on node ``node_of[r]``.
        self.node_sizes = _node_sizes(world_size, nodes)
        self.per_rank = nodes is None
        self.force_tcp = self.per_rank if force_tcp is None else bool(force_tcp)
        self.node_of = [n for n, size in enumerate(self.node_sizes) for _ in range(size)]
        self.local_rank = [i for size in self.node_sizes for i in range(size)]
        self.rate_bps = parse_rate(rate)
        self.mtu = int(mtu)
        self.delay = float(delay)
        self.prefix = prefix
        self.burst_bytes = tbf_burst_bytes(self.rate_bps)
        self.limit_bytes = tbf_limit_bytes(self.rate_bps)
        token = secrets.token_hex(3)
        base = f"{prefix}-{os.getpid()}-{token}"
        n_nodes = len(self.node_sizes)
        kind = "r" if self.per_rank else "n"
        #: One namespace, shaped device and address per node.
        self.node_namespaces = [f"{base}-{kind}{i}" for i in range(n_nodes)]
        self.node_devices = [f"cx{token}{kind}{i}" for i in range(n_nodes)]
        self.node_addresses = [f"{SUBNET}.{i + 1}" for i in range(n_nodes)]
        self.hub = f"{base}-hub" if n_nodes > 2 else None
        self._hub_ports = [f"cx{token}h{i}" for i in range(n_nodes)]
        self._bridge = f"cx{token}br"
        #: The same per rank (ranks of one node share them).
        self.namespaces = [self.node_namespaces[n] for n in self.node_of]
        self.devices = [self.node_devices[n] for n in self.node_of]
        self.addresses = [self.node_addresses[n] for n in self.node_of]
        self.netem_available: bool | None = None
        self._handle_signals = handle_signals
        self._created: list[str] = []
        self._procs: list[subprocess.Popen[Any]] = []
        self._old_handlers: dict[int, Any] = {}
        self._lock = threading.RLock()
        self._active = False
        self._next_port = 29500
        assert all(len(n) <= IFNAMSIZ for n in [*self.node_devices, *self._hub_ports, self._bridge])

    @property
    def nodes(self) -> int:
        return len(self.node_sizes)

    # ---------------------------------------------------------------- lifecycle

    @property
    def active(self) -> bool:
        return self._active

    @property
    def master_addr(self) -> str:
        """Rank 0's address: where the TCPStore listens, reachable from every namespace."""
        return self.addresses[0]

    def __enter__(self) -> LinkEmulator:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        """Create and shape the links; on any failure, remove what was made and raise."""
        missing = missing_prerequisites()
        if missing:
            raise ConfigError("link emulation needs " + ", ".join(missing))
        with self._lock:
            if self._active:
                raise ConfigError("this LinkEmulator is already started")
            self._active = True
        self._install_signal_handlers()
        try:
            cleanup_stale(self.prefix)
            self._build()
        except BaseException:
            self.close()
            raise
        log.info(
            "link emulator up: %d ranks on nodes %s, %s per direction, tbf burst %d B "
            "limit %d B, netem %s",
            self.world_size,
            self.node_sizes,
            format_rate(self.rate_bps),
            self.burst_bytes,
            self.limit_bytes,
            "available" if self.netem_available else "absent (no delay emulation)",
        )

    def _add_namespace(self, ns: str, address: str | None = None) -> None:
        _run(["ip", "netns", "add", ns])
        self._created.append(ns)
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        if address is not None:
            host = socket.gethostname()
            lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost", f"{address} {host}"]
            lines += [f"{a} cgx-rank{i}" for i, a in enumerate(self.addresses)]
            if not self.per_rank:
                lines += [f"{a} cgx-node{i}" for i, a in enumerate(self.node_addresses)]
            folder = NETNS_ETC / ns
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "hosts").write_text("\n".join(lines) + "\n")

    def _build(self) -> None:
        for ns, addr in zip(self.node_namespaces, self.node_addresses, strict=True):
            self._add_namespace(ns, addr)
        if self.hub is not None:
            self._add_namespace(self.hub)
            _run(["ip", "-n", self.hub, "link", "add", self._bridge, "type", "bridge"])
            _run(["ip", "-n", self.hub, "link", "set", self._bridge, "up"])
        egress: list[tuple[str, str]] = []
        if self.nodes == 2:
            ns0, ns1 = self.node_namespaces
            dev0, dev1 = self.node_devices
            _run(["ip", "-n", ns0, "link", "add", dev0, "type", "veth", *_peer(dev1, ns1)])
            egress += [(ns0, dev0), (ns1, dev1)]
        elif self.hub is not None:
            nodes = zip(self.node_namespaces, self.node_devices, self._hub_ports, strict=True)
            for ns, dev, port in nodes:
                _run(["ip", "-n", ns, "link", "add", dev, "type", "veth", *_peer(port, self.hub)])
                _run(["ip", "-n", self.hub, "link", "set", port, "mtu", str(self.mtu)])
                _run(["ip", "-n", self.hub, "link", "set", port, "master", self._bridge])
                _run(["ip", "-n", self.hub, "link", "set", port, "up"])
                egress += [(ns, dev), (self.hub, port)]
        links = zip(self.node_namespaces, self.node_devices, self.node_addresses, strict=True)
        for ns, dev, addr in links if self.nodes > 1 else ():
            _run(["ip", "-n", ns, "link", "set", dev, "mtu", str(self.mtu)])
            _run(["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev])
            _run(["ip", "-n", ns, "link", "set", dev, "up"])
        self.netem_available = self._probe_netem(self.node_namespaces[0])
        if self.delay > 0 and not self.netem_available:
            raise ConfigError(
                "a link delay needs the netem qdisc, which this kernel lacks "
                "('Specified qdisc kind is unknown'); run without delay"
            )
        for ns, dev in egress:
            self._shape(ns, dev)

    @staticmethod
    def _probe_netem(ns: str) -> bool:
        """Whether the kernel has netem: try it on the namespace's own loopback."""
        done = _run(["tc", "-n", ns, "qdisc", "add", "dev", "lo", "root", "netem"], check=False)
        if done.returncode == 0:
            _run(["tc", "-n", ns, "qdisc", "del", "dev", "lo", "root"], check=False)
            return True
        return False

    def _shape(self, ns: str, dev: str) -> None:
        tbf = ["tbf", "rate", f"{self.rate_bps}bit"]
        tbf += ["burst", str(self.burst_bytes), "limit", str(self.limit_bytes)]
        if self.delay > 0:
            # netem delays, its child tbf shapes (the layout tc-netem(8) documents).
            netem = ["netem", "delay", f"{round(self.delay * 1e6)}us", "limit", "100000"]
            _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", *netem])
            _run(
                ["tc", "-n", ns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *tbf]
            )
        else:
            _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", *tbf])

    def close(self) -> list[str]:
        """Stop our processes, delete our namespaces (with their links and qdiscs).

        Idempotent and safe from a signal handler. Returns the names that could not be
        removed (logged; :func:`cleanup_stale` retries them at the next start).
        """
        with self._lock:
            procs, self._procs = self._procs, []
            created, self._created = self._created, []
            self._active = False
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.terminate()
        deadline = time.monotonic() + 2.0
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(deadline - time.monotonic(), 0.01))
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=2.0)
        failed = []
        for ns in reversed(created):
            try:
                err = _delete_namespace(ns)
            except Exception as exc:  # never let teardown stop half-way
                err = str(exc)
            if err is not None:
                failed.append(ns)
                log.warning("could not delete namespace %s: %s", ns, err)
        self._restore_signal_handlers()
        return failed

    def _install_signal_handlers(self) -> None:
        if not self._handle_signals or threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            # A process that ignores the signal (e.g. SIGINT in a background job) goes on
            # ignoring it: tearing the links down under a running job would be a surprise.
            if signal.getsignal(sig) != signal.SIG_IGN:
                self._old_handlers[sig] = signal.signal(sig, self._on_signal)

    def _restore_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, old in list(self._old_handlers.items()):
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(sig, old)
            del self._old_handlers[sig]

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        old = self._old_handlers.get(signum, signal.SIG_DFL)
        self.close()  # also restores the previous handlers
        if callable(old):
            old(signum, frame)  # e.g. default_int_handler raises KeyboardInterrupt
        elif old == signal.SIG_DFL:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    # ---------------------------------------------------------------- running ranks

    def _check_rank(self, rank: int) -> None:
        if not self._active:
            raise ConfigError("the LinkEmulator is not started (use it as a context manager)")
        if not 0 <= rank < self.world_size:
            raise ConfigError(f"rank must be 0..{self.world_size - 1}, got {rank}")

    def new_port(self) -> int:
        """A fresh TCPStore port for the next job (avoids TIME_WAIT of the previous one)."""
        with self._lock:
            self._next_port += 1
            return self._next_port

    def rank_env(self, rank: int, master_port: int | None = None) -> dict[str, str]:
        """Rank ``rank``'s variables, as torchrun would set them on its node (see module doc).

        Each namespace stands for one node: LOCAL_RANK / LOCAL_WORLD_SIZE / GROUP_RANK /
        GROUP_WORLD_SIZE describe the rank's place in it (in the per-rank layout every node
        holds one rank). ``UCX_TLS``/``UCX_NET_DEVICES`` only with :attr:`force_tcp`.
        """
        self._check_rank(rank)
        dev = self.devices[rank]
        package_root = str(Path(__file__).resolve().parents[2])
        pythonpath = os.environ.get("PYTHONPATH")
        env = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": dev} if self.force_tcp else {}
        return {
            **env,
            "UCXPY_IFNAME": dev,
            "GLOO_SOCKET_IFNAME": dev,
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(master_port if master_port is not None else self._next_port),
            "RANK": str(rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank[rank]),
            "LOCAL_WORLD_SIZE": str(self.node_sizes[self.node_of[rank]]),
            "GROUP_RANK": str(self.node_of[rank]),
            "GROUP_WORLD_SIZE": str(self.nodes),
            "CGX_BENCH_LINK_DEVICE": dev,
            "CGX_BENCH_LINK_RATE_BPS": str(self.rate_bps),
            "PYTHONPATH": package_root + (os.pathsep + pythonpath if pythonpath else ""),
        }

    def command(self, rank: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside rank ``rank``'s namespace."""
        self._check_rank(rank)
        return ["ip", "netns", "exec", self.namespaces[rank], *argv]

    def popen(
        self,
        rank: int,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        master_port: int | None = None,
        **kwargs: Any,
    ) -> subprocess.Popen[Any]:
        """Start ``argv`` in rank ``rank``'s namespace with :meth:`rank_env` (plus ``env``).

        The process is tracked: :meth:`close` ends it if it still runs.
        """
        full_env = dict(os.environ)
        full_env.update(self.rank_env(rank, master_port))
        if env:
            full_env.update(env)
        kwargs.setdefault("start_new_session", True)  # our teardown, not the tty, ends it
        p = subprocess.Popen(self.command(rank, argv), env=full_env, **kwargs)
        with self._lock:
            self._procs.append(p)
        return p

    def run_ranks(
        self,
        argv: Sequence[str] | Callable[[int], Sequence[str]],
        *,
        timeout: float,
        env: Mapping[str, str] | Callable[[int], Mapping[str, str]] | None = None,
        grace: float = 10.0,
        progress: Callable[[int, str], None] | None = None,
    ) -> list[RankResult]:
        """Run one process per rank (one shared deadline), return their outputs.

        ``argv``/``env`` may be per-rank callables. A rank that fails makes this raise
        :class:`TransportError` with its stderr (the child's traceback) after the others had
        ``grace`` seconds to notice; the deadline passing raises :class:`CGXTimeoutError`.
        ``progress(rank, line)`` sees every stderr line as it arrives.
        """
        port = self.new_port()
        deadline = time.monotonic() + timeout
        with tempfile.TemporaryDirectory(prefix="cgxlink-") as tmp:
            procs = []
            outs = []
            for rank in range(self.world_size):
                args = argv(rank) if callable(argv) else argv
                extra = env(rank) if callable(env) else env
                out = open(Path(tmp) / f"{rank}.out", "w+")  # noqa: SIM115 (closed below)
                outs.append(out)
                procs.append(
                    self.popen(
                        rank,
                        list(args),
                        env=extra,
                        master_port=port,
                        stdout=out,
                        stderr=subprocess.PIPE,
                        text=True,
                    )
                )
            errs: list[list[str]] = [[] for _ in procs]
            readers = [
                threading.Thread(target=_pump, args=(p.stderr, errs[r], r, progress), daemon=True)
                for r, p in enumerate(procs)
            ]
            for t in readers:
                t.start()
            failed_at: float | None = None
            timed_out = False
            while any(p.poll() is None for p in procs):
                now = time.monotonic()
                if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
                    failed_at = now
                if now > deadline or (failed_at is not None and now > failed_at + grace):
                    timed_out = failed_at is None
                    break
                time.sleep(0.05)
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(timeout=5.0)
            for t in readers:
                t.join(timeout=5.0)
            results = []
            for rank, (p, out) in enumerate(zip(procs, outs, strict=True)):
                out.seek(0)
                results.append(RankResult(rank, p.returncode, out.read(), "".join(errs[rank])))
                out.close()
        with self._lock:
            self._procs = [p for p in self._procs if p not in procs]
        if timed_out:
            raise CGXTimeoutError(
                f"ranks did not finish within {timeout} s; stderr tails:\n" + _tails(results)
            )
        bad = [r for r in results if r.returncode != 0]
        if bad:
            raise TransportError(
                f"rank(s) {[r.rank for r in bad]} failed (exit "
                f"{[r.returncode for r in bad]}); stderr tails:\n" + _tails(bad)
            )
        return results

    # ---------------------------------------------------------------- verification

    def measure_tcp(
        self,
        src: int = 0,
        dst: int = 1,
        *,
        seconds: float = 1.0,
        max_bytes: int = 1 << 34,
        timeout: float = 30.0,
    ) -> TcpMeasurement:
        """Raw TCP payload throughput ``src -> dst`` across the link (one stream).

        The first two buckets' worth of bytes are excluded from the timing (they pass at
        line speed before the shaping bites). Bounded in bytes, time and deadline.
        ``src`` and ``dst`` are ranks on different nodes.
        """
        self._check_rank(src)
        self._check_rank(dst)
        if self.node_of[src] == self.node_of[dst]:
            raise ConfigError("measure_tcp needs two ranks on different nodes")
        probe = [sys.executable, "-m", "cgx_ucx.bench.link_probe"]
        skip = ["--skip", str(2 * self.burst_bytes)]
        deadline = time.monotonic() + timeout
        recv = self.popen(
            dst,
            [*probe, "recv", "--bind", self.addresses[dst], *skip, "--deadline", str(timeout)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        send = None
        try:
            first = _read_line(recv, deadline)
            if not first.startswith("PORT "):
                raise TransportError(f"link probe receiver said {first!r}: {_drain(recv)}")
            port = int(first.split()[1])
            bounds = ["--seconds", str(seconds), "--bytes", str(max_bytes), "--deadline"]
            bounds.append(str(max(deadline - time.monotonic(), 1.0)))
            send = self.popen(
                src,
                [*probe, "send", "--to", f"{self.addresses[dst]}:{port}", *bounds],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            _, send_err = send.communicate(timeout=max(deadline - time.monotonic(), 0.1))
            if send.returncode != 0:
                raise TransportError(f"link probe sender failed: {send_err.strip()}")
            recv_out, recv_err = recv.communicate(timeout=max(deadline - time.monotonic(), 0.1))
            lines = recv_out.strip().splitlines()
            line = lines[-1] if lines else recv_err.strip()
        except subprocess.TimeoutExpired as exc:
            raise CGXTimeoutError(f"link probe {src}->{dst} ran past {timeout} s") from exc
        finally:
            for p in (recv, send):
                if p is not None and p.poll() is None:
                    p.kill()
                    p.wait(timeout=5.0)
        try:
            got = json.loads(line)
        except ValueError as exc:
            raise TransportError(f"link probe receiver said {line!r}") from exc
        return TcpMeasurement(src, dst, got["measured_bytes"], got["seconds"], self.rate_bps)

    def egress_bytes(self, rank: int) -> int:
        """Bytes rank ``rank``'s shaped device has sent (tc's counter, headers included).

        The benchmark compares it before and after a run to prove the traffic crossed the link.
        """
        self._check_rank(rank)
        ns, dev = self.namespaces[rank], self.devices[rank]
        done = _run(["tc", "-s", "-n", ns, "qdisc", "show", "dev", dev])
        m = re.search(r"Sent (\d+) bytes", done.stdout)
        if m is None:
            raise TransportError(f"no qdisc counters on {self.devices[rank]}: {done.stdout!r}")
        return int(m.group(1))

    def interface_counters(self) -> InterfaceCounters:
        """Every interface's byte counters in every node namespace (a snapshot).

        Read from ``/sys/class/net/<if>/statistics`` inside each namespace (``ip netns
        exec`` mounts that namespace's sysfs). Subtract two snapshots with
        :meth:`InterfaceCounters.delta`.
        """
        if not self._active:
            raise ConfigError("the LinkEmulator is not started (use it as a context manager)")
        script = (
            "cd /sys/class/net && for i in *; do "
            'echo "$i $(cat $i/statistics/tx_bytes) $(cat $i/statistics/rx_bytes)"; done'
        )
        snapshot = []
        for ns in self.node_namespaces:
            done = _run(["ip", "netns", "exec", ns, "sh", "-c", script])
            counts = {}
            for line in done.stdout.splitlines():
                parts = line.split()
                if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
                    counts[parts[0]] = (int(parts[1]), int(parts[2]))
            snapshot.append(counts)
        return InterfaceCounters(tuple(snapshot), tuple(self.node_devices))

    def describe(self) -> dict[str, Any]:
        """The emulated link's settings, for the benchmark's JSON record."""
        topology = {1: "one node", 2: "veth pair"}.get(self.nodes, "veth to a bridge")
        return {
            "world_size": self.world_size,
            "nodes": list(self.node_sizes),
            "force_tcp": self.force_tcp,
            "rate_bps": self.rate_bps,
            "rate": format_rate(self.rate_bps),
            "topology": topology,
            "mtu": self.mtu,
            "tbf_burst_bytes": self.burst_bytes,
            "tbf_limit_bytes": self.limit_bytes,
            "delay_s": self.delay,
            "netem_available": self.netem_available,
        }


def _node_sizes(world_size: int, nodes: int | Sequence[int] | None) -> list[int]:
    """Ranks per node from the ``nodes`` argument (see :class:`LinkEmulator`)."""
    if nodes is None:
        return [1] * world_size
    if isinstance(nodes, bool):
        raise ConfigError(f"nodes must be an int or a list of ranks per node, got {nodes!r}")
    if isinstance(nodes, int):
        if nodes < 1 or world_size % nodes:
            raise ConfigError(f"nodes={nodes} does not divide world_size={world_size}")
        return [world_size // nodes] * nodes
    sizes = list(nodes)
    if not sizes or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in sizes):
        raise ConfigError(f"nodes must list positive rank counts, got {nodes!r}")
    if sum(sizes) != world_size:
        raise ConfigError(f"nodes {sizes} hold {sum(sizes)} ranks, world_size is {world_size}")
    return sizes


def _peer(name: str, ns: str) -> list[str]:
    """The ``peer`` clause of ``ip link add ... type veth``: the other end made in ``ns``."""
    return ["peer", "name", name, "netns", ns]


def _pump(
    stream: Any, sink: list[str], rank: int, progress: Callable[[int, str], None] | None
) -> None:
    for line in iter(stream.readline, ""):
        sink.append(line)
        if progress is not None:
            progress(rank, line)
    stream.close()


def _tails(results: Sequence[RankResult], lines: int = 25) -> str:
    parts = []
    for r in results:
        tail = "".join(r.stderr.splitlines(keepends=True)[-lines:])
        parts.append(f"--- rank {r.rank} (exit {r.returncode}) ---\n{tail}")
    return "\n".join(parts)


def _read_line(p: subprocess.Popen[Any], deadline: float) -> str:
    """One stdout line of ``p`` before ``deadline`` (select, so a silent child cannot hang us)."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise CGXTimeoutError("link probe did not answer in time")
        ready, _, _ = select.select([p.stdout], [], [], left)
        if ready:
            return p.stdout.readline().strip()


def _drain(p: subprocess.Popen[Any]) -> str:
    with contextlib.suppress(Exception):
        p.kill()
        _, err = p.communicate(timeout=2.0)
        return str(err).strip()
    return ""
