"""Rendezvous through a torch.distributed Store: addresses, the job token, generations.

The store is duck-typed (``set``, ``get``, ``wait``, ``add``), so TCPStore, FileStore,
HashStore and PrefixStore all work; ``env://`` (MASTER_ADDR, MASTER_PORT, RANK,
WORLD_SIZE, as torchrun sets them) builds a TCPStore, importing torch only then.

Store calls block, and a blocked event loop would stall UCX progress (a peer's connection
to our listener needs it), so every call runs on a private one-thread executor that the
:class:`Rendezvous` shuts down when connecting is over (no thread outlives ``connect``).

Keys live under ``<prefix>/<generation>/``: every ``connect`` of a job bumps a counter, so
a communicator created after another one closed never reads the old one's addresses.

Every communicator also gets an id that is unique in the job: rank 0 draws it from one
counter in the innermost store (under every torch PrefixStore, so process groups that
each got their own prefix still share it) and publishes it with the token. Each rank
publishes its world size with its address, so ranks started with different world sizes
are told so at once, with both sizes, rather than waiting for a rank that never
comes.
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
from contextlib import suppress
from typing import Any, Protocol

from ..errors import ConfigError, PeerFailedError, RendezvousError
from .liveness import MARK_PERIOD_S, LivenessMark, Phase, ProcessId
from .topology import MAX_HINTS_NBYTES

__all__ = [
    "COMM_ID_KEY",
    "PeerAddress",
    "PeerFailedError",
    "Rendezvous",
    "Store",
    "default_host",
    "env_store",
    "local_address_towards",
    "node_id",
    "root_store",
    "store_host",
    "with_rank",
]

log = logging.getLogger("cgx_ucx.transport")

TOKEN_NBYTES = 16
#: Longest worker address accepted from the store (UCX worker addresses with all
#: transports are a few hundred bytes; this bounds what a corrupt key can make us hold).
MAX_ADDRESS_NBYTES = 1 << 16
#: Store key (under the generation) where a rank that failed to connect leaves its reason.
FAILED_KEY = "failed"
#: Longest failure text kept (it ends up in other ranks' exception messages).
MAX_FAILURE_NBYTES = 1024
#: Store polling while waiting for a key: starts at 1 ms (ranks usually publish within
#: milliseconds of each other), doubles up to 100 ms (a failure elsewhere then surfaces
#: within ~0.1 s; a few store round trips per second per rank cost nothing).
POLL_MIN_S = 0.001
POLL_MAX_S = 0.1
#: Bound on publishing a failure (a TCPStore set takes milliseconds; the store may be gone).
FAILURE_PUBLISH_S = 5.0
#: Bound on reading one liveness mark to explain a failure (after the connect deadline).
MARK_READ_S = 1.0
#: Counter (in the innermost store) that numbers every communicator of the job.
COMM_ID_KEY = "cgx_ucx/communicators"
#: How many PrefixStore layers are unwrapped (torch nests one per process group /
#: backend; a bound keeps a self-referencing duck-typed store from hanging us).
MAX_STORE_NESTING = 32


def with_rank(rank: int, text: str) -> str:
    """``"rank N: text"``, unless ``text`` already starts with ``"rank N:"`` or names rank N
    as its subject (no "rank 0: rank 0: ...", no "rank 2: rank 2 could not reach ...")."""
    prefix = f"rank {rank}: "
    return text if text.startswith((prefix, f"rank {rank} ")) else prefix + text


def root_store(store: Any) -> Any:
    """The innermost store under torch's PrefixStores (``store`` itself if none)."""
    for _ in range(MAX_STORE_NESTING):
        inner = getattr(store, "underlying_store", None)
        if inner is None or inner is store:
            return store
        store = inner
    return store


def store_host(store: Any) -> str | None:
    """The host of the TCPStore under ``store``, unwrapping PrefixStores.

    torch hands a backend a ``PrefixStore`` (often several nested) around the job's
    TCPStore; only the innermost store knows the host. None for stores without a host
    (FileStore, HashStore).
    """
    for _ in range(MAX_STORE_NESTING):
        host = getattr(store, "host", None)
        if isinstance(host, str) and host:
            return host
        inner = getattr(store, "underlying_store", None)
        if inner is None or inner is store:
            return None
        store = inner
    return None


