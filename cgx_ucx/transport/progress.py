"""Event-driven UCX progress for the asyncio loop, without busy waiting.

Why (ucxx 0.52): in ucxx's "blocking" and "polling" modes every pending request is
awaited by ``wait_yield`` (a ``sleep(0)`` loop), so one outstanding receive keeps the
loop busy; worse, ucxx's blocking driver arms the worker once and never again, after
which the epoll descriptor stays readable and the loop spins forever, even while idle.
A persistent control receive per peer (needed for liveness and ABORT frames) would
therefore burn a core for the whole training run. "thread" mode with Python futures does
not spin, but costs a progress thread, a notifier thread and several times the round-trip
latency of this driver.

:class:`Progress` replaces ucxx's driver for "blocking" mode on one loop. It follows
UCX's documented blocking scheme: when the worker's event descriptor is readable (or a
new request was posted) it calls ``worker.progress()``, resolves the asyncio futures of
completed requests, and re-arms the worker (``ucp_worker_arm``); when arming reports
pending events it progresses again on the next loop iteration instead of sleeping. An
idle loop therefore sleeps in epoll with requests outstanding. A slow timer
(:data:`SAFETY_PERIOD_S`) progresses anyway while requests are pending, in case an
event was missed.

Requests are posted through UCXX's binding layer (``UCXEndpoint.tag_send`` /
``tag_recv``) and tracked here together with the buffers they use (the binding does not
keep them alive: a freed send buffer crashes a CMA transfer).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import os
import time
import weakref
from typing import Any

from ..config import ENV_SPIN, spin_mode

__all__ = [
    "BOOST_PERIOD_S",
    "ENV_SPIN",
    "SAFETY_PERIOD_S",
    "SIGNALED_RECV_NBYTES",
    "SPIN_MISSES",
    "SPIN_S",
    "Progress",
    "await_or_wake",
    "driver",
    "host_oversubscribed",
    "install",
    "no_spare_core",
    "post_recv",
    "post_send",
    "runnable_threads",
    "share_cores",
    "spin_mode",
    "usable_cores",
]

log = logging.getLogger("cgx_ucx.transport")

#: Progress at least this often even without an event, while idle: ucxx's own requests
#: (listener hand-shakes of incoming connections, ``create_endpoint``) are not tracked
#: here and may need progress to go out. 50 ms: negligible CPU while idle.
SAFETY_PERIOD_S = 0.05
#: While requests are pending, UCX does not signal every event that matters (a send
#: queued for lack of resources, a rendezvous step): without polling, a large compressed
#: allreduce stalls on the 50 ms timer many times. So the driver also polls while requests are
#: pending, starting at this period after any completion and doubling up to
#: SAFETY_PERIOD_S while nothing completes (a wait on a slow peer costs a dozen
#: wake-ups, then 20 per second).
MIN_POLL_S = 20e-6
#: After a request completed, keep progressing on every loop iteration (no sleep) for
#: this long while others are pending: shared-memory transfers with error handling go
#: through fragmented copy-in/copy-out, which advances only when both sides progress
#: and raises no event when FIFO space frees up; sleeping between fragments makes large
#: allreduces several times slower and bimodal. 2 ms covers the gaps between fragments
#: and between pipelined pieces; past it, the exponential back-off takes over.
#:
#: Spinning stops paying where transfers are slower than the spin: a large transfer on
#: a slow link completes a piece every few milliseconds, and a spin after each burns
#: 2 ms to find nothing (on 4 ranks at an emulated 1 Gbit/s, 64 MiB at 32 bits, about
#: 1,500 of the driver's 2,000 runs a call; ``python -m cgx_ucx.bench link --world 4
#: --rates 1gbit --bits 32``). So after SPIN_MISSES spins in a row ended with nothing
#: completed, a completion starts a spin only if it followed the previous one within
#: SPIN_S; a completion during a spin resets the count. 2 ranks, 64 MiB at 1 Gbit/s:
#: 94-99 -> 86-92 CPU-ms a call at 32 bits, 51-59 -> 48-51 at 4 bits, times unchanged;
#: on one host (shared memory, dense completions) 32 and 4 bits unchanged.
SPIN_S = 0.002
#: See SPIN_S.
SPIN_MISSES = 3
#: ``CGX_UCX_SPIN``: "auto" (default) spins as above only while the host has a spare
#: core, "1" always, "0" never (sleep in epoll between polls). Spinning on an
#: oversubscribed host takes the time slice from the peer (or the rank's own training
#: thread) the transfer waits for, and the scheduler then ranks the spinner behind every
#: other busy process: with 8 CPU hogs beside a 2-rank job on 2 cores, a DDP step takes
#: 98 ms spinning and 80 ms not, gloo 26-33 ms (measured by ``python -m cgx_ucx.bench
#: contention --hogs 8`` with ``CGX_UCX_SPIN=1``, then ``0``). MPI libraries do the same
#: (Open MPI's yield-when-idle when oversubscribed). Parsed by :func:`cgx_ucx.config.spin_mode`.
#:
#: "auto": the host counts as oversubscribed while more threads are runnable (the 4th
#: field of /proc/loadavg, an instantaneous count) than this many per core; re-read at
#: most every LOAD_PERIOD_S.
RUNNABLE_PER_CORE = 2
LOAD_PERIOD_S = 0.05
#: Wake-ups on a network link. Every few TCP segments that arrive make the worker's
#: descriptor readable, and each wake-up runs this driver (tens of microseconds of
#: Python, and a context switch) to move a few dozen kilobytes. When a readable
#: descriptor's run completed nothing while only network requests were due (a large
#: message part way in), the descriptor goes unwatched for a while, starting at
#: COALESCE_MIN_S and doubling up to COALESCE_MAX_S while such runs follow: the kernel's
#: socket buffers gather the bytes of many segments for one run. A completion, a
#: node-local transfer that raises no event (see SIGNALED_RECV_NBYTES) or no network
#: request due ends it, and a completion is seen at most COALESCE_MAX_S late. A
#: node-local frame header due beside network transfers does not end it (the two-level
#: allreduce keeps its node's headers due while its pieces cross the network): one that
#: arrives meanwhile is seen at most COALESCE_MAX_S late.
#: ``python -m cgx_ucx.bench link --world 4 --rates 1gbit``, 64 MiB: 32 bits 217-249 ->
#: 186-202 CPU-ms a rank a call (a 4 ms cap: 162-171, at the cost of seeing completions
#: up to 4 ms late), 4 bits 64-70 -> 58-64; times unchanged.
#: Shared-memory and loopback peers alone never leave the descriptor unwatched. The
#: two-level allreduce, 2x2 at 1 Gbit/s, 64 MiB, 4 bits: 50.9-55.4 -> 48.0-50.2 CPU-ms a
#: rank, 104.6-113.8 -> 101.2-104.8 ms a call (4 interleaved pairs).
COALESCE_MIN_S = 0.0005
COALESCE_MAX_S = 0.002
#: Node-local receives into at most this many bytes never make the driver spin where no
#: core is spare (:func:`no_spare_core`). A message that small (a frame header with its
#: inline payload, at most 64 KiB) reaches a shared-memory peer in eager fragments, and
#: each fragment that lands in an armed worker's FIFO makes its descriptor readable;
#: what shared memory signals no event for is a larger message's transfer (fragments
#: waiting for FIFO space, rendezvous steps). The two-level allreduce keeps such headers
#: due for most of a call (each owner's shard and "done" frames, posted at the start),
#: and on their account the driver spun after every completion: 2 emulated nodes of 2
#: ranks on 2 cores, 64 MiB, 4 bits, 1 Gbit/s (``python -m cgx_ucx.bench nodes``),
#: 330-375 driver runs a call (190-265 of them spins that found nothing) -> 107-145, and
#: 50.7-53.7 -> 44.9-51.6 CPU-ms a rank, times unchanged.
SIGNALED_RECV_NBYTES = 1 << 17
#: The period while a communicator is connecting (:meth:`Progress.boost`): connection
#: set-up is a chain of ucxx-driven round trips that would each wait a full period.
BOOST_PERIOD_S = 0.001


class Progress:
    """Drives one UCXX worker from one asyncio loop (see the module docstring)."""

    def __init__(self, worker: Any, loop: asyncio.AbstractEventLoop) -> None:
        self.worker = worker
        self.event_loop = loop  # ucxx's ProgressTask attribute name (its close hook uses it)
        self._fd = worker.epoll_file_descriptor
        #: id(request) -> (request, keep, future, background, remote, silent).
        self._pending: dict[int, tuple[Any, Any, asyncio.Future, bool, bool, bool]] = {}
        #: Pending requests someone is waiting on now (data frames), as opposed to the
        #: background ones (a control channel's standing receive): only these make the
        #: driver spin or poll; background requests complete on events alone.
        self._due = 0
        #: Of those, the ones with a peer on this node (see submit's ``remote``).
        self._due_local = 0
        #: Of those, the ones whose progress raises no event (see submit's ``signaled``).
        self._due_silent = 0
        self._scheduled = False
        #: Runs queued by kick() and not yet run, oldest first (the loop runs them in that
        #: order; one may still be queued after the reader ran the driver). close() cancels
        #: them: each refers to the driver, hence the worker, until the loop runs it, which
        #: a loop kept idle for later communicators may never do.
        self._soon: collections.deque[asyncio.Handle] = collections.deque()
        self._timer: asyncio.TimerHandle | None = None
        self._closed = False
        self._boost = 0
        self._poll = MIN_POLL_S
        self._timer_at = 0.0
        self._active_until = 0.0
        self._spinning = False  # a spin window is open (see SPIN_S)
        self._misses = 0  # spin windows in a row that ended with nothing completed
        self._last_done = -1.0  # loop time of the last completion of a due request
        self._readable = False  # this run was started by the descriptor (see COALESCE_MIN_S)
        self._hold = 0.0  # seconds of the current hold (see COALESCE_MIN_S); 0 outside one
        self._resume: asyncio.TimerHandle | None = None  # set while it is unwatched
        #: Times the driver ran (loop wake-ups spent on UCX: events, polls, spins) and
        #: requests it completed; the latency benchmark reports them per call.
        self.wakeups = 0
        self.completions = 0
        self._spin_mode = spin_mode()
        loop.add_reader(self._fd, self._on_readable)
        self.kick()

    # ucxx keys its progress tasks by loop and may hash/compare them.
    def __hash__(self) -> int:
        return hash(self.event_loop)

    @property
    def _tasks(self) -> tuple:
        return ()

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self.event_loop.is_closed():
            self.event_loop.remove_reader(self._fd)
        while self._soon:
            self._soon.popleft().cancel()
        if self._resume is not None:
            self._resume.cancel()
            self._resume = None
        self._scheduled = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for _, _, fut, *_ in self._pending.values():
            if not fut.done():
                fut.cancel()
        self._pending.clear()
        self._due = self._due_local = self._due_silent = 0

    def boost(self, on: bool) -> None:
        """Progress every BOOST_PERIOD_S while on (nested calls count)."""
        self._boost += 1 if on else -1
        self.kick()

    def kick(self) -> None:
        """Progress on the next loop iteration (after the callbacks already queued)."""
        if not self._scheduled and not self._closed:
            self._scheduled = True
            self._soon.append(self.event_loop.call_soon(self._run_soon))

    def submit(
        self,
        request: Any,
        keep: Any,
        background: bool = False,
        remote: bool = False,
        signaled: bool = False,
    ) -> asyncio.Future:
        """An asyncio future for a UCXX request (``keep``: what must stay alive until done;
        ``background``: nobody waits on it now, so it never makes the driver spin;
        ``remote``: its peer is on another node, so where no core is spare
        (:func:`no_spare_core`) it does not make the driver spin either: network
        transports (TCP, InfiniBand) wake the driver by events, while node-local shared
        memory signals none for a rendezvous transfer's steps; ``signaled``: a node-local
        request whose completion raises an event all the same (see
        SIGNALED_RECV_NBYTES), which does not make it spin there either)."""
        fut = self.event_loop.create_future()
        if request.completed:
            _settle(request, fut)
            return fut
        silent = not (remote or signaled)
        self._pending[id(request)] = (request, keep, fut, background, remote, silent)
        if not background:
            self._due += 1
            self._due_local += not remote
            self._due_silent += silent
            self._active_until = self.event_loop.time() + SPIN_S
            self._spinning = True
        self.kick()
        return fut

    def _run_soon(self) -> None:
        self._soon.popleft()
        self._run()

    def _on_readable(self) -> None:
        self._readable = True
        self._run()

    def _run(self) -> None:
        self._scheduled = False
        readable, self._readable = self._readable, False
        if self._closed:
            return
        self.wakeups += 1
        self.worker.progress()
        completed = False
        if self._pending:
            for key, (req, _, fut, background, remote, silent) in list(self._pending.items()):
                if req.completed:
                    del self._pending[key]
                    _settle(req, fut)
                    self.completions += 1
                    if not background:
                        self._due -= 1
                        self._due_local -= not remote
                        self._due_silent -= silent
                        completed = True
        if self._unwatched(completed, readable):
            return  # _resumed progresses, arms and decides again
        # Sleep in epoll only once the worker is armed; "busy" means events are pending.
        if not self.worker.arm():
            self.kick()
        now = self.event_loop.time()
        if completed:
            if now < self._active_until:
                self._misses = 0
            if self._misses < SPIN_MISSES or now - self._last_done <= SPIN_S:
                self._active_until = now + SPIN_S
                self._spinning = True
            self._last_done = now
        elif self._spinning and now >= self._active_until:
            self._spinning = False
            self._misses += 1
        if self._due and now < self._active_until and self._may_spin():
            self._poll = MIN_POLL_S
            if not completed:
                # Spinning ranks may outnumber cores (4 ranks on 2, say): give the CPU
                # to the peer this transfer is waiting for.
                os.sched_yield()
            self.kick()
            return
        if self._due:
            self._poll = MIN_POLL_S if completed else min(self._poll * 2, SAFETY_PERIOD_S)
            period = self._poll
        else:
            self._poll = MIN_POLL_S
            period = SAFETY_PERIOD_S
        if self._boost > 0:
            period = min(period, BOOST_PERIOD_S)
        when = self.event_loop.time() + period
        if self._timer is not None and self._timer_at > when:
            self._timer.cancel()
            self._timer = None
        if self._timer is None:
            self._timer_at = when
            self._timer = self.event_loop.call_at(when, self._safety)

    def _unwatched(self, completed: bool, readable: bool) -> bool:
        """Whether the worker's descriptor stays unwatched after this run (see
        COALESCE_MIN_S), given what it ``completed`` and whether it was ``readable``."""
        if completed or self._due_silent or self._due == self._due_local:
            self._hold = 0.0
            if self._resume is not None:
                self._watch()
        elif readable and self._resume is None:
            self._hold = min(2 * self._hold, COALESCE_MAX_S) if self._hold else COALESCE_MIN_S
            self._unwatch(self._hold)
        return self._resume is not None

    def _unwatch(self, period: float) -> None:
        """Leave the worker's descriptor unwatched for ``period``."""
        self.event_loop.remove_reader(self._fd)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._resume = self.event_loop.call_later(period, self._resumed)

    def _watch(self) -> None:
        if self._resume is not None:
            self._resume.cancel()
            self._resume = None
        self.event_loop.add_reader(self._fd, self._on_readable)

    def _resumed(self) -> None:
        self._resume = None
        if not self._closed:
            self._watch()
            self._run()

    def _may_spin(self) -> bool:
        if self._spin_mode == "auto":
            if not self._due_silent and _crowded[0]:
                return False  # only requests that raise events are due: those wake us
            return not host_oversubscribed()
        return self._spin_mode == "1"

    def _safety(self) -> None:
        self._timer = None
        self._run()


