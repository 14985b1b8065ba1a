"""The quantization codec: CGX max-min bucketed quantization and its wire format.

Re-exports only. Host (NumPy) arrays run fused Numba kernels (:mod:`.cpu`), CuPy arrays
run CUDA kernels (:mod:`.gpu`); :mod:`.reference` is the plain NumPy definition both are
tested against. Neither Numba nor CuPy is imported until an array needs it.
"""

from .codec import (
    HEADER_NBYTES,
    RAW_BITS,
    CodecHeader,
    backend_name,
    decode,
    decode_add,
    encode,
    encode_decode,
    encode_sum,
    encoded_nbytes,
    read_header,
    reduce_encode,
)
from .feedback import ErrorFeedback

__all__ = [
    "HEADER_NBYTES",
    "RAW_BITS",
    "CodecHeader",
    "ErrorFeedback",
    "backend_name",
    "decode",
    "decode_add",
    "encode",
    "encode_decode",
    "encode_sum",
    "encoded_nbytes",
    "read_header",
    "reduce_encode",
]
