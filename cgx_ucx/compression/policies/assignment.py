"""What a policy assigns: per-layer bits and bucket sizes, and the layers it covers."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...arrays import check_bits, check_positive_int
from ...config import NO_COMPRESSION_BITS, CompressionConfig
from ...errors import ConfigError
from ...layout import Layout
from ..codec import encoded_nbytes

__all__ = [
    "PAPER_CONFIG",
    "PAPER_LAYER_MIN_SIZE",
    "Assignment",
    "LayerInfo",
    "as_layers",
    "layers_from_parameters",
    "wire_nbytes",
]

#: The CGX paper's setting (Markov et al. 2022, section 5): 4 bits, buckets of 1024.
PAPER_CONFIG = CompressionConfig(bits=4, bucket_size=1024)
#: torch_cgx's CGXState default: layers with fewer values go uncompressed.
PAPER_LAYER_MIN_SIZE = 1024

#: Bytes of one encoded copy of a layer of float32 values: an alias of the codec's
#: :func:`~cgx_ucx.compression.codec.encoded_nbytes`, the one function that computes the
#: wire size (24 header bytes + 8 meta bytes per bucket + ``ceil(numel * bits / 8)`` code
#: bytes; header + ``4 * numel`` uncompressed). Kept for the names of the old
#: ``compression.adaptive`` module; new code calls ``encoded_nbytes``.
wire_nbytes = encoded_nbytes


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


def as_layers(layers: Sequence[LayerInfo | int]) -> tuple[LayerInfo, ...]:
    """``layers`` as LayerInfos; a bare size ``n`` at index ``i`` is a 2-D ``layer{i}``."""
    out = []
    for i, layer in enumerate(layers):
        if isinstance(layer, LayerInfo):
            out.append(layer)
        elif isinstance(layer, int | np.integer) and not isinstance(layer, bool):
            out.append(LayerInfo(int(layer), 2, f"layer{i}"))
        else:
            raise ConfigError(f"layer {i} must be a LayerInfo or a size, got {layer!r}")
    return tuple(out)


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
            check_bits(b, "assigned bits")
        for bs in self.bucket_sizes:
            check_positive_int(bs, "assigned bucket size")

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
        """``[n, step, bits..., bucket_sizes...]`` as int64: what the agreement broadcasts."""
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
