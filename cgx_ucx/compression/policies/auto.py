"""Compress a layer only where the cost model says it saves time; re-probe on drift."""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ...arrays import check_positive_int
from ...config import NO_COMPRESSION_BITS, CompressionConfig
from ...errors import CGXError, ConfigError
from .assignment import Assignment, LayerInfo
from .base import Policy, ProbeValue
from .cost import CodecCost, layer_seconds, probe_codec
from .schedule import Schedule

__all__ = ["AutoPolicy", "compress_pays", "probed_codec"]


def _cost_vector(c: CodecCost | None) -> np.ndarray:
    return np.array([np.nan] * 3 if c is None else [c.encode_bps, c.decode_bps, c.overhead_s])


def _cost_of(v: Any) -> CodecCost | None:
    c = np.asarray(v, np.float64).reshape(3)
    return None if np.isnan(c).any() else CodecCost(float(c[0]), float(c[1]), float(c[2]))


def compress_pays(
    numel: int,
    bits: int,
    bucket_size: int,
    world_size: int,
    bandwidth: float,
    codec: CodecCost,
    min_gain: float = 0.0,
) -> bool:
    """The ``auto`` policy's rule for one layer of ``numel`` values: compress at ``bits``
    iff :func:`~.cost.layer_seconds` models it at least ``min_gain`` faster than sending
    it uncompressed over links of ``bandwidth`` bytes/s (benchmarks use it to say which
    width ``auto`` would pick where they measured both)."""
    t_raw = layer_seconds(numel, NO_COMPRESSION_BITS, 1, world_size, bandwidth, None)
    t_q = layer_seconds(numel, bits, bucket_size, world_size, bandwidth, codec)
    return t_q < (1.0 - min_gain) * t_raw


def probed_codec(encode_bps: float, decode_bps: float, overhead_s: float) -> CodecCost | None:
    """The codec cost a link probe measured (the ranks' mean), None where it measured none
    (non-finite or non-positive rates); a non-finite or negative overhead counts as 0."""
    if not (math.isfinite(encode_bps) and math.isfinite(decode_bps)):
        return None
    if encode_bps <= 0 or decode_bps <= 0:
        return None
    over = max(overhead_s, 0.0) if math.isfinite(overhead_s) else 0.0
    return CodecCost(encode_bps, decode_bps, over)