_CORES = os.cpu_count() or 1


_load = [-1.0, False]  # [when read (monotonic), oversubscribed then]
#: This process's job has more ranks on this kernel than the kernel has cores.
_crowded = [False]


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask; the machine's where unknown)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return _CORES


def share_cores(local_ranks: int) -> None:
    """Note how many ranks of the job (the last communicator connected) run on this
    kernel, emulated nodes in other network namespaces included (see :func:`no_spare_core`)."""
    _crowded[0] = local_ranks > usable_cores()


def no_spare_core() -> bool:
    """:func:`host_oversubscribed`, or the job put more ranks on this kernel than it has
    cores: then no core is spare while they all work, though the run queue shows it only
    now and then (ranks that wait on each other are not all runnable at one instant).
    Handing a piece's codec work to a second thread and spinning on a node-local mailbox
    both wait for a time slice then. 4 ranks on 2 cores, one host, 4 bits: a 64 MiB
    allreduce 91-92 ms with this, 107-108 ms without; 16 MiB 24-25 against 30-31.

    The UCX progress driver keeps :func:`host_oversubscribed`: a rendezvous transfer over
    shared memory signals no event to wake on, and without its spin a 64 MiB
    uncompressed allreduce of those 4 ranks took twice as long (180-190 ms, against 93)."""
    return _crowded[0] or host_oversubscribed()


