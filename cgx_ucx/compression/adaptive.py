"""Layer-wise adaptive compression: which layers to quantize, and with how many bits.

A *policy* turns per-layer statistics into a per-layer :class:`Assignment` (bits, bucket
size; ``bits == 32`` sends the layer uncompressed) and from it the
:class:`~cgx_ucx.layout.Layout` that travels with every allreduce. Four policies:

``static``
    The CGX paper's default: 4 bits, buckets of 1024, 1-D layers and layers with fewer
    than ``layer_min_size`` (1024, torch_cgx's ``CGXState``) values uncompressed.
``kmeans``
    CGX's adjuster (torch_cgx's research code, ``KMeanAdjuster``): a decayed accumulation
    of each compressed layer's gradient, scored by the L2 norm of its 100 largest
    magnitudes; k-means on (log size, log score) into one cluster per bit width in
    ``[bits_min, bits_max]``; higher-score clusters get more bits, fewer bits get smaller
    buckets (2 -> 128, 3 -> 256, 4 -> the default).
``budget``
    In the spirit of L-GreCo (arXiv 2210.17357): per-layer (bits, bucket)
    minimizing the bytes on the wire subject to the summed quantization error being at most
    uniform 4-bit's; solved exactly by dynamic programming over a discretized error budget
    (:func:`solve_budget`).
``auto``
    Compress a layer only where the cost model of the allreduce says it saves time, given
    the measured link bandwidth and codec throughput; re-probe when step times drift.

The protocol of one step (every method is cheap unless the step is a decision step)::

    a = policy.assignment(step)          # single process; with ranks: await agree(...)
    layout = policy.layout(indices)      # the layers of one DDP bucket, in bucket order
    ... allreduce(buffer, layout) ...
    policy.observe(step, grads, indices) # local gradients, before (or after) the allreduce

**Agreement across ranks.** Decisions happen only at steps fixed by a schedule that is a
pure function of the step number (:meth:`Policy.due`), so every rank knows, without
talking, when to decide. At such a step :func:`agree` (asyncio) or :func:`agree_sync`
(futures) all-reduces the small per-layer statistics vector (:meth:`local_statistics`,
float32, a few values per layer), every rank decides deterministically from the mean,
and rank ``root``'s encoded assignment is then broadcast and adopted everywhere, so the
ranks agree bit for bit even if two machines' floating point differed in the last place.
All other steps cost no communication.

**Quantization error.** The error of a layer at (bits, bucket) is *measured*: the sum of
squared differences between the gradient and its round trip through CGX's max-min
quantizer, computed with the codec's float32 arithmetic on a fixed, evenly spaced sample of
blocks of the layer (the whole layer when it has at most ``sample_values`` values) and
scaled to the layer's size (:func:`quantization_errors`). The textbook model
``range**2 / (12 * (2**bits - 1)**2)`` per value (one min/max pass for all candidates)
assumes the rounding error is spread uniformly over a unit. Measured against the codec it
holds within 2% for Gaussian and Student-t buckets, but not where values sit on a few
points: with 90% exact zeros (ReLU, dropout, embedding rows) the real error at 2 bits was
1.6x the model's, since every zero lands at the same offset from the grid. The
measurement is exact for any distribution, at a bounded cost: at most ``sample_values``
values per layer and candidate, only on the few steps before a decision.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import inspect
import logging
import math
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Generator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from ..config import NO_COMPRESSION_BITS, VALID_BITS, CompressionConfig
from ..errors import CGXError, CGXTimeoutError, ConfigError
from ..layout import Layout
from .codec import encoded_nbytes

__all__ = [
    "PAPER_CONFIG",
    "PAPER_LAYER_MIN_SIZE",
    "POLICIES",
    "Assignment",
    "AutoPolicy",
    "BudgetPolicy",
    "BudgetSolution",
    "CodecCost",
    "KMeansPolicy",
    "LayerInfo",
    "LayerStats",
    "Policy",
    "Schedule",
    "StaticPolicy",
    "agree",
    "agree_sync",
    "allreduce_seconds",
    "deterministic_kmeans",
    "layer_seconds",
    "layers_from_parameters",
    "make_link_probe",
    "make_policy",
    "probe_codec",
    "quantization_errors",
    "solve_budget",
    "wire_nbytes",
]

log = logging.getLogger("cgx_ucx.adaptive")

#: What a probe returns: a number or a short vector of numbers.
ProbeValue = float | Sequence[float] | np.ndarray

#: The CGX paper's setting (Markov et al. 2022, section 5): 4 bits, buckets of 1024.
PAPER_CONFIG = CompressionConfig(bits=4, bucket_size=1024)
#: torch_cgx's CGXState default: layers with fewer values go uncompressed.
PAPER_LAYER_MIN_SIZE = 1024
#: Values per layer whose quantization error is measured (64 blocks of 1024): 24
#: candidates cost about 3 ms per layer on this 2-core host (NumPy), and 64 buckets keep
#: the sampling error of heavy-tailed gradients near 10% (tests/test_adaptive.py).
DEFAULT_SAMPLE_VALUES = 65536
#: Bytes of one link-probe allreduce: 2 MiB takes 17 ms at 1 Gbit/s, long enough that
#: per-message latency is a few percent, short enough to probe again at every drift.
DEFAULT_PROBE_BYTES = 2 << 20
#: Seconds any collective of :func:`agree` may take (CommConfig's default timeout).
DEFAULT_TIMEOUT = 300.0


# =======================================================================================
# layers and assignments


@dataclass(frozen=True)
class LayerInfo:
    """What a policy knows about a layer before any gradient: size, rank, name.

    ``ndim <= 1`` (biases, norms) is never compressed, as in torch_cgx.
    """

    numel: int
    ndim: int = 2
    name: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.numel, bool) or not isinstance(self.numel, int) or self.numel < 0:
            raise ConfigError(f"layer numel must be an integer >= 0, got {self.numel!r}")
        if isinstance(self.ndim, bool) or not isinstance(self.ndim, int) or self.ndim < 0:
            raise ConfigError(f"layer ndim must be an integer >= 0, got {self.ndim!r}")


def layers_from_parameters(named: Iterable[tuple[str, Any]]) -> list[LayerInfo]:
    """LayerInfo of each ``(name, tensor)`` (e.g. ``model.named_parameters()``), in order.

    Duck-typed (``numel()``, ``dim()``), so torch is not imported here.
    """
    return [LayerInfo(int(t.numel()), int(t.dim()), str(name)) for name, t in named]


def _as_layers(layers: Sequence[LayerInfo | int]) -> tuple[LayerInfo, ...]:
    out = []
    for i, layer in enumerate(layers):
        if isinstance(layer, LayerInfo):
            out.append(layer)
        elif isinstance(layer, int | np.integer) and not isinstance(layer, bool):
            out.append(LayerInfo(int(layer), 2, f"layer{i}"))
        else:
            raise ConfigError(f"layer {i} must be a LayerInfo or a size, got {layer!r}")
    return tuple(out)


def _check_bits(bits: int, what: str = "bits") -> int:
    if isinstance(bits, bool) or not isinstance(bits, int | np.integer) or bits not in VALID_BITS:
        raise ConfigError(f"{what} must be 1..8 or 32, got {bits!r}")
    return int(bits)


def _check_positive_int(value: Any, what: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < minimum:
        raise ConfigError(f"{what} must be an integer >= {minimum}, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class Assignment:
    """Per-layer bits and bucket sizes decided at ``step`` (bits 32 = uncompressed)."""

    bits: tuple[int, ...]
    bucket_sizes: tuple[int, ...]
    step: int = 0

    def __post_init__(self) -> None:
        if len(self.bits) != len(self.bucket_sizes):
            raise ConfigError(
                f"assignment has {len(self.bits)} bits but {len(self.bucket_sizes)} bucket sizes"
            )
        for b in self.bits:
            _check_bits(b, "assigned bits")
        for bs in self.bucket_sizes:
            _check_positive_int(bs, "assigned bucket size")

    def __len__(self) -> int:
        return len(self.bits)

    @property
    def compressed(self) -> tuple[bool, ...]:
        """Per layer: True when quantized."""
        return tuple(b != NO_COMPRESSION_BITS for b in self.bits)

    def layout(self, sizes: Sequence[int], indices: Sequence[int] | None = None) -> Layout:
        """The :class:`Layout` of the layers ``indices`` (default: all), in that order."""
        idx = range(len(self.bits)) if indices is None else indices
        try:
            bits = [self.bits[i] for i in idx]
            buckets = [self.bucket_sizes[i] for i in idx]
            numels = [int(sizes[i]) for i in idx]
        except (IndexError, TypeError) as exc:
            raise ConfigError(f"layer indices out of range for {len(self.bits)} layers") from exc
        return Layout.from_sizes(numels, bits=bits, bucket_sizes=buckets)

    def encode(self) -> np.ndarray:
        """``[n, step, bits..., bucket_sizes...]`` as int64: what :func:`agree` broadcasts."""
        return np.array([len(self.bits), self.step, *self.bits, *self.bucket_sizes], np.int64)

    @classmethod
    def decode(cls, data: np.ndarray, num_layers: int) -> Assignment:
        """Inverse of :meth:`encode`; a buffer of the wrong shape is a ConfigError."""
        data = np.asarray(data)
        if data.ndim != 1 or data.shape[0] != 2 + 2 * num_layers or int(data[0]) != num_layers:
            raise ConfigError(
                f"encoded assignment of shape {data.shape} does not describe {num_layers} layers"
            )
        vals = [int(v) for v in data.tolist()]
        n = num_layers
        return cls(tuple(vals[2 : 2 + n]), tuple(vals[2 + n :]), vals[1])


def wire_nbytes(numel: int, bits: int, bucket_size: int) -> int:
    """Bytes of one encoded copy of a layer: the codec's segment length (header included).

    ``2 float32`` meta per bucket + ``ceil(numel * bits / 8)`` code bytes + 24 header
    bytes; ``4 * numel`` + header uncompressed.
    """
    return encoded_nbytes(int(numel), int(bits), int(bucket_size))


# =======================================================================================
# statistics: per-bucket ranges and the error model


def _xp(x: Any) -> Any:
    """NumPy or CuPy, whichever holds ``x`` (CuPy is only imported for CuPy arrays)."""
    if type(x).__module__.split(".", 1)[0] == "cupy":
        import cupy

        return cupy
    return np


def _from_torch(x: Any) -> Any:
    """A torch tensor as a NumPy (CPU) or CuPy (CUDA, via DLPack) array, without copying
    float32/float16; bfloat16 on the CPU is widened (NumPy has no bfloat16)."""
    x = x.detach()
    if x.is_cuda:
        import cupy

        return cupy.from_dlpack(x)
    if str(x.dtype) == "torch.bfloat16":
        x = x.float()
    return x.numpy()


def _numel(x: Any) -> int | None:
    n = getattr(x, "size", None)
    if callable(n):  # torch.Tensor.size()
        n = x.numel()
    return n if isinstance(n, int) else None


def _flat_float(x: Any) -> Any:
    if type(x).__module__.split(".", 1)[0] == "torch":
        x = _from_torch(x)
    if not hasattr(x, "dtype") or not hasattr(x, "reshape"):
        raise ConfigError(f"gradients must be NumPy or CuPy arrays, got {type(x).__name__}")
    x = x.reshape(-1)
    if x.dtype not in (np.float32, np.float64):
        x = x.astype(np.float32)  # float16/bfloat16: reductions need headroom
    return x


def quantization_errors(
    x: Any,
    bits: Sequence[int],
    bucket_sizes: Sequence[int],
    *,
    sample_values: int = DEFAULT_SAMPLE_VALUES,
) -> np.ndarray:
    """Squared quantization error of ``x`` for every (bucket size, bits): shape (sizes, bits).

    Round to nearest as the codec does it, in float32: ``unit = (max - min) / (2**bits - 1)``,
    ``code = floor((x - min) / unit + 0.5)`` clipped, ``error = x - (min + unit * code)``.
    A layer of more than ``sample_values`` values is measured on evenly spaced blocks of
    ``lcm(bucket_sizes)`` values (so every candidate bucket lies whole inside a block) and
    the sum is scaled by ``numel / sampled``; smaller layers are measured whole, last short
    bucket included. Non-finite values give a non-finite error. NumPy or CuPy input;
    returns NumPy float64.
    """
    sizes = [_check_positive_int(b, "bucket size") for b in bucket_sizes]
    widths = [_check_bits(b) for b in bits]
    if any(b == NO_COMPRESSION_BITS for b in widths):
        raise ConfigError("bits 32 has no quantization error to measure")
    out = np.zeros((len(sizes), len(widths)))
    x = _flat_float(x)
    if x.dtype != np.float32:
        x = x.astype(np.float32)
    n = int(x.shape[0])
    if n == 0 or not sizes or not widths:
        return out
    xp = _xp(x)
    block = math.lcm(*sizes)
    scale = 1.0
    if n > sample_values and n >= block:
        nblocks = n // block
        take = min(nblocks, max(1, sample_values // block))
        starts = (np.arange(take, dtype=np.int64) * nblocks // take) * block
        idx = xp.asarray((starts[:, None] + np.arange(block, dtype=np.int64)).reshape(-1))
        x = x[idx]
        scale = n / float(x.shape[0])
    with np.errstate(invalid="ignore", over="ignore"):  # non-finite in, non-finite out
        _accumulate_errors(xp, x, sizes, widths, out)
    return out * scale


def _accumulate_errors(
    xp: Any, x: Any, sizes: Sequence[int], widths: Sequence[int], out: np.ndarray
) -> None:
    n = int(x.shape[0])
    for si, size in enumerate(sizes):
        m = (n // size) * size
        parts = []
        if m:
            parts.append(x[:m].reshape(-1, size))
        if n - m:
            parts.append(x[m:].reshape(1, -1))
        for part in parts:
            lo = part.min(axis=1, keepdims=True) + np.float32(0)
            hi = part.max(axis=1, keepdims=True) + np.float32(0)
            span = hi - lo
            for bi, width in enumerate(widths):
                levels = np.float32(2**width - 1)
                unit = span / levels
                safe = xp.where(unit > 0, unit, np.float32(1))
                code = xp.clip(xp.floor((part - lo) / safe + np.float32(0.5)), 0, levels)
                err = (part - (lo + unit * code)).astype(np.float64)
                out[si, bi] += float((err * err).sum())


class _WindowMean:
    """Per-layer running sums of statistics over a window; mean is NaN where unobserved."""

    def __init__(self, num_layers: int, shape: tuple[int, ...]) -> None:
        self.sum = np.zeros((num_layers, *shape))
        self.count = np.zeros(num_layers, np.int64)

    def add(self, index: int, values: np.ndarray) -> None:
        self.sum[index] += values
        self.count[index] += 1

    def mean(self) -> np.ndarray:
        cnt = np.where(self.count > 0, self.count, np.nan).astype(np.float64)
        return self.sum / cnt.reshape(-1, *([1] * (self.sum.ndim - 1)))

    def reset(self) -> None:
        self.sum[:] = 0.0
        self.count[:] = 0

    def state(self, prefix: str) -> dict[str, Any]:
        return {f"{prefix}_sum": self.sum.copy(), f"{prefix}_count": self.count.copy()}

    def load(self, prefix: str, state: Mapping[str, Any]) -> None:
        self.sum = np.array(state[f"{prefix}_sum"], np.float64).reshape(self.sum.shape)
        self.count = np.array(state[f"{prefix}_count"], np.int64).reshape(self.count.shape)


# =======================================================================================
# schedule


@dataclass(frozen=True)
class Schedule:
    """When a policy decides, and on which steps it gathers statistics for that decision.

    Decisions at ``warmup, warmup + interval, warmup + 2 * interval, ...``; statistics are
    gathered on the ``window`` steps before each decision (and only there, so most steps
    cost nothing). A pure function of the step, identical on every rank.
    """

    warmup: int = 50
    interval: int = 500
    window: int = 20

    def __post_init__(self) -> None:
        _check_positive_int(self.warmup, "warmup", 0)
        _check_positive_int(self.interval, "interval", 1)
        _check_positive_int(self.window, "window", 0)

    def is_decision(self, step: int) -> bool:
        return step >= self.warmup and (step - self.warmup) % self.interval == 0

    def next_decision(self, step: int) -> int:
        """The first decision step strictly after ``step``."""
        if step < self.warmup:
            return self.warmup
        return self.warmup + ((step - self.warmup) // self.interval + 1) * self.interval

    def in_window(self, step: int) -> bool:
        return step >= 0 and self.next_decision(step) - self.window <= step


# =======================================================================================
# the policy base


@dataclass(frozen=True)
class LayerStats:
    """One row of :meth:`Policy.stats`: the current assignment of a layer and its cost.

    ``wire_bytes``: one encoded copy (what each peer chunk costs); ``rel_error``: measured
    squared quantization error over the squared norm of the gradient, at the last logging
    step (NaN before one, 0 uncompressed).
    """

    index: int
    name: str
    numel: int
    bits: int
    bucket_size: int
    wire_bytes: int
    rel_error: float


class Policy(ABC):
    """Maps per-layer statistics to a per-layer (bits, bucket size, compressed) assignment.

    Subclasses gather what they need in :meth:`_observe_layer` (called for compressible
    layers on the window steps only), summarize it in :meth:`_statistics` (a fixed-length
    vector that :func:`agree` averages over the ranks) and decide from that vector alone in
    :meth:`_decide`, so that equal statistics give equal assignments on every rank.
    """

    name: ClassVar[str] = "policy"
    #: Version of the state_dict layout; load_state_dict refuses others.
    STATE_VERSION: ClassVar[int] = 1

    def __init__(
        self,
        layers: Sequence[LayerInfo | int],
        config: CompressionConfig | None = None,
        *,
        layer_min_size: int = PAPER_LAYER_MIN_SIZE,
        schedule: Schedule | None = None,
        log_every: int = 0,
    ) -> None:
        self._layers = _as_layers(layers)
        self.config = PAPER_CONFIG if config is None else config
        if not isinstance(self.config, CompressionConfig):
            raise ConfigError(f"config must be a CompressionConfig, got {self.config!r}")
        self.layer_min_size = _check_positive_int(layer_min_size, "layer_min_size", 0)
        self.schedule = schedule or Schedule()
        if not isinstance(self.schedule, Schedule):
            raise ConfigError(f"schedule must be a Schedule, got {self.schedule!r}")
        self.log_every = _check_positive_int(log_every, "log_every", 0)
        threshold = max(self.layer_min_size, self.config.minimal_size, 1)
        self._sizes = np.array([layer.numel for layer in self._layers], np.int64)
        #: layers any policy may quantize: >= 2-D, large enough, compression enabled
        self._compressible = np.array(
            [
                self.config.enabled and layer.ndim > 1 and layer.numel >= threshold
                for layer in self._layers
            ],
            bool,
        )
        self._rel_error = np.full(self.num_layers, np.nan)
        self._decisions = 0
        self._current = self.static_assignment()

    # -- what the policy covers ----------------------------------------------------------
    @property
    def layers(self) -> tuple[LayerInfo, ...]:
        return self._layers

    @property
    def num_layers(self) -> int:
        return len(self._layers)

    @property
    def sizes(self) -> np.ndarray:
        return self._sizes.copy()

    @property
    def compressible(self) -> np.ndarray:
        """Per layer: may be quantized at all (>= 2-D, >= layer_min_size, bits < 32)."""
        return self._compressible.copy()

    @property
    def current(self) -> Assignment:
        """The assignment in force."""
        return self._current

    @property
    def decisions(self) -> int:
        """How many decisions this policy has made."""
        return self._decisions

    def static_assignment(self, step: int = 0) -> Assignment:
        """The paper's rule: ``config.bits`` on compressible layers, uncompressed elsewhere."""
        bits = tuple(
            self.config.bits if c else NO_COMPRESSION_BITS for c in self._compressible.tolist()
        )
        return Assignment(bits, (self.config.bucket_size,) * self.num_layers, step)

    # -- the per-step protocol -----------------------------------------------------------
    def due(self, step: int) -> bool:
        """True when ``step`` is a decision step (a pure function of the step number)."""
        return bool(self._compressible.any()) and self.schedule.is_decision(step)

    def _log_step(self, step: int) -> bool:
        return self.log_every > 0 and step % self.log_every == 0

    def observing(self, step: int) -> bool:
        """True when :meth:`observe` does any work at ``step``."""
        if not self._compressible.any():
            return False
        return self.schedule.in_window(step) or self._log_step(step)

    def observe(
        self, step: int, grads: Sequence[Any], indices: Sequence[int] | None = None
    ) -> None:
        """Record the gradients of layers ``indices`` (default: all) at ``step``.

        Arrays (NumPy, CuPy or torch tensors; float32/16/bfloat16) are this rank's
        gradients, i.e. what the allreduce quantizes. Outside the statistics window and the
        logging steps only the arguments are checked, so it may be called every step.
        """
        idx = range(self.num_layers) if indices is None else indices
        if len(grads) != len(idx):
            raise ConfigError(f"observe got {len(grads)} gradients for {len(idx)} layers")
        for i, g in zip(idx, grads, strict=True):
            if not 0 <= i < self.num_layers:
                raise ConfigError(f"layer index {i} out of range for {self.num_layers} layers")
            n = _numel(g)
            if n != self._sizes[i]:
                raise ConfigError(
                    f"gradient of layer {i} has {n} values, expected {self._sizes[i]}"
                )
        if not self.observing(step):
            return
        window = self.schedule.in_window(step)
        log_step = self._log_step(step)
        for i, g in zip(idx, grads, strict=True):
            if not self._compressible[i]:
                continue
            x = _flat_float(g)
            if log_step:
                self._rel_error[i] = self._relative_error(i, x)
            if window:
                self._observe_layer(step, i, x)

    def _relative_error(self, index: int, x: Any) -> float:
        bits, bucket = self._current.bits[index], self._current.bucket_sizes[index]
        if bits == NO_COMPRESSION_BITS:
            return 0.0
        norm = float(_xp(x).dot(x, x)) if x.shape[0] else 0.0
        err = float(quantization_errors(x, [bits], [bucket])[0, 0])
        return err / norm if norm > 0 else (0.0 if err == 0 else float("inf"))

    def local_statistics(self, step: int) -> np.ndarray:
        """This rank's statistics for the decision at ``step``: a float32 vector.

        Its length is fixed by the policy and the layers; layers without observations
        hold NaN, which stays NaN in the all-reduced mean, and such layers keep their
        assignment.
        """
        del step
        stats = np.asarray(self._statistics(), np.float64).reshape(-1).astype(np.float32)
        if stats.shape[0] != self._statistics_size():
            raise CGXError(f"policy {self.name!r} produced {stats.shape[0]} statistics")
        return stats

    def wants_probe(self, step: int, statistics: np.ndarray) -> bool:
        """True when :func:`agree` must run :meth:`probe` on every rank before deciding."""
        del step, statistics
        return False

    def probe(self) -> ProbeValue | Awaitable[ProbeValue]:
        """A collective measurement (e.g. of the link); only called when wanted.

        Returns a number or a short vector of numbers (or an awaitable of one).
        """
        raise ConfigError(f"policy {self.name!r} has no probe")

    def set_probe_result(self, values: np.ndarray) -> None:
        """The probe's values (float64 vector), averaged over the ranks."""
        del values

    def decide(self, step: int, statistics: np.ndarray) -> Assignment:
        """Decide from (all-reduced mean) ``statistics``; deterministic. Installs the result."""
        statistics = np.asarray(statistics, np.float64).reshape(-1)
        if statistics.shape[0] != self._statistics_size():
            raise ConfigError(
                f"policy {self.name!r} expects {self._statistics_size()} statistics, "
                f"got {statistics.shape[0]}"
            )
        decided = self._decide(step, statistics)
        self._decisions += 1
        self._after_decision()
        self._current = decided
        return decided

    def adopt(self, assignment: Assignment) -> None:
        """Install an assignment decided elsewhere (rank 0's, after :func:`agree`)."""
        if len(assignment) != self.num_layers:
            raise ConfigError(
                f"assignment covers {len(assignment)} layers, the policy {self.num_layers}"
            )
        for i, (b, c) in enumerate(zip(assignment.bits, self._compressible.tolist(), strict=True)):
            if b != NO_COMPRESSION_BITS and not c:
                raise ConfigError(f"assignment quantizes layer {i}, which is not compressible")
        self._current = assignment

    def assignment(self, step: int) -> Assignment:
        """The assignment for ``step`` in a single process (decides locally when due).

        With several ranks use :func:`agree` / :func:`agree_sync` instead, so that every
        rank decides from the same statistics.
        """
        if self.due(step):
            stats = self.local_statistics(step)
            if self.wants_probe(step, stats):
                value = self.probe()
                if inspect.isawaitable(value):
                    raise ConfigError("an asynchronous probe needs `await agree(...)`")
                self.set_probe_result(_probe_vector(value).astype(np.float64))
            self.decide(step, stats)
        self.maybe_log(step)
        return self._current

    def layout(self, indices: Sequence[int] | None = None) -> Layout:
        """Layout of layers ``indices`` (default all) in that order, from the current assignment."""
        return self._current.layout(self._sizes, indices)

    # -- visibility -----------------------------------------------------------------------
    def wire_bytes(self, indices: Sequence[int] | None = None) -> int:
        """Bytes of one encoded copy of layers ``indices`` (default all), as assigned now."""
        a = self._current
        idx = range(self.num_layers) if indices is None else indices
        return sum(wire_nbytes(int(self._sizes[i]), a.bits[i], a.bucket_sizes[i]) for i in idx)

    def stats(self) -> list[LayerStats]:
        """Per layer: bits, bucket size, bytes of one encoded copy, relative error."""
        a = self._current
        return [
            LayerStats(
                i,
                layer.name,
                layer.numel,
                a.bits[i],
                a.bucket_sizes[i],
                wire_nbytes(layer.numel, a.bits[i], a.bucket_sizes[i]),
                0.0 if a.bits[i] == NO_COMPRESSION_BITS else float(self._rel_error[i]),
            )
            for i, layer in enumerate(self._layers)
        ]

    def stats_table(self) -> str:
        """:meth:`stats` as a plain-text table."""
        head = ("layer", "name", "numel", "bits", "bucket", "wire_bytes", "rel_error")
        body = [
            (
                str(r.index),
                r.name,
                str(r.numel),
                str(r.bits),
                str(r.bucket_size),
                str(r.wire_bytes),
                f"{r.rel_error:.3g}",
            )
            for r in self.stats()
        ]
        widths = [max([len(h)] + [len(row[k]) for row in body]) for k, h in enumerate(head)]
        lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True))]
        lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in body]
        return "\n".join(lines)

    def maybe_log(self, step: int) -> None:
        """Log the assignment at INFO every ``log_every`` steps (formatted only if enabled)."""
        if self._log_step(step) and log.isEnabledFor(logging.INFO):
            log.info(
                "policy %s step %d: %d/%d layers compressed, %d of %d bytes\n%s",
                self.name,
                step,
                sum(self._current.compressed),
                self.num_layers,
                self.wire_bytes(),
                sum(wire_nbytes(n, NO_COMPRESSION_BITS, 1) for n in self._sizes.tolist()),
                self.stats_table(),
            )

    # -- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """NumPy arrays and plain values only."""
        a = self._current
        state = {
            "policy": self.name,
            "version": self.STATE_VERSION,
            "sizes": self._sizes.copy(),
            "bits": np.array(a.bits, np.int64),
            "bucket_sizes": np.array(a.bucket_sizes, np.int64),
            "assigned_step": int(a.step),
            "decisions": int(self._decisions),
            "rel_error": self._rel_error.copy(),
        }
        state.update(self._extra_state())
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; a state of another policy or model is a ConfigError."""
        try:
            if state["policy"] != self.name or int(state["version"]) != self.STATE_VERSION:
                raise ConfigError(
                    f"state of policy {state['policy']!r} v{state['version']} cannot be "
                    f"loaded into {self.name!r} v{self.STATE_VERSION}"
                )
            if not np.array_equal(np.asarray(state["sizes"]), self._sizes):
                raise ConfigError("state was saved for layers of other sizes")
            assignment = Assignment(
                tuple(int(b) for b in np.asarray(state["bits"]).tolist()),
                tuple(int(b) for b in np.asarray(state["bucket_sizes"]).tolist()),
                int(state["assigned_step"]),
            )
            rel = np.array(state["rel_error"], np.float64).reshape(self.num_layers)
            self._load_extra_state(state)
        except (KeyError, ValueError, TypeError) as exc:
            raise ConfigError(f"invalid {self.name!r} policy state: {exc}") from exc
        self.adopt(assignment)
        self._decisions = int(state["decisions"])
        self._rel_error = rel

    # -- subclass hooks -------------------------------------------------------------------
    @abstractmethod
    def _decide(self, step: int, statistics: np.ndarray) -> Assignment:
        """The assignment for ``statistics`` (float64, all ranks' mean); deterministic."""

    def _observe_layer(self, step: int, index: int, grad: Any) -> None:
        """One compressible layer's gradient on a window step (flat float array)."""
        del step, index, grad

    def _statistics(self) -> Sequence[float] | np.ndarray:
        return ()

    def _statistics_size(self) -> int:
        return 0

    def _after_decision(self) -> None:
        """Called after each decision (reset windows, decay accumulators)."""
        return None

    def _extra_state(self) -> dict[str, Any]:
        return {}

    def _load_extra_state(self, state: Mapping[str, Any]) -> None:
        """Validate and load the subclass's state (raise before changing anything)."""
        del state


# =======================================================================================
# 1. static


class StaticPolicy(Policy):
    """The CGX paper's default: ``config`` (4 bits, buckets of 1024) on every compressible
    layer; 1-D layers and layers under ``layer_min_size`` uncompressed. Never re-decides.
    """

    name = "static"

    def due(self, step: int) -> bool:
        return False

    def observing(self, step: int) -> bool:
        # only to fill the stats table on logging steps
        return bool(self._compressible.any()) and self._log_step(step)

    def _decide(self, step: int, statistics: np.ndarray) -> Assignment:
        return self.static_assignment(step)


# =======================================================================================
# 2. CGX's k-means adjuster


def deterministic_kmeans(
    points: np.ndarray, k: int, *, iterations: int = 100
) -> tuple[np.ndarray, np.ndarray]:
    """Lloyd's k-means with a fixed initialization; returns (labels, centroids).

    Initial centroids are the distinct points at evenly spaced ranks of the last
    coordinate (ties by the other coordinates), so equal inputs give equal outputs on
    every rank (CGX's scipy ``kmeans2(minit="++")`` is random, hence its broadcast).
    ``k`` is lowered to the number of distinct points. Ties go to the lower cluster.
    """
    points = np.asarray(points, np.float64)
    if points.ndim != 2 or points.shape[0] == 0:
        raise ConfigError(f"k-means needs a non-empty (m, d) array, got shape {points.shape}")
    if not np.isfinite(points).all():
        raise ConfigError("k-means points must be finite")
    uniq = np.unique(points, axis=0)
    order = np.lexsort(tuple(uniq[:, j] for j in range(uniq.shape[1])))
    uniq = uniq[order]
    k = max(1, min(int(k), uniq.shape[0]))
    picks = np.round(np.linspace(0, uniq.shape[0] - 1, k)).astype(np.int64)
    centroids = uniq[picks].copy()
    labels = np.full(points.shape[0], -1, np.int64)
    for _ in range(iterations):
        d2 = ((points[:, None, :] - centroids[None, :, :]) ** 2).sum(axis=2)
        new = np.argmin(d2, axis=1)
        if np.array_equal(new, labels):
            break
        labels = new
        for c in range(k):
            members = points[labels == c]
            if members.shape[0]:
                centroids[c] = members.mean(axis=0)
    return labels, centroids


class KMeansPolicy(Policy):
    """CGX's adjuster: cluster layers by (size, score), more bits for higher scores.

    1. Each observed step (inside the window before a decision), every compressible
       layer's accumulator becomes ``decay * acc + grad``. torch_cgx's research code adds
       ``0.8 * grad`` every step and multiplies by 0.8 only after each adjustment; decaying
       every step instead lets old gradients fade without waiting for an adjustment, and
       since the oldest of 20 steps then weighs 0.8**20 ~ 1%, a 20-step window before each
       decision sees all that matters while the other steps cost nothing.
    2. Score: L2 norm of the ``top_k`` (100, as CGX) largest magnitudes of the accumulator.
    3. k-means on whitened ``(log2 size, log2 score)`` with one cluster per bit width in
       ``[bits_min, bits_max]``: sizes and scores span orders of magnitude, and in linear
       units (CGX's) one huge layer takes a cluster of its own.
    4. Clusters ranked by centroid score get ``bits_min .. bits_max``; bucket sizes from
       ``bucket_for_bits`` (2 -> 128, 3 -> 256, else ``config.bucket_size``, as CGX).
    5. After each decision the accumulators are multiplied by ``decay`` (CGX) and reset to
       zero every ``reset_every`` decisions. Layers with a non-finite or zero score keep
       their bits.
    """

    name = "kmeans"

    def __init__(
        self,
        layers: Sequence[LayerInfo | int],
        config: CompressionConfig | None = None,
        *,
        bits_min: int = 2,
        bits_max: int = 4,
        bucket_for_bits: Mapping[int, int] | None = None,
        decay: float = 0.8,
        top_k: int = 100,
        reset_every: int = 4,
        schedule: Schedule | None = None,
        **kwargs: Any,
    ) -> None:
        self.bits_min = _check_bits(bits_min, "bits_min")
        self.bits_max = _check_bits(bits_max, "bits_max")
        if not 1 <= self.bits_min <= self.bits_max <= 8:
            raise ConfigError(f"need 1 <= bits_min <= bits_max <= 8, got {bits_min}..{bits_max}")
        if not 0.0 <= decay < 1.0:
            raise ConfigError(f"decay must be in [0, 1), got {decay!r}")
        self.decay = float(decay)
        self.top_k = _check_positive_int(top_k, "top_k")
        self.reset_every = _check_positive_int(reset_every, "reset_every")
        cfg = PAPER_CONFIG if config is None else config
        default_bucket = cfg.bucket_size
        mapping = {1: 32, 2: 128, 3: min(256, default_bucket)}
        if bucket_for_bits is not None:
            mapping = {int(b): int(s) for b, s in bucket_for_bits.items()}
        self.bucket_for_bits = {
            b: _check_positive_int(mapping.get(b, default_bucket), f"bucket for {b} bits")
            for b in range(self.bits_min, self.bits_max + 1)
        }
        super().__init__(
            layers, cfg, schedule=schedule or Schedule(warmup=50, interval=500, window=20), **kwargs
        )
        self._acc: list[Any] = [None] * self.num_layers

    def _observe_layer(self, step: int, index: int, grad: Any) -> None:
        acc = self._acc[index]
        if acc is not None and _xp(acc) is not _xp(grad):
            acc = self._acc[index] = _xp(grad).asarray(acc)  # loaded on the host
        if acc is None:
            self._acc[index] = grad.astype(np.float32, copy=True)
        else:
            acc *= self.decay
            acc += grad

    def _score(self, index: int) -> float:
        acc = self._acc[index]
        if acc is None or acc.shape[0] == 0:
            return float("nan")
        xp = _xp(acc)
        mags = xp.abs(acc)
        k = min(self.top_k, mags.shape[0])
        top = xp.partition(mags, mags.shape[0] - k)[mags.shape[0] - k :].astype(np.float64)
        return math.sqrt(float((top * top).sum()))

    def _statistics(self) -> np.ndarray:
        return np.array([self._score(i) for i in range(self.num_layers)])

    def _statistics_size(self) -> int:
        return self.num_layers

    def _after_decision(self) -> None:
        reset = self._decisions % self.reset_every == 0
        for i, acc in enumerate(self._acc):
            if acc is None:
                continue
            if reset:
                self._acc[i] = None
            else:
                acc *= self.decay

    def _decide(self, step: int, statistics: np.ndarray) -> Assignment:
        scores = statistics
        prev = self._current
        bits = list(prev.bits)
        buckets = list(prev.bucket_sizes)
        valid = [
            i
            for i in range(self.num_layers)
            if self._compressible[i] and np.isfinite(scores[i]) and scores[i] > 0
        ]
        if valid:
            feats = np.stack(
                [np.log2(self._sizes[valid].astype(np.float64)), np.log2(scores[valid])], axis=1
            )
            std = feats.std(axis=0)
            feats = np.where(std > 0, feats / np.where(std > 0, std, 1.0), 0.0)
            nbits = self.bits_max - self.bits_min + 1
            # equal scores carry no ranking: one cluster, the default bits
            labels, centroids = deterministic_kmeans(feats, nbits if std[1] > 0 else 1)
            k = centroids.shape[0]
            rank = np.empty(k, np.int64)
            rank[np.lexsort((np.arange(k), centroids[:, 1]))] = np.arange(k)
            for j, i in enumerate(valid):
                if k == 1:
                    b = min(max(self.config.bits, self.bits_min), self.bits_max)
                else:
                    b = self.bits_min + round(rank[labels[j]] * (nbits - 1) / (k - 1))
                bits[i] = b
                buckets[i] = self.bucket_for_bits[b]
        return Assignment(tuple(bits), tuple(buckets), step)

    def _extra_state(self) -> dict[str, Any]:
        have = np.array([a is not None for a in self._acc], bool)
        parts = [_to_numpy(a) for a in self._acc if a is not None]
        flat = np.concatenate(parts).astype(np.float32) if parts else np.zeros(0, np.float32)
        return {"acc_present": have, "acc": flat}

    def _load_extra_state(self, state: Mapping[str, Any]) -> None:
        have = np.asarray(state["acc_present"], bool)
        flat = np.asarray(state["acc"], np.float32)
        if have.shape != (self.num_layers,):
            raise ConfigError("accumulator mask does not match the layers")
        need = int(self._sizes[have].sum())
        if flat.shape != (need,):
            raise ConfigError(f"accumulators hold {flat.shape} values, expected {need}")
        pos = 0
        self._acc = [None] * self.num_layers
        for i in np.flatnonzero(have).tolist():
            n = int(self._sizes[i])
            self._acc[i] = flat[pos : pos + n].copy()
            pos += n


def _to_numpy(a: Any) -> np.ndarray:
    return a.get() if hasattr(a, "get") and not isinstance(a, np.ndarray) else np.asarray(a)


# =======================================================================================
# 3. error-budget optimum (L-GreCo-like)


@dataclass(frozen=True)
class BudgetSolution:
    """Result of :func:`solve_budget`: the option per layer, its bytes and true error."""

    choice: np.ndarray
    nbytes: int
    error: float
    feasible: bool


def _default_resolution(num_layers: int) -> int:
    # The rounding of each layer's error up to a budget unit wastes < 1 unit per layer,
    # so 64 units per layer keep the waste under 1/64 (1.6%) of the budget; 16384 caps
    # the DP table (layers x units, int16) at a few MB.
    return int(min(max(1024, 64 * num_layers), 16384))


def solve_budget(
    errors: np.ndarray,
    nbytes: np.ndarray,
    budget: float,
    *,
    resolution: int | None = None,
) -> BudgetSolution:
    """Choose one option per layer minimizing total bytes with summed error <= ``budget``.

    ``errors`` and ``nbytes`` are (layers, options); an infinite error marks an option as
    unavailable. The budget is cut into ``resolution`` units of ``q = budget / resolution``
    and each option costs ``ceil(error / q)`` units; the dynamic program over "units
    used" is exact for these rounded costs. Rounding *up* is conservative: a choice whose
    rounded costs fit in ``resolution`` units has a true error ``<= sum ceil(e/q) * q <=
    budget``, so the constraint is never violated; it may only miss a solution within
    ``layers * q`` of the budget. Ties: fewer bytes, then fewer units, then the lower
    option index. With ``budget == 0`` only error-free options are allowed.
    """
    errors = np.asarray(errors, np.float64)
    nbytes = np.asarray(nbytes, np.float64)
    if errors.ndim != 2 or errors.shape != nbytes.shape:
        raise ConfigError(f"errors {errors.shape} and nbytes {nbytes.shape} must be equal 2-D")
    if np.isnan(errors).any() or (errors < 0).any():
        raise ConfigError("errors must be >= 0 (inf marks an unavailable option)")
    if not np.isfinite(nbytes).all() or (nbytes < 0).any():
        raise ConfigError("nbytes must be finite and >= 0")
    if not (math.isfinite(budget) and budget >= 0):
        raise ConfigError(f"budget must be finite and >= 0, got {budget!r}")
    nlayers, nopts = errors.shape
    if nlayers == 0:
        return BudgetSolution(np.zeros(0, np.int64), 0, 0.0, True)
    if nopts == 0:
        raise ConfigError("every layer needs at least one option")
    units = _default_resolution(nlayers) if resolution is None else resolution
    units = _check_positive_int(units, "resolution")
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        if budget > 0:
            cost = np.ceil(errors / (budget / units))
        else:
            cost = np.where(errors == 0, 0.0, np.inf)
    cost[~(cost <= units)] = np.inf

    dp = np.full(units + 1, np.inf)
    dp[0] = 0.0
    choice = np.full((nlayers, units + 1), -1, np.int16 if nopts < 2**15 else np.int32)
    for layer in range(nlayers):
        new = np.full(units + 1, np.inf)
        arg = choice[layer]
        for opt in _undominated(cost[layer], nbytes[layer]):
            c = int(cost[layer, opt])
            cand = dp[: units + 1 - c] + nbytes[layer, opt]
            seg = new[c:]
            better = cand < seg
            seg[better] = cand[better]
            arg[c:][better] = opt
        dp = new
    j = int(np.argmin(dp))
    if not np.isfinite(dp[j]):
        return BudgetSolution(np.full(nlayers, -1, np.int64), -1, float("inf"), False)
    picked = np.empty(nlayers, np.int64)
    for layer in range(nlayers - 1, -1, -1):
        opt = int(choice[layer, j])
        picked[layer] = opt
        j -= int(cost[layer, opt])
    rows = np.arange(nlayers)
    return BudgetSolution(
        picked,
        int(nbytes[rows, picked].sum()),
        float(errors[rows, picked].sum()),
        True,
    )


def _undominated(cost: np.ndarray, nbytes: np.ndarray) -> list[int]:
    """Options not dominated in (rounded cost, bytes); equal pairs keep the lowest index."""
    keep = []
    avail = [o for o in range(cost.shape[0]) if np.isfinite(cost[o])]
    for o in avail:
        dominated = False
        for p in avail:
            if p == o:
                continue
            le = cost[p] <= cost[o] and nbytes[p] <= nbytes[o]
            strict = cost[p] < cost[o] or nbytes[p] < nbytes[o]
            if le and (strict or p < o):
                dominated = True
                break
        if not dominated:
            keep.append(o)
    return keep


class BudgetPolicy(Policy):
    """Fewest bytes on the wire at no more quantization error than uniform ``config``.

    1. Statistics: per compressible layer, its squared quantization error at every
       (bucket size, bits) candidate, measured (:func:`quantization_errors`) on each of the
       ``window`` steps before a decision and averaged.
    2. Options per layer: every ``bits x bucket_sizes`` pair, plus uncompressed (no error,
       4 bytes a value) when ``allow_uncompressed``; bytes from :func:`wire_nbytes`.
    3. Budget: ``budget_scale`` times the error of uniform ``config`` (4 bits, buckets of
       1024) summed over the compressible layers with finite statistics.
    4. :func:`solve_budget`. If its bytes are not below uniform's (the conservative
       rounding can cost the last units of budget), uniform ``config`` is kept, so with
       ``budget_scale >= 1`` it never sends more than static nor errs more than static.
    Layers without finite statistics (no observation, or an overflowed gradient) keep their
    assignment and spend none of the budget.
    """

    name = "budget"

    def __init__(
        self,
        layers: Sequence[LayerInfo | int],
        config: CompressionConfig | None = None,
        *,
        bits: Sequence[int] = (2, 3, 4, 5, 6, 8),
        bucket_sizes: Sequence[int] = (128, 256, 512, 1024),
        allow_uncompressed: bool = True,
        budget_scale: float = 1.0,
        resolution: int | None = None,
        sample_values: int = DEFAULT_SAMPLE_VALUES,
        schedule: Schedule | None = None,
        **kwargs: Any,
    ) -> None:
        self.option_bits = tuple(sorted({_check_bits(b) for b in bits} - {NO_COMPRESSION_BITS}))
        self.option_buckets = tuple(
            sorted({_check_positive_int(b, "bucket size") for b in bucket_sizes})
        )
        if not self.option_bits or not self.option_buckets:
            raise ConfigError("budget policy needs at least one bit width and bucket size")
        if not (math.isfinite(budget_scale) and budget_scale > 0):
            raise ConfigError(f"budget_scale must be > 0, got {budget_scale!r}")
        self.allow_uncompressed = bool(allow_uncompressed)
        self.budget_scale = float(budget_scale)
        self.resolution = resolution
        self.sample_values = _check_positive_int(sample_values, "sample_values")
        #: the last decision's summed error and its budget (visibility)
        self.last_error = float("nan")
        self.last_budget = float("nan")
        super().__init__(
            layers,
            config,
            schedule=schedule or Schedule(warmup=50, interval=500, window=10),
            **kwargs,
        )
        cfg = self.config
        self._stat_bits = tuple(sorted({*self.option_bits, cfg.bits} - {NO_COMPRESSION_BITS}))
        self._stat_buckets = tuple(sorted({*self.option_buckets, cfg.bucket_size}))
        if math.lcm(*self._stat_buckets) > 1 << 20:
            raise ConfigError(
                f"bucket sizes {self._stat_buckets} have a least common multiple above 2**20: "
                "choose sizes that divide each other (e.g. powers of two)"
            )
        self._errors = _WindowMean(self.num_layers, (len(self._stat_buckets), len(self._stat_bits)))

    def options(self) -> list[tuple[int, int]]:
        """The (bits, bucket size) candidates, uncompressed last."""
        opts = [(b, s) for b in self.option_bits for s in self.option_buckets]
        if self.allow_uncompressed:
            opts.append((NO_COMPRESSION_BITS, self.config.bucket_size))
        return opts

    def _observe_layer(self, step: int, index: int, grad: Any) -> None:
        errs = quantization_errors(
            grad, self._stat_bits, self._stat_buckets, sample_values=self.sample_values
        )
        self._errors.add(index, errs)

    def _statistics(self) -> np.ndarray:
        return self._errors.mean()

    def _statistics_size(self) -> int:
        return self._errors.sum.size

    def _after_decision(self) -> None:
        self._errors.reset()

    def _error_of(self, errors: np.ndarray, bits: int, bucket: int) -> np.ndarray:
        if bits == NO_COMPRESSION_BITS:
            return np.zeros(errors.shape[0])
        return errors[:, self._stat_buckets.index(bucket), self._stat_bits.index(bits)]

    def _decide(self, step: int, statistics: np.ndarray) -> Assignment:
        errors = statistics.reshape(self._errors.sum.shape)
        bits = list(self._current.bits)
        buckets = list(self._current.bucket_sizes)
        layers = [
            i
            for i in range(self.num_layers)
            if self._compressible[i] and np.isfinite(errors[i]).all() and (errors[i] >= 0).all()
        ]
        if not layers:
            return Assignment(tuple(bits), tuple(buckets), step)
        errors = errors[layers]
        cfg = self.config
        ref_err = float(self._error_of(errors, cfg.bits, cfg.bucket_size).sum())
        budget = self.budget_scale * ref_err
        ref_bytes = sum(wire_nbytes(int(self._sizes[i]), cfg.bits, cfg.bucket_size) for i in layers)
        opts = self.options()
        table = np.stack([self._error_of(errors, b, s) for b, s in opts], axis=1)
        nbytes = np.array(
            [[wire_nbytes(int(self._sizes[i]), b, s) for b, s in opts] for i in layers], np.float64
        )
        sol = solve_budget(table, nbytes, budget, resolution=self.resolution)
        if sol.feasible and (sol.nbytes < ref_bytes or self.budget_scale < 1.0):
            for r, i in enumerate(layers):
                bits[i], buckets[i] = opts[int(sol.choice[r])]
            self.last_error = sol.error
        else:
            for i in layers:
                bits[i], buckets[i] = cfg.bits, cfg.bucket_size
            self.last_error = ref_err
        self.last_budget = budget
        return Assignment(tuple(bits), tuple(buckets), step)

    def _extra_state(self) -> dict[str, Any]:
        return {
            **self._errors.state("errors"),
            "last_error": self.last_error,
            "last_budget": self.last_budget,
        }

    def _load_extra_state(self, state: Mapping[str, Any]) -> None:
        errors = _WindowMean(self.num_layers, self._errors.sum.shape[1:])
        errors.load("errors", state)
        self._errors = errors
        self.last_error = float(state["last_error"])
        self.last_budget = float(state["last_budget"])


# =======================================================================================
# 4. automatic: compress only where it saves time


@dataclass(frozen=True)
class CodecCost:
    """Codec speed on this device: bytes of float32 input per second, and a per-call cost.

    ``encode_bps``: :func:`~cgx_ucx.compression.encode`; ``decode_bps``:
    :func:`~cgx_ucx.compression.decode_add`; ``overhead_s``: fixed seconds per call
    (dispatch, kernel launch), measured on a 1-value buffer.
    """

    encode_bps: float
    decode_bps: float
    overhead_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("encode_bps", "decode_bps"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ConfigError(f"{name} must be a positive number, got {v!r}")
        if not (math.isfinite(self.overhead_s) and self.overhead_s >= 0):
            raise ConfigError(f"overhead_s must be >= 0, got {self.overhead_s!r}")


def allreduce_seconds(nbytes: float, world_size: int, bandwidth: float) -> float:
    """Wire time of a scatter-reduce-allgather of ``nbytes`` per rank.

    Each rank sends ``(w-1)/w`` of the buffer in the scatter-reduce and again in the
    allgather: ``2 * (w-1)/w * nbytes / bandwidth`` (bandwidth in bytes/s per peer link).
    """
    if world_size <= 1:
        return 0.0
    return 2.0 * (world_size - 1) / world_size * nbytes / bandwidth


def layer_seconds(
    numel: int,
    bits: int,
    bucket_size: int,
    world_size: int,
    bandwidth: float,
    codec: CodecCost | None,
) -> float:
    """Modeled seconds one rank spends on one layer in a SRA allreduce.

    Uncompressed: wire time of ``4 * numel`` bytes. Compressed: wire time of the encoded
    bytes plus the codec, with no overlap (conservative towards not compressing): per
    rank the scatter-reduce encodes the ``(w-1)/w`` of the layer its peers own and
    decode-adds ``(w-1)/w`` into its own share; the owner then encodes and decodes its
    reduced ``1/w``; the allgather decodes ``(w-1)/w``. In all: one encode of the layer and
    ``(2w-1)/w`` decodes, and about three codec calls.
    """
    if world_size <= 1:
        return 0.0
    if bits == NO_COMPRESSION_BITS:
        return allreduce_seconds(4.0 * numel, world_size, bandwidth)
    if codec is None:
        raise ConfigError("the codec cost is needed to time a compressed layer")
    wire = allreduce_seconds(float(wire_nbytes(numel, bits, bucket_size)), world_size, bandwidth)
    w = world_size
    work = (
        4.0 * numel / codec.encode_bps
        + 4.0 * numel * (2 * w - 1) / w / codec.decode_bps
        + 3.0 * codec.overhead_s
    )
    return wire + work


def probe_codec(
    bits: int = 4,
    bucket_size: int = 1024,
    *,
    numel: int = 1 << 22,
    repeats: int = 3,
    like: Any = None,
) -> CodecCost:
    """Measure the codec kernels on this device: median encode and decode_add passes.

    ``like``: an array whose device/array module to measure on (default: host NumPy).
    Two 16 MiB inputs are used in turn: encoding one 4 MiB buffer again and again ran
    5x faster than a fresh one here (it stayed in the last-level cache), which made
    compression look cheap. The per-call overhead comes from a 1-value buffer. Kernels
    only: :func:`make_link_probe` measures the engine's whole compressed path instead.
    """
    from .codec import decode_add, encode

    numel = _check_positive_int(numel, "numel")
    repeats = _check_positive_int(repeats, "repeats")
    xp = np if like is None else _xp(like)
    rng = np.random.default_rng(0)
    xs = [xp.asarray(rng.standard_normal(numel).astype(np.float32)) for _ in range(2)]
    acc = xp.zeros(numel, np.float32)
    tiny = xp.ones(1, np.float32)
    tiny_acc = xp.zeros(1, np.float32)
    outs = [xp.empty(wire_nbytes(numel, bits, bucket_size), np.uint8) for _ in range(2)]
    tiny_out = xp.empty(wire_nbytes(1, bits, bucket_size), np.uint8)
    sync = _device_sync(xp)

    def median(fn: Callable[[int], Any]) -> float:
        fn(0)  # warm-up: JIT compilation, kernel build
        sync()
        times = []
        for k in range(repeats):
            t0 = time.perf_counter()
            fn(k % 2)
            sync()
            times.append(time.perf_counter() - t0)
        return max(float(np.median(times)), 1e-9)

    t_enc = median(lambda k: encode(xs[k], bits, bucket_size, out=outs[k]))
    bufs = [encode(xs[k], bits, bucket_size, out=outs[k]) for k in range(2)]
    t_dec = median(lambda k: decode_add(bufs[k], acc))
    tiny_buf = encode(tiny, bits, bucket_size, out=tiny_out)
    t_over = min(
        median(lambda k: encode(tiny, bits, bucket_size, out=tiny_out)),
        median(lambda k: decode_add(tiny_buf, tiny_acc)),
    )
    return CodecCost(4.0 * numel / t_enc, 4.0 * numel / t_dec, t_over)


def make_link_probe(
    comm: Any,
    *,
    nbytes: int = DEFAULT_PROBE_BYTES,
    bits: int = 4,
    bucket_size: int = 1024,
    repeats: int = 2,
    world_size: int | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> Callable[[], ProbeValue | Awaitable[ProbeValue]]:
    """A probe for :class:`AutoPolicy` that times the engine itself, on the real link.

    Returns ``[bandwidth, encode_bps, decode_bps, overhead_s]``:

    1. ``bandwidth`` (bytes/s per peer) = ``2 (w-1)/w * nbytes / t_raw``, with ``t_raw``
       the best of ``repeats`` uncompressed allreduces of ``nbytes`` (after a warm-up):
       it includes what the engine spends per byte (summing, framing), as a raw layer does.
    2. The same buffer all-reduced at ``bits`` / ``bucket_size`` takes ``t_q``; what is
       left after its wire time is the engine's whole compressed path (kernels, staging,
       thread hand-offs), expressed as one effective codec rate for both directions:
       ``4n * (1 + (2w-1)/w) / (t_q - wire time)`` (the work :func:`layer_seconds` counts).
       Bare kernel rates (:func:`probe_codec`) were 3-5x optimistic here. Where the engine
       hides the codec behind the wire (a slow link) the rate comes out very large: the
       codec is then free, which is what the decision needs to know.
    3. ``overhead_s`` per codec call: the same (up to) 64 Ki values compressed as 32
       layers instead of one, the extra time divided by 32 layers x 3 calls.

    A collective: every rank must call the probe at the same point (:func:`agree` does).
    For an asyncio communicator (``allreduce`` is a coroutine function) the probe is a
    coroutine function; otherwise it waits on the returned futures.
    """
    nbytes = _check_positive_int(nbytes, "nbytes", 4)
    repeats = _check_positive_int(repeats, "repeats")
    bits = _check_bits(bits)
    if bits == NO_COMPRESSION_BITS:
        raise ConfigError("the link probe compares against a quantized width: bits 1..8")
    w = _world_size(comm, world_size)
    n = nbytes // 4
    pristine = np.random.default_rng(1).standard_normal(n).astype(np.float32)
    buf = pristine.copy()
    layers = 32
    if n < 16 * layers:
        raise ConfigError(f"nbytes must be at least {64 * layers} for the probe")
    small = min(1 << 16, n) // layers * layers
    many = Layout.from_sizes(
        [small // layers] * layers, bits=[bits] * layers, bucket_sizes=[bucket_size] * layers
    )
    one = Layout.from_sizes([small], bits=[bits], bucket_sizes=[bucket_size])
    kinds: list[tuple[dict[str, Any], int]] = [
        ({}, n),
        ({"bits": bits, "bucket_size": bucket_size}, n),
        ({"layout": one}, small),
        ({"layout": many}, small),
    ]

    def result(best: list[float]) -> np.ndarray:
        t_raw, t_q, t_one, t_many = best
        factor = 2.0 * (w - 1) / w if w > 1 else 1.0
        bw = factor * 4.0 * n / t_raw
        wire = allreduce_seconds(float(wire_nbytes(n, bits, bucket_size)), w, bw)
        work = 4.0 * n * (1.0 + (2 * w - 1) / w)
        rate = work / max(t_q - wire, 1e-9)
        over = max(t_many - t_one, 0.0) / (layers * 3)
        return np.array([bw, rate, rate, over])

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
            return result(best)

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
        return result(best)

    return probe


def _device_sync(xp: Any) -> Callable[[], None]:
    if xp is np:
        return lambda: None
    return lambda: xp.cuda.get_current_stream().synchronize()


class AutoPolicy(Policy):
    """Compress a layer only where the modeled allreduce time says it saves time.

    1. Inputs: the link bandwidth per peer (bytes/s) and the codec cost. Either given
       (``link_bandwidth``, ``codec``), or measured: ``link_probe`` is a collective the
       ranks run together at a decision step, returning the bandwidth alone or
       ``[bandwidth, encode_bps, decode_bps, overhead_s]`` (:func:`make_link_probe` times
       the engine's raw and compressed allreduce on the real link); without codec numbers
       from there, :func:`probe_codec` times the kernels on this device. The ranks use the
       mean of their measurements.
    2. Per compressible layer: compress with ``config`` (4 bits, buckets of 1024) iff
       :func:`layer_seconds` compressed ``< (1 - min_gain)`` times uncompressed. Small
       layers stay uncompressed because of the per-call overhead; on a fast link every
       layer does, on a slow one every large layer is compressed.
    3. Drift: the caller reports step times (:meth:`record_step_time`). The baseline is
       the median of the first ``drift_window`` (20) steps after a decision, the current
       level the median of the last 20; every ``check_every`` steps the ranks all-reduce
       a drift flag, and when any rank's level moved by more than ``drift_threshold``
       (30%: well below the 2x a wrong choice costs on a slow link) the link and codec
       are probed again and the assignment recomputed. An EWMA with a 5-step time
       constant was tried first: on this shared 2-core host single steps spike several
       times over when other processes run, and in one training run it raised a false
       alarm on an unchanged link, re-probed (six 2 MiB and six small allreduces) and
       switched the assignment for a whole interval; medians ignore such spikes.
    """

    name = "auto"

    def __init__(
        self,
        layers: Sequence[LayerInfo | int],
        config: CompressionConfig | None = None,
        *,
        world_size: int,
        link_bandwidth: float | None = None,
        link_probe: Callable[[], ProbeValue | Awaitable[ProbeValue]] | None = None,
        codec: CodecCost | None = None,
        codec_probe: Callable[[], CodecCost] | None = None,
        check_every: int = 50,
        drift_window: int = 20,
        drift_threshold: float = 0.3,
        min_gain: float = 0.0,
        **kwargs: Any,
    ) -> None:
        self.world_size = _check_positive_int(world_size, "world_size")
        if link_bandwidth is not None and not (
            math.isfinite(link_bandwidth) and link_bandwidth > 0
        ):
            raise ConfigError(f"link_bandwidth must be > 0 bytes/s, got {link_bandwidth!r}")
        if link_bandwidth is None and link_probe is None and self.world_size > 1:
            raise ConfigError("auto policy needs link_bandwidth or link_probe")
        if not drift_threshold > 0:
            raise ConfigError(f"drift_threshold must be > 0, got {drift_threshold!r}")
        if not 0 <= min_gain < 1:
            raise ConfigError(f"min_gain must be in [0, 1), got {min_gain!r}")
        if codec is not None and not isinstance(codec, CodecCost):
            raise ConfigError(f"codec must be a CodecCost, got {codec!r}")
        self.link_bandwidth = None if link_bandwidth is None else float(link_bandwidth)
        self.link_probe = link_probe
        #: the codec cost in use; given, from the link probe, or from the kernels
        self.codec = codec
        self._codec_given = codec is not None
        self._probe_codec: CodecCost | None = None  # the link probe's (ranks' mean)
        self.codec_probe = codec_probe
        self.check_every = _check_positive_int(check_every, "check_every")
        self.drift_threshold = float(drift_threshold)
        self.drift_window = _check_positive_int(drift_window, "drift_window")
        self.min_gain = float(min_gain)
        self._recent: collections.deque[float] = collections.deque(maxlen=self.drift_window)
        self._baseline = float("nan")
        self._since = 0
        self._probed = False
        # Wall time of the last probe (its collective included): a drift is only worth a
        # re-probe when it could repay it within one check interval (see ``drifted``).
        self._probe_seconds = 0.0
        self._probe_started: float | None = None
        kwargs.setdefault("schedule", Schedule(warmup=0, interval=self.check_every, window=0))
        super().__init__(layers, config, **kwargs)

    # -- step times -----------------------------------------------------------------------
    def record_step_time(self, seconds: float) -> None:
        """One step's wall time (cheap; call every step)."""
        if not (math.isfinite(seconds) and seconds >= 0):
            return
        self._recent.append(float(seconds))
        self._since += 1
        if self._since == self.drift_window:
            self._baseline = float(np.median(self._recent))

    @property
    def drifted(self) -> bool:
        """True when the recent median step time moved more than ``drift_threshold``."""
        b = self._baseline
        if not b > 0 or len(self._recent) < self.drift_window:
            return False
        delta = abs(float(np.median(self._recent)) - b)
        if not delta / b > self.drift_threshold:
            return False
        # A re-probe costs ``_probe_seconds`` of every rank's time; a drift of ``delta``
        # per step cannot repay it within ``check_every`` steps when smaller. Measured
        # here: on loopback with 2.8 ms steps, re-probes fired by 30% noise cost auto
        # 0.15 ms per step (1.065x the policy it picked); with this check 1.008x.
        return delta * self.check_every > self._probe_seconds

    # -- protocol -------------------------------------------------------------------------
    def _statistics(self) -> np.ndarray:
        """``[drift flag, encode_bps, decode_bps, overhead_s]`` of this rank.

        The codec entries are NaN when the link probe measures the codec (or one rank:
        nothing to time); otherwise the given cost, or the kernels measured here.
        """
        nan = float("nan")
        if self.world_size <= 1:
            return np.array([0.0, nan, nan, nan])
        drift = self.drifted
        c: CodecCost | None = None
        if self._codec_given:
            c = self.codec
        elif self.link_probe is None:
            if self.codec_probe is not None and (self.codec is None or drift):
                self.codec = self.codec_probe()
            elif self.codec is None or drift:
                self.codec = probe_codec(self.config.bits, self.config.bucket_size)
            c = self.codec
        flag = 1.0 if drift else 0.0
        if c is None:
            return np.array([flag, nan, nan, nan])
        return np.array([flag, c.encode_bps, c.decode_bps, c.overhead_s])

    def _statistics_size(self) -> int:
        return 4

    def wants_probe(self, step: int, statistics: np.ndarray) -> bool:
        if self.link_probe is None or self.world_size <= 1:
            return False
        wanted = not self._probed or float(np.asarray(statistics)[0]) > 0
        if wanted:
            self._probe_started = time.perf_counter()
        return wanted

    def probe(self) -> ProbeValue | Awaitable[ProbeValue]:
        if self.link_probe is None:
            raise ConfigError("auto policy has no link_probe")
        return self.link_probe()

    def set_probe_result(self, values: np.ndarray) -> None:
        values = np.asarray(values, np.float64).reshape(-1)
        bw = float(values[0])
        if not (math.isfinite(bw) and bw > 0):
            raise CGXError(f"link probe measured {bw!r} bytes/s")
        self.link_bandwidth = bw
        self._probed = True
        if self._probe_started is not None:
            self._probe_seconds = time.perf_counter() - self._probe_started
            self._probe_started = None
        if values.shape[0] >= 4 and np.isfinite(values[1:4]).all() and (values[1:3] > 0).all():
            self._probe_codec = CodecCost(
                float(values[1]), float(values[2]), max(float(values[3]), 0.0)
            )

    def _decide(self, step: int, statistics: np.ndarray) -> Assignment:
        drift = float(statistics[0])
        first = self._decisions == 0
        if not first and not drift > 0:
            return self._current
        codec: CodecCost | None = None
        if self.world_size > 1:
            bw = self.link_bandwidth
            if bw is None:
                raise ConfigError(
                    "auto policy: no link bandwidth (give link_bandwidth or link_probe)"
                )
            enc, dec, over = (float(v) for v in statistics[1:4])
            if self._codec_given:
                codec = self.codec
            elif math.isfinite(enc) and math.isfinite(dec) and enc > 0 and dec > 0:
                codec = CodecCost(enc, dec, max(over, 0.0) if math.isfinite(over) else 0.0)
            else:
                codec = self._probe_codec
            if codec is None:
                raise CGXError("auto policy: the link probe measured no codec cost")
            self.codec = codec
        bits, buckets = [], []
        for i, n in enumerate(self._sizes.tolist()):
            b = NO_COMPRESSION_BITS
            if self._compressible[i] and codec is not None:
                bw = float(self.link_bandwidth)  # type: ignore[arg-type]
                t_raw = layer_seconds(n, NO_COMPRESSION_BITS, 1, self.world_size, bw, None)
                t_q = layer_seconds(
                    n, self.config.bits, self.config.bucket_size, self.world_size, bw, codec
                )
                if t_q < (1.0 - self.min_gain) * t_raw:
                    b = self.config.bits
            bits.append(b)
            buckets.append(self.config.bucket_size)
        # a new regime: measure a new baseline
        self._recent.clear()
        self._baseline = float("nan")
        self._since = 0
        return Assignment(tuple(bits), tuple(buckets), step)

    def _extra_state(self) -> dict[str, Any]:
        def vec(c: CodecCost | None) -> np.ndarray:
            return np.array(
                [np.nan] * 3 if c is None else [c.encode_bps, c.decode_bps, c.overhead_s]
            )

        return {
            "link_bandwidth": float("nan") if self.link_bandwidth is None else self.link_bandwidth,
            "codec": vec(self.codec),
            "probe_codec": vec(self._probe_codec),
            "recent": np.array(self._recent, np.float64),
            "baseline": self._baseline,
            "since": self._since,
            "probed": self._probed,
        }

    def _load_extra_state(self, state: Mapping[str, Any]) -> None:
        def cost(v: Any) -> CodecCost | None:
            c = np.asarray(v, np.float64).reshape(3)
            return None if np.isnan(c).any() else CodecCost(float(c[0]), float(c[1]), float(c[2]))

        bw = float(state["link_bandwidth"])
        codec = cost(state["codec"])
        probe_codec_ = cost(state["probe_codec"])
        recent = np.asarray(state["recent"], np.float64).reshape(-1)[-self.drift_window :]
        baseline = float(state["baseline"])
        since, probed = int(state["since"]), bool(state["probed"])
        self.link_bandwidth = None if math.isnan(bw) else bw
        if not self._codec_given:
            self.codec = codec
        self._probe_codec = probe_codec_
        self._recent = collections.deque(recent.tolist(), maxlen=self.drift_window)
        self._baseline, self._since, self._probed = baseline, since, probed


# =======================================================================================
# agreement across ranks


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
        vec = _probe_vector(value)
        reduced = yield "allreduce", vec
        policy.set_probe_result(np.asarray(reduced, np.float64) / world_size)
    decided = policy.decide(step, mean.astype(np.float32))
    got = yield "broadcast", decided.encode()
    final = Assignment.decode(np.asarray(got), policy.num_layers)
    policy.adopt(final)
    policy.maybe_log(step)
    return final


def _probe_vector(value: Any) -> np.ndarray:
    vec = np.atleast_1d(np.asarray(value, np.float64)).astype(np.float32)
    if vec.ndim != 1 or vec.shape[0] == 0 or vec.shape[0] > 64:
        raise CGXError(f"a probe must return a number or a short vector, got {value!r}")
    return vec


def _world_size(comm: Any, world_size: int | None) -> int:
    if world_size is not None:
        return _check_positive_int(world_size, "world_size")
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


async def agree(
    policy: Policy,
    comm: Any,
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


async def _deadline(aw: Awaitable[Any], timeout: float, what: str) -> Any:
    try:
        return await asyncio.wait_for(aw, timeout)
    except TimeoutError as exc:
        raise CGXTimeoutError(f"policy agreement: {what} took longer than {timeout} s") from exc


def agree_sync(
    policy: Policy,
    comm: Any,
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


def _wait(obj: Any, timeout: float, what: str) -> Any:
    if isinstance(obj, concurrent.futures.Future):
        try:
            return obj.result(timeout)
        except concurrent.futures.TimeoutError as exc:
            raise CGXTimeoutError(f"policy agreement: {what} took longer than {timeout} s") from exc
    if hasattr(obj, "wait") and hasattr(obj, "done") and callable(obj.done):
        # torch.futures.Future (and Work-like objects): no timeout parameter, so poll
        deadline = time.monotonic() + timeout
        delay = 1e-4
        while not obj.done():
            if time.monotonic() > deadline:
                raise CGXTimeoutError(f"policy agreement: {what} took longer than {timeout} s")
            time.sleep(delay)
            delay = min(delay * 2, 0.01)
        return obj.wait()
    if inspect.isawaitable(obj):
        raise ConfigError("this communicator is asynchronous: use `await agree(...)`")
    return obj


# =======================================================================================
# construction by name

POLICIES: dict[str, type[Policy]] = {
    "static": StaticPolicy,
    "kmeans": KMeansPolicy,
    "budget": BudgetPolicy,
    "auto": AutoPolicy,
}


def make_policy(
    name: str,
    layers: Sequence[LayerInfo | int],
    config: CompressionConfig | None = None,
    **kwargs: Any,
) -> Policy:
    """Build a policy by name: ``"static" | "kmeans" | "budget" | "auto"``."""
    cls = POLICIES.get(name)
    if cls is None:
        raise ConfigError(f"unknown compression policy {name!r}; choose one of {sorted(POLICIES)}")
    return cls(layers, config, **kwargs)