def default_host(store: Any) -> str:
    """The address peers should dial: the local interface that routes to the store's host
    (found through PrefixStores), else to MASTER_ADDR, else the hostname's address.

    Loopback or the hostname would leave ranks in other network namespaces or on other
    hosts unable to dial, so the store is unwrapped first.
    """
    for target in (store_host(store), os.environ.get("MASTER_ADDR")):
        if target:
            addr = local_address_towards(target)
            if addr:
                return addr
    with suppress(OSError):
        return local_address_towards(socket.gethostname()) or "127.0.0.1"
    return "127.0.0.1"


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
        from torch.distributed import PrefixStore, TCPStore
    except ImportError as exc:
        raise ConfigError("env:// rendezvous needs torch; pass store= otherwise") from exc
    # Under torchrun's agent the store is already served: join it as a client, under
    # this restart's prefix, as torch's own env:// does (a rank that served it as well
    # would fail to bind).
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store = TCPStore(
        os.environ["MASTER_ADDR"],
        port,
        world,
        is_master=rank == 0 and not agent,
        timeout=datetime.timedelta(seconds=timeout),
        wait_for_workers=False,
    )
    if agent:
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = PrefixStore(f"/worker/attempt_{attempt}", store)
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
    """What a rank publishes: where its listener is, its UCX worker addresses (full, and
    network-only for peers on other nodes: :mod:`.levels`), its machine, the world size it
    was started with, and its packed :class:`~.topology.NodeHints`."""

    # host length, port, worker-address length, node length, world size,
    # network-only address length, hints length
    _HEAD = struct.Struct("<HHIHIIH")

    def __init__(
        self,
        host: str,
        port: int,
        worker_address: bytes,
        node: str = "",
        world_size: int = 0,
        net_address: bytes = b"",
        hints: bytes = b"",
    ) -> None:
        self.host, self.port, self.worker_address, self.node = host, port, worker_address, node
        self.world_size = world_size
        self.net_address, self.hints = net_address, hints

    def pack(self) -> bytes:
        h, n = self.host.encode(), self.node.encode()
        head = self._HEAD.pack(
            len(h),
            self.port,
            len(self.worker_address),
            len(n),
            self.world_size,
            len(self.net_address),
            len(self.hints),
        )
        return head + h + self.worker_address + n + self.net_address + self.hints

    @classmethod
    def unpack(cls, raw: bytes) -> PeerAddress:
        if len(raw) < cls._HEAD.size:
            raise RendezvousError("malformed peer address in the store (too short)")
        hlen, port, alen, nlen, world, netlen, hintlen = cls._HEAD.unpack_from(raw)
        sizes = (hlen, alen, nlen, netlen, hintlen)
        if (
            max(alen, netlen) > MAX_ADDRESS_NBYTES
            or hintlen > MAX_HINTS_NBYTES
            or len(raw) != cls._HEAD.size + sum(sizes)
        ):
            raise RendezvousError("malformed peer address in the store (length mismatch)")
        parts, pos = [], cls._HEAD.size
        for size in sizes:
            parts.append(raw[pos : pos + size])
            pos += size
        try:
            host, node = parts[0].decode(), parts[2].decode()
        except UnicodeDecodeError as exc:
            raise RendezvousError("malformed peer address in the store (not UTF-8)") from exc
        return cls(host, port, parts[1], node, world, parts[3], parts[4])


