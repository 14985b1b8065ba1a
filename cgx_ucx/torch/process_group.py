"""The ``cgx`` process group: :class:`ProcessGroupCGX`, a torch.distributed ProcessGroup
whose collectives run on the cgx_ucx engine.

Semantics:

1. ``all_reduce`` SUM/AVG of float32/float16/bfloat16 is quantized when compression
   is on: explicit configuration in code (``CGXOptions`` or ``group.compression``)
   wins, else torch_cgx's environment variables, read when each call starts (so a
   script may change them between calls). Tensors under the minimal size go exact.
2. SUM of integer tensors, and every other reduction (MAX, MIN, PRODUCT, BAND, BOR,
   BXOR, and bool tensors) are exact: SUM/AVG through the engine's uncompressed path,
   the rest through an allgather and a local reduction in rank order, so every rank
   computes the identical value.
3. Every op gloo has on CPU in torch 2.13: broadcast, allgather (list, single-tensor
   and coalesced forms), reduce_scatter (list, tensor and coalesced forms), reduce,
   gather, scatter, all_to_all (list and single-tensor, even or uneven splits),
   barrier, monitored_barrier, allreduce_coalesced (:mod:`.ops`), and point-to-point
   send/recv/recv from any source (:mod:`.p2p`). reduce_scatter SUM/AVG of float
   tensors is quantized when compression is on (FSDP's gradient reduce-scatter),
   like all_reduce; its allgathers stay exact.
4. The ``timeout`` given to init_process_group bounds every wait: it becomes the
   engine's per-wait deadline (CommConfig.timeout) and bounds ``work.wait()``.
5. ``async_op=True`` returns a :class:`~cgx_ucx.torch.work.CGXWork`; errors surface
   from ``wait()`` and ``get_future()`` as CGXError subclasses.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime
import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..arrays import check_root
from ..config import (
    CompressionConfig,
    compression_from_env,
    environment_problems,
    raise_problems,
)
from ..errors import CGXError, CGXTimeoutError, ConfigError
from ..transport.topology import hierarchy_problems
from . import at_exit, ops
from . import p2p as _p2p
from ._convert import as_array
from .checks import (
    check_allgather_outputs,
    check_coalesced,
    check_gather_into,
    check_root_tensor,
    per_rank,
    single,
)
from .group_order import GroupIdentity, check_group_order
from .options import CGXOptions, comm_config
from .protocols import Communicator, Store
from .startup import connect, warm_torch_path
from .work import CGXWork, wait_seconds

__all__ = ["BACKEND_NAME", "MONITOR_STATUS_WAIT_S", "ProcessGroupCGX"]

log = logging.getLogger("cgx_ucx")

BACKEND_NAME = "cgx"

#: How long monitored_barrier waits for the peers' status answers after its timeout.
MONITOR_STATUS_WAIT_S = 5.0


def _timeout_of(opts: Any) -> Any:
    """The ``timeout`` of torch's options object, if any."""
    return getattr(opts, "timeout", None)


def _tells_peers(fn: Callable[..., CGXWork]) -> Callable[..., CGXWork]:
    """For a numbered collective: an error raised before the engine call is submitted
    (a ConfigError of :mod:`.checks`, or torch refusing the tensors) also refuses that
    call on the engine, so the peers raise CollectiveMismatchError at once instead of
    pairing this rank's next call with it or waiting until the timeout. Each such method
    starts exactly one engine collective, so the refusal takes the number the call would
    have taken; an error after the submission is not refused again. Only this thread's
    submissions count: another thread's collective on the group in the meantime does
    not hide the error."""

    @functools.wraps(fn)
    def checked(self: ProcessGroupCGX, *args: Any, **kwargs: Any) -> CGXWork:
        before = self._comm.submitted_here
        try:
            return fn(self, *args, **kwargs)
        except Exception as exc:
            if not self._closed and self._size > 1 and self._comm.submitted_here == before:
                # A closed or failed communicator: the peers know already.
                with contextlib.suppress(CGXError):
                    self._comm.refuse(fn.__name__, exc)
            raise

    return checked


