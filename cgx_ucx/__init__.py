"""cgx_ucx: compressed (about 4-bit) gradient all-reduce for data-parallel training on UCX.

The public face only: re-exports. See README.md for the API.
"""

from .config import CommConfig, CompressionConfig, resolve_comm, resolve_compression
from .errors import (
    CGXError,
    CGXTimeoutError,
    CodecError,
    CollectiveMismatchError,
    ConfigError,
    PeerLostError,
    ProtocolError,
    RendezvousError,
    TransportError,
)
from .layout import LayerSpec, Layout

__version__ = "0.1.0"

__all__ = [
    "CGXError",
    "CGXTimeoutError",
    "CodecError",
    "CollectiveMismatchError",
    "CommConfig",
    "CompressionConfig",
    "ConfigError",
    "LayerSpec",
    "Layout",
    "PeerLostError",
    "ProtocolError",
    "RendezvousError",
    "TransportError",
    "resolve_comm",
    "resolve_compression",
]
