"""Rendezvous through a torch.distributed Store: addresses, the job token, generations.

The store is duck-typed (``set``, ``get``, ``wait``, ``add``), so TCPStore, FileStore,
HashStore and PrefixStore all work; ``env://`` (MASTER_ADDR, MASTER_PORT, RANK,
WORLD_SIZE, as torchrun sets them) builds a TCPStore, importing torch only then.

Store calls block, and a blocked event loop would stall UCX progress (a peer's connection
to our listener needs it), so every call runs on a private one-thread executor that the
:class:`Rendezvous` shuts down when connecting is over (no thread outlives ``connect``).

Keys live under ``<prefix>/<generation>/``: every ``connect`` of a job bumps a counter, so
a communicator created after another one closed never reads the old one's addresses.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime
import logging
import os
import secrets
import socket
import struct
import time
from typing import Any, Protocol

from ..errors import ConfigError, RendezvousError

__all__ = [
    "PeerAddress",
    "Rendezvous",
    "Store",
    "env_store",
    "local_address_towards",
    "node_id",
]

log = logging.getLogger("cgx_ucx.transport")

TOKEN_NBYTES = 16
#: Longest worker address accepted from the store (UCX worker addresses with all
#: transports are a few hundred bytes; this bounds what a corrupt key can make us hold).
MAX_ADDRESS_NBYTES = 1 << 16


class Store(Protocol):
    """The part of ``torch.distributed.Store`` the rendezvous uses."""

    def set(self, key: str, value: bytes | str) -> None: ...
    def get(self, key: str) -> bytes: ...
    def add(self, key: str, amount: int) -> int: ...
    def wait(self, keys: list[str], timeout: Any = ...) -> None: ...


def env_store(timeout: float) -> tuple[Any, int, int]:
    """A TCPStore from torchrun's env:// variables; returns (store, rank, world_size)."""
    missing = [
        v for v in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE") if v not in os.environ
    ]
    if missing:
        raise ConfigError(
            f"no store given and env:// is incomplete: {', '.join(missing)} not set "
            "(torchrun sets them; or pass store=, rank=, world_size=)"
        )
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        port = int(os.environ["MASTER_PORT"])
    except ValueError as exc:
        raise ConfigError(f"env:// variables must be integers: {exc}") from exc
    try:
        from torch.distributed import TCPStore
    except ImportError as exc:
        raise ConfigError("env:// rendezvous needs torch; pass store= otherwise") from exc
    store = TCPStore(
        os.environ["MASTER_ADDR"],
        port,
        world,
        is_master=rank == 0,
        timeout=datetime.timedelta(seconds=timeout),
        wait_for_workers=False,
    )
    return store, rank, world


def local_address_towards(host: str) -> str | None:
    """The local IP address the kernel would use to reach ``host`` (no packet is sent)."""
    try:
        infos = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)
    except OSError:
        return None
    for family, _, _, _, sockaddr in infos:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            try:
                s.connect(sockaddr)
                return s.getsockname()[0]
            except OSError:
                continue
    return None


def node_id() -> str:
    """Identifies the machine (kernel) this process runs on.

    The kernel's boot id: ranks in different network namespaces of one machine (the
    link emulator) still share its CPUs, so they count as local to each other.
    """
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


class PeerAddress:
    """What a rank publishes: where its listener is, its UCX worker address, its machine."""

    _HEAD = struct.Struct("<HHIH")  # host length, port, worker-address length, node length

    def __init__(self, host: str, port: int, worker_address: bytes, node: str = "") -> None:
        self.host, self.port, self.worker_address, self.node = host, port, worker_address, node

    def pack(self) -> bytes:
        h, n = self.host.encode(), self.node.encode()
        head = self._HEAD.pack(len(h), self.port, len(self.worker_address), len(n))
        return head + h + self.worker_address + n

    @classmethod
    def unpack(cls, raw: bytes) -> PeerAddress:
        if len(raw) < cls._HEAD.size:
            raise RendezvousError("malformed peer address in the store (too short)")
        hlen, port, alen, nlen = cls._HEAD.unpack_from(raw)
        if alen > MAX_ADDRESS_NBYTES or len(raw) != cls._HEAD.size + hlen + alen + nlen:
            raise RendezvousError("malformed peer address in the store (length mismatch)")
        pos = cls._HEAD.size
        try:
            host = raw[pos : pos + hlen].decode()
            node = raw[pos + hlen + alen :].decode()
        except UnicodeDecodeError as exc:
            raise RendezvousError("malformed peer address in the store (not UTF-8)") from exc
        return cls(host, port, raw[pos + hlen : pos + hlen + alen], node)


class Rendezvous:
    """Store operations of one ``connect``, each bounded by the connect deadline."""

    def __init__(self, store: Any, rank: int, world_size: int, prefix: str, deadline: float):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.prefix = prefix
        self.deadline = deadline  # time.monotonic() value
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="cgx-rdzv")
        self.generation = -1

    def close(self, wait: bool = True) -> None:
        """Stop the store thread (``wait=False`` on error paths, where a store call may
        still block until the connect deadline: the thread then ends on its own)."""
        self._pool.shutdown(wait=wait, cancel_futures=True)

    def _remaining(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise RendezvousError(f"rank {self.rank}: rendezvous deadline passed")
        return left

    async def _call(self, fn: Any, *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(self._pool, fn, *args)
        try:
            return await asyncio.wait_for(fut, self._remaining())
        except TimeoutError as exc:
            raise RendezvousError(
                f"rank {self.rank}: the store did not answer within the connect timeout"
            ) from exc
        except RendezvousError:
            raise
        except Exception as exc:
            raise RendezvousError(f"rank {self.rank}: store call failed: {exc}") from exc

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{self.generation}/{name}"

    async def join(self) -> int:
        """Count this connect; all ranks of one connect share its generation."""
        n = int(await self._call(self.store.add, f"{self.prefix}/joined", 1))
        self.generation = (n - 1) // self.world_size
        return self.generation

    async def _wait_get(self, key: str) -> bytes:
        def wait_get() -> bytes:
            try:
                self.store.wait([key], datetime.timedelta(seconds=self._remaining()))
            except TypeError:  # a duck-typed store without the timeout argument
                self.store.wait([key])
            return self.store.get(key)

        value = await self._call(wait_get)
        return bytes(value) if not isinstance(value, bytes) else value

    async def token(self) -> bytes:
        """The job token: rank 0 draws it; the others read it."""
        key = self._key("token")
        if self.rank == 0:
            tok = secrets.token_bytes(TOKEN_NBYTES)
            await self._call(self.store.set, key, tok)
            return tok
        tok = await self._wait_get(key)
        if len(tok) != TOKEN_NBYTES:
            raise RendezvousError(f"malformed job token in the store ({len(tok)} bytes)")
        return tok

    async def publish(self, address: PeerAddress) -> None:
        await self._call(self.store.set, self._key(f"addr/{self.rank}"), address.pack())

    async def peer(self, rank: int) -> PeerAddress:
        return PeerAddress.unpack(await self._wait_get(self._key(f"addr/{rank}")))