class AutoPolicy(Policy):
    """Compress a layer only where the modeled allreduce time says it saves time.

    1. Inputs: the link bandwidth per peer (bytes/s) and the codec cost. Either given
       (``link_bandwidth``, ``codec``), or measured: ``link_probe`` is a collective the
       ranks run together at a decision step, returning the bandwidth alone or
       ``[bandwidth, encode_bps, decode_bps, overhead_s]``
       (:func:`cgx_ucx.agreement.make_link_probe` times the engine's raw and compressed
       allreduce on the real link); without codec numbers from there, :func:`probe_codec`
       times the kernels on this device. The ranks use the mean of their measurements.
    2. Per compressible layer: compress with ``config`` (4 bits, buckets of 1024) iff
       :func:`layer_seconds` compressed ``< (1 - min_gain)`` times uncompressed. Small
       layers stay uncompressed because of the per-call overhead; on a fast link every
       layer does, on a slow one every large layer is compressed.
    3. Drift: the caller reports step times (:meth:`record_step_time`). The baseline is
       the median of the first ``drift_window`` (20) steps after a decision, the current
       level the median of the last 20; every ``check_every`` steps the ranks all-reduce
       a drift flag, and when any rank's level moved by more than ``drift_threshold``
       (30%: well below the 2x a wrong choice costs on a slow link) the link and codec
       are probed again and the assignment recomputed. Medians, not an EWMA: on a shared
       host single steps spike several times over when other processes run, and an EWMA
       turns such spikes into false alarms on an unchanged link (a re-probe, and a
       switched assignment for a whole interval); medians ignore them.
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
        self.world_size = check_positive_int(world_size, "world_size")
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
        self.check_every = check_positive_int(check_every, "check_every")
        self.drift_threshold = float(drift_threshold)
        self.drift_window = check_positive_int(drift_window, "drift_window")
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
        # per step cannot repay it within ``check_every`` steps when smaller. Without this
        # check, noise on short steps fires re-probes whose cost makes auto slower than the
        # policy it picks.
        return delta * self.check_every > self._probe_seconds

    # -- protocol -------------------------------------------------------------------------
    def _local_codec(self, drift: bool) -> CodecCost | None:
        """The codec cost this rank reports: given, or measured here when the link probe
        does not measure it (``None`` when the link probe does)."""
        if self._codec_given:
            return self.codec
        if self.link_probe is not None:
            return None
        if self.codec is None or drift:
            if self.codec_probe is not None:
                self.codec = self.codec_probe()
            else:
                self.codec = probe_codec(self.config.bits, self.config.bucket_size)
        return self.codec

    def _statistics(self) -> np.ndarray:
        """``[drift flag, encode_bps, decode_bps, overhead_s]`` of this rank.

        The codec entries are NaN when the link probe measures the codec (or one rank:
        nothing to time); otherwise the given cost, or the kernels measured here.
        """
        if self.world_size <= 1:
            return np.array([0.0, np.nan, np.nan, np.nan])
        drift = self.drifted
        flag = 1.0 if drift else 0.0
        return np.array([flag, *_cost_vector(self._local_codec(drift))])

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

    def _agreed_codec(self, statistics: np.ndarray) -> CodecCost:
        """The codec cost to decide with: given, the ranks' mean, or the link probe's."""
        codec: CodecCost | None
        if self._codec_given:
            codec = self.codec
        else:
            codec = probed_codec(*(float(v) for v in statistics[1:4])) or self._probe_codec
        if codec is None:
            raise CGXError("auto policy: the link probe measured no codec cost")
        return codec

    def _compress(self, numel: int, bandwidth: float, codec: CodecCost) -> bool:
        """True when a layer of ``numel`` values is modeled faster compressed."""
        cfg = self.config
        return compress_pays(
            numel, cfg.bits, cfg.bucket_size, self.world_size, bandwidth, codec, self.min_gain
        )

    def _decide(self, step: int, statistics: np.ndarray) -> Assignment:
        drift = float(statistics[0])
        first = self._decisions == 0
        if not first and not drift > 0:
            return self._current
        bits = [NO_COMPRESSION_BITS] * self.num_layers
        if self.world_size > 1:
            bw = self.link_bandwidth
            if bw is None:
                raise ConfigError(
                    "auto policy: no link bandwidth (give link_bandwidth or link_probe)"
                )
            codec = self.codec = self._agreed_codec(statistics)
            for i, n in enumerate(self._sizes.tolist()):
                if self._compressible[i] and self._compress(n, bw, codec):
                    bits[i] = self.config.bits
        # a new regime: measure a new baseline
        self._recent.clear()
        self._baseline = float("nan")
        self._since = 0
        return Assignment(tuple(bits), (self.config.bucket_size,) * self.num_layers, step)

    def _extra_state(self) -> dict[str, Any]:
        return {
            "link_bandwidth": float("nan") if self.link_bandwidth is None else self.link_bandwidth,
            "codec": _cost_vector(self.codec),
            "probe_codec": _cost_vector(self._probe_codec),
            "recent": np.array(self._recent, np.float64),
            "baseline": self._baseline,
            "since": self._since,
            "probed": self._probed,
        }

    def _load_extra_state(self, state: Mapping[str, Any]) -> None:
        bw = float(state["link_bandwidth"])
        codec = _cost_of(state["codec"])
        probe_codec_ = _cost_of(state["probe_codec"])
        recent = np.asarray(state["recent"], np.float64).reshape(-1)[-self.drift_window :]
        baseline = float(state["baseline"])
        since, probed = int(state["since"]), bool(state["probed"])
        self.link_bandwidth = None if math.isnan(bw) else bw
        if not self._codec_given:
            self.codec = codec
        self._probe_codec = probe_codec_
        self._recent = collections.deque(recent.tolist(), maxlen=self.drift_window)
        self._baseline, self._since, self._probed = baseline, since, probed