def host_oversubscribed() -> bool:
    """Whether more threads are runnable on this host than RUNNABLE_PER_CORE per core,
    re-read at most every LOAD_PERIOD_S. Spinning (here) and handing codec work to a
    second thread (:class:`~cgx_ucx.collectives.piece_codec.CodecRunner`) only pay while
    a core is spare; on a full host each costs a time slice or a wake-up."""
    now = time.monotonic()
    if now - _load[0] > LOAD_PERIOD_S:
        runnable = runnable_threads()
        _load[0] = now
        _load[1] = runnable is not None and runnable > RUNNABLE_PER_CORE * _CORES
    return bool(_load[1])


def runnable_threads() -> int | None:
    """Threads runnable on the host right now (/proc/loadavg), None where unknown."""
    try:
        with open("/proc/loadavg", "rb") as f:
            return int(f.read().split()[3].split(b"/")[0])
    except (OSError, IndexError, ValueError):
        return None


async def await_or_wake(
    fut: asyncio.Future, others: tuple[asyncio.Future, ...], timeout: float | None
) -> bool:
    """Await ``fut`` itself until it is done (True), or until one of ``others`` completes
    or ``timeout`` passes (False; ``fut`` is then cancelled, as it would be on a deadline).

    Cheaper than ``asyncio.wait`` on the same set, which this replaces on every UCX
    operation of the mesh: no waiter future (one loop hop less per completion), no set, no
    coroutine scan; the wake-up cancels the awaited future and is told apart from a
    cancellation of the caller by a flag."""
    woken = False

    def wake(_: Any = None) -> None:
        nonlocal woken
        if not fut.done():
            woken = True
            fut.cancel()

    hooked = [f for f in others if not f.done()]
    if len(hooked) < len(others):
        wake()
        return False
    for f in hooked:
        f.add_done_callback(wake)
    timer = fut.get_loop().call_later(timeout, wake) if timeout is not None else None
    try:
        await fut
    except asyncio.CancelledError:
        if not woken:
            raise
    except Exception:  # the operation's own error: the caller reads it from fut
        pass
    finally:
        for f in hooked:
            f.remove_done_callback(wake)
        if timer is not None:
            timer.cancel()
    return not woken


