"""Error feedback over the layers of a flat gradient buffer (shared by the hook and
GradientSync).

The codec's :class:`~cgx_ucx.compression.ErrorFeedback` keeps one residual per key; here
a key is ``(bucket index, layer index)`` and only compressed layers have one. The
residual is that of the local quantization ``c - decode(encode(c))`` with the layer's
bits and bucket size, the same round-to-nearest the engine applies to what this rank
sends, so the error of one step is re-sent in the next (EF-SGD, Karimireddy et al.
2019).

A layer that an adaptive policy (or a changed configuration) switches to uncompressed
gets its last residual added once and then none: the exact send delivers it, where
dropping it would lose that step's error and keeping it would re-send a stale one
whenever the layer is compressed again.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ..arrays import to_host, xp_of
from ..errors import ConfigError
from ..layout import Layout
from ._convert import as_array

__all__ = ["LayerFeedback", "split_state"]


class LayerFeedback:
    """Residual memory for the compressed layers of flat buffers, keyed by bucket.

    ``undoable``: what :meth:`apply` changes can be undone until :meth:`commit`
    (:meth:`rollback`), for a caller that may discard a step and send it again.
    """

    def __init__(self, *, undoable: bool = False) -> None:
        from ..compression import ErrorFeedback

        self._ef = ErrorFeedback()
        self._buckets: set[int] = set()  # bucket indices that hold a residual
        #: With ``undoable``: each key's residual as it was before the first apply since
        #: the last commit (None: it had none), and the buffers update() may write into
        #: instead, so a discarded step costs no copy and the hot path no allocation.
        self._before: dict[tuple[int, int], Any] | None = {} if undoable else None
        self._spare: dict[tuple[int, int], Any] = {}

    def holds(self, index: int) -> bool:
        """True when bucket ``index`` has a residual (to add even if nothing is compressed)."""
        return index in self._buckets

    def apply(self, index: int, buf: torch.Tensor, layout: Layout) -> None:
        """Add each compressed layer's residual to ``buf`` in place; keep the new one.

        An uncompressed layer that still holds a residual gets it added, once; a
        bucket with neither a compressed layer nor a residual is left as it is.
        """
        if not layout.compressed and index not in self._buckets:
            return
        from ..compression import decode, encode

        ef = self._ef
        flat = buf.detach()
        for i, spec in enumerate(layout):
            if spec.numel == 0:
                continue
            key = (index, i)
            if self._before is not None and key not in self._before:
                self._before[key] = ef.residual(key)
            old = ef.residual(key)
            if old is not None and old.shape[0] != spec.numel:
                ef.reset(key)  # the buckets were rebuilt: that residual was another layer's
                old = None
            layer = flat[spec.offset : spec.end]
            if not spec.compressed:
                if old is not None:  # sent exactly from now on: flush the residual once
                    layer.add_(torch.from_numpy(to_host(old)).to(layer.device, layer.dtype))
                    ef.reset(key)
                    if not any(k[0] == index for k in ef.keys()):  # noqa: SIM118 (not iterable)
                        self._buckets.discard(index)
                continue
            self._buckets.add(index)
            x = as_array(layer)
            if layer.dtype == torch.float32:
                comp = ef.compensate(key, x, out=x)
                sent = comp
            else:
                # float16/bfloat16: compensate in float32, send the rounded value; the
                # residual keeps the rounding error as well as the quantization error.
                comp = ef.compensate(key, x)
                layer.copy_(torch.as_tensor(comp, device=layer.device))
                sent = as_array(layer.float())
            self._keep_before(key)
            ef.update(key, comp, decode(encode(sent, spec.bits, spec.bucket_size)))

    def _keep_before(self, key: tuple[int, int]) -> None:
        """Before update(): when the residual is the one to put back on rollback, make a
        spare buffer the residual, so that update() writes there and leaves it intact."""
        if self._before is None:
            return
        current = self._ef.residual(key)
        if current is None or current is not self._before[key]:
            return
        spare = self._spare.pop(key, None)
        if spare is None or spare.shape != current.shape or xp_of(spare) is not xp_of(current):
            spare = xp_of(current).empty_like(current)
        self._ef.restore(key, spare)

    def commit(self) -> None:
        """The steps applied since the last commit were sent: keep their residuals (the
        ones they replaced become spare buffers)."""
        if self._before is None:
            return
        for key, before in self._before.items():
            if before is not None and before is not self._ef.residual(key):
                self._spare[key] = before
        self._before.clear()

    def rollback(self, index: int | None = None) -> None:
        """The steps applied since the last commit were not delivered (of bucket
        ``index`` only, or of all): put back the residuals they had before, so a retry
        adds each one once."""
        if self._before is None:
            return
        for key in [k for k in self._before if index is None or k[0] == index]:
            before = self._before.pop(key)
            current = self._ef.residual(key)
            self._ef.restore(key, before)
            if current is not None and current is not before:
                self._spare[key] = current
        self._buckets = {b for b, _ in self._ef.keys()}  # noqa: SIM118 (not iterable)

    def hold(self, index: int, layers: Iterable[int]) -> dict[int, Any]:
        """Copies of the residuals of ``layers`` of bucket ``index`` as they are now (None
        for one without), for :meth:`restore` if this step's result for them is then
        discarded."""
        held = {}
        for i in layers:
            old = self._ef.residual((index, i))
            held[i] = None if old is None else old.copy()
        return held

    def restore(self, index: int, held: Mapping[int, Any]) -> None:
        """Put back residuals taken by :meth:`hold`: the layers' part of this step was
        not used (no rank used the parameter: its gradient stays as it was, as DDP
        leaves it), so what :meth:`apply` added to it was sent for nothing and its
        error must not be forgotten."""
        for i, old in held.items():
            self._ef.restore((index, i), old)
            if old is not None:
                self._buckets.add(index)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Residuals as CPU float32 tensors named ``"<bucket>.<layer>"``."""
        return {f"{b}.{i}": torch.from_numpy(arr) for (b, i), arr in self._ef.state_dict().items()}

    def load_state_dict(self, residuals: Mapping[str, Any]) -> None:
        loaded = {}
        try:
            for name, tensor in residuals.items():
                b, i = (int(p) for p in name.split("."))
                loaded[(b, i)] = torch.as_tensor(tensor).detach().cpu().float().numpy()
        except (ValueError, TypeError, AttributeError) as exc:
            raise ConfigError(f"not an error-feedback state: {exc}") from exc
        self._ef.load_state_dict(loaded)
        self._buckets = {b for b, _ in loaded}
        if self._before is not None:
            self._before.clear()
        self._spare.clear()


def split_state(
    state: Mapping[str, Any], owner: str, feedback: LayerFeedback | None
) -> tuple[int, Any, Any]:
    """``(steps, residuals, policy state or None)`` of a checkpoint saved by ``owner``
    (``CGXState`` or ``GradientSync``), read before anything is restored so that a bad
    state changes nothing; residuals without error feedback are refused, not dropped."""
    try:
        steps = int(state["steps"])
        residuals = state["residuals"]
        policy_state = state.get("policy")
    except (KeyError, ValueError, TypeError, AttributeError) as exc:
        raise ConfigError(f"not a {owner} state dict: {exc!r}") from exc
    if residuals and feedback is None:
        raise ConfigError("the state holds error-feedback residuals but error_feedback is off")
    return steps, residuals, policy_state
