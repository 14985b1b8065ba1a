"""A torchft process group on cgx_ucx: fault-tolerant training with compressed all-reduce.

torchft's :class:`~torchft.manager.Manager` drives :class:`ProcessGroupCGX` as it drives
its own ``ProcessGroupGloo``: at every quorum change it calls
``configure(store_addr, replica_id, rank, world_size, ...)``, which drops the group of
the previous quorum and connects a fresh ``cgx`` group
(:class:`cgx_ucx.torch.ProcessGroupCGX`) under the quorum's store prefix, in the same
process. Everything torchft runs on a process group works on this one: its
``DistributedDataParallel`` and ``OptimizerWrapper``, ``Manager.allreduce``, DiLoCo and
Streaming DiLoCo (:mod:`torchft.local_sgd`) and the checkpoint transports (they use
broadcast, send and recv, which stay exact)::

    from cgx_ucx.torchft import ProcessGroupCGX
    from torchft import Manager

    pg = ProcessGroupCGX(bits=4)                   # or CGX_COMPRESSION_* variables
    manager = Manager(pg=pg, min_replica_size=1, ...)

Semantics:

1. all_reduce SUM/AVG of float tensors is quantized as in the ``cgx`` backend: the
   ``compression`` (or ``bits``) given here, else the CGX_COMPRESSION_* environment
   variables read at each call. :meth:`ProcessGroupCGX.compressed` overrides it for the
   calls made inside a ``with`` block on the calling thread (say, 2-bit DiLoCo
   pseudo-gradients while the rest stays exact). The reduced values are identical on
   every replica, so replicas that start equal stay bit-identical.
2. :meth:`ProcessGroupCGX.abort` fails every operation in flight at once with a
   :class:`~cgx_ucx.errors.TransportError` and releases the endpoints without waiting
   on any peer; a call made after it raises :class:`ProcessGroupAbortedError`, which
   torchft's Manager records as the step's error. :meth:`errored` returns the abort's
   error until the next ``configure``.
3. Reconfiguration tears the previous group down as :meth:`abort` does (without its
   error): torchft configures only between steps, and peers that still hold the old
   group see this rank leave it, which is what a new quorum means (a peer still
   finishing that group's last collective fails it, does not commit the step, and
   heals from a group that did); :meth:`shutdown` closes gracefully instead. The
   engine thread and the UCX context are held from the first ``configure`` to
   :meth:`shutdown`, so a reconfiguration neither starts threads nor pays UCX's start
   and stop.
4. HSDP (a DeviceMesh over torchft's ManagedProcessGroup) needs a group registered
   with torch's functional collectives, which a Python process group cannot serve:
   :meth:`register` raises :class:`~cgx_ucx.errors.ConfigError` saying so.

5. :class:`DistributedDataParallel` is torchft's, with a comm hook that also works once
   the Manager has recorded an error (torchft 0.2.0's fails inside backward then), and
   that lets this group average as it reduces when every replica of the quorum
   participates (:meth:`ProcessGroupCGX.summing_as_average`), instead of the Manager
   dividing every bucket afterwards.
6. :class:`PseudoGradientFeedback` adds error feedback to a DiLoCo's compressed
   pseudo-gradients: each parameter's quantization error is carried into its next sync.

Requires the ``ft`` extra (torchft).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torchft.ddp import DistributedDataParallel as _FtDDP
from torchft.process_group import ProcessGroupWrapper

from .config import CommConfig, CompressionConfig, compression_from_env, resolve_comm
from .errors import CGXError, ConfigError, TransportError
from .torch import CGXOptions
from .torch import ProcessGroupCGX as _CGXGroup

__all__ = [
    "ABORT_TIMEOUT_S",
    "BACKEND_NAME",
    "DistributedDataParallel",
    "ProcessGroupAbortedError",
    "ProcessGroupCGX",
    "PseudoGradientFeedback",
]

log = logging.getLogger("cgx_ucx")

#: The name torchft and torch.distributed see (``getBackendName()``).
BACKEND_NAME = "torchft-cgx"

#: Seconds :meth:`ProcessGroupCGX.abort` waits for the engine to release the old group.
#: Releasing is local work (no peer is waited on); the bound only guards against an
#: engine loop held up by other work.
ABORT_TIMEOUT_S = 5.0


class ProcessGroupAbortedError(TransportError):
    """The torchft process group was aborted or is not configured: torchft's Manager
    reports it as the step's error and configures a new group at the next quorum."""


