"""Host backend. Interim: delegates to the NumPy reference until the Numba kernels land."""

from .reference import (  # noqa: F401
    decode_add_into,
    decode_into,
    empty_bytes,
    empty_values,
    encode_into,
)
