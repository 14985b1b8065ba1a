"""Error feedback: carry the quantization error of one step into the next.

Quantizing a gradient ``g`` loses ``g - decode(encode(g))``. Error feedback (Seide et al.
2014 "1-bit SGD"; Karimireddy et al. 2019 "EF-SGD"; optional in CGX) keeps that residual
per buffer and adds it to the next gradient of the same buffer before quantizing, so the
error is delayed, not lost. Numbered steps of one use::

    1. c = g + residual[key]          compensate()
    2. b = encode(c, ...)             (sent)
    3. residual[key] = c - decode(b)  update()

:meth:`ErrorFeedback.encode` does the three steps with persistent per-key buffers (no
allocation after the first call for a key). Residuals are float32 whatever the input
dtype, and live on the device of the arrays given (NumPy or CuPy). Keys are any hashable
(e.g. ``(bucket_index, chunk)``); a key whose length changes is an error (its residual
belongs to a different layout), call :meth:`reset` first.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Mapping
from typing import Any

import numpy as np

from ..arrays import is_cupy, to_host, xp_of
from ..errors import CodecError
from . import codec

__all__ = ["ErrorFeedback"]


class ErrorFeedback:
    """Per-key residual memory ``x - decode(encode(x))`` for compressed communication."""

    def __init__(self) -> None:
        # residual[key] and the scratch holding the compensated values, float32, per key
        self._residual: dict[Hashable, Any] = {}
        self._scratch: dict[Hashable, Any] = {}

    # -- inspection -----------------------------------------------------------------
    def __contains__(self, key: Hashable) -> bool:
        return key in self._residual

    def __len__(self) -> int:
        return len(self._residual)

    def keys(self) -> Iterator[Hashable]:
        return iter(list(self._residual))

    def residual(self, key: Hashable) -> Any:
        """The current residual of ``key`` (float32), or None before the first update."""
        return self._residual.get(key)

    # -- the three steps --------------------------------------------------------------
    def _residual_for(self, key: Hashable, x: Any) -> Any:
        res = self._residual.get(key)
        if res is None:
            return None
        if res.shape != x.shape:
            raise CodecError(
                f"error feedback key {key!r} holds {res.shape[0]} values, got {x.shape[0]};"
                " call reset(key) when a buffer's layout changes"
            )
        xp = xp_of(x)
        if xp is not np and not is_cupy(res):  # loaded from a state dict
            res = xp.asarray(res)
            self._residual[key] = res
        elif xp is np and is_cupy(res):
            raise CodecError(f"residual of {key!r} is on a GPU, the values on the host")
        return res

    def compensate(self, key: Hashable, x: Any, out: Any = None) -> Any:
        """``x + residual[key]`` as float32, into ``out`` (may be ``x`` itself if float32).

        Before the first :meth:`update` of ``key`` the residual is zero.
        """
        xp = xp_of(x)
        if out is None:
            out = xp.empty(x.shape, dtype=np.float32)
        elif out.dtype != np.float32 or out.shape != x.shape:
            raise CodecError("compensate's out must be float32 with the shape of x")
        res = self._residual_for(key, x)
        if res is None:
            if out is not x:
                out[...] = x.astype(np.float32, copy=False)
        elif x.dtype == np.float32:
            xp.add(x, res, out=out)
        else:
            out[...] = x.astype(np.float32)
            out += res
        return out

    def update(self, key: Hashable, compensated: Any, decoded: Any) -> None:
        """Store ``residual[key] = compensated - decoded`` (reusing the key's buffer)."""
        xp = xp_of(compensated)
        res = self._residual_for(key, compensated)
        if res is None:
            res = xp.empty(compensated.shape, dtype=np.float32)
            self._residual[key] = res
        if decoded.dtype != np.float32:
            decoded = decoded.astype(np.float32)
        xp.subtract(compensated, decoded, out=res)

    def encode(
        self,
        key: Hashable,
        x: Any,
        bits: int,
        bucket_size: int = 1024,
        *,
        out: Any = None,
        stochastic: bool = False,
        seed: int = 0,
    ) -> Any:
        """Compensate, encode and update in one call; returns the encoded segment.

        The compensated values live in a per-key scratch buffer and the decode for the
        residual is written straight into the residual buffer, so after the first call
        for a key nothing is allocated (except the segment when ``out`` is None).
        """
        xp = xp_of(x)
        scratch = self._scratch.get(key)
        if scratch is None or scratch.shape != x.shape or xp_of(scratch) is not xp:
            scratch = xp.empty(x.shape, dtype=np.float32)
            self._scratch[key] = scratch
        comp = self.compensate(key, x, out=scratch)
        buf = codec.encode(comp, bits, bucket_size, out=out, stochastic=stochastic, seed=seed)
        res = self._residual_for(key, x)
        if res is None:
            res = xp.empty(x.shape, dtype=np.float32)
            self._residual[key] = res
        codec.decode(buf, out=res)  # res = decode(encode(comp))
        xp.subtract(comp, res, out=res)  # res = comp - decode(encode(comp))
        return buf

    def reset(self, key: Hashable | None = None) -> None:
        """Forget the residual of ``key`` (of every key when None)."""
        if key is None:
            self._residual.clear()
            self._scratch.clear()
        else:
            self._residual.pop(key, None)
            self._scratch.pop(key, None)

    def restore(self, key: Hashable, residual: Any) -> None:
        """Make ``residual`` (a float32 array this object may keep, e.g. a copy of an
        earlier :meth:`residual`) the residual of ``key``; None forgets it. For a caller
        whose step was discarded after the residual was updated."""
        if residual is None:
            self.reset(key)
            return
        self._residual[key] = residual
        self._scratch.pop(key, None)

    # -- checkpointing -------------------------------------------------------------------
    def state_dict(self) -> dict[Hashable, np.ndarray]:
        """The residuals as host NumPy float32 arrays (copies), keyed as given."""
        return {k: to_host(v, copy=True) for k, v in self._residual.items()}

    def load_state_dict(self, state: Mapping[Hashable, Any]) -> None:
        """Replace the residuals; arrays move to the values' device on first use."""
        residual = {}
        for k, v in state.items():
            arr = np.asarray(to_host(v), dtype=np.float32)
            if arr.ndim != 1:
                raise CodecError(f"residual of {k!r} must be 1-D, got shape {arr.shape}")
            residual[k] = arr.copy()
        self._residual = residual
        self._scratch.clear()
