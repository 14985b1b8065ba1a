"""cgx_ucx: compressed (about 4-bit) gradient all-reduce for data-parallel training on UCX.

The public face only: re-exports (reference: docs/reference/; examples: README.md). When
PyTorch is installed, importing cgx_ucx registers the ``cgx`` torch.distributed backend
(the one side effect), so an existing script changes one line:
``dist.init_process_group("cgx")``.

Importing cgx_ucx does not import PyTorch: a job on NumPy or CuPy arrays alone would pay
about a second and 200 MB of RSS for it. The backend is registered at once where torch is
already imported, else as soon as torch is (:mod:`._torch_hook`); the torch names
re-exported here (``GradientSync``, ``cgx_hook``, ...) import it on first use.
"""

import importlib as _importlib
import importlib.util as _importlib_util
from typing import Any as _Any

from . import _torch_hook
from .collectives import CommStats, Communicator, connect
from .config import CommConfig, CompressionConfig, resolve_comm, resolve_compression
from .engine import Engine, SyncCommunicator, connect_sync
from .errors import (
    CGXError,
    CGXTimeoutError,
    CodecError,
    CollectiveMismatchError,
    ConfigError,
    PeerFailedError,
    PeerLostError,
    ProtocolError,
    RendezvousError,
    TransportError,
)
from .layout import LayerSpec, Layout

__version__ = "0.1.0"


def describe(file=None, *, quiet=False):  # type: ignore[no-untyped-def]
    """Print and return what a bug report needs (see :func:`cgx_ucx.diagnostics.describe`).

    Imported on first use: ``python -m cgx_ucx.diagnostics`` then runs the module fresh
    (an eager import here made runpy warn that it was already imported)."""
    from .diagnostics import describe as _describe

    return _describe(file, quiet=quiet)


__all__ = [
    "CGXError",
    "CGXTimeoutError",
    "CodecError",
    "CollectiveMismatchError",
    "CommConfig",
    "CommStats",
    "Communicator",
    "CompressionConfig",
    "ConfigError",
    "Engine",
    "LayerSpec",
    "Layout",
    "PeerFailedError",
    "PeerLostError",
    "ProtocolError",
    "RendezvousError",
    "SyncCommunicator",
    "TransportError",
    "connect",
    "connect_sync",
    "describe",
    "resolve_comm",
    "resolve_compression",
]

# torch is an optional extra: the core works on NumPy and CuPy arrays without it.
_TORCH_NAMES = ("CGXOptions", "CGXState", "GradientSync", "cgx_hook")
if _importlib_util.find_spec("torch") is not None:
    __all__ += list(_TORCH_NAMES)
    _torch_hook.register_when_torch_imports()


def __getattr__(name: str) -> _Any:
    """The torch integration on first use: ``cgx_ucx.torch`` and its re-exported names."""
    if name == "torch" or name in _TORCH_NAMES:
        module = _importlib.import_module(".torch", __name__)  # registers "cgx"
        return module if name == "torch" else getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
