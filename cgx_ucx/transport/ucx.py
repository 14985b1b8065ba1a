"""UCX start-up: environment defaults applied before UCX initializes, one shared context.

UCXX keeps one application context (one UCP worker) per process. Every communicator of
this process shares it; :func:`acquire` starts it on first use and :func:`release`
shuts it down when the last communicator closes, so a later communicator starts from a
clean worker (and nothing of ours keeps running in between).

Defaults, each applied only where the user has not set the variable (ucxx 0.52 / UCX
1.21):

- ``UCX_TCP_TX_SEG_SIZE=256K``, ``UCX_TCP_RX_SEG_SIZE=1M``: several times UCX's default TCP
  throughput for large messages (the point-to-point rows of ``UCX_TLS=tcp python -m
  cgx_ucx.bench allreduce``). Only TCP links use them (loopback under ``UCX_TLS=tcp``,
  and between hosts).
- ``UCX_MM_ERROR_HANDLING=y``: shared-memory transports (sysv, posix) advertise error
  handling (peer liveness by keepalive), so the data endpoints, which keep error
  handling on, still get shared memory on one host instead of TCP loopback (see
  :mod:`.mesh` for why error handling stays on).
- ``UCX_RNDV_THRESH=inf`` and ``UCX_ZCOPY_THRESH=0`` when ``UCX_TLS`` names TCP only (see
  :data:`TCP_ONLY_DEFAULTS`): two-way transfers run at half the link rate otherwise, and
  large eager sends go out from the user's buffer instead of a copy of it.
- ``UCX_RNDV_THRESH`` when the launcher places the job on several nodes (see
  :func:`multi_node_defaults`): ``inf`` on hosts without an NVIDIA GPU, ``2mb`` with one,
  so that compressed pieces cross the network without a rendezvous hand-shake while
  uncompressed device pieces keep zero-copy (cuda_ipc) inside a node.
- ``UCX_MEMTYPE_CACHE``: ucxx sets it at import for old UCX versions; UCX >= 1.19 no
  longer knows it and prints "unused environment variable" at every start. When the
  user did not set it, it is removed again before the context is created.

The progress mode ("blocking" by default, :class:`~cgx_ucx.config.CommConfig`) is fixed
when the context starts; a communicator asking for another mode while the context is
running gets the running one (logged).
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import gc
import logging
import os
import sys
import sysconfig
import threading
import time
import traceback
from collections.abc import Mapping
from typing import Any

from ..errors import TransportError
from . import progress as _progress

__all__ = [
    "ABORT_PERIOD_NS",
    "TCP_ONLY_DEFAULTS",
    "UCX_DEFAULTS",
    "acquire",
    "apply_env_defaults",
    "errors",
    "multi_node_defaults",
    "release",
    "release_abandoned_endpoints",
    "tcp_excluded",
    "transport_defaults",
    "ucxx_module",
]

log = logging.getLogger("cgx_ucx.transport")

#: UCX variables set when the user did not set them (see the module docstring for the
#: measurements behind each value). Each belongs to one family of transports and is set
#: only where UCX_TLS lets that family load (:func:`transport_defaults`): UCX prints
#: "unused environment variable" at every start for a setting of a transport it did not
#: load (UCX_MM_ERROR_HANDLING under UCX_TLS=tcp, say).
UCX_DEFAULTS: dict[str, str] = {
    "UCX_TCP_TX_SEG_SIZE": "256K",
    "UCX_TCP_RX_SEG_SIZE": "1M",
    "UCX_MM_ERROR_HANDLING": "y",
}
#: Per family of :data:`UCX_DEFAULTS` (by prefix): the UCX_TLS names that load it
#: (aliases included: "sm"/"shm" = the shared-memory transports, "mm" = posix and sysv),
#: and the sets of names any one of which, excluded (``^...``), leaves none of it.
_FAMILIES: dict[str, tuple[frozenset[str], tuple[frozenset[str], ...]]] = {
    "UCX_TCP_": (frozenset({"all", "tcp"}), (frozenset({"tcp"}),)),
    "UCX_MM_": (
        frozenset({"all", "sm", "shm", "mm", "posix", "sysv", "xpmem"}),
        (frozenset({"sm"}), frozenset({"shm"}), frozenset({"mm"}), frozenset({"posix", "sysv"})),
    ),
}

#: Set too when UCX_TLS names only TCP (the link emulator, TCP-only clusters): UCX's
#: rendezvous protocol sends its handshake (RTS/ATS) on the same TCP stream as the bulk
#: data, so with traffic both ways each handshake queues behind a whole piece going
#: the other way, which halves two-way throughput (eager-only sends restore it, as
#: ``python -m cgx_ucx.bench link`` measures). Not applied where shared memory,
#: CMA, cuda_ipc or RDMA may be used: those need rendezvous for zero-copy.
#:
#: ``UCX_ZCOPY_THRESH=0``: eager sends above a TCP segment otherwise take UCX's
#: "multi-frag eager copy-in copy-out" protocol, which copies every segment into a bounce
#: buffer before the socket write; zero-copy sends write from the user's buffer
#: (``UCX_PROTO_INFO=y`` names both). 64 MiB, 32 bits: 2 ranks on TCP loopback 61 -> 51
#: CPU-ms a call; ``bench link`` at 10 Gbit/s, 2 ranks 88 -> 83 ms, 4 ranks 275 -> 251 ms
#: (134 -> 118 CPU-ms a rank); unchanged at 1 Gbit/s, where the link binds.
TCP_ONLY_DEFAULTS: dict[str, str] = {"UCX_RNDV_THRESH": "inf", "UCX_ZCOPY_THRESH": "0"}
#: UCX_TLS entries that are TCP (or need no data path of their own).
#: What ucxx puts in UCX_RNDV_THRESH at import when the user did not set it.
UCXX_RNDV_THRESH = "8192"
_TCP_TLS = frozenset({"tcp", "self", "sockcm", "tcp_sockcm"})

#: Period handed to UCXX's endpoint abort (ns): the default of 10 s would stall a close
#: on an endpoint whose peer is gone.
ABORT_PERIOD_NS = 100_000_000

_lock = threading.Lock()
_users = 0
_owned = False  # True when the running UCXX context was started by us
_memtype_cache_user_set: bool | None = None
_rndv_thresh_user_set: bool | None = None
#: Listeners of communicators that gave up connecting, kept open until a peer still
#: dialing them has given up too: (monotonic deadline, listener). See park_listener().
_parked: list[tuple[float, Any]] = []
#: When release() has to keep an unused context (something still refers to it), it tries
#: again this many seconds later, then after the next (a failed connect's exception holds
#: UCX frames until its caller drops it); a parked listener's deadline comes first.
SHUTDOWN_RETRY_S = (0.5, 5.0)
#: The pending retry (see _shut_down_later), on the loop of the last release().
_retry: asyncio.TimerHandle | None = None


#: Rendezvous threshold of multi-node jobs on hosts with an NVIDIA GPU: above every
#: compressed piece (a 4 MiB input piece is at most 1 MiB at 8 bits), below the
#: uncompressed ones, which need rendezvous for zero-copy between GPUs of a node.
GPU_MULTI_NODE_RNDV_THRESH = "2mb"


def multi_node_defaults(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """UCX defaults for a job that the launcher (torchrun's ``WORLD_SIZE`` and
    ``LOCAL_WORLD_SIZE``, or a ``GROUP_RANK`` above 0) places on several nodes; empty
    for a single node or without launcher variables.

    Why: between nodes UCX runs over TCP unless the hosts have RDMA, and its rendezvous
    protocol sends the hand-shake of every large message on the TCP stream that carries
    the bulk data, behind whatever is queued there; on emulated nodes both the two-level
    and the flat allreduce run markedly faster with eager sends (measured by
    ``python -m cgx_ucx.bench nodes``). Hosts with an NVIDIA GPU get a finite
    threshold instead (see :data:`GPU_MULTI_NODE_RNDV_THRESH`)."""
    env = os.environ if env is None else env
    try:
        world = int(env.get("WORLD_SIZE", "0"))
        local = int(env.get("LOCAL_WORLD_SIZE", "0"))
        group_rank = int(env.get("GROUP_RANK", "0"))
    except ValueError:
        return {}  # malformed launcher variables: the topology check names them
    if not (0 < local < world or group_rank > 0):
        return {}
    gpu = os.path.exists("/dev/nvidiactl")
    return {"UCX_RNDV_THRESH": GPU_MULTI_NODE_RNDV_THRESH if gpu else "inf"}


def apply_env_defaults(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Set :data:`UCX_DEFAULTS` (and ``extra``) in ``os.environ`` where unset.

    Must run before UCX initializes (UCX reads its variables once, when the context is
    created). Returns the variables it actually set.
    """
    applied = {}
    tls = os.environ.get("UCX_TLS", "")
    defaults = transport_defaults(tls)
    defaults.update(multi_node_defaults())
    if _tcp_only(tls):
        defaults.update(TCP_ONLY_DEFAULTS)
    for name, value in {**defaults, **(extra or {})}.items():
        if name not in os.environ or _set_by_ucxx(name):
            os.environ[name] = value
            applied[name] = value
    return applied


