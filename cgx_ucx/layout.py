"""Layer layout of a flat buffer: which values form which layer, and how each is sent.

A layout travels with every allreduce call (DESIGN.md, data path step 2): nothing is
inferred from call order, so an unrelated all_reduce in between cannot corrupt the
bookkeeping (IST-DASLab/torch_cgx#5). Ranks compare a 64-bit digest of the layout in
every message header; different layouts on different ranks are a
:class:`~cgx_ucx.errors.CollectiveMismatchError`, never silently wrong numbers.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from .arrays import MAX_BUCKET_SIZE, check_bits, check_positive_int
from .config import NO_COMPRESSION_BITS, CompressionConfig
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
        # integers only: the digest packs them as u64/u32 (a float would fail there, late)
        check_positive_int(self.offset, "layer offset", 0)
        check_positive_int(self.numel, "layer numel", 0)
        check_bits(self.bits, "layer bits")
        check_positive_int(self.bucket_size, "layer bucket_size", limit=MAX_BUCKET_SIZE + 1)

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