def _settle(request: Any, fut: asyncio.Future) -> None:
    if fut.done():
        return
    try:
        request.check_error()
    except Exception as exc:
        fut.set_exception(exc)
    else:
        fut.set_result(None)


_drivers: dict[asyncio.AbstractEventLoop, Progress] = {}


def install(ucxx: Any, loop: asyncio.AbstractEventLoop) -> Progress:
    """Replace ucxx's blocking-mode driver of ``loop`` by a :class:`Progress`."""
    drv = _drivers.get(loop)
    if drv is not None and not drv.closed:
        return drv
    from ucxx._lib_async import application_context as appctx

    ctx = ucxx_context(ucxx)
    old = appctx.ProgressTasks.get(loop)
    if old is not None and not isinstance(old, Progress):
        for t in getattr(old, "_tasks", ()) or ():
            if t is not None:
                t.cancel()
        with contextlib.suppress(ValueError, OSError):  # not registered
            loop.remove_reader(ctx.worker.epoll_file_descriptor)
        _let_go(old, loop)
    drv = Progress(ctx.worker, loop)
    appctx.ProgressTasks[loop] = drv
    _drivers[loop] = drv
    return drv


def _let_go(task: Any, loop: asyncio.AbstractEventLoop) -> None:
    """Let ucxx's replaced progress task be freed now. It wraps ``loop.close`` in a
    closure that holds it, hence its worker and the whole UCX context (listener, shared
    memory), until the loop closes: one leaked context per context made on a long-lived
    loop. Its finalizers would remove the worker's reader, which this driver holds."""
    for ref in weakref.getweakrefs(task):
        finalizer = getattr(ref, "__callback__", None)
        if isinstance(finalizer, weakref.finalize):
            finalizer.detach()
    rsock = getattr(task, "rsock", None)
    if rsock is not None:
        rsock.close()
    vars(loop).pop("close", None)  # ucxx's wrapper; the class's close is the loop's own