def _loads(tls: str, prefix: str) -> bool:
    """Whether UCX_TLS ``tls`` lets UCX load the transport family of ``prefix``
    (:data:`_FAMILIES`): always when empty; unless excluded by a ``^...`` list; if named
    by a list of transports."""
    names, excluding = _tls_names(tls)
    loads, covers = _FAMILIES[prefix]
    if excluding:
        return not any(c <= names for c in covers)
    return not names or bool(names & loads)


def transport_defaults(tls: str) -> dict[str, str]:
    """The entries of :data:`UCX_DEFAULTS` of the transports UCX_TLS ``tls`` lets load."""
    return {
        name: value
        for name, value in UCX_DEFAULTS.items()
        if _loads(tls, next(p for p in _FAMILIES if name.startswith(p)))
    }


def tcp_excluded(tls: str | None = None) -> bool:
    """Whether UCX_TLS (``tls``, default: the environment's) keeps UCX from loading TCP,
    which it needs to connect endpoints to a listener's address (its "tcp" connection
    manager): every rank's connect then fails as "Destination is unreachable"."""
    return not _loads(os.environ.get("UCX_TLS", "") if tls is None else tls, "UCX_TCP_")


def _set_by_ucxx(name: str) -> bool:
    """ucxx sets UCX_RNDV_THRESH=8192 at import unless the user set it; that value is
    not the user's, so our TCP-only default may replace it."""
    return (
        name == "UCX_RNDV_THRESH"
        and _rndv_thresh_user_set is False
        and os.environ.get(name) == UCXX_RNDV_THRESH
    )