class Rendezvous:
    """Store operations of one ``connect``, each bounded by the connect deadline."""

    def __init__(self, store: Any, rank: int, world_size: int, prefix: str, deadline: float):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.prefix = prefix
        self.deadline = deadline  # time.monotonic() value
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="cgx-rdzv")
        # Name resolution gets its own thread: a resolver that hangs (no DNS) must not
        # hold up the store calls and the failure watch queued behind it.
        self._aux: concurrent.futures.ThreadPoolExecutor | None = None
        self.generation = -1
        self._stop_watch = False
        self._watch: asyncio.Future | None = None
        #: This rank's liveness mark (:mod:`.liveness`): its process, and ``state``, set
        #: by the connecting mesh, says the phase and the ranks still waited for there.
        self.process = ProcessId.own(node_id())
        self.state: Any = None
        self._marked = -MARK_PERIOD_S  # time.monotonic() of the last mark written

    def close(self, wait: bool = True) -> None:
        """Stop the store thread (``wait=False`` on error paths, where a store call may
        still block until the connect deadline: the thread then ends on its own)."""
        self._pool.shutdown(wait=wait, cancel_futures=True)
        if self._aux is not None:
            self._aux.shutdown(wait=False, cancel_futures=True)

    def _remaining(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise RendezvousError(f"rank {self.rank}: the connect timeout passed")
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

    def run_blocking(self, fn: Any, *args: Any) -> asyncio.Future:
        """Run a blocking call that is not a store call (name resolution) on a thread of
        its own, shut down with the store thread when connecting is over."""
        if self._aux is None:
            self._aux = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="cgx-resolve")
        return asyncio.get_running_loop().run_in_executor(self._aux, fn, *args)

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{self.generation}/{name}"

    async def join(self) -> int:
        """Count this connect; all ranks of one connect share its generation."""
        n = int(await self._call(self.store.add, f"{self.prefix}/joined", 1))
        self.generation = (n - 1) // self.world_size
        return self.generation

    async def _wait_get(self, key: str, what: str = "") -> bytes:
        """Wait for ``key`` (bounded by the connect deadline), failing early when another
        rank has published a connect failure: a rank that cannot connect must not leave
        the others waiting out a long connect timeout."""
        fail_key = self._key(FAILED_KEY)
        has_check = callable(getattr(self.store, "check", None))

        def wait_get() -> bytes:
            if not has_check:
                try:
                    self.store.wait([key], datetime.timedelta(seconds=self._remaining()))
                except TypeError:  # a duck-typed store without the timeout argument
                    self.store.wait([key])
                return self.store.get(key)
            pause = POLL_MIN_S
            while not self.store.check([key]):
                self._beat()
                self._raise_if_failed(fail_key)
                left = self._remaining()
                time.sleep(min(pause, left))
                pause = min(pause * 2, POLL_MAX_S)
            return self.store.get(key)

        try:
            value = await self._call(wait_get)
        except PeerFailedError:
            raise
        except RendezvousError as exc:
            if what and time.monotonic() >= self.deadline:
                raise RendezvousError(
                    f"rank {self.rank}: {what} within the connect timeout"
                ) from exc
            raise
        return bytes(value) if not isinstance(value, bytes) else value

    def _write_mark(self) -> None:
        phase, pending = self.state() if self.state is not None else (Phase.ADDRESSES, ())
        mark = LivenessMark(time.time(), self.process, phase, tuple(pending))
        self.store.set(self._key(f"alive/{self.rank}"), mark.pack())
        self._marked = time.monotonic()

    def _beat(self) -> None:
        """Rewrite this rank's liveness mark when MARK_PERIOD_S has passed (store thread)."""
        if self.generation >= 0 and time.monotonic() - self._marked >= MARK_PERIOD_S:
            with suppress(Exception):  # the mark only explains; the waits report the store
                self._write_mark()

    def _tick(self, fail_key: str) -> None:
        self._beat()
        self._raise_if_failed(fail_key)

    async def mark(self, rank: int) -> LivenessMark | None:
        """``rank``'s liveness mark, None when there is none or the store does not answer
        within MARK_READ_S (usable after the connect deadline, to explain a failure)."""
        key = self._key(f"alive/{rank}")

        def read() -> bytes | None:
            check = getattr(self.store, "check", None)
            if callable(check) and not check([key]):
                return None
            return bytes(self.store.get(key))

        try:
            raw = await asyncio.wait_for(
                asyncio.get_running_loop().run_in_executor(self._pool, read), MARK_READ_S
            )
        except Exception:
            return None
        return LivenessMark.unpack(raw) if raw is not None else None

    def _raise_if_failed(self, fail_key: str) -> None:
        if self.store.check([fail_key]):
            raw = self.store.get(fail_key)
            text = bytes(raw)[:MAX_FAILURE_NBYTES].decode("utf-8", errors="replace")
            raise PeerFailedError(f"rank {self.rank}: connect failed elsewhere: {text}")

    async def watch_failures(self) -> str | None:
        """Poll the store until some rank publishes a connect failure; return its text.

        Returns None when the store cannot be polled (no ``check``) or fails, and ends
        at the connect deadline (the waits themselves raise then)."""
        if self.generation < 0 or not callable(getattr(self.store, "check", None)):
            return None
        fail_key = self._key(FAILED_KEY)
        loop = asyncio.get_running_loop()
        # No wait_for here: Python 3.11's wait_for can swallow a cancellation that races
        # the inner future's completion, and this task is cancelled on every connect.
        while not self._stop_watch and time.monotonic() < self.deadline:
            try:
                await loop.run_in_executor(self._pool, self._tick, fail_key)
            except PeerFailedError as exc:
                return str(exc)
            except Exception:  # the store failed: the waits report that themselves
                return None
            await asyncio.sleep(POLL_MAX_S)
        return None

    def start_watch(self) -> None:
        """Start :meth:`watch_failures` in the background (:meth:`race` uses it)."""
        self._watch = asyncio.ensure_future(self.watch_failures())

    async def stop_watch(self) -> None:
        """End the watch (bounded: Python 3.11's wait_for may swallow a cancellation)."""
        self._stop_watch = True
        if self._watch is not None:
            self._watch.cancel()
            await asyncio.wait({self._watch}, timeout=POLL_MAX_S * 2)

    async def race(self, aw: Any, timeout: float) -> Any:
        """Await ``aw`` for at most ``timeout`` s (TimeoutError), ending early with
        :class:`PeerFailedError` when another rank publishes a connect failure."""
        loop = asyncio.get_running_loop()
        fut = asyncio.ensure_future(aw)
        end = loop.time() + timeout
        while True:
            if fut.done():
                return fut.result()
            watch = self._watch
            if watch is not None and watch.done():
                reason = None
                if not watch.cancelled() and watch.exception() is None:
                    reason = watch.result()
                if reason:
                    fut.cancel()
                    raise PeerFailedError(reason)
                watch = None  # ended without news: wait on without it
            left = end - loop.time()
            if left <= 0:
                fut.cancel()
                raise TimeoutError
            waiters = {fut} if watch is None else {fut, watch}
            await asyncio.wait(waiters, timeout=left, return_when=asyncio.FIRST_COMPLETED)

    async def failed_elsewhere(self) -> PeerFailedError | None:
        """The failure another rank published already, if any (one bounded store check).

        A rank whose own step failed asks this before blaming the peer in front of it:
        the first failure often makes the next one (a rank that cannot dial the culprit
        publishes, then aborts its half-made connections, which cancels the culprit's own
        handshake with it), and every rank should name the first cause."""
        if self.generation < 0 or not callable(getattr(self.store, "check", None)):
            return None
        loop = asyncio.get_running_loop()
        try:
            await asyncio.wait_for(
                loop.run_in_executor(self._pool, self._raise_if_failed, self._key(FAILED_KEY)),
                FAILURE_PUBLISH_S,
            )
        except PeerFailedError as exc:
            return exc
        except Exception:  # the store is gone or slow: report our own failure
            return None
        return None

    async def publish_failure(self, reason: str) -> None:
        """Best effort: tell the other ranks this connect failed (bounded by
        FAILURE_PUBLISH_S; on the store thread, so no thread outlives ``connect``)."""
        if self.generation < 0:
            return
        text = reason.encode("utf-8", errors="replace")[:MAX_FAILURE_NBYTES]
        key = self._key(FAILED_KEY)
        try:
            loop = asyncio.get_running_loop()
            await asyncio.wait_for(
                loop.run_in_executor(self._pool, self.store.set, key, text), FAILURE_PUBLISH_S
            )
        except Exception as exc:
            log.debug("rank %d: could not publish the connect failure: %s", self.rank, exc)

    async def credentials(self) -> tuple[bytes, int]:
        """(job token, communicator id): rank 0 draws the token and takes the next id from
        the job-wide counter (:data:`COMM_ID_KEY`); the others read both."""
        key = self._key("token")
        if self.rank == 0:
            comm = int(await self._call(root_store(self.store).add, COMM_ID_KEY, 1))
            tok = secrets.token_bytes(TOKEN_NBYTES)
            await self._call(self.store.set, key, tok + struct.pack("<I", comm & 0xFFFFFFFF))
            return tok, comm & 0xFFFFFFFF
        raw = await self._wait_get(key, "rank 0 did not publish the job token")
        if len(raw) != TOKEN_NBYTES + 4:
            raise RendezvousError(f"malformed job token in the store ({len(raw)} bytes)")
        return raw[:TOKEN_NBYTES], struct.unpack_from("<I", raw, TOKEN_NBYTES)[0]

    async def token(self) -> bytes:
        """The job token (see :meth:`credentials`)."""
        return (await self.credentials())[0]

    async def publish(self, address: PeerAddress) -> None:
        """Publish ``address``, after this rank's first liveness mark (so a rank that reads
        the address finds the mark)."""
        await self._call(self._write_mark)
        await self._call(self.store.set, self._key(f"addr/{self.rank}"), address.pack())

    async def peer(self, rank: int) -> PeerAddress:
        """``rank``'s address; RendezvousError naming both sizes when it was started with
        another world size."""
        raw = await self._wait_get(self._key(f"addr/{rank}"), f"rank {rank} did not show up")
        addr = PeerAddress.unpack(raw)
        if addr.world_size and addr.world_size != self.world_size:
            raise RendezvousError(
                f"world size mismatch: rank {self.rank} was started with world_size "
                f"{self.world_size}, rank {rank} with world_size {addr.world_size}"
            )
        return addr
