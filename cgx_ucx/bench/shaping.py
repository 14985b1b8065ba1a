"""Link rates and ``tc`` shaping: a ``tbf`` qdisc at the asked rate, ``netem`` for a delay.

Every egress device of an emulated link gets a ``tbf`` qdisc; its bucket and queue sizes
follow from the rate (:func:`tbf_burst_bytes`, :func:`tbf_limit_bytes`). A delay puts
``netem`` above it, which not every kernel has (:func:`probe_netem`).
"""

from __future__ import annotations

import re

from ..errors import ConfigError, TransportError
from .iproute import run

__all__ = [
    "BURST_FLOOR_BYTES",
    "DEFAULT_MTU",
    "format_rate",
    "parse_rate",
    "probe_netem",
    "qdisc_sent_bytes",
    "shape",
    "tbf_burst_bytes",
    "tbf_limit_bytes",
]

#: Commodity Ethernet's MTU; a 1500-byte frame carries 1448 bytes of TCP payload with
#: timestamps, so TCP sees at most ~95.6% of the shaped rate (``python -m cgx_ucx.bench
#: link`` reports the measured share as ``tcp_probe.fraction_of_rate``).
DEFAULT_MTU = 1500
#: tbf burst floor: a veth hands GSO packets of up to 64 KiB to the qdisc, and tbf segments
#: (in software, at a CPU cost) any packet larger than its bucket; 128 KiB passes them whole.
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


def probe_netem(ns: str) -> bool:
    """Whether the kernel has netem: try it on the namespace's own loopback."""
    done = run(["tc", "-n", ns, "qdisc", "add", "dev", "lo", "root", "netem"], check=False)
    if done.returncode == 0:
        run(["tc", "-n", ns, "qdisc", "del", "dev", "lo", "root"], check=False)
        return True
    return False


def shape(
    ns: str, dev: str, rate_bps: int, burst_bytes: int, limit_bytes: int, delay: float
) -> None:
    """Shape ``dev``'s egress in namespace ``ns``: tbf at ``rate_bps``, under netem when
    ``delay`` (seconds) is positive."""
    tbf = ["tbf", "rate", f"{rate_bps}bit"]
    tbf += ["burst", str(burst_bytes), "limit", str(limit_bytes)]
    if delay > 0:
        # netem delays, its child tbf shapes (the layout tc-netem(8) documents).
        netem = ["netem", "delay", f"{round(delay * 1e6)}us", "limit", "100000"]
        run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", *netem])
        run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *tbf])
    else:
        run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", *tbf])


def qdisc_sent_bytes(ns: str, dev: str) -> int:
    """Bytes ``dev``'s root qdisc in ``ns`` has sent (tc's counter, headers included)."""
    done = run(["tc", "-s", "-n", ns, "qdisc", "show", "dev", dev])
    m = re.search(r"Sent (\d+) bytes", done.stdout)
    if m is None:
        raise TransportError(f"no qdisc counters on {dev}: {done.stdout!r}")
    return int(m.group(1))