def _tls_names(tls: str) -> tuple[set[str], bool]:
    """The transport names a UCX_TLS value lists (lower case), and whether it lists them
    to exclude them (``^...``)."""
    excluding = tls.lstrip().startswith("^")
    return {t.strip().lower() for t in tls.lstrip().lstrip("^").split(",") if t.strip()}, excluding


def _tcp_only(tls: str) -> bool:
    """True when UCX_TLS selects TCP only (``^`` exclusion lists never are)."""
    names, excluding = _tls_names(tls)
    return bool(names) and not excluding and names <= _TCP_TLS


def ucxx_module() -> Any:
    """Import ucxx (lazily: importing it loads libucx and sets UCX variables)."""
    global _memtype_cache_user_set, _rndv_thresh_user_set
    if "ucxx" not in sys.modules and _memtype_cache_user_set is None:
        _memtype_cache_user_set = "UCX_MEMTYPE_CACHE" in os.environ
        _rndv_thresh_user_set = "UCX_RNDV_THRESH" in os.environ
    try:
        import ucxx
    except ImportError as exc:  # pragma: no cover - ucxx is a hard dependency
        raise TransportError("ucxx (package ucxx-cu12) is required for the transport") from exc
    return ucxx


_ERRORS: tuple[type[BaseException], ...] = ()


def errors() -> tuple[type[BaseException], ...]:
    """The exception types UCXX raises for failed operations (imported lazily)."""
    global _ERRORS
    if not _ERRORS:
        from ucxx._lib.libucxx import UCXError

        _ERRORS = (UCXError,)
    return _ERRORS


