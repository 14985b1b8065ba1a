"""The policy base: per-layer statistics in, a per-layer :class:`Assignment` out.

The protocol of one step (every method is cheap unless the step is a decision step)::

    a = policy.assignment(step)          # single process; with ranks: cgx_ucx.agreement
    layout = policy.layout(indices)      # the layers of one DDP bucket, in bucket order
    ... allreduce(buffer, layout) ...
    policy.observe(step, grads, indices) # local gradients, before (or after) the allreduce

**Agreement across ranks.** Decisions happen only at steps fixed by a schedule that is a
pure function of the step number (:meth:`Policy.due`), so every rank knows, without
talking, when to decide. At such a step :func:`cgx_ucx.agreement.agree` (asyncio) or
:func:`cgx_ucx.agreement.agree_sync` (futures) all-reduces the small per-layer statistics
vector (:meth:`Policy.local_statistics`, float32, a few values per layer), every rank
decides deterministically from the mean, and rank ``root``'s encoded assignment is then
broadcast and adopted everywhere, so the ranks agree bit for bit even if two machines'
floating point differed in the last place. All other steps cost no communication. This
package only computes; whatever runs a collective lives in :mod:`cgx_ucx.agreement`.
"""

from __future__ import annotations

import inspect
import logging
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from ...arrays import check_positive_int
from ...config import NO_COMPRESSION_BITS, CompressionConfig
from ...errors import CGXError, ConfigError
from ...layout import Layout
from ..codec import encoded_nbytes
from .assignment import PAPER_CONFIG, PAPER_LAYER_MIN_SIZE, Assignment, LayerInfo, as_layers
from .error_model import as_flat_float, numel_of, relative_error
from .schedule import Schedule

__all__ = ["LayerStats", "Policy", "ProbeValue", "probe_vector"]

log = logging.getLogger("cgx_ucx.adaptive")

#: What a probe returns: a number or a short vector of numbers.
ProbeValue = float | Sequence[float] | np.ndarray


def probe_vector(value: Any) -> np.ndarray:
    """A probe's result as a float32 vector of 1..64 values; anything else is a CGXError."""
    vec = np.atleast_1d(np.asarray(value, np.float64)).astype(np.float32)
    if vec.ndim != 1 or vec.shape[0] == 0 or vec.shape[0] > 64:
        raise CGXError(f"a probe must return a number or a short vector, got {value!r}")
    return vec


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
    vector that the agreement averages over the ranks) and decide from that vector alone
    in :meth:`_decide`, so that equal statistics give equal assignments on every rank.
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
        self._layers = as_layers(layers)
        self.config = PAPER_CONFIG if config is None else config
        if not isinstance(self.config, CompressionConfig):
            raise ConfigError(f"config must be a CompressionConfig, got {self.config!r}")
        self.layer_min_size = check_positive_int(layer_min_size, "layer_min_size", 0)
        self.schedule = schedule or Schedule()
        if not isinstance(self.schedule, Schedule):
            raise ConfigError(f"schedule must be a Schedule, got {self.schedule!r}")
        self.log_every = check_positive_int(log_every, "log_every", 0)
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
            n = numel_of(g)
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
            x = as_flat_float(g)
            if log_step:
                a = self._current
                self._rel_error[i] = relative_error(x, a.bits[i], a.bucket_sizes[i])
            if window:
                self._observe_layer(step, i, x)

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
        """True when the agreement must run :meth:`probe` on every rank before deciding."""
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
        """Install an assignment decided elsewhere (the root rank's, after the agreement)."""
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

        With several ranks use :func:`cgx_ucx.agreement.agree` / ``agree_sync`` instead,
        so that every rank decides from the same statistics.
        """
        if self.due(step):
            stats = self.local_statistics(step)
            if self.wants_probe(step, stats):
                value = self.probe()
                if inspect.isawaitable(value):
                    raise ConfigError("an asynchronous probe needs `await agree(...)`")
                self.set_probe_result(probe_vector(value).astype(np.float64))
            self.decide(step, stats)
        self.maybe_log(step)
        return self._current

    def layout(self, indices: Sequence[int] | None = None) -> Layout:
        """Layout of layers ``indices`` (default all) in that order, from the current assignment."""
        return self._current.layout(self._sizes, indices)

    # -- visibility -----------------------------------------------------------------------
    def wire_bytes(self, indices: Sequence[int] | None = None) -> int:
        """Bytes of one encoded copy of layers ``indices`` (default all), as assigned now:
        the sum of :func:`~cgx_ucx.compression.codec.encoded_nbytes` over the layers."""
        a = self._current
        idx = range(self.num_layers) if indices is None else indices
        return sum(encoded_nbytes(int(self._sizes[i]), a.bits[i], a.bucket_sizes[i]) for i in idx)

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
                encoded_nbytes(layer.numel, a.bits[i], a.bucket_sizes[i]),
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
                sum(encoded_nbytes(n, NO_COMPRESSION_BITS, 1) for n in self._sizes.tolist()),
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