class ProcessGroupCGX(ProcessGroupWrapper):
    """A reconfigurable ``cgx`` process group for torchft (see the module docstring).

    ``timeout`` bounds every wait of a collective and the connect of each configure.
    ``compression`` (a :class:`~cgx_ucx.config.CompressionConfig`) or its shorthand
    ``bits`` sets the all_reduce compression; neither: the CGX_COMPRESSION_* variables.
    ``comm`` is the base of the communicator's configuration (its timeouts are replaced
    by ``timeout``).
    """

    def __init__(
        self,
        timeout: datetime.timedelta = datetime.timedelta(seconds=60),
        *,
        compression: CompressionConfig | None = None,
        bits: int | None = None,
        comm: CommConfig | None = None,
    ) -> None:
        super().__init__(timeout=timeout)
        if compression is not None and bits is not None:
            raise ConfigError("give compression or bits, not both")
        if compression is not None and not isinstance(compression, CompressionConfig):
            raise ConfigError(f"compression must be a CompressionConfig, got {compression!r}")
        self._compression = CompressionConfig(bits=bits) if bits is not None else compression
        self._comm_base = comm
        self._errored: Exception | None = None
        self._local = threading.local()
        #: The engine and the UCX context, held from the first configure to shutdown.
        self._engine: Any = None
        self._lock = threading.Lock()
        self._configures = 0

    # -- identity -----------------------------------------------------------------------------
    def getBackendName(self) -> str:
        return BACKEND_NAME

    def __repr__(self) -> str:
        return f"ProcessGroupCGX(pg={self._pg!r}, compression={self.compression})"

    @property
    def configures(self) -> int:
        """How many times :meth:`configure` connected a group."""
        return self._configures

    @property
    def group(self) -> _CGXGroup | None:
        """The ``cgx`` group of the current quorum (None before configure, after abort)."""
        pg = self._pg
        return pg if isinstance(pg, _CGXGroup) else None

    @property
    def parent(self) -> Any:
        pg = self._pg
        if pg is None:
            raise self._errored_copy()
        return pg

    # -- compression --------------------------------------------------------------------------
    @property
    def compression(self) -> CompressionConfig | None:
        """The compression set in code (None: the CGX_COMPRESSION_* variables)."""
        return self._compression

    @compression.setter
    def compression(self, config: CompressionConfig | None) -> None:
        if config is not None and not isinstance(config, CompressionConfig):
            raise ConfigError(f"expected a CompressionConfig or None, got {config!r}")
        self._compression = config
        group = self.group
        if group is not None:
            group.compression = config

    @contextlib.contextmanager
    def compressed(
        self, config: CompressionConfig | None = None, *, bits: int | None = None
    ) -> Iterator[None]:
        """Use ``config`` (or ``CompressionConfig(bits=bits)``) for the all_reduce calls
        this thread makes inside the block, whatever the group's compression is::

            with pg.compressed(bits=2):
                manager.allreduce(pseudo_grad)
        """
        if (config is None) == (bits is None):
            raise ConfigError("compressed() takes a CompressionConfig or bits=, one of them")
        if config is None:
            config = CompressionConfig(bits=bits)  # type: ignore[arg-type]
        if not isinstance(config, CompressionConfig):
            raise ConfigError(f"expected a CompressionConfig, got {config!r}")
        with self._on_this_thread("override", config):
            yield

    def effective_compression(self) -> CompressionConfig | None:
        """The compression an all_reduce made now on this thread uses: a
        :meth:`compressed` block's, else the one set in code, else the CGX_COMPRESSION_*
        variables'; None when it sends values as they are."""
        config = getattr(self._local, "override", None)
        if config is None:
            config = self._compression if self._compression is not None else compression_from_env()
        return config if config.enabled else None

    @contextlib.contextmanager
    def summing_as_average(self) -> Iterator[None]:
        """Run the SUM all_reduce calls this thread makes inside the block as AVG: the
        group divides as it reduces (on compressed layouts, before the reduced values are
        requantized), instead of a separate pass over the result. For a caller that would
        divide the sum by the group's size itself, as torchft's ``Manager.allreduce`` does
        when every member of the quorum participates (see :class:`DistributedDataParallel`)."""
        with self._on_this_thread("average", True):
            yield

    @contextlib.contextmanager
    def _on_this_thread(self, name: str, value: Any) -> Iterator[None]:
        """Set this thread's ``name`` setting (read by :meth:`allreduce`) for the block,
        the outer block's value back after it."""
        outer = getattr(self._local, name, None)
        setattr(self._local, name, value)
        try:
            yield
        finally:
            setattr(self._local, name, outer)

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        if getattr(self._local, "average", False):
            opts = _as_average(opts)
        override = getattr(self._local, "override", None)
        if override is None:
            return super().allreduce(tensors, opts)
        group = self.parent
        # The group reads its compression when the call is submitted, synchronously.
        with self._lock:
            before = group.compression if self._compression is not None else None
            group.compression = override
            try:
                return super().allreduce(tensors, opts)
            finally:
                group.compression = before

    # -- torchft's life cycle -----------------------------------------------------------------
    def _comm_config(self) -> CommConfig:
        secs = self._timeout.total_seconds()
        if not secs > 0:
            raise ConfigError(f"the process group timeout must be > 0, got {self._timeout}")
        return resolve_comm(self._comm_base, timeout=secs, connect_timeout=secs)

    def _hold_engine(self, config: CommConfig) -> None:
        """Keep the engine thread and the UCX context from the first configure to
        :meth:`shutdown`: a group's teardown then releases only its endpoints and
        listener, and the next configure connects on the running context instead of
        starting the engine and UCX again."""
        if self._engine is not None:
            return
        from .engine import Engine  # UCX is imported only when a group is made

        engine = Engine.get(retain=True)
        try:
            engine.run(_acquire_ucx(config), config.connect_timeout)
        except BaseException:
            engine.release()
            raise
        self._engine = engine

    def _drop_engine(self) -> None:
        engine, self._engine = self._engine, None
        if engine is None:
            return
        try:
            if engine.running:
                engine.run(_release_ucx(), ABORT_TIMEOUT_S)
        except CGXError as exc:
            log.info("releasing the UCX context of a torchft-cgx group: %s", exc)
        finally:
            engine.release()

    def _create_pg(self, store: Any, rank: int, world_size: int) -> _CGXGroup:
        config = self._comm_config()
        self._hold_engine(config)
        options = CGXOptions(compression=self._compression, comm=config)
        group = _CGXGroup(store, rank, world_size, self._timeout, options)
        self._errored = None
        self._configures += 1
        log.info(
            "torchft-cgx group %d: rank %d/%d of replica %s, quorum %s",
            self._configures,
            rank,
            world_size,
            self._replica_id,
            self._quorum_id,
        )
        return group

    def abort(self, errored: bool = True) -> None:
        """Fail every operation in flight (TransportError) and release the group without
        waiting on any peer. ``errored``: :meth:`errored` reports the abort until the next
        :meth:`configure` (torchft passes False when it reconfigures)."""
        if errored:
            self._errored = ProcessGroupAbortedError(
                f"the torchft-cgx process group was aborted (replica {self._replica_id}, "
                f"quorum {self._quorum_id})"
            )
            self.errors_logger.info(
                "",
                extra={
                    "replica_id": self._replica_id,
                    "rank": self._rank,
                    "quorum_id": self._quorum_id,
                    "error": "process_group_abort",
                },
            )
        # Not torchft's abort: it calls the group's own abort(), which closes gracefully
        # (a BYE to each peer, then waits for theirs).
        pg, self._pg = self._pg, None
        if isinstance(pg, _CGXGroup):
            _release(pg)

    def errored(self) -> Exception | None:
        return self._errored

    def shutdown(self) -> None:
        """Close the group (a BYE to each peer, and a bounded wait for theirs, so that
        peers still finishing the last collective receive what this rank sent), then
        release the engine thread and the UCX context; ``configure`` may follow."""
        pg, self._pg = self._pg, None
        if isinstance(pg, _CGXGroup):
            try:
                pg.shutdown()
            except CGXError as exc:
                log.info("closing a torchft-cgx group: %s", exc)
                _release(pg)
        self._drop_engine()

    def register(self, name: str) -> Any:
        raise ConfigError(
            "ProcessGroupCGX cannot be registered with torch's functional collectives "
            "(a Python process group cannot serve them), so HSDP through torchft's "
            "ManagedProcessGroup and DeviceMesh is not supported: use it for the replica "
            "dimension through the Manager (DDP, DiLoCo), or torchft's ProcessGroupGloo/NCCL"
        )

    def _errored_copy(self) -> ProcessGroupAbortedError:
        if isinstance(self._errored, ProcessGroupAbortedError):
            return ProcessGroupAbortedError(str(self._errored))
        return ProcessGroupAbortedError(
            "the torchft-cgx process group is not configured (configure() is called by "
            "torchft's Manager at each quorum)"
        )