def _drop_stale_memtype_cache(ucxx: Any) -> None:
    # ucxx sets UCX_MEMTYPE_CACHE=n for UCX versions that had the option; 1.19+ warn
    # about it as unknown on every context start.
    if _memtype_cache_user_set is False and tuple(ucxx.get_ucx_version()) >= (1, 19, 0):
        os.environ.pop("UCX_MEMTYPE_CACHE", None)


def park_listener(listener: Any, hold_s: float) -> None:
    """Keep ``listener`` open for ``hold_s`` seconds instead of closing it now.

    For a communicator that failed to connect while peers may still be dialing it: UCX
    1.21 crashes (SIGSEGV on its async thread, in ``ucp_cm_server_conn_request_cb``) when
    a listener is destroyed between accepting a peer's TCP connection and receiving
    that peer's connection request. A parked listener goes on answering (the
    communicator's accept handler refuses what arrives) and keeps the context alive;
    it is closed at its deadline (by the retry of :func:`release` on the loop that
    released the context last), or by the first :func:`acquire` after it."""
    with _lock:
        _parked.append((time.monotonic() + hold_s, listener))


def _close_expired_listeners() -> None:
    """Close the parked listeners past their deadline (with _lock held)."""
    now = time.monotonic()
    keep = []
    for deadline, listener in _parked:
        if deadline > now:
            keep.append((deadline, listener))
            continue
        try:
            listener.close()
        except Exception as exc:  # pragma: no cover - ucxx close of a dead worker
            log.debug("closing a parked UCX listener: %s", exc)
    _parked[:] = keep


def acquire(progress_mode: str, ucx_env: Mapping[str, str] | None = None) -> Any:
    """Start (or join) the process's UCXX context; returns the ucxx module.

    Call from inside the event loop that will drive UCX progress.
    """
    global _users, _owned, _retry
    with _lock:
        if _retry is not None:  # the context is in use again
            _retry.cancel()
            _retry = None
        _close_expired_listeners()
        ucxx = ucxx_module()
        ctx = getattr(ucxx.core, "_ctx", None)
        if ctx is None:
            applied = apply_env_defaults(ucx_env)
            _drop_stale_memtype_cache(ucxx)
            if applied:
                log.info("UCX defaults applied (unset by the user): %s", applied)
            try:
                ucxx.init(progress_mode=progress_mode)
            except Exception as exc:
                raise TransportError(f"UCX failed to initialize: {exc}") from exc
            _owned = True
            log.info("UCX context started, progress mode %r", progress_mode)
        elif ctx.progress_mode != progress_mode:
            log.info(
                "UCX already running in progress mode %r; %r requested, keeping %r",
                ctx.progress_mode,
                progress_mode,
                ctx.progress_mode,
            )
        # Make sure the calling loop drives progress (a no-op when it already does); in
        # blocking mode with our own event-driven driver (see .progress for why).
        loop = asyncio.get_running_loop()
        ctx = _progress.ucxx_context(ucxx)
        ctx.continuous_ucx_progress(loop)
        if ctx.progress_mode == "blocking":
            _progress.install(ucxx, loop)
        _users += 1
        return ucxx


#: ucxx's ``size_t ucxx::Endpoint::getCancelingSize() const`` (exported by libucxx, not
#: by its Python API): see release_abandoned_endpoints.
_CANCELING_SIZE_SYMBOL = "_ZNK4ucxx8Endpoint16getCancelingSizeEv"


@functools.cache
def _canceling_size() -> Any:
    """``Endpoint::getCancelingSize`` of the libucxx ucxx loaded (RTLD_NOLOAD: never a
    second copy), or None where it cannot be found (another ucxx build)."""
    try:
        fn = getattr(ctypes.CDLL("libucxx.so", mode=os.RTLD_NOLOAD), _CANCELING_SIZE_SYMBOL)
    except (OSError, AttributeError) as exc:
        log.debug("ucxx's Endpoint::getCancelingSize not found: %s", exc)
        return None
    fn.argtypes = [ctypes.c_void_p]
    fn.restype = ctypes.c_size_t
    return fn


