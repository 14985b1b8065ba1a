"""The ``cgx`` group's reductions and data movement beyond allreduce/broadcast/allgather.

Each function checks its tensors, starts the engine's collective and returns a
:class:`Pending`: the engine future and the step that writes the results into the
caller's tensors once it completes (run on a completion thread, never on the engine's
loop). :class:`~cgx_ucx.torch.process_group.ProcessGroupCGX` wraps it into a Work.

- exact reductions other than SUM/AVG (MAX, MIN, PRODUCT, bitwise): an allgather and a
  local reduction in rank order, so every rank computes the identical value;
- reduce-scatter: the engine's scatter-reduce (quantized for SUM/AVG of float tensors
  when compression is on: FSDP's gradient reduce-scatter; exact otherwise);
- all-to-all (even or uneven splits, list form), the coalesced allgathers and
  reduce-scatters, gather, scatter.
"""

from __future__ import annotations

import concurrent.futures
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..config import NO_COMPRESSION_BITS, CompressionConfig
from ..errors import ConfigError
from ..layout import Layout
from ._convert import FLOAT_DTYPES, as_array, can_sum_dtype, is_float
from .futures import Finished
from .protocols import Communicator

__all__ = [
    "GroupView",
    "Pending",
    "allgather_coalesced",
    "allgather_into_tensor_coalesced",
    "allreduce_into",
    "allreduce_layout",
    "alltoall",
    "alltoall_single",
    "gather",
    "red_op",
    "reduce_scatter",
    "reduce_scatter_tensor_coalesced",
    "scatter",
    "staged",
]

_RedOp = dist.ReduceOp.RedOpType
#: Reductions computed by allgather + a local reduction (exact, rank order).
_LOCAL_REDUCE = {
    _RedOp.MAX: "max",
    _RedOp.MIN: "min",
    _RedOp.PRODUCT: "prod",
    _RedOp.BAND: "band",
    _RedOp.BOR: "bor",
    _RedOp.BXOR: "bxor",
}


#: Reductions the engine computes itself (for the dtypes it sums), by their engine name.
_ENGINE_OPS = {_RedOp.SUM: "sum", _RedOp.AVG: "avg"}


@dataclass(frozen=True)
class GroupView:
    """What the ops need of a group: its communicator, this rank and the group size."""

    comm: Communicator
    rank: int
    size: int


@dataclass(frozen=True)
class Pending:
    """A started collective: its name, the engine future, the step that finishes it."""

    what: str
    future: concurrent.futures.Future[Any] | Finished
    finish: Callable[[Any], Any]


def _nothing() -> None:
    return None


@functools.cache
def _without_future(cls: type) -> str | None:
    """The method of ``cls`` that does what its own ``allreduce`` does without a future
    for a call done on the calling thread (the engine's ``allreduce_now``), or None:
    looked up on the class, so that a wrapper's ``__getattr__`` cannot hand out the
    wrapped communicator's and skip the wrapper's ``allreduce``."""
    return getattr(getattr(cls, "allreduce", None), "without_future", None)


def _as_now(
    allreduce: Callable[..., concurrent.futures.Future[Any]],
) -> Callable[..., tuple[Any, concurrent.futures.Future[Any]]]:
    """An ``allreduce`` of the Communicator protocol in the shape of the engine's
    ``allreduce_now``: (None, its future)."""
    return lambda *args, **kwargs: (None, allreduce(*args, **kwargs))


def red_op(op: Any) -> Any:
    """The RedOpType of a ReduceOp or RedOpType."""
    return op if isinstance(op, _RedOp) else op.op


def staged(t: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None]]:
    """A contiguous tensor standing for ``t`` and the step that writes it back."""
    if t.layout != torch.strided:
        raise ConfigError(
            f"the cgx backend moves dense tensors only, got {t.layout}: call .to_dense() "
            "first, or use a gloo group for sparse all_reduce"
        )
    if t.is_contiguous():
        return t, _nothing
    if any(stride == 0 and size > 1 for size, stride in zip(t.shape, t.stride(), strict=True)):
        # An expanded view: several elements share one memory location, so no result can
        # be written into it, and copying back would fail only after the call had run.
        raise ConfigError(
            f"the cgx backend writes results into the tensor, and this one (shape "
            f"{tuple(t.shape)}, strides {t.stride()}) is an expanded view whose elements "
            "share memory: pass .clone() or .contiguous()"
        )
    stage = t.contiguous()
    return stage, lambda: t.copy_(stage)


