"""The typed errors of cgx_ucx.

Every failure the library detects is raised as a subclass of :class:`CGXError`;
errors of the libraries underneath (UCXX, NumPy, CuPy) are wrapped with
``raise ... from`` so the cause stays visible.
"""

from __future__ import annotations

__all__ = [
    "CGXError",
    "CGXTimeoutError",
    "CodecError",
    "CollectiveMismatchError",
    "ConfigError",
    "PeerFailedError",
    "PeerLostError",
    "ProtocolError",
    "RendezvousError",
    "TransportError",
]


class CGXError(RuntimeError):
    """Base class of every error raised by cgx_ucx."""


class ConfigError(CGXError, ValueError):
    """An invalid configuration value (argument or environment variable)."""


class CodecError(CGXError, ValueError):
    """A compressed buffer that cannot be decoded: truncated, oversized or garbage."""


class TransportError(CGXError):
    """A failure of the UCX transport that is not attributable to one peer."""


class RendezvousError(TransportError):
    """Ranks could not find each other or prove membership through the store."""


class PeerFailedError(RendezvousError):
    """Another rank published a connect failure for this rendezvous generation."""


class PeerLostError(TransportError):
    """A peer died, closed its endpoint or stopped answering.

    ``peer`` is the rank of the lost peer (``None`` when unknown).
    """

    def __init__(self, message: str, peer: int | None = None) -> None:
        super().__init__(message)
        self.peer = peer


class CGXTimeoutError(PeerLostError, TimeoutError):
    """A wait ran past its deadline; the peer that did not answer is named.

    ``alive`` says what the peer's control channel told: True (it answered a status
    request: late, not dead; the message says which collective it is in), False (it is
    gone), None (connected but no answer in time).
    """

    def __init__(self, message: str, peer: int | None = None, alive: bool | None = None) -> None:
        super().__init__(message, peer)
        self.alive = alive


class ProtocolError(TransportError):
    """A malformed, foreign or unauthenticated frame arrived.

    A frame that fails the pair's keyed check fails the communicator without dropping
    the peer it claims to come from (it may be forged); a well-authenticated frame that
    breaks the protocol drops the peer that sent it.
    """


class CollectiveMismatchError(CGXError):
    """Ranks called a collective with different arguments (numel, dtype, op, layout, bits)."""