class ProcessGroupCGX(dist.ProcessGroup):
    """A torch.distributed process group whose collectives run on cgx_ucx.

    Made by ``dist.init_process_group("cgx")`` / ``dist.new_group(backend="cgx")``;
    users normally do not construct it. ``communicator`` is the engine's synchronous
    communicator (the DDP hook and GradientSync use it directly).
    """

    def __init__(
        self,
        store: Store | None,
        rank: int,
        size: int,
        timeout: datetime.timedelta | None = None,
        options: CGXOptions | None = None,
        *,
        communicator: Communicator | None = None,
        group: GroupIdentity | None = None,
    ) -> None:
        # The (store, rank, size) constructor refuses Python subclasses in torch 2.13.
        super().__init__(rank, size)
        if options is not None and not isinstance(options, CGXOptions):
            raise ConfigError(
                f"pg_options of a cgx group must be cgx_ucx.torch.CGXOptions, got {options!r}"
            )
        self._rank = rank
        self._size = size
        self._comm_config = comm_config(timeout, options)
        self._compression = options.compression if options is not None else None
        # Every bad CGX_* value fails here, all named, on every rank alike (not at connect,
        # where the first rank to find one failed and its peers saw only that it did).
        raise_problems(
            environment_problems(compression=self._compression is None) + hierarchy_problems()
        )
        self._group_name = ""
        self._group_desc = ""
        self._closed = False
        if communicator is None and group is not None:
            # Before the connect, which would wait out its timeout for peers that made
            # another group under this name.
            check_group_order(store, group, rank, self._comm_config.connect_timeout)
        self._comm = (
            communicator
            if communicator is not None
            else connect(store, rank, size, self._comm_config, "cgx")
        )
        self._view = ops.GroupView(self._comm, rank, size)
        warm_torch_path()
        at_exit.close_at_exit(self)
        log.info(
            "cgx process group rank %d/%d up (timeout %.0f s)",
            rank,
            size,
            self._comm_config.timeout,
        )

    # -- identity (the trampoline needs these for a Python group) ------------------------
    def getBackendName(self) -> str:
        return BACKEND_NAME

    def getRank(self) -> int:
        return self._rank

    def getSize(self) -> int:
        return self._size

    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupName(self) -> str:
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    def getGroupDesc(self) -> str:
        return self._group_desc

    def __repr__(self) -> str:
        return f"ProcessGroupCGX(rank={self._rank}, size={self._size}, name={self._group_name!r})"

    # -- configuration ---------------------------------------------------------------------
    @property
    def communicator(self) -> Communicator:
        """The engine's synchronous communicator of this group."""
        return self._comm

    @property
    def timeout(self) -> float:
        """Seconds any single wait of this group may take."""
        return self._comm_config.timeout

    @property
    def compression(self) -> CompressionConfig:
        """The compression all_reduce uses now (explicit, else environment, else off)."""
        return self._compression if self._compression is not None else compression_from_env()

    @compression.setter
    def compression(self, config: CompressionConfig | None) -> None:
        """Set explicit compression (wins over the environment); None: back to env."""
        if config is not None and not isinstance(config, CompressionConfig):
            raise ConfigError(f"expected a CompressionConfig or None, got {config!r}")
        self._compression = config

    # -- plumbing ----------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise CGXError("this cgx process group has been shut down")

    def _work(
        self,
        what: str,
        cf: Any,
        finish: Callable[[Any], Any],
        timeout: Any = None,
    ) -> CGXWork:
        secs = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else None
        limit = secs if secs is not None and secs > 0 else self._comm_config.timeout
        return CGXWork.from_future(what, limit, cf, finish)

    def _run(self, pending: ops.Pending, opts: Any) -> CGXWork:
        return self._work(pending.what, pending.future, pending.finish, _timeout_of(opts))

    # -- collectives -------------------------------------------------------------------------
    @_tells_peers
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> CGXWork:
        self._check_open()
        opts = opts if opts is not None else dist.AllreduceOptions()
        t = single(tensors, "allreduce")
        stage, back = ops.staged(t)
        cf, post = ops.allreduce_into(self._view, stage, opts.reduceOp, self.compression)

        def finish(_: Any) -> list[torch.Tensor]:
            post()
            back()
            return tensors

        return self._work("allreduce", cf, finish, opts.timeout)

    @_tells_peers
    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> CGXWork:
        self._check_open()
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        check_coalesced(tensors)
        flat = torch.cat([t.reshape(-1) for t in tensors])
        cf, post = ops.allreduce_into(self._view, flat, opts.reduceOp, self.compression)

        def finish(_: Any) -> list[torch.Tensor]:
            post()
            offset = 0
            for t in tensors:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()
            return tensors

        return self._work("allreduce_coalesced", cf, finish, opts.timeout)

    @_tells_peers
    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> CGXWork:
        self._check_open()
        opts = opts if opts is not None else dist.BroadcastOptions()
        t = single(tensors, "broadcast")
        check_root_tensor(opts.rootTensor)
        stage, back = ops.staged(t)
        cf = self._comm.broadcast(as_array(stage), root=opts.rootRank)

        def finish(_: Any) -> list[torch.Tensor]:
            back()
            return tensors

        return self._work("broadcast", cf, finish, opts.timeout)

    def _allgather_flat(self, inp: torch.Tensor, out: torch.Tensor) -> Any:
        """Gather contiguous ``inp`` from every rank into contiguous ``out`` (world, n)."""
        return self._comm.allgather(as_array(inp.reshape(-1)), out=as_array(out))

    @_tells_peers
    def allgather(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> CGXWork:
        self._check_open()
        t = single(input_tensors, "allgather")
        outs = per_rank(output_tensors, self._size, "allgather", "output")
        check_allgather_outputs(outs, t)
        src = t.contiguous()
        gathered = torch.empty((self._size, t.numel()), dtype=t.dtype, device=t.device)
        cf = self._allgather_flat(src, gathered)

        def finish(_: Any) -> list[list[torch.Tensor]]:
            for o, row in zip(outs, gathered, strict=True):
                o.copy_(row.view_as(o))
            return output_tensors

        return self._work("allgather", cf, finish, _timeout_of(opts))

    @_tells_peers
    def all_gather_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> CGXWork:
        """Gather every rank's ``input`` into ``output`` (world * numel values)."""
        self._check_open()
        check_gather_into(output, input, self._size)
        stage, back = ops.staged(output)
        cf = self._allgather_flat(input.contiguous(), stage.view(self._size, -1))

        def finish(_: Any) -> list[torch.Tensor]:
            back()
            return [output]

        return self._work("all_gather_single", cf, finish, _timeout_of(opts))

    # torch < 2.13 names the same operation _allgather_base.
    _allgather_base = all_gather_single

    @_tells_peers
    def allgather_coalesced(
        self,
        output_lists: list[list[torch.Tensor]],
        input_list: list[torch.Tensor],
        opts: Any = None,
    ) -> CGXWork:
        self._check_open()
        return self._run(ops.allgather_coalesced(self._view, output_lists, input_list), opts)

    @_tells_peers
    def allgather_into_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> CGXWork:
        self._check_open()
        return self._run(ops.allgather_into_tensor_coalesced(self._view, outputs, inputs), opts)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    @_tells_peers
    def reduce_scatter(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: Any = None,
    ) -> CGXWork:
        """Shard ``rank`` of the reduction; SUM/AVG of floats quantized when compression
        is on (the sum of the peers' quantized shards and our own exact one)."""
        self._check_open()
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        out = single(output_tensors, "reduce_scatter")
        ins = per_rank(input_tensors, self._size, "reduce_scatter", "input")
        cfg = self.compression
        return self._run(ops.reduce_scatter(self._view, out, ins, opts.reduceOp, cfg), opts)

    @_tells_peers
    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> CGXWork:
        """reduce_scatter_tensor: as :meth:`reduce_scatter`; ``input`` stays unchanged."""
        self._check_open()
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        pending = ops.reduce_scatter(
            self._view, output, input, opts.reduceOp, self.compression, "reduce_scatter_single"
        )
        return self._run(pending, opts)

    _reduce_scatter_base = reduce_scatter_single

    @_tells_peers
    def reduce_scatter_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> CGXWork:
        self._check_open()
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        pending = ops.reduce_scatter_tensor_coalesced(
            self._view, outputs, inputs, opts.reduceOp, self.compression
        )
        return self._run(pending, opts)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    @_tells_peers
    def alltoall_base(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> CGXWork:
        """all_to_all_single: even (empty split lists) or uneven splits along dim 0."""
        self._check_open()
        pending = ops.alltoall_single(
            self._view, output, input, output_split_sizes, input_split_sizes
        )
        return self._run(pending, opts)

    all_to_all_single = alltoall_base

    @_tells_peers
    def alltoall(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> CGXWork:
        self._check_open()
        return self._run(ops.alltoall(self._view, output_tensors, input_tensors), opts)

    @_tells_peers
    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> CGXWork:
        """Reduce to ``rootRank``; other ranks' tensors are left unchanged. An all_reduce
        underneath: SUM/AVG of floats is quantized when compression is on, as there."""
        self._check_open()
        opts = opts if opts is not None else dist.ReduceOptions()
        t = single(tensors, "reduce")
        check_root(opts.rootRank, self._size, "reduce: root")  # else nobody keeps the sum
        is_root = self._rank == opts.rootRank
        stage = t.contiguous() if is_root else t.clone(memory_format=torch.contiguous_format)
        cf, post = ops.allreduce_into(
            self._view, stage, opts.reduceOp, self.compression, root=opts.rootRank
        )

        def finish(_: Any) -> list[torch.Tensor]:
            post()
            if is_root and stage is not t:
                t.copy_(stage)
            return tensors

        return self._work("reduce", cf, finish, opts.timeout)

    @_tells_peers
    def gather(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> CGXWork:
        self._check_open()
        opts = opts if opts is not None else dist.GatherOptions()
        t = single(input_tensors, "gather")
        is_root = self._rank == opts.rootRank
        outs = per_rank(output_tensors, self._size, "gather", "output") if is_root else []
        cf, post = ops.gather(self._view, outs, t, opts.rootRank)

        def finish(result: Any) -> list[list[torch.Tensor]]:
            post(result)
            return output_tensors

        return self._work("gather", cf, finish, opts.timeout)

    @_tells_peers
    def scatter(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: Any = None,
    ) -> CGXWork:
        self._check_open()
        opts = opts if opts is not None else dist.ScatterOptions()
        out = single(output_tensors, "scatter")
        is_root = self._rank == opts.rootRank
        ins = per_rank(input_tensors, self._size, "scatter", "input") if is_root else None
        cf, post = ops.scatter(self._view, out, ins, opts.rootRank)

        def finish(result: Any) -> list[torch.Tensor]:
            post(result)
            return output_tensors

        return self._work("scatter", cf, finish, opts.timeout)

    @_tells_peers
    def barrier(self, opts: Any = None) -> CGXWork:
        self._check_open()
        cf = self._comm.barrier()
        return self._work("barrier", cf, lambda _: [], _timeout_of(opts))

    def monitored_barrier(self, timeout: Any = None, wait_all_ranks: bool = False) -> None:
        """A barrier bounded by ``timeout``: past it, a CGXTimeoutError naming every rank
        that has not reached the barrier (asked on the control channels), as gloo's
        names the ranks that failed to pass it. Every rank waits for all and reports all
        late ranks (``wait_all_ranks`` is accepted; the report is always complete)."""
        work = self.barrier()
        try:
            work.wait(timeout)
        except CGXTimeoutError as exc:
            try:
                late = self._comm.late_peers().result(MONITOR_STATUS_WAIT_S)
            except (CGXError, concurrent.futures.TimeoutError):
                raise exc from None
            if not late:
                raise
            ranks = [r for r, _ in late]
            raise CGXTimeoutError(
                f"monitored_barrier on rank {self._rank}: rank(s) {ranks} did not reach the "
                f"barrier within {wait_seconds(timeout) or self.timeout:g} s: "
                + "; ".join(text for _, text in late),
                peer=ranks[0],
                alive=None,
            ) from exc

    # -- point to point ------------------------------------------------------------------------
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> CGXWork:
        """Send to group rank ``dst``; ordered per (destination, tag) (see :mod:`.p2p`)."""
        self._check_open()
        return self._run(_p2p.send(self._view, tensors, dst, tag), None)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> CGXWork:
        self._check_open()
        return _p2p.recv(self._view, tensors, src, tag, self._comm_config.timeout)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> CGXWork:
        """Receive from whichever rank sends first on ``tag``; the work's
        ``_source_rank()`` names it (torch's ``recv(src=None)`` returns it)."""
        self._check_open()
        return _p2p.recv(self._view, tensors, None, tag, self._comm_config.timeout)

    # -- lifetime ----------------------------------------------------------------------------
    def shutdown(self, timeout: float | None = None) -> None:
        """Close the communicator (dist.destroy_process_group calls this)."""
        at_exit.forget(self)
        if not self._closed:
            self._closed = True
            self._comm.close(timeout)

    def abort(self) -> None:
        self.shutdown()