async def _acquire_ucx(config: CommConfig) -> None:
    """On the engine loop: count one more user of the process's UCX context."""
    from .transport import ucx

    ucx.acquire(config.progress_mode, config.ucx_env)


async def _release_ucx() -> None:
    from .transport import ucx

    ucx.release()


async def _abort_communicator(comm: Any) -> None:
    """On the engine loop: drop the endpoints at once (in-flight calls fail), then close
    the communicator (nothing left to wait for)."""
    with contextlib.suppress(Exception):
        await comm.transport.abort()
    await comm.close()


def _release(group: _CGXGroup) -> None:
    """Tear ``group`` down without waiting on its peers: in-flight operations fail with
    TransportError at once."""
    sync = group.communicator
    engine = sync.engine
    if not sync.closed and engine.running:
        try:
            if threading.current_thread() is engine.thread:
                engine.submit(_abort_communicator(sync.comm))
            else:
                engine.run(_abort_communicator(sync.comm), ABORT_TIMEOUT_S)
        except CGXError as exc:
            log.info("releasing a torchft-cgx group: %s", exc)
    group.shutdown(ABORT_TIMEOUT_S)


class DistributedDataParallel(_FtDDP):
    """torchft's ``DistributedDataParallel`` with a comm hook that does not wait for each
    bucket's all-reduce, and that takes the Manager's error paths, where torchft 0.2.0's
    hook waits, fails or hangs inside backward:

    - torchft's hook calls ``wait()`` on each bucket's work before it returns, so a
      bucket's all-reduce never overlaps the backward pass of the layers before it. Here
      the managed work's future chain (the Manager's average, its error handling) is set
      up without waiting, and DDP waits for all buckets at the end of backward, as with a
      plain process group;
    - once a step has failed, ``Manager.allreduce`` returns a finished placeholder work
      whose future torchft's hook cannot unwrap (an AssertionError/AttributeError): here
      its future is returned as it is;
    - a bucket's all-reduce that fails (any error the process group raises) made the
      managed work's ``wait()`` record the error and return False without ever setting up
      its future, which then never completed: DDP's backward waited on it forever. Here
      the Manager's error handling completes the bucket's future with the bucket as it is.

    Either way the step ends, and ``should_commit`` discards a failed one. On a
    :class:`ProcessGroupCGX` whose quorum is all participating, each bucket is averaged
    by the group as it reduces (see :func:`_average`).

    Same constructor, except that ``gradient_as_bucket_view`` defaults to True: each
    parameter's ``.grad`` is a view of its bucket, so the all-reduced bucket is the
    gradient and DDP copies nothing back: a pass over every gradient a step fewer, and
    no second copy of the gradients held (3 replica groups of the 22 M-parameter MLP on
    a 2-core host: 0.50 -> 0.47 s a step at 4 bits). Pass
    ``gradient_as_bucket_view=False`` for DDP's default.
    """

    def __init__(self, manager: Any, module: torch.nn.Module, **kwargs: Any) -> None:
        kwargs.setdefault("gradient_as_bucket_view", True)
        super().__init__(manager, module, **kwargs)

    # Unannotated: DDP checks the annotations, and this module's are strings.
    @staticmethod
    def _comm_hook(state, bucket):  # type: ignore[no-untyped-def]
        work = _average(state, bucket.buffer())
        chained = _managed_future(work)
        if chained is not None:
            return chained
        if work.wait() is False:  # the Manager holds the error: the step is discarded
            return _finished(bucket.buffer())
        fut = work.get_future()
        inner = getattr(fut, "_fut", None)  # a managed future: hand out the real one
        return inner if inner is not None else fut


