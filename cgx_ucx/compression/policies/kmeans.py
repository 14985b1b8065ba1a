"""CGX's k-means adjuster: cluster layers by (size, score), more bits for higher scores."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ...arrays import check_bits, check_positive_int, to_host, xp_of
from ...config import CompressionConfig
from ...errors import ConfigError
from .assignment import PAPER_CONFIG, Assignment, LayerInfo
from .base import Policy
from .schedule import Schedule

__all__ = ["KMeansPolicy", "deterministic_kmeans"]


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
        self.bits_min = check_bits(bits_min, "bits_min")
        self.bits_max = check_bits(bits_max, "bits_max")
        if not 1 <= self.bits_min <= self.bits_max <= 8:
            raise ConfigError(f"need 1 <= bits_min <= bits_max <= 8, got {bits_min}..{bits_max}")
        if not 0.0 <= decay < 1.0:
            raise ConfigError(f"decay must be in [0, 1), got {decay!r}")
        self.decay = float(decay)
        self.top_k = check_positive_int(top_k, "top_k")
        self.reset_every = check_positive_int(reset_every, "reset_every")
        cfg = PAPER_CONFIG if config is None else config
        default_bucket = cfg.bucket_size
        mapping = {1: 32, 2: 128, 3: min(256, default_bucket)}
        if bucket_for_bits is not None:
            mapping = {int(b): int(s) for b, s in bucket_for_bits.items()}
        self.bucket_for_bits = {
            b: check_positive_int(mapping.get(b, default_bucket), f"bucket for {b} bits")
            for b in range(self.bits_min, self.bits_max + 1)
        }
        super().__init__(
            layers, cfg, schedule=schedule or Schedule(warmup=50, interval=500, window=20), **kwargs
        )
        self._acc: list[Any] = [None] * self.num_layers

    def _observe_layer(self, step: int, index: int, grad: Any) -> None:
        acc = self._acc[index]
        if acc is not None and xp_of(acc) is not xp_of(grad):
            acc = self._acc[index] = xp_of(grad).asarray(acc)  # loaded on the host
        if acc is None:
            self._acc[index] = grad.astype(np.float32, copy=True)
        else:
            acc *= self.decay
            acc += grad

    def _score(self, index: int) -> float:
        acc = self._acc[index]
        if acc is None or acc.shape[0] == 0:
            return float("nan")
        xp = xp_of(acc)
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
        parts = [to_host(a) for a in self._acc if a is not None]
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