def _local_reduce(kind: str, gathered: torch.Tensor, out: torch.Tensor) -> None:
    """Reduce ``gathered`` (world, ...) over dim 0 into ``out``, in rank order."""
    if kind in ("max", "min") and gathered.dtype in _NO_TORCH_MINMAX:
        # torch has no amax/amin for uint16..uint64; NumPy does (host tensors only,
        # checked by _local_kind before the call starts).
        reduce = np.maximum if kind == "max" else np.minimum
        reduce.reduce(gathered.numpy(), axis=0, out=out.numpy())
    elif kind == "max":
        torch.amax(gathered, dim=0, out=out)
    elif kind == "min":
        torch.amin(gathered, dim=0, out=out)
    elif kind == "prod":
        acc = gathered[0].clone()
        for row in gathered[1:]:
            acc.mul_(row)
        out.copy_(acc)
    else:
        fn = {
            "band": torch.bitwise_and,
            "bor": torch.bitwise_or,
            "bxor": torch.bitwise_xor,
        }[kind]
        acc = gathered[0].clone()
        for row in gathered[1:]:
            acc = fn(acc, row)
        out.copy_(acc)


def _local_kind(t: torch.Tensor, op: Any) -> str:
    """The local reduction of ``op`` on ``t`` (ConfigError when it is not defined)."""
    kind = _LOCAL_REDUCE.get(op)
    if op in (_RedOp.SUM, _RedOp.AVG) and t.dtype == torch.bool:
        kind = "bor"  # torch's SUM of bools is a logical or
    if kind is None and op in (_RedOp.SUM, _RedOp.AVG):
        raise ConfigError(
            f"the cgx backend cannot {op.name} tensors of {t.dtype}: it sums floating "
            "(16, 32, 64 bit), complex, int8..int64 and uint8 tensors; convert the tensor "
            "or use a gloo group"
        )
    if kind is None:
        raise ConfigError(f"the cgx backend does not support reduce op {op}")
    if kind in ("band", "bor", "bxor") and (t.is_floating_point() or t.is_complex()):
        raise ConfigError(f"bitwise reduce op {op} needs integer or bool tensors, got {t.dtype}")
    if t.is_complex() and kind in ("max", "min"):
        raise ConfigError(f"{op} is not defined for complex tensors")
    if kind in ("max", "min") and t.dtype in _NO_TORCH_MINMAX and t.device.type != "cpu":
        raise ConfigError(
            f"{op} of {t.dtype} tensors on {t.device} is not available (torch has no "
            "max/min for them); convert the tensor to a signed type"
        )
    return kind


#: Unsigned dtypes torch cannot take the max/min of (torch 2.13); NumPy does on the host.
_NO_TORCH_MINMAX = tuple(
    getattr(torch, name) for name in ("uint16", "uint32", "uint64") if hasattr(torch, name)
)


def _engine_sums(dtype: torch.dtype, name: str) -> bool:
    """Whether the engine computes ``name`` ("sum" or "avg", from :data:`_ENGINE_OPS`) of
    ``dtype`` itself; ConfigError for an AVG it cannot define. Takes what the caller
    looked up once: torch's enum comparisons cost ~0.3 us each, on every call."""
    if dtype in FLOAT_DTYPES:
        return True
    if not can_sum_dtype(dtype):
        return False
    if name == "avg" and not (dtype.is_floating_point or dtype.is_complex):
        raise ConfigError(f"AVG is defined for floating tensors only, got {dtype}")
    return True


def _sums(t: torch.Tensor, op: Any) -> bool:
    """Whether the engine sums ``t`` itself (SUM/AVG of a summable dtype)."""
    name = _ENGINE_OPS.get(op)
    return name is not None and _engine_sums(t.dtype, name)


def allreduce_layout(numel: int, dtype: torch.dtype, cfg: CompressionConfig | None) -> Layout:
    """The layout a SUM/AVG all_reduce of ``numel`` engine values of ``dtype`` is sent
    with under ``cfg``: one layer, compressed when ``cfg`` is on and the dtype is a float
    the codec takes (None: uncompressed)."""
    on = cfg is not None and cfg.enabled and dtype in FLOAT_DTYPES
    return _one_layer(numel, cfg if on else None)


@functools.lru_cache(maxsize=256)
def _one_layer(numel: int, cfg: CompressionConfig | None) -> Layout:
    """The layout of a one-tensor all_reduce (``cfg`` None: uncompressed). Cached: a
    training loop repeats the same calls, and a Layout is immutable."""
    if cfg is None:
        return Layout.uniform(numel)
    return Layout.from_sizes([numel], cfg)


