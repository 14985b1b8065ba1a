"""What the link emulator measures of its links: TCP throughput, interface byte counters.

:meth:`cgx_ucx.bench.netns.LinkEmulator.measure_tcp` returns a :class:`TcpMeasurement`;
:meth:`~cgx_ucx.bench.netns.LinkEmulator.interface_counters` an :class:`InterfaceCounters`
snapshot, built from :func:`read_interface_counters` in each node namespace.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from .iproute import run

__all__ = ["InterfaceCounters", "TcpMeasurement", "read_interface_counters"]

#: Prints ``<interface> <tx_bytes> <rx_bytes>`` per interface of the namespace it runs in.
_COUNTERS_SCRIPT = (
    "cd /sys/class/net && for i in *; do "
    'echo "$i $(cat $i/statistics/tx_bytes) $(cat $i/statistics/rx_bytes)"; done'
)


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


def read_interface_counters(ns: str) -> dict[str, tuple[int, int]]:
    """``{interface: (tx_bytes, rx_bytes)}`` of namespace ``ns``, from
    ``/sys/class/net/<if>/statistics`` (``ip netns exec`` mounts that namespace's sysfs)."""
    done = run(["ip", "netns", "exec", ns, "sh", "-c", _COUNTERS_SCRIPT])
    counts = {}
    for line in done.stdout.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
            counts[parts[0]] = (int(parts[1]), int(parts[2]))
    return counts
