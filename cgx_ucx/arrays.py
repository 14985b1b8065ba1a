"""Array kinds and the validators every layer shares (the bottom of the package).

Buffers are NumPy arrays (host) or CuPy arrays (GPU); bfloat16 is ``ml_dtypes.bfloat16``
on the host, since NumPy has none. Torch tensors are recognized by duck typing and turned
into NumPy/CuPy arrays over the same memory (DLPack for CUDA), so nothing here imports
torch. CuPy is looked up only when a CuPy array (or a CUDA tensor) is given: importing
cgx_ucx never needs CUDA.

The validators raise :class:`~cgx_ucx.errors.ConfigError` for bad arguments (a caller's
mistake) unless told otherwise, and return the value as a plain ``int``.
"""

from __future__ import annotations

import sys
from typing import Any

import ml_dtypes
import numpy as np

from .errors import CGXError, CodecError, ConfigError

__all__ = [
    "BFLOAT16",
    "CODEC_DTYPES",
    "MAX_BUCKET_SIZE",
    "MAX_SECONDS",
    "NO_COMPRESSION_BITS",
    "SEED_LIMIT",
    "VALID_BITS",
    "as_uint8_buffer",
    "check_bits",
    "check_positive_int",
    "check_root",
    "check_seconds",
    "check_seed",
    "is_array",
    "is_bfloat16",
    "is_cupy",
    "is_float_dtype",
    "is_torch",
    "to_host",
    "torch_as_array",
    "xp_of",
]

#: The host bfloat16 dtype (``ml_dtypes.bfloat16``).
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
#: Dtypes the codec quantizes; everything else goes uncompressed only.
CODEC_DTYPES = frozenset({np.dtype(np.float32), np.dtype(np.float16), BFLOAT16})
#: torch_cgx's bits value for "do not quantize" (the codec's RAW segments).
NO_COMPRESSION_BITS = 32
#: Widths the codec supports: 1..8 bits per value (CGX paper), or 32 uncompressed.
VALID_BITS = frozenset(range(1, 9)) | {NO_COMPRESSION_BITS}
#: Largest bucket (values per scale pair) the codec header's u32 field holds.
MAX_BUCKET_SIZE = 2**32 - 1
#: Seeds are 64-bit counters of the stochastic-rounding hash (splitmix64).
SEED_LIMIT = 2**64

# A tuple, not ``int | np.integer``: the union would be built again on every call.
_INTEGER = (int, np.integer)


# ---------------------------------------------------------------------------------------
# kinds


def is_cupy(x: Any) -> bool:
    """True when ``x`` is a CuPy object (array), judged by its type's top-level module."""
    t = type(x)
    if t is np.ndarray:  # the host path asks dozens of times per collective
        return False
    return t.__module__.split(".", 1)[0] == "cupy"


def is_array(x: Any) -> bool:
    """True for a NumPy or a CuPy array."""
    return isinstance(x, np.ndarray) or is_cupy(x)


def is_torch(x: Any) -> bool:
    """True when ``x`` is a torch object (tensor), without importing torch."""
    return type(x).__module__.split(".", 1)[0] == "torch"


def xp_of(x: Any) -> Any:
    """The array module holding ``x``: ``cupy`` for CuPy arrays, else ``numpy``.

    A CuPy array can exist only once CuPy is imported, so this never imports it.
    """
    if is_cupy(x):
        return sys.modules["cupy"]
    return np


def is_bfloat16(dtype: Any) -> bool:
    """True for bfloat16: ``ml_dtypes.bfloat16`` (or its name) or ``torch.bfloat16``."""
    if isinstance(dtype, np.dtype):
        return dtype == BFLOAT16
    if str(dtype) == "torch.bfloat16":
        return True
    try:
        return np.dtype(dtype) == BFLOAT16
    except TypeError:
        return False


def is_float_dtype(dtype: np.dtype) -> bool:
    """True for a NumPy floating dtype, bfloat16 included (its kind is not ``"f"``)."""
    return dtype == BFLOAT16 or dtype.kind == "f"


def torch_as_array(t: Any) -> Any:
    """A torch tensor as an array over the same memory (no copy).

    CUDA tensors become CuPy arrays through DLPack (CuPy is imported here, only then);
    CPU tensors become NumPy arrays, bfloat16 as an int16 view re-typed to
    :data:`BFLOAT16` (same bytes). The tensor is detached first, so tensors that
    require grad are accepted; the array aliases its storage.
    """
    t = t.detach()
    if t.is_cuda:
        import cupy

        return cupy.from_dlpack(t)
    if str(t.dtype) == "torch.bfloat16":
        return t.view(sys.modules["torch"].int16).numpy().view(BFLOAT16)
    return t.numpy()