def allreduce_into(
    g: GroupView, t: torch.Tensor, op: Any, cfg: CompressionConfig, root: int | None = None
) -> tuple[concurrent.futures.Future[Any] | Finished, Callable[[], None]]:
    """Start an allreduce of contiguous ``t`` in place.

    Returns the engine future (:class:`~.futures.Finished` for a call that completed on
    this thread) and the step to run once it is done (the local
    reduction of the allgather path; nothing for SUM/AVG). ``root``: a reduce's root,
    signed so that ranks disagreeing on it raise a mismatch.
    """
    op = red_op(op)
    name = _ENGINE_OPS.get(op)
    if name is not None and _engine_sums(t.dtype, name):
        arr = as_array(t)  # any shape (the engine flattens it); complex: 2 floats a value
        lay = allreduce_layout(arr.size, t.dtype, cfg)
        # The engine's allreduce_now hands back a call that completed on this thread
        # without making a future; any other communicator (a wrapper, a subclass that
        # overrides allreduce, a test double) is called through its allreduce.
        method = _without_future(type(g.comm))
        start = getattr(g.comm, method) if method else _as_now(g.comm.allreduce)
        value, cf = start(
            arr, name, layout=lay, stochastic=cfg.stochastic, seed=cfg.seed, root=root
        )
        return (cf if cf is not None else Finished(value)), _nothing
    kind = _local_kind(t, op)
    # Exact: allgather every rank's tensor, then reduce locally in rank order, so
    # every rank computes the same value.
    flat = t.view(-1)
    gathered = torch.empty((g.size, flat.numel()), dtype=t.dtype, device=t.device)
    cf = g.comm.allgather(as_array(flat), out=as_array(gathered), reduce_op=kind, root=root)
    return cf, lambda: _local_reduce(kind, gathered, flat)


# -- reduce-scatter -----------------------------------------------------------------------


def _reduce_scatter_flat(
    g: GroupView,
    output: torch.Tensor,
    flat: torch.Tensor,
    op: Any,
    cfg: CompressionConfig,
    what: str,
) -> Pending:
    """Reduce contiguous ``flat`` (world * n values, left unchanged) into ``output``."""
    n = output.numel()
    if flat.numel() != g.size * n or flat.dtype != output.dtype:
        raise ConfigError(
            f"{what}: input must hold {g.size} x {n} values of {output.dtype}, "
            f"got {flat.numel()} of {flat.dtype}"
        )
    op = red_op(op)
    if _sums(flat, op):
        stage, back = staged(output)
        bits = cfg.bits_for(n) if cfg.enabled and is_float(flat) else NO_COMPRESSION_BITS
        cf = g.comm.reduce_scatter(
            as_array(flat),
            as_array(stage.view(-1)),
            "avg" if op == _RedOp.AVG else "sum",
            bits=bits,
            bucket_size=cfg.bucket_size,
            stochastic=cfg.stochastic,
            seed=cfg.seed,
        )

        def finish_rs(_: Any) -> list[torch.Tensor]:
            back()
            return [output]

        return Pending(what, cf, finish_rs)
    work = flat.clone()  # the local-reduce path reduces in place
    cf, post = allreduce_into(g, work, op, cfg)
    rank = g.rank

    def finish(_: Any) -> list[torch.Tensor]:
        post()
        output.copy_(work[rank * n : (rank + 1) * n].view_as(output))
        return [output]

    return Pending(what, cf, finish)


def reduce_scatter(
    g: GroupView,
    output: torch.Tensor,
    inputs: Sequence[torch.Tensor] | torch.Tensor,
    op: Any,
    cfg: CompressionConfig,
    what: str = "reduce_scatter",
) -> Pending:
    """Shard ``rank`` of the reduction of every rank's input into ``output``; ``inputs``
    is one tensor of world * n values or a list of world tensors of n values."""
    if isinstance(inputs, torch.Tensor):
        flat = inputs.reshape(-1)
        flat = flat if flat.is_contiguous() else flat.contiguous()
    else:
        if len(inputs) != g.size:
            raise ConfigError(f"{what} needs {g.size} input tensors, got {len(inputs)}")
        flat = torch.cat([x.reshape(-1) for x in inputs])
    return _reduce_scatter_flat(g, output, flat, op, cfg, what)