def _as_average(opts: Any) -> Any:
    """``opts`` (AllreduceOptions or a ReduceOp) with a SUM turned into AVG."""
    from torch.distributed import AllreduceOptions, ReduceOp

    if isinstance(opts, AllreduceOptions):
        if opts.reduceOp != ReduceOp.SUM:
            return opts
        avg = AllreduceOptions()
        avg.reduceOp = ReduceOp.AVG
        avg.timeout = opts.timeout
        avg.asyncOp = opts.asyncOp
        return avg
    return ReduceOp.AVG if opts == ReduceOp.SUM else opts


def _average(manager: Any, tensor: torch.Tensor) -> Any:
    """``manager.allreduce(tensor)`` (the average over the step's participants). Where
    every member of the quorum participates, on a :class:`ProcessGroupCGX`, the group
    averages as it reduces, and the Manager's division of the result (one more pass over
    every bucket, on the group's completion thread) goes: the average, each replica
    bit-identical. Otherwise (a replica recovering, an error recorded, another group)
    the Manager's path as it is."""
    from torch.distributed import ReduceOp

    pg = getattr(manager, "_pg", None)
    if (
        not isinstance(pg, ProcessGroupCGX)
        or not tensor.is_floating_point()
        or manager.errored() is not None
    ):
        return manager.allreduce(tensor)
    manager.wait_quorum()  # as manager.allreduce does first: the step's participants
    group = pg.group
    if (
        group is None
        or not manager.is_participating()
        or manager.num_participants() != group.size()
    ):
        return manager.allreduce(tensor)
    with pg.summing_as_average():
        return manager.allreduce(tensor, reduce_op=ReduceOp.SUM)


