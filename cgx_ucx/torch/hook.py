"""The DDP communication hook: ``model.register_comm_hook(CGXState(pg), cgx_hook)``.

As torch_cgx users know it, without its "register layers at step 2" bookkeeping: each
call builds the bucket's layer layout from ``bucket.gradients()`` and sends it with
the allreduce (DESIGN.md, data path step 2), so DDP's bucket rebuild after the first
iteration, and any other all_reduce in the same job, compressed or not, cannot
confuse it (torch_cgx issue #5).

Algorithm of one call (``cgx_hook(state, bucket)``):

1. Layout: one layer per gradient in the bucket; 1-D tensors (biases, norms) and
   layers under ``max(layer_min_size, minimal_size)`` values go uncompressed
   (CGX paper, section 4: they are a small share of the bytes and sensitive).
2. Divide the bucket by the world size first (as PyTorch's allreduce_hook, so fp16
   sums do not overflow).
3. With error feedback: add each compressed layer's residual from the previous step
   and keep the new residual ``c - decode(encode(c))`` of what is sent.
4. Submit the compressed allreduce (SUM) to the engine and return a torch future at
   once: backward goes on while the bucket travels.
"""

# No ``from __future__ import annotations`` here: DDP's register_comm_hook compares the
# hook's annotations with dist.GradBucket and torch.futures.Future[torch.Tensor] as
# objects, and string annotations fail that check.
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..config import CompressionConfig, resolve_compression
from ..errors import ConfigError
from ..layout import Layout
from ._convert import as_array, is_float
from ._feedback import LayerFeedback
from .backend import get_communicator
from .futures import to_torch_future

__all__ = ["CGXState", "cgx_hook", "layer_layout", "wire_bytes"]

#: The paper's defaults (CGX, section 5): 4 bits, buckets of 1024 values.
PAPER_DEFAULTS = CompressionConfig(bits=4, bucket_size=1024)


def layer_layout(
    tensors: Sequence[torch.Tensor], config: CompressionConfig, layer_min_size: int
) -> Layout:
    """Layout of a flat buffer holding ``tensors`` back to back.

    A tensor is compressed when compression is on, it is floating point, it has more
    than one dimension and at least ``max(layer_min_size, config.minimal_size)`` values.
    """
    threshold = max(layer_min_size, config.minimal_size)
    compressible = [
        is_float(t) and t.dim() > 1 and t.numel() >= threshold and config.enabled for t in tensors
    ]
    return Layout.from_sizes([t.numel() for t in tensors], config, compressible=compressible)


