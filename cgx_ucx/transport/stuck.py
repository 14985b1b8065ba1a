"""Release UCX's TCP connections that can no longer drain, so teardown cannot hang.

Why: UCX destroys a TCP endpoint by sending a 9-byte CONN_FIN event with a blocking send
(``uct_tcp_ep_destroy`` -> ``uct_tcp_cm_send_event`` -> ``ucs_socket_do_io_b``, which
retries while the kernel answers EAGAIN). On a connection that cannot drain (a cut link,
a host gone silent) the send queue is full of data nobody acknowledges, so that send
retries until the kernel gives the connection up: minutes of TCP retransmissions
(``net.ipv4.tcp_retries2``). It runs in whatever progresses the worker next, typically
ucxx's endpoint finalizers and the listener's destructor at interpreter exit, so after a
link cut a rank that raised its typed error within seconds and closed would still take
minutes to exit.

:func:`release_stuck` shuts the write side of exactly those sockets: TCP connections of
this process to a given peer address with data queued that the kernel already tried to
deliver in vain and no acknowledgement for a while (:func:`_is_stuck`). The next send on
them fails at once (EPIPE; UCX sends with MSG_NOSIGNAL), so UCX's destroy goes on. Data
already queued still leaves if it can (the FIN follows it), and nothing is closed under
UCX's feet (the descriptor stays UCX's). A connection that is still acknowledged, one
whose peer only stopped reading (it answers the kernel's probes), or one to another
address is never touched. The mesh calls it when it closes after a failure, and
:func:`release_at_exit` makes it run at interpreter exit as well, ahead of ucxx's
finalizers, for a failed communicator nobody closed.
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import logging
import os
import socket
import struct
import sys
from collections.abc import Iterable, Iterator

__all__ = [
    "QUIET_S",
    "addresses_of",
    "host_acknowledges",
    "release_at_exit",
    "release_stuck",
    "stuck_sockets",
]

log = logging.getLogger("cgx_ucx.transport")

#: A connection counts as stuck once it has had data in flight and no acknowledgement
#: for this long: a live peer acknowledges within a round trip.
QUIET_S = 1.0

# struct tcp_info (linux/tcp.h, a stable ABI): eight bytes of u8 fields (tcpi_retransmits
# byte 2, tcpi_probes byte 3), then u32 fields (tcpi_last_ack_recv the 13th: offset 56, ms).
_TCP_INFO_NBYTES = 104
_RETRANSMITS = 2
_PROBES = 3
_LAST_ACK_RECV = 56
# ioctl SIOCOUTQ (= TIOCOUTQ): bytes in the send queue, unsent or unacknowledged.
_SIOCOUTQ = 0x5411
#: The kernel counts tcpi_last_ack_recv in clock ticks (jiffies: 1-10 ms): an
#: acknowledgement that came right after a send can read as up to a tick older.
_TICK_MS = 20
#: Unanswered zero-window probes that count as silence: the kernel of a peer that only
#: stopped reading answers each probe (so at most one is ever outstanding).
_SILENT_PROBES = 2


def _normal(text: str) -> str:
    """One spelling per address: IPv4-mapped IPv6 as the IPv4 address (ValueError for
    what is not an IP literal)."""
    ip = ipaddress.ip_address(text.split("%")[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip)


def addresses_of(host: str) -> frozenset[str]:
    """The IP addresses of ``host`` (a literal, or a name resolved now): called when a
    peer is connected, so that teardown, when the network may be gone, never waits for
    a name server. Empty where the name does not resolve."""
    try:
        return frozenset({_normal(host)})
    except ValueError:
        pass
    out = set()
    with contextlib.suppress(OSError, ValueError):
        for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM):
            out.add(_normal(str(info[4][0])))
    return frozenset(out)


def _addresses(hosts: Iterable[str]) -> set[str]:
    """The IP literals among ``hosts``, normalized (names are left out: no resolving
    here, see :func:`addresses_of`)."""
    out: set[str] = set()
    for host in hosts:
        with contextlib.suppress(ValueError):
            out.add(_normal(host))
    return out


def _peer_ip(sock: socket.socket) -> str | None:
    try:
        return _normal(str(sock.getpeername()[0]))
    except (OSError, ValueError, IndexError):
        return None


def _tcp_state(sock: socket.socket) -> tuple[int, int, int, int]:
    """(bytes queued to send, retransmission time-outs of the oldest unacknowledged
    segment, unanswered window probes, ms since the last acknowledgement) of a TCP
    socket."""
    import fcntl

    queued = struct.unpack("i", fcntl.ioctl(sock.fileno(), _SIOCOUTQ, b"\0" * 4))[0]
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_NBYTES)
    if len(info) < _LAST_ACK_RECV + 4:
        return queued, 0, 0, 0
    last_ack_ms = struct.unpack_from("I", info, _LAST_ACK_RECV)[0]
    return queued, info[_RETRANSMITS], info[_PROBES], last_ack_ms


def _is_stuck(sock: socket.socket, quiet_s: float) -> bool:
    """Data queued, no acknowledgement for ``quiet_s``, and the kernel already waited in
    vain: a retransmission timed out (data in flight across a cut link), or window probes
    went unanswered (a link that is down on this side, where nothing could even be
    sent). A peer that only stopped reading (a zero window) answers every probe and is
    not stuck: its connection drains once it reads."""
    queued, retransmits, probes, last_ack_ms = _tcp_state(sock)
    silent = retransmits > 0 or probes >= _SILENT_PROBES
    return queued > 0 and silent and last_ack_ms >= quiet_s * 1e3


def _stuck(hosts: Iterable[str], quiet_s: float) -> Iterator[tuple[int, socket.socket]]:
    """:func:`_connections` to ``hosts`` that are stuck (:func:`_is_stuck`)."""
    for fd, sock in _connections(hosts):
        try:
            if _is_stuck(sock, quiet_s):
                yield fd, sock
        except OSError:
            continue


def _connections(hosts: Iterable[str]) -> Iterator[tuple[int, socket.socket]]:
    """(descriptor, a duplicate of it) for each of this process's TCP connections to any
    of ``hosts`` (IP addresses; Linux only). The duplicate is open while the caller
    holds it, so acting on it can never hit another socket that took a descriptor
    number closed meanwhile."""
    if not sys.platform.startswith("linux"):
        return
    targets = _addresses(hosts)
    if not targets:
        return
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return
    for name in names:
        fd = int(name)
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue  # closed meanwhile
        with sock:  # the duplicate only
            try:
                tcp = sock.type == socket.SOCK_STREAM and sock.family in (
                    socket.AF_INET,
                    socket.AF_INET6,
                )
                if not (tcp and _peer_ip(sock) in targets):
                    continue
            except OSError:
                continue
            yield fd, sock


def host_acknowledges(hosts: Iterable[str], within_s: float) -> bool | None:
    """Whether the kernel of the host at ``hosts`` answers at the TCP level: True when
    one of this process's connections to it received an acknowledgement in the last
    ``within_s`` seconds (the host is up and the link carries), False when data waits
    on a connection to it and nothing was acknowledged for that long, None when no
    connection tells (none, nothing sent, not Linux). A peer process that is stopped
    or blocked still has its kernel acknowledge what it is sent; one behind a cut link
    or on a host that went down does not."""
    silent = False
    for _, sock in _connections(hosts):
        try:
            queued, _, _, last_ack_ms = _tcp_state(sock)
        except OSError:
            continue
        if last_ack_ms <= within_s * 1e3 + _TICK_MS:
            return True
        silent = silent or queued > 0
    return False if silent else None


def stuck_sockets(hosts: Iterable[str], quiet_s: float = QUIET_S) -> list[int]:
    """Descriptors of this process's TCP connections to any of ``hosts`` (IP addresses)
    that are stuck (:func:`_is_stuck`; Linux, [] elsewhere)."""
    return [fd for fd, _ in _stuck(hosts, quiet_s)]


def release_stuck(hosts: Iterable[str], quiet_s: float = QUIET_S) -> int:
    """Shut the write side of every stuck connection to ``hosts`` (:func:`stuck_sockets`);
    returns how many."""
    done = 0
    hosts = list(hosts)
    for _, sock in _stuck(hosts, quiet_s):
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_WR)  # acts on the connection, not the descriptor
            done += 1
    if done:
        log.info(
            "released %d stuck TCP connection(s) to %s (nothing acknowledged: cut or silent)",
            done,
            ", ".join(sorted(hosts)),
        )
    return done


_exit_hosts: set[str] = set()  # non-empty once the atexit hook is registered


def release_at_exit(hosts: Iterable[str]) -> None:
    """Release the stuck connections to ``hosts`` at interpreter exit as well: for a
    failed communicator that nobody closed (an asyncio job that lets its error end the
    program), whose endpoints ucxx's finalizers destroy at exit. atexit runs the
    handlers registered last first, and this one is registered once an endpoint (so
    ucxx's finalizer hook) exists, so it runs before them."""
    new = {h for h in hosts if h}
    if new and not _exit_hosts:
        atexit.register(_release_at_exit)
    _exit_hosts.update(new)


def _release_at_exit() -> None:
    with contextlib.suppress(Exception):  # nothing to report to at exit
        release_stuck(_exit_hosts)