def _managed_future(work: Any) -> torch.futures.Future | None:
    """A future of torchft's managed ``work`` that completes when its all-reduce and the
    callbacks registered on it (the Manager's average) are done, without waiting for it;
    a failure is reported to the Manager and the future completes with the bucket as it
    is (``Manager.wrap_future``). None for any other work (a finished placeholder, a
    plain process group's), or a torchft whose managed work is built otherwise.

    torchft 0.2 runs that chain only inside ``wait()``, after waiting: its callbacks
    close over the loop variable that walks the chain, so run later they find the wrong
    node. The chain is walked here instead, each callback bound to its own node."""
    head = getattr(work, "_managed_fut_head", None)
    inner, manager = getattr(work, "_work", None), getattr(work, "_manager", None)
    if head is None or inner is None or manager is None or not hasattr(work, "_value"):
        return None
    from torchft.manager import _SimpleFuture

    value = [work._value]  # noqa: SLF001 - torchft 0.2's managed work, no public way

    def step(callback: Any) -> Any:
        def run(done: torch.futures.Future) -> Any:
            done.wait()  # the all-reduce's error, if any, goes on to wrap_future
            value[0] = callback(_SimpleFuture(value[0]))
            return value[0]

        return run

    fut = inner.get_future()
    node = head
    while node._next is not None:  # noqa: SLF001
        fut = fut.then(step(node._callback))  # noqa: SLF001
        node = node._next  # noqa: SLF001
    if node is head:  # no callback: the bucket is the all-reduce's result
        fut = fut.then(lambda done: (done.wait(), value[0])[1])
    fut = manager.wrap_future(fut, value[0])
    # A later wait() on the work waits for this chain instead of running the callbacks
    # a second time.
    node._fut = fut  # noqa: SLF001
    work._is_set_future_callback_called = True  # noqa: SLF001
    return fut


def _finished(value: torch.Tensor) -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return fut