def driver(loop: asyncio.AbstractEventLoop) -> Progress | None:
    drv = _drivers.get(loop)
    return drv if drv is not None and not drv.closed else None


def uninstall_all() -> None:
    for drv in _drivers.values():
        drv.close()
    _drivers.clear()


# -- ucxx internals ---------------------------------------------------------------------
# The driver needs three things ucxx 0.52 does not make public: the application context
# (to reach its worker), and an endpoint's binding-level object and default tags (to post
# requests that this driver, not ucxx's, completes). They are read here and nowhere else.


def ucxx_context(ucxx: Any) -> Any:
    """ucxx's process-wide application context."""
    return ucxx.core._get_ctx()  # noqa: SLF001 (ucxx internal, see above)


def _binding(ep: Any, tag: int | None, default: str) -> tuple[Any, int]:
    """The binding-level endpoint of a ucxx Endpoint and ``tag`` (None: its ``default``)."""
    if tag is None:
        tag = ep._tags[default]  # noqa: SLF001 (ucxx internal, see above)
    return ep._ep, tag  # noqa: SLF001 (ucxx internal, see above)


@functools.cache
def _ucxx_types() -> tuple[Any, Any, Any]:
    """(Array, Tag, TagMaskFull) of ucxx, imported once: these are on every operation's
    path, and an import statement there costs microseconds each time."""
    from ucxx._lib.arr import Array
    from ucxx.types import Tag, TagMaskFull

    return Array, Tag, TagMaskFull