def release_abandoned_endpoints(exc: BaseException) -> int:
    """Close the endpoints that a failed ucxx call left in the frames of ``exc`` (a
    ``create_endpoint`` whose exchange with the peer timed out, against an address that
    does not answer), so that they and their UCX worker are freed; returns how many.

    Why (ucxx 0.52): ``create_endpoint`` posts a stream receive on the new endpoint. The
    timeout drops the Python request, whose cancel UCP ignores for stream receives, so
    the C++ request stays in the endpoint's in-flight set, holding a reference to the
    endpoint, which holds the worker: a C++ cycle that nothing frees, keeping the whole
    UCX worker (about 17 descriptors, shared memory) until the process exits. ucxx's blocking
    close (what ``Endpoint.abort`` runs) completes the receive, but first moves it to the
    endpoint's "canceling" set, which only ``Endpoint::getCancelingSize`` empties, and
    nothing calls that; it is called here. The finished frames of ``exc`` (ucxx's) are
    cleared as well: they would hold the endpoint for as long as the caller keeps the
    error."""
    from ucxx._lib.libucxx import UCXEndpoint

    tb = exc.__traceback__
    found: list[Any] = []
    for frame, _ in traceback.walk_tb(tb):
        for obj in gc.get_referents(frame):  # its locals, without making a locals dict
            if isinstance(obj, UCXEndpoint) and all(obj is not f for f in found):
                found.append(obj)
    if tb is not None:
        traceback.clear_frames(tb)  # frames still running (the caller's) stay as they are
    purge = _canceling_size()
    for ep in found:
        try:
            ep.close_blocking(period=ABORT_PERIOD_NS, max_attempts=1)
            left = purge(ep.ucxx_ptr) if purge is not None else 0
        except Exception as err:  # pragma: no cover - ucxx refusing to close a dead endpoint
            log.debug("closing an endpoint of a failed dial: %s", err)
            continue
        if left:
            log.debug("endpoint of a failed dial closed, %d request(s) still held", left)
    return len(found)


def _stop_progress_tasks(ucxx: Any) -> None:
    """Stop the progress tasks UCXX attached to event loops.

    UCXX keeps them (and a reader on the worker's epoll descriptor) until the loop
    closes; after the worker is gone they would keep progressing a dead worker and
    hold it in memory, and a new context on the same loop would get no progress task.
    """
    try:
        from ucxx._lib_async import application_context as appctx
    except ImportError:  # pragma: no cover
        return
    tasks = getattr(appctx, "ProgressTasks", {})
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    for loop, task in list(tasks.items()):
        if loop.is_closed():
            continue
        worker = getattr(task, "worker", None)
        fd = worker.epoll_file_descriptor if worker is not None else None
        for t in getattr(task, "_tasks", ()) or ():
            if t is None:
                continue
            if loop is running:
                t.cancel()
            else:
                loop.call_soon_threadsafe(t.cancel)
        if fd is not None and task.__class__.__name__ == "BlockingMode":
            if loop is running:
                loop.remove_reader(fd)
            else:
                loop.call_soon_threadsafe(loop.remove_reader, fd)
    tasks.clear()


#: References to the application context that _context_holders itself accounts for:
#: ucxx.core's, its local variable's and sys.getrefcount's argument.
_CONTEXT_OWN_REFS = 3
#: Whether sys.getrefcount counts every reference, as the shortcuts below assume: on the
#: GIL builds of CPython before 3.14. 3.14 borrows references on the evaluation stack,
#: and the free-threaded build counts some references per thread, so there a count can
#: read lower than the holders: the context would be dropped under a holder (a SIGSEGV
#: later). There the collector is asked instead (exact, and slower).
_REFCOUNTS_EXACT = (
    sys.implementation.name == "cpython"
    and sys.version_info < (3, 14)
    and not sysconfig.get_config_var("Py_GIL_DISABLED")
)


def _context_holders(ucxx: Any) -> list[str]:
    """What, besides ucxx itself, still references the running application context
    (an endpoint or listener a cancelled handshake left behind), described briefly."""
    core = getattr(ucxx, "core", None)
    ctx = getattr(core, "_ctx", None)
    if ctx is None:
        return []
    if _REFCOUNTS_EXACT and sys.getrefcount(ctx) <= _CONTEXT_OWN_REFS:
        # Nothing else refers to it, not even garbage awaiting collection: no full
        # collection and scan of the heap (each takes a good part of a second in a
        # process with a large heap on a loaded machine, inside every close()).
        return []
    gc.collect()
    own = vars(core)
    return [f"{type(r).__name__} {str(r)[:80]}" for r in gc.get_referrers(ctx) if r is not own]