def wire_bytes(layout: Layout, itemsize: int, world_size: int) -> int:
    """Payload bytes one rank sends in a scatter-reduce-allgather of ``layout``.

    Each rank sends (world-1)/world of the buffer in each of the two phases; a
    compressed layer costs 8 bytes of meta per bucket plus ``ceil(n*bits/8)`` code
    bytes (DESIGN.md, wire format), an uncompressed one ``n * itemsize``. Headers are
    left out (they are constant per message, not per value).
    """
    total = 0
    for spec in layout:
        if spec.compressed:
            total += 8 * -(-spec.numel // spec.bucket_size) + (spec.numel * spec.bits + 7) // 8
        else:
            total += spec.numel * itemsize
    return 2 * total * (world_size - 1) // max(world_size, 1)


class CGXState:
    """State of :func:`cgx_hook` for one DDP model.

    Tuned by the user:
        process_group: the group DDP runs on (default WORLD). On a ``cgx`` group its
            communicator is used; on any other backend (e.g. gloo) a cgx_ucx
            communicator over the same ranks is made here, so this constructor is a
            collective call: every rank must construct its state.
        layer_min_size: layers with fewer values go uncompressed (at least the
            CGX_COMPRESSION_MINIMAL_SIZE value).
        compression_params: ``{"bits": 4, "bucket_size": 1024}`` and optionally
            ``"stochastic"``, ``"seed"``. Given keys win over the CGX_COMPRESSION_*
            environment, read at each call; missing ones come from the environment,
            else the paper's defaults (4 bits, bucket 1024).
        error_feedback: carry each step's quantization error into the next.

    Internal: the communicator, per-bucket layouts, residuals.

    Stats: ``steps`` (DDP iterations seen), ``bytes_sent`` (payload bytes this rank
    sent through the hook, all steps), ``bytes_per_step`` (of the last full step);
    both computed from the bucket layouts (:func:`wire_bytes`). The communicator's
    ``stats.bytes_sent`` counts everything it really sent, frame headers included.
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        layer_min_size: int = 1024,
        compression_params: Mapping[str, Any] | None = None,
        *,
        error_feedback: bool = False,
        communicator: Any = None,
    ) -> None:
        # -- tuned by the user
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        if self.process_group is None:
            raise ConfigError("CGXState needs torch.distributed initialized or a process_group")
        if not isinstance(layer_min_size, int) or layer_min_size < 0:
            raise ConfigError(f"layer_min_size must be an integer >= 0, got {layer_min_size!r}")
        self.layer_min_size = layer_min_size
        self.compression_params = dict(compression_params or {})
        self.error_feedback = bool(error_feedback)
        _ = self.compression  # validates compression_params now, not at the first backward
        # -- internal
        self.communicator = (
            communicator if communicator is not None else get_communicator(self.process_group)
        )
        self.world_size = self.process_group.size()
        self._feedback = LayerFeedback() if self.error_feedback else None
        self._lock = threading.Lock()
        # -- stats
        self.steps = 0
        self.bytes_sent = 0
        self.bytes_per_step = 0
        self._step_bytes = 0

    @property
    def compression(self) -> CompressionConfig:
        """The configuration the next call uses (params > environment > paper)."""
        return resolve_compression(PAPER_DEFAULTS, **self.compression_params)

    # -- checkpointing -------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Checkpointable state: step count and error-feedback residuals (as tensors)."""
        residuals = self._feedback.state_dict() if self._feedback is not None else {}
        return {"steps": self.steps, "residuals": residuals}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        try:
            steps = int(state["steps"])
            residuals = state["residuals"]
        except (KeyError, ValueError, TypeError) as exc:
            raise ConfigError(f"not a CGXState state dict: {exc!r}") from exc
        if self._feedback is not None:
            self._feedback.load_state_dict(residuals)
        elif residuals:
            raise ConfigError("the state holds error-feedback residuals but error_feedback is off")
        self.steps = steps

    # -- accounting ------------------------------------------------------------------------
    def _account(self, nbytes: int, last: bool) -> None:
        with self._lock:
            self.bytes_sent += nbytes
            self._step_bytes += nbytes
            if last:
                self.steps += 1
                self.bytes_per_step = self._step_bytes
                self._step_bytes = 0

    def __repr__(self) -> str:
        return (
            f"CGXState(world_size={self.world_size}, layer_min_size={self.layer_min_size}, "
            f"compression={self.compression}, error_feedback={self.error_feedback})"
        )


def cgx_hook(state: CGXState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket`` across ranks with compressed allreduce; returns at once.

    Register with ``ddp_model.register_comm_hook(state, cgx_hook)``. The future's value
    is the averaged bucket buffer, as DDP expects.
    """
    buf = bucket.buffer()
    config = state.compression
    layout = layer_layout(bucket.gradients(), config, state.layer_min_size)
    buf.div_(state.world_size)
    if state._feedback is not None and layout.compressed:
        state._feedback.apply(bucket.index(), buf, layout)
    # A different stochastic-rounding seed for every step and bucket (codec contract).
    seed = (config.seed + (state.steps << 20) + bucket.index()) % (1 << 64)
    cf = state.communicator.allreduce(
        as_array(buf), op="sum", layout=layout, stochastic=config.stochastic, seed=seed
    )
    state._account(wire_bytes(layout, buf.element_size(), state.world_size), bucket.is_last())
    return to_torch_future(cf, lambda _: buf)
