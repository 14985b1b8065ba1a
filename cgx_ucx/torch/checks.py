"""Argument checks of the ``cgx`` group's ops, each a ConfigError that says what is
expected.

They run before the op is submitted, so that
:class:`~cgx_ucx.torch.process_group.ProcessGroupCGX` can refuse the call on the peers
too (they raise at once instead of waiting until the timeout).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import ConfigError

__all__ = [
    "check_allgather_outputs",
    "check_coalesced",
    "check_gather_into",
    "check_root_tensor",
    "per_rank",
    "single",
]


def single(tensors: Sequence[torch.Tensor], what: str) -> torch.Tensor:
    """The one tensor of ``tensors`` (the group's ops take one tensor per rank)."""
    if len(tensors) != 1:
        raise ConfigError(f"cgx {what} takes exactly one tensor per call, got {len(tensors)}")
    return tensors[0]


def per_rank(
    tensors: Sequence[Sequence[torch.Tensor]], size: int, what: str, side: str
) -> Sequence[torch.Tensor]:
    """The one list of ``tensors``, checked to hold a tensor for every one of ``size``
    ranks."""
    ranks = single(tensors, what)
    if len(ranks) != size:
        raise ConfigError(f"{what} needs {size} {side} tensors, got {len(ranks)}")
    return ranks


def check_coalesced(tensors: Sequence[torch.Tensor]) -> None:
    """allreduce_coalesced: at least one tensor, all of one dtype and device."""
    if not tensors:
        raise ConfigError("allreduce_coalesced needs at least one tensor")
    if len({(t.dtype, t.device) for t in tensors}) != 1:
        raise ConfigError("allreduce_coalesced needs tensors of one dtype and device")


def check_root_tensor(root_tensor: int) -> None:
    """broadcast: one tensor per rank, so the root's tensor is its first."""
    if root_tensor != 0:
        raise ConfigError("cgx broadcast takes one tensor per rank (rootTensor must be 0)")


def check_allgather_outputs(outs: Sequence[torch.Tensor], t: torch.Tensor) -> None:
    """allgather: every output has the input's shape and dtype."""
    for o in outs:
        if o.shape != t.shape or o.dtype != t.dtype:
            raise ConfigError(
                f"allgather outputs must match the input's shape and dtype "
                f"({tuple(t.shape)}, {t.dtype}), got ({tuple(o.shape)}, {o.dtype})"
            )


def check_gather_into(output: torch.Tensor, input: torch.Tensor, size: int) -> None:
    """all_gather_single: ``output`` holds ``size`` inputs' values, of the input's dtype."""
    if output.numel() != size * input.numel() or output.dtype != input.dtype:
        raise ConfigError(
            f"all_gather_single: output must hold {size} x {input.numel()} values "
            f"of {input.dtype}, got {output.numel()} of {output.dtype}"
        )
