"""Emulated commodity links: one network namespace per node, veth pairs, ``tc tbf`` shaping.

CGX's claim is about slow links (1-25 Gbit/s Ethernet between nodes); this module builds such
a link on one machine so the claim can be measured and repeated by anyone with root.

Two layouts:

- per rank (``LinkEmulator(4)``): every rank is a node of its own, so every byte between
  ranks crosses a shaped link (the layout of ``bench link``);
- nodes (``LinkEmulator(4, nodes=2)`` or ``nodes=[3, 1]``): one namespace per node holds
  that node's ranks (consecutive ranks, as torchrun places them); ranks of one node talk
  through shared memory or the node's ``lo``, ranks of different nodes through the shaped
  link. The ranks get torchrun's variables (``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
  ``GROUP_RANK``, ``GROUP_WORLD_SIZE``) and, by default, no UCX variables at all: what
  UCX does then is what a user on two hosts gets (see ``force_tcp``).

1. One network namespace per node (:mod:`.namespaces`: ``<prefix>-<pid>-<token>-r<rank>``
   per rank, ``...-n<node>`` per node), each with ``lo`` up and one veth device holding
   ``10.213.0.<node+1>/24``. The subnet is private and exists only inside these
   namespaces: nothing outside them is ever addressed. Inside node i's namespace the
   machine's hostname resolves to node i's address (``/etc/netns/<ns>/hosts``, which
   ``ip netns exec`` mounts over ``/etc/hosts``), as on a cluster node.
2. Two nodes: the two veth ends are joined directly. More nodes: each node's veth goes to a
   bridge in a hub namespace (``...-hub``), i.e. a switch with one port per node.
3. Every egress device (the node's veth, and for the bridge also the hub's port towards the
   node) gets a ``tbf`` qdisc at the asked rate (:mod:`.shaping`), so each node has an up-
   and a downlink of that rate, as a NIC on a switch does.
4. Everything is removed on exit, on failure (``finally``), on SIGINT/SIGTERM (the handlers
   tear down, restore the previous handler and re-raise), and left-overs of a killed run
   (namespace names carry the owner's pid; the owner is dead) at the next start.

Rank processes are started inside their node's namespace with ``ip netns exec`` and a
per-rank environment (:meth:`LinkEmulator.rank_env`; :mod:`.ranks` collects their outputs).
With ``force_tcp`` (the default of the per-rank layout) it forces the traffic onto the shaped
device:

- ``UCX_TLS=tcp`` and ``UCX_NET_DEVICES=<veth>``: all namespaces share one kernel, so with
  UCX_TLS unset UCX finds shared memory across them and ignores the shaping (the honesty
  checks of ``python -m cgx_ucx.bench link`` refuse such a run). In the nodes layout this is
  exactly what the engine's per-level transports must prevent by themselves, so there
  ``force_tcp`` is off by default.
- ``GLOO_SOCKET_IFNAME=<veth>`` per rank (with one name for all ranks the store times out),
  ``UCXPY_IFNAME=<veth>`` for ``ucxx.get_address``.
- ``MASTER_ADDR`` = rank 0's address: the TCPStore lives in rank 0's namespace and is reached
  over the link by every rank.

Byte counters: :meth:`LinkEmulator.interface_counters` reads every interface's
``/sys/class/net/<if>/statistics/{tx,rx}_bytes`` inside every node namespace; two snapshots
subtracted (:meth:`InterfaceCounters.delta`) show how many bytes crossed each node's shaped
link and how many went over its ``lo`` (shared memory moves no interface bytes at all).

Delay: ``netem`` is not in every kernel (where it is missing, ``tc qdisc add ... netem``
answers "Specified qdisc kind is unknown"). :attr:`LinkEmulator.netem_available` reports
whether it is; asking for a delay without it is a :class:`~cgx_ucx.errors.ConfigError`,
never a silently undelayed link.

Only the standard library and iproute2's ``ip`` and ``tc`` commands are used, their output
parsed where needed: pyroute2 would add a dependency to CI's install and still leave
``ip netns exec`` (or setns in a forked child) to start the ranks, and ``tc``'s tbf and netem
options map one to one onto the commands above.
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
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import IO, Any

from ..errors import CGXTimeoutError, ConfigError, TransportError
from .iproute import run
from .measurements import InterfaceCounters, TcpMeasurement, read_interface_counters
from .namespaces import (
    DEFAULT_PREFIX,
    IFNAMSIZ,
    MAX_WORLD,
    NETNS_ETC,
    SUBNET,
    cleanup_stale,
    delete_namespace,
    veth_peer,
    write_hosts,
)
from .ranks import RankResult, raise_for_results, run_processes
from .shaping import (
    BURST_FLOOR_BYTES,
    DEFAULT_MTU,
    format_rate,
    parse_rate,
    probe_netem,
    qdisc_sent_bytes,
    shape,
    tbf_burst_bytes,
    tbf_limit_bytes,
)

# The emulator's public face, with what it is built from re-exported for its callers.
__all__ = [
    "BURST_FLOOR_BYTES",
    "DEFAULT_PREFIX",
    "NETNS_ETC",
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
            the kernel (:class:`ConfigError` otherwise).
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
        run(["ip", "netns", "add", ns])
        self._created.append(ns)
        run(["ip", "-n", ns, "link", "set", "lo", "up"])
        if address is not None:
            host = socket.gethostname()
            lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost", f"{address} {host}"]
            lines += [f"{a} cgx-rank{i}" for i, a in enumerate(self.addresses)]
            if not self.per_rank:
                lines += [f"{a} cgx-node{i}" for i, a in enumerate(self.node_addresses)]
            write_hosts(ns, lines)

    def _build(self) -> None:
        for ns, addr in zip(self.node_namespaces, self.node_addresses, strict=True):
            self._add_namespace(ns, addr)
        if self.hub is not None:
            self._add_namespace(self.hub)
            run(["ip", "-n", self.hub, "link", "add", self._bridge, "type", "bridge"])
            run(["ip", "-n", self.hub, "link", "set", self._bridge, "up"])
        egress: list[tuple[str, str]] = []
        if self.nodes == 2:
            ns0, ns1 = self.node_namespaces
            dev0, dev1 = self.node_devices
            run(["ip", "-n", ns0, "link", "add", dev0, "type", "veth", *veth_peer(dev1, ns1)])
            egress += [(ns0, dev0), (ns1, dev1)]
        elif self.hub is not None:
            nodes = zip(self.node_namespaces, self.node_devices, self._hub_ports, strict=True)
            for ns, dev, port in nodes:
                run(
                    ["ip", "-n", ns, "link", "add", dev, "type", "veth", *veth_peer(port, self.hub)]
                )
                run(["ip", "-n", self.hub, "link", "set", port, "mtu", str(self.mtu)])
                run(["ip", "-n", self.hub, "link", "set", port, "master", self._bridge])
                run(["ip", "-n", self.hub, "link", "set", port, "up"])
                egress += [(ns, dev), (self.hub, port)]
        links = zip(self.node_namespaces, self.node_devices, self.node_addresses, strict=True)
        for ns, dev, addr in links if self.nodes > 1 else ():
            run(["ip", "-n", ns, "link", "set", dev, "mtu", str(self.mtu)])
            run(["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev])
            run(["ip", "-n", ns, "link", "set", dev, "up"])
        self.netem_available = probe_netem(self.node_namespaces[0])
        if self.delay > 0 and not self.netem_available:
            raise ConfigError(
                "a link delay needs the netem qdisc, which this kernel lacks "
                "('Specified qdisc kind is unknown'); run without delay"
            )
        for ns, dev in egress:
            shape(ns, dev, self.rate_bps, self.burst_bytes, self.limit_bytes, self.delay)

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
                err = delete_namespace(ns)
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

        def start(rank: int, out: IO[str]) -> subprocess.Popen[Any]:
            args = argv(rank) if callable(argv) else argv
            extra = env(rank) if callable(env) else env
            return self.popen(
                rank,
                list(args),
                env=extra,
                master_port=port,
                stdout=out,
                stderr=subprocess.PIPE,
                text=True,
            )

        procs, results, timed_out = run_processes(
            start, self.world_size, timeout=timeout, grace=grace, progress=progress
        )
        with self._lock:
            self._procs = [p for p in self._procs if p not in procs]
        raise_for_results(results, timed_out, timeout)
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
        return qdisc_sent_bytes(self.namespaces[rank], self.devices[rank])

    def interface_counters(self) -> InterfaceCounters:
        """Every interface's byte counters in every node namespace (a snapshot).

        Read from ``/sys/class/net/<if>/statistics`` inside each namespace (``ip netns
        exec`` mounts that namespace's sysfs). Subtract two snapshots with
        :meth:`InterfaceCounters.delta`.
        """
        if not self._active:
            raise ConfigError("the LinkEmulator is not started (use it as a context manager)")
        snapshot = [read_interface_counters(ns) for ns in self.node_namespaces]
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