def post_send(ep: Any, buf: Any, tag: int | None, remote: bool = False, loop: Any = None) -> Any:
    """Send ``buf`` on a ucxx Endpoint; returns an awaitable (driver future or coroutine).
    ``remote``: the peer is on another node (:meth:`Progress.submit`). ``loop``: the
    running loop, where the caller holds it: on Python 3.11 each
    ``asyncio.get_running_loop()`` costs a ``getpid`` system call (a fork check), about
    1% of a rank's CPU in a large two-level allreduce, which posts thousands of pieces."""
    drv = driver(loop or asyncio.get_running_loop())
    if drv is None:
        return ep.send(buf, tag=tag, force_tag=tag is not None)
    array, tag_type, _ = _ucxx_types()
    if ep.closed:
        raise _closed_error()
    arr = array(buf)
    bep, t = _binding(ep, tag, "msg_send")
    # Untagged sends and receives are the control channel's (ABORT, BYE, STATUS and its
    # standing receive): background, see Progress.submit.
    return drv.submit(bep.tag_send(arr, tag_type(t)), (arr, buf), tag is None, remote)


def post_recv(ep: Any, buf: Any, tag: int | None, remote: bool = False, loop: Any = None) -> Any:
    """Receive into ``buf`` on a ucxx Endpoint; returns an awaitable (see post_send)."""
    drv = driver(loop or asyncio.get_running_loop())
    if drv is None:
        return ep.recv(buf, tag=tag, force_tag=tag is not None)
    array, tag_type, mask_full = _ucxx_types()
    if ep.closed:
        raise _closed_error()
    arr = array(buf)
    bep, t = _binding(ep, tag, "msg_recv")
    request = bep.tag_recv(arr, tag_type(t), mask_full)
    return drv.submit(request, (arr, buf), tag is None, remote, arr.nbytes <= SIGNALED_RECV_NBYTES)


def _closed_error() -> Exception:
    from ucxx._lib.libucxx import UCXCloseError

    return UCXCloseError("Endpoint closed")