def reduce_scatter_tensor_coalesced(
    g: GroupView,
    outputs: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    op: Any,
    cfg: CompressionConfig,
) -> Pending:
    """Several reduce-scatters in one: every rank's shards laid side by side."""
    what = "reduce_scatter_tensor_coalesced"
    _pairs(outputs, inputs, g.size, what, "input")
    # Rank r's shard of the joint buffer is shard r of every input, in order.
    rows = [x.reshape(g.size, -1) for x in inputs]
    flat = torch.cat(rows, dim=1).reshape(-1)
    joint = torch.empty(flat.numel() // g.size, dtype=flat.dtype, device=flat.device)
    inner = _reduce_scatter_flat(g, joint, flat, op, cfg, what)

    def finish(result: Any) -> list[torch.Tensor]:
        inner.finish(result)
        _split_into(joint, outputs)
        return list(outputs)

    return Pending(what, inner.future, finish)


# -- allgather, coalesced ---------------------------------------------------------------------


def _pairs(
    outputs: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    size: int,
    what: str,
    big: str,
) -> None:
    """Check coalesced (output, input) pairs: one dtype, ``big`` side ``size`` times larger."""
    if len(outputs) != len(inputs) or not inputs:
        raise ConfigError(
            f"{what} needs as many outputs as inputs (at least one), "
            f"got {len(outputs)} and {len(inputs)}"
        )
    if len({t.dtype for t in (*outputs, *inputs)}) != 1:
        raise ConfigError(f"{what} needs tensors of one dtype (one call per dtype otherwise)")
    for o, i in zip(outputs, inputs, strict=True):
        small, large = (o, i) if big == "input" else (i, o)
        if large.numel() != size * small.numel():
            raise ConfigError(
                f"{what}: each {big} must hold {size} x the values of its pair, "
                f"got {large.numel()} and {small.numel()}"
            )


def _split_into(flat: torch.Tensor, outs: Sequence[torch.Tensor]) -> None:
    offset = 0
    for o in outs:
        o.copy_(flat[offset : offset + o.numel()].view_as(o))
        offset += o.numel()


def _gather_rows(g: GroupView, inputs: Sequence[torch.Tensor]) -> tuple[Any, torch.Tensor]:
    """One allgather of every input side by side; returns (future, rows of (world, n))."""
    flat = torch.cat([x.reshape(-1) for x in inputs])
    rows = torch.empty((g.size, flat.numel()), dtype=flat.dtype, device=flat.device)
    return g.comm.allgather(as_array(flat), out=as_array(rows)), rows


def allgather_coalesced(
    g: GroupView, output_lists: Sequence[Sequence[torch.Tensor]], inputs: Sequence[torch.Tensor]
) -> Pending:
    """``output_lists[r][i]`` = rank r's ``inputs[i]``, in one allgather."""
    what = "allgather_coalesced"
    if not inputs or len({t.dtype for t in inputs}) != 1:
        raise ConfigError(f"{what} needs at least one input, all of one dtype")
    if len(output_lists) != g.size or any(len(lst) != len(inputs) for lst in output_lists):
        raise ConfigError(f"{what} needs {g.size} output lists of {len(inputs)} tensors each")
    cf, rows = _gather_rows(g, inputs)

    def finish(_: Any) -> list[list[torch.Tensor]]:
        for row, outs in zip(rows, output_lists, strict=True):
            _split_into(row, outs)
        return [list(lst) for lst in output_lists]

    return Pending(what, cf, finish)


def allgather_into_tensor_coalesced(
    g: GroupView, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]
) -> Pending:
    """``outputs[i]`` = every rank's ``inputs[i]`` concatenated, in one allgather."""
    what = "allgather_into_tensor_coalesced"
    _pairs(outputs, inputs, g.size, what, "output")
    cf, rows = _gather_rows(g, inputs)

    def finish(_: Any) -> list[torch.Tensor]:
        offset = 0
        for o, i in zip(outputs, inputs, strict=True):
            n = i.numel()
            o.copy_(rows[:, offset : offset + n].reshape(o.shape))
            offset += n
        return list(outputs)

    return Pending(what, cf, finish)


# -- all-to-all -----------------------------------------------------------------------------


def _row_counts(t: torch.Tensor, splits: Sequence[int] | None, size: int, what: str) -> Any:
    """Value counts per rank from split sizes along dim 0 (None: even)."""
    if not splits:
        return None
    if len(splits) != size or sum(splits) != (t.shape[0] if t.dim() else 1):
        raise ConfigError(
            f"all_to_all_single: {what} split sizes {list(splits)} must be {size} sizes "
            f"summing to dim 0 ({t.shape[0] if t.dim() else 1})"
        )
    per_row = t[0].numel() if t.dim() and t.shape[0] else 0
    per_row *= 2 if t.is_complex() else 1  # complex values travel as float pairs
    return [int(s) * per_row for s in splits]