class PseudoGradientFeedback:
    """Error feedback on the pseudo-gradients of a torchft ``DiLoCo`` (or Streaming
    DiLoCo) whose outer syncs go through a :class:`ProcessGroupCGX`::

        with DiLoCo(manager, [model], inner, outer, sync_every=100) as diloco:
            feedback = PseudoGradientFeedback(diloco, pg)
            for batch in data:
                ...
                with pg.compressed(bits=2):
                    inner.step()          # every 100th step syncs, with error feedback

    At each sync, before the all-reduce, every parameter's pseudo-gradient gets the
    residual its previous sync left (``c = g + residual``), and the new residual is
    ``c - decode(encode(c))`` with the bits and bucket size that sync uses (the same
    rounding the all-reduce applies to this replica's contribution), so the quantization
    error of one sync is sent in the next instead of being lost (EF-SGD, Karimireddy et
    al. 2019). A sync that is not committed (``should_commit`` False, or an error) puts
    the previous residuals back; a replica group that does not take part in a sync
    (healing) keeps its residuals. A sync sent exactly (compression off) sends the
    residual once and clears it. Residuals live with this object: a restarted replica
    group starts without them.

    Needs per-parameter all-reduces (``use_bucketization`` off: a bucket's quantization
    blocks would not be the parameters'); ConfigError otherwise, or when the DiLoCo's
    torchft version keeps its pseudo-gradients elsewhere.
    """

    def __init__(self, diloco: Any, pg: ProcessGroupCGX) -> None:
        from .torch._feedback import LayerFeedback

        if not isinstance(pg, ProcessGroupCGX):
            raise ConfigError(f"pg must be a cgx_ucx.torchft.ProcessGroupCGX, got {pg!r}")
        fragments = getattr(diloco, "_fragments", None)
        if not fragments or not all(_feedback_ready(f) for f in fragments):
            raise ConfigError(
                "PseudoGradientFeedback needs a torchft DiLoCo whose fragments save their "
                "pseudo-gradients in _grads (_save_grads) and sync through perform_sync "
                f"(torchft 0.2); got {type(diloco).__name__}"
            )
        if any(getattr(f, "use_bucketization", False) for f in fragments):
            raise ConfigError(
                "error feedback on pseudo-gradients needs per-parameter all-reduces: "
                "create the DiLoCo with use_bucketization=False"
            )
        self._pg = pg
        self._feedback = LayerFeedback(undoable=True)
        self._index: dict[tuple[int, str], int] = {}
        #: Syncs whose pseudo-gradients got error feedback, and those rolled back.
        self.applied = 0
        self.rolled_back = 0
        for i, fragment in enumerate(fragments):
            self._wrap(i, fragment)

    def _wrap(self, number: int, fragment: Any) -> None:
        save_grads, perform_sync = fragment._save_grads, fragment.perform_sync  # noqa: SLF001

        def save_grads_with_feedback() -> None:
            save_grads()
            if fragment._manager.is_participating():  # noqa: SLF001
                self._apply(number, fragment._grads)  # noqa: SLF001

        def perform_sync_then_keep() -> bool:
            try:
                committed = perform_sync()
            except BaseException:
                self._feedback.rollback()
                self.rolled_back += 1
                raise
            if committed:
                self._feedback.commit()
            else:
                self._feedback.rollback()
                self.rolled_back += 1
            return committed

        fragment._save_grads = save_grads_with_feedback  # noqa: SLF001
        fragment.perform_sync = perform_sync_then_keep

    def _apply(self, number: int, grads: dict[str, torch.Tensor]) -> None:
        from .torch.ops import allreduce_layout

        config = self._pg.effective_compression()
        for name, g in grads.items():
            if not g.is_contiguous():  # not one of DiLoCo's: it makes each one afresh
                continue
            index = self._index.setdefault((number, name), len(self._index))
            # The layout the group's all_reduce sends it with: the same rounding.
            layout = allreduce_layout(g.numel(), g.dtype, config)
            self._feedback.apply(index, g.view(-1), layout)
        self.applied += 1


def _feedback_ready(fragment: Any) -> bool:
    return all(
        hasattr(fragment, name) for name in ("_save_grads", "_grads", "perform_sync", "_manager")
    )