def _drop_context(ucxx: Any) -> bool:
    """ucxx.reset() without its full garbage collection, where none is needed: when
    nothing but ucxx refers to the context, and nothing but the context to its worker
    and UCP context, dropping ucxx's reference frees all three at once. False (nothing
    done) otherwise. The collection costs a good part of a second inside every close()
    on a loaded machine (ucxx.reset() collects unconditionally)."""
    if not _REFCOUNTS_EXACT:
        return False
    core = ucxx.core
    ctx = getattr(core, "_ctx", None)
    if ctx is None or sys.getrefcount(ctx) > _CONTEXT_OWN_REFS:
        return False
    worker, context = getattr(ctx, "worker", None), getattr(ctx, "context", None)
    if worker is None or context is None:
        return False
    # Each: the context's attribute, this frame's, the tuple's and sys.getrefcount's
    # argument. More: a progress task just stopped still holds the worker, alive for a
    # loop iteration or garbage that only a full collection frees.
    if max(map(sys.getrefcount, (worker, context))) > 4:
        return False
    del worker, context
    core.stop_notifier_thread()
    core._ctx = None  # noqa: SLF001 - what ucxx.reset() does before its collection
    del ctx
    return True


def release(reset: bool = True) -> None:
    """Drop one user; the last one shuts the context down (when we started it).

    ``reset=False`` keeps the context running (a later :func:`acquire` reuses it): for
    a user that could not wait for a connection handshake still in flight inside ucxx,
    since resetting UCX under a half-made endpoint crashes the process (SIGSEGV).

    A context still referenced (a parked listener, the frames of a failed connect's
    exception) is kept, and shut down later on the calling loop once nothing refers to
    it (:func:`_shut_down_later`): its listener ports, sockets and shared memory do not
    outlive the communicators that used it for long."""
    global _users
    with _lock:
        if _users <= 0:
            return
        _users -= 1
        if _users or not _owned:
            return
        if not reset:
            log.info("UCX context kept: a connection handshake was still in flight")
            return
        _shut_down(SHUTDOWN_RETRY_S)


def _shut_down(retries: tuple[float, ...]) -> None:
    """Shut the unused context down (with _lock held), or try again later: at the first
    parked listener's deadline, else after ``retries[0]`` seconds."""
    global _owned
    ucxx = sys.modules.get("ucxx")
    if ucxx is None:
        return
    _close_expired_listeners()
    holders = _context_holders(ucxx)
    if holders:
        # ucxx.reset() would drop its handle and leave this context to be destroyed
        # whenever the holder goes, under the next context's workers, which crashes
        # the process (SIGSEGV). Keep it; the next acquire() reuses it, as after
        # reset=False.
        log.info("UCX context kept: still referenced by %s", "; ".join(holders))
        _shut_down_later(retries)
        return
    _progress.uninstall_all()
    _stop_progress_tasks(ucxx)
    if not _drop_context(ucxx):
        try:
            ucxx.reset()
        except Exception as exc:
            log.warning("UCX reset left references behind: %s", str(exc).splitlines()[0])
    _owned = False
    log.info("UCX context shut down")


def _shut_down_later(retries: tuple[float, ...]) -> None:
    """Try :func:`_shut_down` again on the running loop (with _lock held): at the first
    parked listener's deadline, else after ``retries[0]`` s; nothing once retries are
    spent or without a running loop (then the next acquire() reuses the context)."""
    global _retry
    if _retry is not None:
        _retry.cancel()
        _retry = None
    if _parked:
        delay = min(deadline for deadline, _ in _parked) - time.monotonic()
    elif retries:
        delay, retries = retries[0], retries[1:]
    else:
        return
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return
    _retry = loop.call_later(max(delay, 0.0), _retry_shut_down, retries)


def _retry_shut_down(retries: tuple[float, ...]) -> None:
    global _retry
    with _lock:
        _retry = None
        ucxx = sys.modules.get("ucxx")
        ctx = getattr(getattr(ucxx, "core", None), "_ctx", None)
        if _users or not _owned or ctx is None:
            return
        del ctx
        _shut_down(retries)
