"""Agreement of a compression policy across ranks, and the link probe of ``auto``.

A policy (:mod:`cgx_ucx.compression.policies`) only computes; this module runs the
collectives it needs, over any communicator that offers ``allreduce`` and ``broadcast``
(:class:`PolicyComm`): the engine's asyncio :class:`~cgx_ucx.collectives.Communicator`,
its synchronous face in :mod:`cgx_ucx.engine`, or a torch process-group wrapper.

At a decision step (:meth:`~cgx_ucx.compression.policies.Policy.due`, a pure function of
the step number, so every rank knows without talking) :func:`agree` (asyncio) or
:func:`agree_sync` (futures):

1. all-reduces each rank's small statistics vector (a few float32 values per layer) and
   divides by the world size;
2. when the policy wants it (``auto``: first decision, or a step-time drift), runs the
   policy's probe on every rank and all-reduces its result the same way;
3. decides on every rank from the same mean, and broadcasts rank ``root``'s encoded
   assignment, which every rank adopts, so the ranks agree bit for bit even if two
   machines' floating point differed in the last place.

All other steps cost no communication. Every collective waits at most ``timeout``
seconds and then raises :class:`~cgx_ucx.errors.CGXTimeoutError`. torch is never
imported: futures are duck-typed (``concurrent.futures.Future``, or anything with
``done()`` and ``wait()`` such as ``torch.futures.Future``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import math
import time
from collections.abc import Awaitable, Callable, Generator
from typing import Any, Protocol

import numpy as np

from .arrays import check_bits, check_positive_int
from .compression.codec import encoded_nbytes
from .compression.policies import (
    Assignment,
    Policy,
    ProbeValue,
    allreduce_seconds,
    probe_vector,
)
from .config import NO_COMPRESSION_BITS
from .errors import CGXError, CGXTimeoutError, ConfigError
from .layout import Layout

__all__ = [
    "DEFAULT_PROBE_BYTES",
    "DEFAULT_TIMEOUT",
    "PolicyComm",
    "agree",
    "agree_sync",
    "make_link_probe",
]

#: Bytes of the smaller link-probe allreduce (the larger is 4x): 2 and 8 MiB take 17 and
#: 67 ms at 1 Gbit/s uncompressed, short enough to probe again at every drift.
DEFAULT_PROBE_BYTES = 2 << 20
#: Seconds any collective of :func:`agree` may take (CommConfig's default timeout).
DEFAULT_TIMEOUT = 300.0


class PolicyComm(Protocol):
    """What the agreement and the link probe use of a communicator.

    ``allreduce`` sums ``x`` over the ranks (the link probe also passes ``layout=`` or
    ``bits=`` / ``bucket_size=`` to compress); ``broadcast`` copies rank ``root``'s ``x``.
    Each may work in place and return ``None``, or return the result, an awaitable of it
    (asyncio communicators: use :func:`agree`), or a future (``concurrent.futures`` or
    ``torch.futures``: use :func:`agree_sync`). The world size is read from
    ``world_size`` (or a ``size()`` method) unless given to the functions here.
    """

    @property
    def world_size(self) -> int: ...

    def allreduce(self, x: np.ndarray, op: str = "sum", **kwargs: Any) -> Any: ...

    def broadcast(self, x: np.ndarray, root: int = 0) -> Any: ...


# ---------------------------------------------------------------------------------------
# the protocol, independent of how collectives are waited for


def _agree_steps(
    policy: Policy, step: int, world_size: int
) -> Generator[tuple[str, Any], Any, Assignment]:
    """The agreement protocol as a generator of collective requests.

    Yields ``("allreduce", array)``, ``("probe", None)`` or ``("broadcast", array)`` and
    receives the result; :func:`agree` and :func:`agree_sync` drive it. Every rank yields
    the same sequence because every branch depends only on all-reduced values.
    """
    if not policy.due(step):
        policy.maybe_log(step)
        return policy.current
    stats = np.ascontiguousarray(policy.local_statistics(step), np.float32)
    total = yield "allreduce", stats.copy()
    mean = np.asarray(total, np.float64) / world_size
    if policy.wants_probe(step, mean):
        value = yield "probe", None
        vec = probe_vector(value)
        reduced = yield "allreduce", vec
        policy.set_probe_result(np.asarray(reduced, np.float64) / world_size)
    decided = policy.decide(step, mean.astype(np.float32))
    got = yield "broadcast", decided.encode()
    final = Assignment.decode(np.asarray(got), policy.num_layers)
    policy.adopt(final)
    policy.maybe_log(step)
    return final


def _world_size(comm: Any, world_size: int | None) -> int:
    if world_size is not None:
        return check_positive_int(world_size, "world_size")
    for attr in ("world_size", "size"):
        v = getattr(comm, attr, None)
        if callable(v):
            v = v()
        if isinstance(v, int) and v >= 1:
            return v
    raise ConfigError("cannot tell the world size of the communicator; pass world_size=")


def _result_or(res: Any, buf: np.ndarray) -> np.ndarray:
    """Collectives may work in place (return None) or return the result."""
    if res is None:
        return buf
    if isinstance(res, list | tuple) and len(res) == 1:
        res = res[0]
    if hasattr(res, "numpy") and not isinstance(res, np.ndarray):
        res = res.numpy()
    out = np.asarray(res)
    if out.shape != buf.shape:
        raise CGXError(f"collective returned shape {out.shape}, expected {buf.shape}")
    return out


def _timeout_error(what: str, timeout: float) -> CGXTimeoutError:
    return CGXTimeoutError(f"policy agreement: {what} took longer than {timeout} s")


# ---------------------------------------------------------------------------------------
# asyncio


async def _deadline(aw: Awaitable[Any], timeout: float, what: str) -> Any:
    try:
        return await asyncio.wait_for(aw, timeout)
    except TimeoutError as exc:
        raise _timeout_error(what, timeout) from exc


async def agree(
    policy: Policy,
    comm: PolicyComm,
    step: int,
    *,
    world_size: int | None = None,
    root: int = 0,
    timeout: float = DEFAULT_TIMEOUT,
) -> Assignment:
    """Decide (when due) with every rank and return the assignment all ranks adopted.

    ``comm`` offers ``await comm.allreduce(array, op="sum")`` and ``await
    comm.broadcast(array, root=root)`` (results returned or written in place). Must be
    called by every rank at every step at which the policy is due, in the same order
    relative to other collectives; on other steps it returns at once with no
    communication. Each collective waits at most ``timeout`` seconds
    (:class:`~cgx_ucx.errors.CGXTimeoutError`).
    """
    w = _world_size(comm, world_size)
    gen = _agree_steps(policy, step, w)
    value: Any = None
    try:
        while True:
            kind, arg = gen.send(value)
            if kind == "allreduce":
                res = await _deadline(comm.allreduce(arg, op="sum"), timeout, "allreduce")
                value = _result_or(res, arg)
            elif kind == "broadcast":
                res = await _deadline(comm.broadcast(arg, root=root), timeout, "broadcast")
                value = _result_or(res, arg)
            else:
                value = policy.probe()
                if inspect.isawaitable(value):
                    value = await _deadline(value, timeout, "probe")
    except StopIteration as stop:
        return stop.value


# ---------------------------------------------------------------------------------------
# futures


def _poll(obj: Any, timeout: float, what: str) -> Any:
    """Wait for a future without a timeout parameter (``torch.futures.Future``, Work-like
    objects) by polling ``done()`` with a growing sleep, then return ``wait()``."""
    deadline = time.monotonic() + timeout
    delay = 1e-4
    while not obj.done():
        if time.monotonic() > deadline:
            raise _timeout_error(what, timeout)
        time.sleep(delay)
        delay = min(delay * 2, 0.01)
    return obj.wait()


def _wait(obj: Any, timeout: float, what: str) -> Any:
    """The result of ``obj``: a future waited for at most ``timeout`` s, or ``obj`` itself."""
    if isinstance(obj, concurrent.futures.Future):
        try:
            return obj.result(timeout)
        except concurrent.futures.TimeoutError as exc:
            raise _timeout_error(what, timeout) from exc
    if hasattr(obj, "wait") and hasattr(obj, "done") and callable(obj.done):
        return _poll(obj, timeout, what)
    if inspect.isawaitable(obj):
        raise ConfigError("this communicator is asynchronous: use `await agree(...)`")
    return obj


def agree_sync(
    policy: Policy,
    comm: PolicyComm,
    step: int,
    *,
    world_size: int | None = None,
    root: int = 0,
    timeout: float = DEFAULT_TIMEOUT,
) -> Assignment:
    """:func:`agree` for synchronous communicators.

    ``comm.allreduce(array, op="sum")`` / ``comm.broadcast(array, root=root)`` may return
    the result, ``None`` (in place), a ``concurrent.futures.Future`` or a
    ``torch.futures.Future``; each is waited for at most ``timeout`` seconds. The probe
    must be synchronous here.
    """
    w = _world_size(comm, world_size)
    gen = _agree_steps(policy, step, w)
    value: Any = None
    try:
        while True:
            kind, arg = gen.send(value)
            if kind == "allreduce":
                value = _result_or(_wait(comm.allreduce(arg, op="sum"), timeout, kind), arg)
            elif kind == "broadcast":
                value = _result_or(_wait(comm.broadcast(arg, root=root), timeout, kind), arg)
            else:
                value = policy.probe()
                if inspect.isawaitable(value):
                    raise ConfigError("an asynchronous probe needs `await agree(...)`")
    except StopIteration as stop:
        return stop.value


# ---------------------------------------------------------------------------------------
# the link probe

#: Layers of the per-call-overhead measurement (the same values as one layer and as these).
_PROBE_LAYERS = 32
#: The probe times the raw and the compressed allreduce at ``nbytes`` and at this many
#: times ``nbytes``: the difference gives the per-byte costs without the fixed cost of a
#: call, which one size alone spreads over its bytes. At 10 Gbit/s on a 2-core host a
#: 2 MiB call spends most of its time on fixed costs, and a one-size estimate (0.9 GB/s
#: of "codec") keeps 64 MiB layers uncompressed that run in 0.6-0.7x the time compressed
#: (``python -m cgx_ucx.bench link --rates 10gbit --world 2`` shows auto's choice per
#: size next to the measured times).
_PROBE_SCALE = 4


def _probe_kinds(n: int, bits: int, bucket_size: int) -> list[tuple[dict[str, Any], int]]:
    """The allreduces the probe times: (keywords, number of values) each."""
    layers = _PROBE_LAYERS
    small = min(1 << 16, n) // layers * layers
    many = Layout.from_sizes(
        [small // layers] * layers, bits=[bits] * layers, bucket_sizes=[bucket_size] * layers
    )
    one = Layout.from_sizes([small], bits=[bits], bucket_sizes=[bucket_size])
    quantized = {"bits": bits, "bucket_size": bucket_size}
    big = _PROBE_SCALE * n
    return [
        ({}, n),
        (quantized, n),
        ({}, big),
        (quantized, big),
        ({"layout": one}, small),
        ({"layout": many}, small),
    ]


def _probe_result(best: list[float], n: int, w: int, bits: int, bucket_size: int) -> np.ndarray:
    """``[bandwidth, rate, rate, overhead_s]`` from the best times of the six kinds.

    Per-byte figures come from the two sizes (falling back to the larger size alone when
    noise makes a difference non-positive); the compressed call's fixed cost beyond the
    raw one's is charged as per-codec-call overhead (three calls a layer), or the
    many-layers measurement when that is larger."""
    t_raw, t_q, t_raw_big, t_q_big, t_one, t_many = best
    big = _PROBE_SCALE * n
    factor = 2.0 * (w - 1) / w if w > 1 else 1.0
    d_raw = t_raw_big - t_raw
    bw = factor * 4.0 * (big - n) / d_raw if d_raw > 0 else factor * 4.0 * big / t_raw_big

    def codec_seconds(m: int, t: float) -> float:  # a compressed call less its wire time
        return t - allreduce_seconds(float(encoded_nbytes(m, bits, bucket_size)), w, bw)

    def work(m: int) -> float:  # the bytes layer_seconds counts for m values
        return 4.0 * m * (1.0 + (2 * w - 1) / w)

    rest, rest_big = codec_seconds(n, t_q), codec_seconds(big, t_q_big)
    d_q = rest_big - rest
    rate = (work(big) - work(n)) / d_q if d_q > 0 else work(big) / max(rest_big, 1e-9)
    fixed_q = rest_big - work(big) / rate
    fixed_raw = t_raw_big - factor * 4.0 * big / bw
    over = max(t_many - t_one, 0.0) / (_PROBE_LAYERS * 3)
    over = max(over, (fixed_q - fixed_raw) / 3.0)
    return np.array([bw, rate, rate, over])


def make_link_probe(
    comm: PolicyComm,
    *,
    nbytes: int = DEFAULT_PROBE_BYTES,
    bits: int = 4,
    bucket_size: int = 1024,
    repeats: int = 2,
    world_size: int | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> Callable[[], ProbeValue | Awaitable[ProbeValue]]:
    """A probe for :class:`~cgx_ucx.compression.policies.AutoPolicy` that times the
    engine itself, on the real link.

    Returns ``[bandwidth, encode_bps, decode_bps, overhead_s]``:

    Every allreduce is timed as the best of ``repeats`` (after a warm-up), at ``nbytes``
    and at 4 x ``nbytes``; per-byte figures come from the difference between the two
    sizes, so that the fixed cost of a call is not spread over its bytes.

    1. ``bandwidth`` (bytes/s per peer) = ``2 (w-1)/w * (4n - n) * 4 / (t_raw(4n) -
       t_raw(n))`` for ``n`` = nbytes / 4 values: it includes what the engine spends per
       byte (summing, framing), as a raw layer does.
    2. The same buffers all-reduced at ``bits`` / ``bucket_size`` take ``t_q``; what is
       left after the wire time is the engine's whole compressed path (kernels, staging,
       thread hand-offs), expressed per byte as one effective codec rate for both
       directions: the difference of ``4m * (1 + (2w-1)/w)`` (the work
       :func:`~cgx_ucx.compression.policies.layer_seconds` counts for ``m`` values)
       over the difference of ``t_q - wire time``. Bare kernel rates
       (:func:`~cgx_ucx.compression.policies.probe_codec`) leave staging and hand-offs
       out and are optimistic. Where the engine hides the codec behind the wire (a slow
       link) the rate comes out very large: the codec is then free, which is what the
       decision needs to know.
    3. ``overhead_s`` per codec call: the larger of (a) the same (up to) 64 Ki values
       compressed as 32 layers instead of one, the extra time divided by 32 layers x 3
       calls, and (b) a third of the fixed cost a compressed call has beyond a raw one
       (the intercepts of the two fits).

    A collective: every rank must call the probe at the same point (:func:`agree` does).
    For an asyncio communicator (``allreduce`` is a coroutine function) the probe is a
    coroutine function; otherwise it waits on the returned futures.
    """
    nbytes = check_positive_int(nbytes, "nbytes", 4)
    repeats = check_positive_int(repeats, "repeats")
    bits = check_bits(bits)
    if bits == NO_COMPRESSION_BITS:
        raise ConfigError("the link probe compares against a quantized width: bits 1..8")
    w = _world_size(comm, world_size)
    n = nbytes // 4
    if n < 16 * _PROBE_LAYERS:
        raise ConfigError(f"nbytes must be at least {64 * _PROBE_LAYERS} for the probe")
    pristine = np.random.default_rng(1).standard_normal(_PROBE_SCALE * n).astype(np.float32)
    buf = pristine.copy()
    kinds = _probe_kinds(n, bits, bucket_size)

    if inspect.iscoroutinefunction(getattr(comm, "allreduce", None)):

        async def probe_async() -> np.ndarray:
            best = []
            for kw, size in kinds:
                t = math.inf
                for k in range(repeats + 1):
                    buf[:size] = pristine[:size]
                    t0 = time.perf_counter()
                    aw = comm.allreduce(buf[:size], op="sum", **kw)
                    await _deadline(aw, timeout, "link probe")
                    if k:  # the first one warms up connections, buffers and kernels
                        t = min(t, time.perf_counter() - t0)
                best.append(t)
            return _probe_result(best, n, w, bits, bucket_size)

        return probe_async

    def probe() -> np.ndarray:
        best = []
        for kw, size in kinds:
            t = math.inf
            for k in range(repeats + 1):
                buf[:size] = pristine[:size]
                t0 = time.perf_counter()
                _wait(comm.allreduce(buf[:size], op="sum", **kw), timeout, "link probe")
                if k:
                    t = min(t, time.perf_counter() - t0)
            best.append(t)
        return _probe_result(best, n, w, bits, bucket_size)

    return probe
