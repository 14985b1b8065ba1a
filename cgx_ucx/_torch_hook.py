"""Register the ``cgx`` torch.distributed backend without importing torch first.

``import cgx_ucx`` must make ``dist.init_process_group("cgx")`` work whichever of the two
a script imports first, and must not import torch itself (about a second and 200 MB of
RSS that a job on NumPy or CuPy arrays never uses). So where torch is already imported,
:func:`register_when_torch_imports` imports :mod:`cgx_ucx.torch` (which registers the
backend) at once; else it puts a finder at the head of ``sys.meta_path`` that answers for
the module ``torch`` alone: it asks the finders after it for torch's spec and wraps that
spec's ``exec_module``, so that once torch's own ``__init__`` has run to the end,
:mod:`cgx_ucx.torch` is imported too. The finder leaves ``sys.meta_path`` then (and
stays out of every other import).

A failure to import :mod:`cgx_ucx.torch` there does not fail the user's ``import torch``:
it is logged and warned about, and raised again where the integration is used
(``cgx_ucx.GradientSync``, ``import cgx_ucx.torch``).
"""

from __future__ import annotations

import importlib
import importlib.abc
import logging
import sys
import threading
import warnings
from typing import Any

__all__ = ["register_when_torch_imports"]

log = logging.getLogger("cgx_ucx")

_TORCH = "torch"
_lock = threading.Lock()


def _import_integration() -> None:
    """Import :mod:`cgx_ucx.torch` (it registers the backend), warning instead of raising."""
    try:
        importlib.import_module("cgx_ucx.torch")
    except Exception as exc:
        log.warning("the cgx torch backend could not be registered: %r", exc)
        warnings.warn(
            f"cgx_ucx: the 'cgx' torch.distributed backend could not be registered: {exc!r}",
            RuntimeWarning,
            stacklevel=2,
        )


class _AfterTorch(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the spec of ``torch`` that the finders after it find."""

    def __init__(self) -> None:
        self._busy = threading.local()

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != _TORCH or getattr(self._busy, "on", False):
            return None
        self._busy.on = True
        try:
            spec = None
            for finder in list(sys.meta_path):
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        finally:
            self._busy.on = False
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)  # torch's __init__, to the end (an error propagates as it would)
            self.remove()
            _import_integration()

        # The spec (and its loader) is this one import's own: the finder made it now.
        loader.exec_module = exec_module
        return spec

    def remove(self) -> None:
        with _lock:
            if self in sys.meta_path:
                sys.meta_path.remove(self)


def register_when_torch_imports() -> None:
    """Register the backend now if torch is imported, else once it is (see the module)."""
    if _TORCH in sys.modules:
        _import_integration()
        return
    with _lock:
        if not any(isinstance(f, _AfterTorch) for f in sys.meta_path):
            sys.meta_path.insert(0, _AfterTorch())