def _values(t: torch.Tensor) -> int:
    """Values of ``t`` as the engine sees them (complex: float pairs)."""
    return t.numel() * (2 if t.is_complex() else 1)


def alltoall_single(
    g: GroupView,
    output: torch.Tensor,
    input: torch.Tensor,
    output_splits: Sequence[int] | None,
    input_splits: Sequence[int] | None,
) -> Pending:
    """Rows of ``input`` to each rank by ``input_splits``, theirs into ``output`` (exact)."""
    if output.dtype != input.dtype:
        raise ConfigError(
            f"all_to_all_single: output dtype {output.dtype} != input dtype {input.dtype}"
        )
    src = input.contiguous()
    stage, back = staged(output)
    cf = g.comm.alltoall(
        as_array(src.view(-1)),
        as_array(stage.view(-1)),
        _row_counts(input, input_splits, g.size, "input"),
        _row_counts(output, output_splits, g.size, "output"),
    )

    def finish(_: Any) -> list[torch.Tensor]:
        back()
        return [output]

    return Pending("all_to_all_single", cf, finish)


def alltoall(
    g: GroupView, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]
) -> Pending:
    """``inputs[i]`` to rank i, rank i's tensor for us into ``outputs[i]`` (exact)."""
    if len(outputs) != g.size or len(inputs) != g.size:
        raise ConfigError(f"all_to_all needs {g.size} input and {g.size} output tensors")
    if len({t.dtype for t in (*outputs, *inputs)}) != 1:
        raise ConfigError("all_to_all needs tensors of one dtype")
    flat = torch.cat([x.reshape(-1) for x in inputs])
    out = torch.empty(sum(o.numel() for o in outputs), dtype=flat.dtype, device=flat.device)
    cf = g.comm.alltoall(
        as_array(flat),
        as_array(out),
        [_values(x) for x in inputs],
        [_values(o) for o in outputs],
    )

    def finish(_: Any) -> list[torch.Tensor]:
        _split_into(out, outputs)
        return list(outputs)

    return Pending("all_to_all", cf, finish)


# -- gather, scatter ------------------------------------------------------------------------


def gather(
    g: GroupView, outs: Sequence[torch.Tensor], t: torch.Tensor, root: int
) -> tuple[Any, Callable[[Any], None]]:
    """Every rank's ``t`` into ``outs`` on ``root`` (an allgather: simple and exact)."""
    if g.rank == root:
        for r, o in enumerate(outs):
            if o.numel() != t.numel() or o.dtype != t.dtype:
                raise ConfigError(
                    f"gather: output {r} on the root holds {o.numel()} values of {o.dtype}, "
                    f"the input {t.numel()} of {t.dtype}"
                )
    gathered = torch.empty((g.size, t.numel()), dtype=t.dtype, device=t.device)
    flat = as_array(t.contiguous().reshape(-1))
    cf = g.comm.allgather(flat, out=as_array(gathered), root=root)  # ranks agree on the root
    keep = outs if g.rank == root else []

    def finish(_: Any) -> None:
        for o, row in zip(keep, gathered, strict=False):
            o.copy_(row.view_as(o))

    return cf, finish


def scatter(
    g: GroupView, out: torch.Tensor, ins: Sequence[torch.Tensor] | None, root: int
) -> tuple[Any, Callable[[Any], None]]:
    """``ins[r]`` of ``root`` into rank r's ``out``. One broadcast of every rank's part:
    simple and exact; scatter is rare in training."""
    if ins is not None:
        for r, x in enumerate(ins):
            if x.numel() != out.numel() or x.dtype != out.dtype:
                raise ConfigError(
                    f"scatter: input {r} on the root holds {x.numel()} values of {x.dtype}, "
                    f"the output {out.numel()} of {out.dtype}"
                )
        buf = torch.stack([x.reshape(-1) for x in ins])
    else:
        buf = torch.empty((g.size, out.numel()), dtype=out.dtype, device=out.device)
    cf = g.comm.broadcast(as_array(buf), root=root)
    rank = g.rank

    def finish(_: Any) -> None:
        out.copy_(buf[rank].view_as(out))

    return cf, finish
