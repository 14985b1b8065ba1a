"""The mailboxes' ordered loads and stores, compiled (:mod:`.mailbox` imports this lazily).

A fence (sequentially consistent) around every store and after every load keeps the
payload's bytes ahead of the number that publishes them on any CPU, and keeps the spin's
load inside its loop; the spin releases the GIL, so a waiting caller's thread does not
hold up the engine loop's.
"""

from __future__ import annotations

from typing import Any

import numba
from numba import types
from numba.extending import intrinsic

__all__ = ["load", "spin", "store"]


@intrinsic
def _fence(typingctx: Any) -> Any:  # pragma: no cover - compiled
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.void(), codegen


@numba.njit(nogil=True, cache=True)
def store(words: Any, i: int, value: int) -> None:  # pragma: no cover - compiled
    _fence()
    words[i] = value
    _fence()


@numba.njit(nogil=True, cache=True)
def load(words: Any, i: int) -> int:  # pragma: no cover - compiled
    v = words[i]
    _fence()
    return v


@numba.njit(nogil=True, cache=True)
def spin(words: Any, i: int, target: int, spins: int) -> bool:  # pragma: no cover - compiled
    """Whether ``words[i] >= target`` within ``spins`` ordered loads."""
    for _ in range(spins):
        if words[i] >= target:
            _fence()
            return True
        _fence()
    return False