def to_host(x: Any, copy: bool = False) -> np.ndarray:
    """``x`` as a NumPy array: CuPy arrays are copied to the host, NumPy arrays returned
    as they are (a copy when ``copy``), anything else through ``np.asarray``."""
    if is_cupy(x):
        return x.get()
    if copy:
        return np.array(x)
    return np.asarray(x)


def as_uint8_buffer(buf: Any, what: str = "an encoded buffer") -> Any:
    """A 1-D contiguous ``uint8`` view of ``buf`` (NumPy/CuPy array or bytes-like).

    Arrays must already be 1-D contiguous uint8 (returned as they are, on their device);
    bytes-like objects are viewed without a copy. Anything else is a
    :class:`~cgx_ucx.errors.CodecError`.
    """
    if is_cupy(buf) or isinstance(buf, np.ndarray):
        if buf.dtype != np.uint8 or buf.ndim != 1:
            raise CodecError(f"{what} is a 1-D uint8 array, got {buf.dtype} with shape {buf.shape}")
        if not buf.flags.c_contiguous:
            raise CodecError(f"{what} must be contiguous")
        return buf
    try:
        return np.frombuffer(memoryview(buf).cast("B"), dtype=np.uint8)
    except (TypeError, ValueError) as exc:
        raise CodecError(f"not a buffer: {type(buf).__name__}") from exc


# ---------------------------------------------------------------------------------------
# validators


def check_bits(bits: Any, what: str = "bits") -> int:
    """``bits`` as an int in 1..8 or 32 (no compression); ConfigError otherwise.

    Booleans and floats are refused even where they compare equal to a valid width.
    """
    if isinstance(bits, bool) or not isinstance(bits, _INTEGER):
        raise ConfigError(f"{what} must be an integer 1..8 or 32, got {bits!r}")
    bits = int(bits)
    if not (1 <= bits <= 8 or bits == NO_COMPRESSION_BITS):
        raise ConfigError(f"{what} must be 1..8 or 32 (no compression), got {bits}")
    return bits


def check_seed(seed: Any, what: str = "seed") -> int:
    """``seed`` as an int in [0, 2**64) (the stochastic-rounding counter); ConfigError
    otherwise."""
    if isinstance(seed, bool) or not isinstance(seed, _INTEGER):
        raise ConfigError(f"{what} must be an integer in [0, 2**64), got {seed!r}")
    seed = int(seed)
    if not 0 <= seed < SEED_LIMIT:
        raise ConfigError(f"{what} must be an integer in [0, 2**64), got {seed}")
    return seed


def check_root(root: Any, world_size: int, what: str = "root") -> int:
    """``root`` as a rank of a group of ``world_size`` (an int, not a bool); ConfigError
    otherwise."""
    if (
        isinstance(root, bool)
        or not isinstance(root, (int, np.integer))
        or not 0 <= int(root) < world_size
    ):
        raise ConfigError(f"{what} must be a rank in 0..{world_size - 1}, got {root!r}")
    return int(root)


#: The longest timeout: every wait has a finite deadline, and the platform's timed waits
#: overflow near 2**63 ns (an infinite timeout crashed close() with an OverflowError).
MAX_SECONDS = 1e9


def check_seconds(value: Any, what: str = "timeout") -> float:
    """``value`` as a number of seconds > 0 and at most MAX_SECONDS (int or float, not
    bool); ConfigError otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{what} must be a number of seconds > 0, got {value!r}")
    if not value > 0:
        raise ConfigError(f"{what} must be > 0 seconds, got {value!r}")
    if not value <= MAX_SECONDS:
        raise ConfigError(
            f"{what} must be finite, at most {MAX_SECONDS:g} seconds (31 years), got {value!r}"
        )
    return float(value)


def check_positive_int(
    value: Any,
    what: str,
    minimum: int = 1,
    *,
    limit: int | None = None,
    error: type[CGXError] = ConfigError,
) -> int:
    """``value`` as an int ``>= minimum`` (and ``< limit`` when given).

    Raises ``error`` (ConfigError unless told, e.g. CodecError for sizes read from a
    buffer); booleans are refused.
    """
    if isinstance(value, bool) or not isinstance(value, _INTEGER) or value < minimum:
        raise error(f"{what} must be an integer >= {minimum}, got {value!r}")
    value = int(value)
    if limit is not None and value >= limit:
        raise error(f"{what} must be an integer in [{minimum}, {limit}), got {value}")
    return value
