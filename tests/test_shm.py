"""cgx_ucx.transport.shm: segments a node peer maps, and what a bad descriptor gets.

The collectives that use it are checked in test_hierarchical_unit (one process) and
test_netns (ranks in separate processes and namespaces, as torchrun starts them)."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import numpy as np
import pytest

from cgx_ucx.errors import PeerLostError, ProtocolError, TransportError
from cgx_ucx.transport import shm

pytestmark = pytest.mark.skipif(not shm.available(), reason="needs memfd_create and /proc")


def test_a_peer_reads_the_described_bytes_in_place():
    seg = shm.Segment(1 << 16)
    seg.array[100:200] = np.arange(100, dtype=np.uint8)
    desc = shm.Descriptor.unpack(seg.describe(100, 100).pack())
    peers = shm.PeerSegments(rank=1)
    view = peers.view(0, desc)
    np.testing.assert_array_equal(view, np.arange(100, dtype=np.uint8))
    assert not view.flags.writeable
    seg.array[100] = 42  # the same memory, not a copy
    assert peers.view(0, desc)[0] == 42
    peers.clear()
    seg.close()


def _child(conn) -> None:
    seg = shm.Segment(1 << 20)
    seg.array[:] = 7
    conn.send(bytes(seg.describe(4096, 1 << 19).pack()))
    conn.recv()  # the parent has read it
    seg.close()


def _describing(target):
    """A spawned process running ``target(conn)``, the parent's end of the pipe, and the
    descriptor the child sent first."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=target, args=(child,))
    p.start()
    return p, parent, shm.Descriptor.unpack(np.frombuffer(parent.recv(), np.uint8))


def test_another_process_maps_a_segment():
    p, parent, desc = _describing(_child)
    try:
        peers = shm.PeerSegments(rank=0)
        view = peers.view(1, desc)
        assert view.nbytes == 1 << 19 and np.all(view == 7)
        parent.send(b"done")
        peers.clear()
    finally:
        p.join(30)
    assert p.exitcode == 0


def _exits_after_describing(conn) -> None:
    seg = shm.Segment(1 << 16)
    conn.send(bytes(seg.describe(0, 1 << 12).pack()))
    conn.recv()
    os._exit(0)  # its files close; the parent has not reaped it: a zombie


def test_a_peer_that_exited_after_describing_its_bytes_is_named_lost():
    """A node peer killed between describing its bytes and their reading: the reader's
    error names it as lost (PeerLostError.peer), so that the ranks blame it, not the
    reader, and does not send the user off to PID namespaces."""
    p, parent, desc = _describing(_exits_after_describing)
    try:
        parent.send(b"exit")
        deadline = time.monotonic() + 30
        while not shm.process_gone(p.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert shm.process_gone(p.pid) and os.path.exists(f"/proc/{p.pid}")  # a zombie
        with pytest.raises(PeerLostError, match="rank 5's shared memory") as err:
            shm.PeerSegments(rank=0).view(5, desc)
        assert err.value.peer == 5
    finally:
        p.join(30)
    assert not shm.process_gone(os.getpid())


def test_pool_reuses_segments_by_size_class():
    pool = shm.SegmentPool()
    a = pool.take(100_000)
    assert a.size == 1 << 17
    pool.give(a)
    assert pool.take(70_000) is a
    b = pool.take(10)
    assert b.size == shm.MIN_SEGMENT and b is not a
    pool.give(a)
    pool.give(b)
    pool.clear()


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (b"x" * 10, "has"),
        (b"NOPE" + bytes(shm.DESCRIPTOR_NBYTES - 4), "not a shared-memory descriptor"),
    ],
)
def test_malformed_descriptors_are_protocol_errors(raw, match):
    with pytest.raises(ProtocolError, match=match):
        shm.Descriptor.unpack(np.frombuffer(raw, np.uint8))


def test_out_of_bounds_descriptor_is_refused_before_mapping():
    seg = shm.Segment(1 << 16)
    desc = seg.describe(0, 16)
    bad = shm.Descriptor(**{**desc.__dict__, "offset": (1 << 16) - 8})
    with pytest.raises(ProtocolError, match="out of bounds"):
        shm.Descriptor.unpack(bad.pack())
    seg.close()


def test_a_descriptor_naming_another_file_is_refused():
    seg = shm.Segment(1 << 16)
    desc = seg.describe(0, 16)
    wrong = shm.Descriptor(**{**desc.__dict__, "ino": desc.ino + 1})
    with pytest.raises(TransportError, match="not the segment"):
        shm.PeerSegments(rank=0).view(1, wrong)
    seg.close()


def test_an_unreachable_process_names_the_way_out():
    seg = shm.Segment(1 << 16)
    desc = seg.describe(0, 16)
    gone = shm.Descriptor(**{**desc.__dict__, "pid": 2**31 - 1})
    with pytest.raises(TransportError, match="CGX_UCX_INTRA_SHM=0"):
        shm.PeerSegments(rank=0).view(3, gone)
    seg.close()
    assert os.path.isdir("/proc/self/fd")


def test_mappings_are_bounded_in_count_and_bytes():
    segs = [shm.Segment(1 << 16) for _ in range(5)]
    peers = shm.PeerSegments(rank=0)
    peers.MAX_MAPPED_BYTES = 3 << 16
    views = [peers.view(1, s.describe(0, 8)) for s in segs]
    assert len(peers._maps) == 3 and peers._bytes == 3 << 16
    peers.MAX_MAPPED = 2
    peers.view(1, segs[0].describe(0, 8))  # mapped again: the oldest two go
    assert len(peers._maps) == 2
    assert all(v.nbytes == 8 and int(v.sum()) == 0 for v in views)  # evicted: still readable
    peers.clear()
    for s in segs:
        s.close()
