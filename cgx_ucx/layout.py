"""Layer layout of a flat buffer: which values form which layer, and how each is sent.

A layout travels with every allreduce call (DESIGN.md, data path step 2): nothing is
inferred from call order, so an unrelated all_reduce in between cannot corrupt the
bookkeeping (torch_cgx issue #5). Ranks compare a 64-bit digest of the layout in
every message header; different layouts on different ranks are a
:class:`~cgx_ucx.errors.CollectiveMismatchError`, never silently wrong numbers.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from .config import NO_COMPRESSION_BITS, VALID_BITS, CompressionConfig
from .errors import ConfigError

__all__ = ["LayerSpec", "Layout"]

_SPEC = struct.Struct("<QQII")


@dataclass(frozen=True)
class LayerSpec:
    """One layer: values ``[offset, offset + numel)`` of the flat buffer.

    ``bits`` 1..8 quantize the layer in buckets of ``bucket_size`` values; 32 sends
    it uncompressed.
    """

    offset: int
    numel: int
    bits: int = NO_COMPRESSION_BITS
    bucket_size: int = 1024

    def __post_init__(self) -> None:
        if self.offset < 0 or self.numel < 0:
            raise ConfigError(f"layer offset/numel must be >= 0, got {self.offset}/{self.numel}")
        if self.bits not in VALID_BITS:
            raise ConfigError(f"layer bits must be 1..8 or 32, got {self.bits!r}")
        if self.bucket_size < 1:
            raise ConfigError(f"layer bucket_size must be >= 1, got {self.bucket_size!r}")

    @property
    def end(self) -> int:
        return self.offset + self.numel

    @property
    def compressed(self) -> bool:
        return self.bits != NO_COMPRESSION_BITS


@dataclass(frozen=True)
class Layout:
    """An ordered, gap-free cover of ``[0, numel)`` by layers."""

    layers: tuple[LayerSpec, ...]

    def __post_init__(self) -> None:
        pos = 0
        for spec in self.layers:
            if spec.offset != pos:
                raise ConfigError(
                    f"layers must be contiguous and ordered: expected offset {pos}, "
                    f"got {spec.offset}"
                )
            pos = spec.end

    # -- construction -----------------------------------------------------------------
    @classmethod
    def uniform(
        cls, numel: int, bits: int = NO_COMPRESSION_BITS, bucket_size: int = 1024
    ) -> Layout:
        """A single layer covering the whole buffer."""
        return cls((LayerSpec(0, numel, bits, bucket_size),))

    @classmethod
    def from_sizes(
        cls,
        sizes: Iterable[int],
        config: CompressionConfig | None = None,
        *,
        bits: Sequence[int] | None = None,
        bucket_sizes: Sequence[int] | None = None,
        compressible: Sequence[bool] | None = None,
    ) -> Layout:
        """Build a layout from per-layer sizes.

        Without ``bits``, each layer gets ``config.bits_for(size)`` (small layers go
        uncompressed). ``compressible[i] = False`` forces layer ``i`` uncompressed
        (DDP hooks use it for 1-D tensors such as biases and norms).
        """
        sizes = [int(s) for s in sizes]
        config = config or CompressionConfig()
        specs = []
        offset = 0
        for i, size in enumerate(sizes):
            b = bits[i] if bits is not None else config.bits_for(size)
            if compressible is not None and not compressible[i]:
                b = NO_COMPRESSION_BITS
            bs = bucket_sizes[i] if bucket_sizes is not None else config.bucket_size
            specs.append(LayerSpec(offset, size, b, bs))
            offset += size
        return cls(tuple(specs))

    # -- properties -------------------------------------------------------------------
    @property
    def numel(self) -> int:
        return self.layers[-1].end if self.layers else 0

    @property
    def compressed(self) -> bool:
        """True when any layer is quantized."""
        return any(spec.compressed and spec.numel for spec in self.layers)

    @property
    def digest(self) -> int:
        """64-bit digest identifying this layout; equal layouts give equal digests."""
        h = hashlib.blake2b(digest_size=8)
        for s in self.layers:
            h.update(_SPEC.pack(s.offset, s.numel, s.bits, s.bucket_size))
        return int.from_bytes(h.digest(), "little")

    def __iter__(self) -> Iterator[LayerSpec]:
        return iter(self.layers)

    def __len__(self) -> int:
        return len(self.layers)

    def check(self, numel: int) -> None:
        """Raise ConfigError unless this layout covers exactly ``numel`` values."""
        if self.numel != numel:
            raise ConfigError(f"layout covers {self.numel} values but the buffer has {numel}")
