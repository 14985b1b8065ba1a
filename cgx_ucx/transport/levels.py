"""Transports per level: node-local endpoints on shared memory, cross-node ones on the network.

UCX picks an endpoint's transports (its *lanes*) from what both workers have and what the
remote worker's *address* advertises. A worker address packed with
``UCP_WORKER_ADDRESS_FLAG_NET_ONLY`` (``ucp_worker_query``) advertises only the worker's
network devices (TCP, InfiniBand/RoCE): an endpoint made from it can use nothing else, not
shared memory, CMA or CUDA IPC, even where they would reach. So one UCX worker serves both
levels and the choice is made per peer. With UCX 1.21 and ``UCX_TLS`` unset, endpoints
from the full address use ``sysv``/``posix`` between emulated "nodes" as well, so nothing
crosses the shaped link; endpoints from the network-only address use ``tcp`` on the node's
link device, while node-local endpoints from the full address keep ``sysv``/``posix`` (and
``cma`` with error handling off). ``python -m cgx_ucx.bench nodes`` prints the transports
per level it got:

- every rank publishes both addresses (:func:`worker_addresses`);
- towards a peer on its node a rank dials the peer's full address, towards any other peer
  the network-only one (:func:`address_kind`); both directions are decided by the sender,
  so both follow the topology that every rank computed from the same hints;
- :func:`endpoint_transports` names what an endpoint really got (``ucp_ep_query``), for
  logs and ``stats()``.

The two UCP calls are not in ucxx's API; they are reached here through ctypes on the
``libucp`` that ucxx has already loaded, with the structures of UCX's public headers
(``ucp.h``, stable since UCX 1.10 for the address flag and 1.14 for the transports query).
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import Any

from ..errors import TransportError
from .topology import HierarchyConfig, Topology

__all__ = [
    "ADDRESS_FULL",
    "ADDRESS_NET_ONLY",
    "LEVEL_CROSS_NODE",
    "LEVEL_NODE_LOCAL",
    "Lane",
    "address_kind",
    "endpoint_plan",
    "endpoint_transports",
    "format_transports",
    "level_of",
    "node_local_lanes",
    "ucp_worker_handle",
    "worker_addresses",
]

LEVEL_NODE_LOCAL = "node-local"
LEVEL_CROSS_NODE = "cross-node"
#: Which of a peer's two published addresses to dial.
ADDRESS_FULL = "full"
ADDRESS_NET_ONLY = "net"

# ucp.h values (public API).
_UCP_WORKER_ATTR_FIELD_ADDRESS = 1 << 1
_UCP_WORKER_ATTR_FIELD_ADDRESS_FLAGS = 1 << 2
_UCP_WORKER_ADDRESS_FLAG_NET_ONLY = 1 << 0
_UCP_EP_ATTR_FIELD_TRANSPORTS = 1 << 3
_UCP_ENTITY_NAME_MAX = 32
#: Lanes an endpoint may have (UCP_MAX_LANES is 64 in UCX 1.21; endpoints use a few).
_MAX_LANES = 64
#: Room after the structures we declare: UCX only writes the fields named in field_mask,
#: but a newer UCX might have grown the structure, so never hand it the exact size.
_SLACK = 512


class _WorkerAttr(ctypes.Structure):
    _fields_ = [
        ("field_mask", ctypes.c_uint64),
        ("thread_mode", ctypes.c_int),
        ("address_flags", ctypes.c_uint32),
        ("address", ctypes.c_void_p),
        ("address_length", ctypes.c_size_t),
        ("max_am_header", ctypes.c_size_t),
        ("name", ctypes.c_char * _UCP_ENTITY_NAME_MAX),
        ("max_debug_string", ctypes.c_size_t),
        ("slack", ctypes.c_char * _SLACK),
    ]


class _TransportEntry(ctypes.Structure):
    _fields_ = [
        ("transport_name", ctypes.c_char_p),
        ("device_name", ctypes.c_char_p),
    ]


class _Transports(ctypes.Structure):
    _fields_ = [
        ("entries", ctypes.POINTER(_TransportEntry)),
        ("num_entries", ctypes.c_uint),
        ("entry_size", ctypes.c_size_t),
    ]


class _SockaddrStorage(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 16)]


class _EpAttr(ctypes.Structure):
    _fields_ = [
        ("field_mask", ctypes.c_uint64),
        ("name", ctypes.c_char * _UCP_ENTITY_NAME_MAX),
        ("local_sockaddr", _SockaddrStorage),
        ("remote_sockaddr", _SockaddrStorage),
        ("transports", _Transports),
        ("user_data", ctypes.c_void_p),
        ("slack", ctypes.c_char * _SLACK),
    ]


_libucp: ctypes.CDLL | None = None


def _ucp() -> ctypes.CDLL:
    """The libucp ucxx loaded (RTLD_NOLOAD: the same instance, never a second copy)."""
    global _libucp
    if _libucp is None:
        from .ucx import ucxx_module

        ucxx_module()  # loads libucx's libraries
        try:
            lib = ctypes.CDLL("libucp.so.0", mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL)
        except OSError as exc:
            raise TransportError(f"libucp is not loaded in this process: {exc}") from exc
        lib.ucp_worker_query.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        lib.ucp_worker_query.restype = ctypes.c_int
        lib.ucp_worker_release_address.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        lib.ucp_worker_release_address.restype = None
        lib.ucp_ep_query.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        lib.ucp_ep_query.restype = ctypes.c_int
        _libucp = lib
    return _libucp


def _query_address(lib: ctypes.CDLL, worker: int, flags: int) -> bytes:
    attr = _WorkerAttr()
    attr.field_mask = _UCP_WORKER_ATTR_FIELD_ADDRESS | _UCP_WORKER_ATTR_FIELD_ADDRESS_FLAGS
    attr.address_flags = flags
    status = lib.ucp_worker_query(ctypes.c_void_p(worker), ctypes.byref(attr))
    if status != 0 or not attr.address:
        raise TransportError(f"ucp_worker_query failed (UCX status {status})")
    try:
        return ctypes.string_at(attr.address, attr.address_length)
    finally:
        lib.ucp_worker_release_address(ctypes.c_void_p(worker), ctypes.c_void_p(attr.address))


def worker_addresses(worker_handle: int) -> dict[str, bytes]:
    """The worker's full address and its network-only one (``{ADDRESS_FULL: ..., ...}``).

    ``worker_handle`` is the ``ucp_worker_h`` as an int (ucxx: the application context's
    ``ucp_worker``). The network-only address is empty of lanes on a machine without any
    network device UCX can use; dialing it then fails (UCX: unreachable).
    """
    lib = _ucp()
    return {
        ADDRESS_FULL: _query_address(lib, worker_handle, 0),
        ADDRESS_NET_ONLY: _query_address(lib, worker_handle, _UCP_WORKER_ADDRESS_FLAG_NET_ONLY),
    }


@dataclass(frozen=True)
class Lane:
    """One transport an endpoint uses: e.g. ``Lane("tcp", "eth0")``, ``Lane("sysv", "memory")``."""

    transport: str
    device: str

    def __str__(self) -> str:
        return f"{self.transport}/{self.device}"


def endpoint_transports(ep_handle: int) -> tuple[Lane, ...]:
    """The transports UCX chose for an endpoint (``ucp_ep_query``), in lane order, no repeats.

    ``ep_handle`` is the ``ucp_ep_h`` as an int (ucxx: ``Endpoint.ucp_endpoint``). Valid
    once the endpoint is connected (after its first completed message, to be sure: the
    lanes of an endpoint made from a worker address are final once wire-up completed).
    """
    lib = _ucp()
    entries = (_TransportEntry * _MAX_LANES)()
    attr = _EpAttr()
    attr.field_mask = _UCP_EP_ATTR_FIELD_TRANSPORTS
    attr.transports.entries = ctypes.cast(entries, ctypes.POINTER(_TransportEntry))
    attr.transports.num_entries = _MAX_LANES
    attr.transports.entry_size = ctypes.sizeof(_TransportEntry)
    status = lib.ucp_ep_query(ctypes.c_void_p(ep_handle), ctypes.byref(attr))
    if status != 0:
        raise TransportError(f"ucp_ep_query failed (UCX status {status})")
    lanes: list[Lane] = []
    for i in range(min(attr.transports.num_entries, _MAX_LANES)):
        e = entries[i]
        lane = Lane(
            (e.transport_name or b"?").decode(errors="replace"),
            (e.device_name or b"?").decode(errors="replace"),
        )
        if lane not in lanes:
            lanes.append(lane)
    return tuple(lanes)


def format_transports(lanes: tuple[Lane, ...]) -> str:
    """``"sysv/memory+posix/memory"``: one string for a log line or a stats field."""
    return "+".join(str(lane) for lane in lanes) or "none"


#: Transports that share memory between processes: never right between nodes.
NODE_LOCAL_TRANSPORTS = frozenset({"sysv", "posix", "cma", "xpmem", "knem", "cuda_ipc", "rocm_ipc"})


def node_local_lanes(lanes: tuple[Lane, ...]) -> tuple[Lane, ...]:
    """The lanes of ``lanes`` that share memory (wrong on a cross-node endpoint)."""
    return tuple(lane for lane in lanes if lane.transport in NODE_LOCAL_TRANSPORTS)


def level_of(topology: Topology, rank: int, peer: int) -> str:
    return LEVEL_NODE_LOCAL if topology.same_node(rank, peer) else LEVEL_CROSS_NODE


def address_kind(
    topology: Topology, rank: int, peer: int, hierarchy: HierarchyConfig | None = None
) -> str:
    """Which of ``peer``'s addresses ``rank`` dials: full on its node, else network-only.

    ``hierarchy.intra_transport == "network"`` (torch_cgx's ``CGX_INNER_COMMUNICATOR_TYPE=MPI``)
    sends node-local traffic over the network path as well.
    """
    if rank == peer:
        raise TransportError(f"rank {rank} has no endpoint to itself")
    network_inside = hierarchy is not None and hierarchy.intra_transport == "network"
    if topology.same_node(rank, peer) and not network_inside:
        return ADDRESS_FULL
    return ADDRESS_NET_ONLY


def endpoint_plan(
    topology: Topology, rank: int, hierarchy: HierarchyConfig | None = None
) -> dict[int, tuple[str, str]]:
    """Per peer of ``rank``: ``(level, address kind)``, e.g. ``{1: ("node-local", "full")}``."""
    return {
        peer: (level_of(topology, rank, peer), address_kind(topology, rank, peer, hierarchy))
        for peer in range(topology.world_size)
        if peer != rank
    }


def ucp_worker_handle(ucxx: Any) -> int:
    """The running ucxx application context's ``ucp_worker_h`` (for :func:`worker_addresses`)."""
    from .progress import ucxx_context

    return int(ucxx_context(ucxx).ucp_worker)
