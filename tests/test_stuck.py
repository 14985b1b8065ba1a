"""cgx_ucx.transport.stuck: which TCP connections a failed mesh releases before UCX's
teardown (its blocking send on a connection that cannot drain would hold process exit
after a link cut; tests/test_chaos.py runs that end to end).

Both sides are real kernel connections: a peer that only stopped reading (loopback, a
zero window) must never count as stuck; one whose link went down (two network
namespaces, the far side's device set down) must, and once released a send fails at
once instead of waiting for the kernel to give the connection up.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import pytest

from cgx_ucx.bench import netns
from cgx_ucx.bench.netns import LinkEmulator
from cgx_ucx.transport import stuck

MISSING = netns.missing_prerequisites()


def _fill(sock: socket.socket) -> int:
    """Send until the kernel queues no more (the peer does not read)."""
    sock.setblocking(False)
    sent = 0
    try:
        while True:
            sent += sock.send(b"x" * 65536)
    except BlockingIOError:
        pass
    return sent


@pytest.mark.timeout(60)
def test_a_peer_that_only_stopped_reading_is_never_released() -> None:
    """A zero window: the peer's kernel answers every probe, so however long nothing is
    read (and with no quiet period asked), the connection is left alone and drains
    completely once the peer reads."""
    srv = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(srv.getsockname())
    reader, _ = srv.accept()
    try:
        sent = _fill(client)
        assert sent > 0
        end = time.monotonic() + 4.0  # the probe timer backs off past 1 s meanwhile
        while time.monotonic() < end:
            assert stuck.stuck_sockets(["127.0.0.1"], quiet_s=0.0) == []
            time.sleep(0.02)
        assert stuck._tcp_state(client)[0] > 0  # still queued: the case was real
        assert stuck.release_stuck(["127.0.0.1", "localhost"], quiet_s=0.0) == 0
        # Untouched: every byte still arrives, and the connection still sends.
        client.setblocking(True)
        got = 0
        reader.settimeout(10)
        while got < sent:
            got += len(reader.recv(1 << 20))
        client.sendall(b"after")
        assert reader.recv(5) == b"after"
    finally:
        for s in (client, reader, srv):
            s.close()


@pytest.mark.timeout(30)
def test_a_host_acknowledges_what_a_process_that_does_not_read_is_sent() -> None:
    """A peer process that reads nothing (stopped, blocked) still has its kernel
    acknowledge a message: seen within the window since the send, not once that window
    excludes the acknowledgement, and never for a host nothing is connected to."""
    srv = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(srv.getsockname())
    reader, _ = srv.accept()  # never reads
    try:
        time.sleep(0.6)  # the handshake's acknowledgements fall out of a 0.3 s window
        assert stuck.host_acknowledges(["127.0.0.1"], 0.3) is None  # nothing queued
        t0 = time.monotonic()
        client.sendall(b"status?")
        time.sleep(0.2)
        assert stuck.host_acknowledges(["127.0.0.1"], time.monotonic() - t0) is True
        assert stuck._tcp_state(client)[0] == 0  # acknowledged, not read
        assert stuck.host_acknowledges(["192.0.2.1"], 10.0) is None
    finally:
        for s in (client, reader, srv):
            s.close()


def test_unknown_or_unrelated_hosts_select_nothing() -> None:
    """Teardown never resolves names (the network may be gone): peers' addresses are
    resolved when they connect (addresses_of), and only IP literals select sockets."""
    assert stuck.stuck_sockets([]) == []
    assert stuck.stuck_sockets(["", "localhost", "no-such-host.invalid"]) == []
    assert stuck.release_stuck(["192.0.2.1"]) == 0  # TEST-NET-1: nothing connects there
    assert stuck.addresses_of("127.0.0.1") == {"127.0.0.1"}
    assert stuck.addresses_of("::ffff:10.0.0.1") == {"10.0.0.1"}  # as getpeername gives it
    assert "127.0.0.1" in stuck.addresses_of("localhost")
    assert stuck.addresses_of("no-such-host.invalid") == frozenset()


# Runs in namespace 0: connects to the silent server in namespace 1, fills the send
# queue, says READY, waits for the link to go down, then finds and releases the stuck
# connection, and checks that a send now fails at once.
_CLIENT = """
import json, socket, sys, time
from cgx_ucx.transport import stuck
host, port = sys.argv[1], int(sys.argv[2])
c = socket.create_connection((host, port), timeout=10)
c.setblocking(False)
try:
    while True:
        c.send(b"x" * 65536)
except BlockingIOError:
    pass
print("READY", flush=True)
sys.stdin.readline()  # the link is down now
t0 = time.monotonic()
found = []
while time.monotonic() - t0 < 20 and not found:
    found = stuck.stuck_sockets([host])
    time.sleep(0.05)
other = stuck.stuck_sockets(["192.0.2.1"])
acknowledges = stuck.host_acknowledges([host], 1.0)
released = stuck.release_stuck([host])
t1 = time.monotonic()
try:
    c.send(b"y")
    error = None
except OSError as exc:
    error = type(exc).__name__
print(json.dumps({"found": found == [c.fileno()], "after_s": t1 - t0, "other": other,
                  "released": released, "error": error, "acknowledges": acknowledges,
                  "send_s": time.monotonic() - t1}))
"""

_SERVER = """
import socket, sys, time
s = socket.create_server((sys.argv[1], 0))
print(s.getsockname()[1], flush=True)
conn, _ = s.accept()
time.sleep(120)  # never reads
"""


@pytest.mark.skipif(bool(MISSING), reason="needs " + ", ".join(MISSING or ["nothing"]))
@pytest.mark.netns
@pytest.mark.timeout(90)
def test_a_connection_across_a_link_that_went_down_is_released() -> None:
    with LinkEmulator(2, "1gbit", prefix="cgxstuck") as link:
        server = link.popen(
            1,
            [sys.executable, "-c", _SERVER, link.addresses[1]],
            stdout=subprocess.PIPE,
            text=True,
        )
        client = None
        try:
            port = server.stdout.readline().strip()
            assert port.isdigit(), port
            client = link.popen(
                0,
                [sys.executable, "-c", _CLIENT, link.addresses[1], port],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            assert client.stdout.readline().strip() == "READY"
            dev, ns = link.devices[1], link.namespaces[1]
            subprocess.run(["ip", "-n", ns, "link", "set", dev, "down"], check=True, timeout=10)
            client.stdin.write("go\n")
            client.stdin.flush()
            out, _ = client.communicate(timeout=40)
        finally:
            for p in (server, client):
                if p is not None and p.poll() is None:
                    p.kill()
                    p.wait(timeout=10)
    res = json.loads(out.strip().splitlines()[-1])
    print(res)
    assert res["found"] and res["released"] == 1, res
    # Seen stuck once the kernel's first retransmissions went unanswered and no ACK came
    # for QUIET_S: seconds, not the minutes the kernel takes to give up.
    assert res["after_s"] < 15, res
    assert res["other"] == [], res
    assert res["acknowledges"] is False, res  # data queued, nothing acknowledged
    assert res["error"] in ("BrokenPipeError", "ConnectionResetError"), res
    assert res["send_s"] < 1.0, res
