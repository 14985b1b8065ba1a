"""Gradient averaging without DDP: per-parameter hooks, fused buckets, overlap.

For custom and asyncio training loops::

    sync = GradientSync(model)                # collective: every rank constructs it
    for x, y in data:
        loss_fn(model(x), y).backward()       # buckets start their allreduce here
        sync.synchronize()                    # or: await sync  (asyncio loops)
        opt.step(); opt.zero_grad()

How (numbered as in PyTorch's comm hooks):

1. At construction, the parameters that require grad are split into buckets of at
   most ``bucket_cap_mb``, in reverse registration order (gradients of the last
   layers are ready first in backward), one dtype and device per bucket. Each bucket
   has a persistent flat buffer and a layer layout (1-D and small layers uncompressed,
   :func:`~cgx_ucx.torch.layers.layer_layout`, as in :func:`~cgx_ucx.torch.hook.cgx_hook`).
2. ``Tensor.register_post_accumulate_grad_hook`` on every parameter (public autograd
   API; nothing reaches into ``grad_fn``) copies the accumulated gradient into its
   bucket. When a bucket is full its compressed allreduce starts on the engine thread
   while backward goes on, averaged as :func:`~cgx_ucx.torch.layers.bucket_op` says
   (by the engine, or divided by the world size first). Buckets start in
   index order on every rank, so ranks whose autograd order differs still pair the
   same buckets (the engine pairs collectives by sequence number).
3. ``synchronize()`` starts the buckets whose parameters got no gradient in this
   backward (each contributes its ``param.grad`` as it is, zeros without one: so a
   parameter used on some ranks gets their average, as DDP's find_unused_parameters),
   waits for all with the communicator's timeout, and writes the averages into
   ``param.grad`` (not for parameters frozen since construction). By default a
   parameter no rank used gets a zero gradient. With ``find_unused_parameters=True``
   (DDP's name and meaning) every rank also sums, after the buckets, one exact flag per
   parameter (its hook ran since the last synchronize, under ``no_sync()`` too), and a
   parameter no rank used keeps its ``.grad`` as it is (None stays None), as DDP does;
   optimizers then skip it instead of stepping on a zero gradient (momentum, weight
   decay). That costs one small uncompressed allreduce per step.
4. With an adaptive ``policy``: each bucket shows the policy this rank's gradients
   before it is divided (``policy.observe``: work only on the steps before a decision
   and on logging steps). After the averages are written, every rank runs the
   policy's agreement for the next step (at construction for the first), which
   communicates only at decision steps, and each bucket's layout becomes
   ``policy.layout`` of its layers: nothing of this runs during backward.

A parameter that gets no gradient in a backward pass holds its bucket, and to keep
the order the buckets after it, until ``synchronize()``: pass only the parameters
that are used to keep the full overlap.

Gradient accumulation: wrap the backward passes that should not communicate in
``with sync.no_sync():``; a parameter that becomes ready twice between two
synchronizations is an error (as in DDP), not a silent double count.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Generator, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..arrays import check_positive_int, check_seconds
from ..compression.policies import LayerStats, Policy
from ..config import CompressionConfig, resolve_comm, resolved_compression
from ..errors import CGXTimeoutError, ConfigError
from ..layout import Layout
from ._convert import as_array
from ._feedback import LayerFeedback, split_state
from ._policy import DEFAULT_LOG_EVERY, PolicyRunner, check_policy_args, named_parameters
from .communicators import get_communicator
from .layers import PAPER_DEFAULTS, average_first, bucket_seed, layer_layout, wire_bytes
from .protocols import Communicator

__all__ = ["GradientSync"]

#: DDP's default bucket cap (torch.nn.parallel.DistributedDataParallel, 25 MiB): large
#: enough to amortize per-message costs, small enough to overlap with backward.
DEFAULT_BUCKET_CAP_MB = 25.0


@dataclass
class _Bucket:
    index: int
    params: list[torch.nn.Parameter]
    offsets: list[int]
    buffer: torch.Tensor
    layout: Layout
    indices: tuple[int, ...] = ()  # the policy's layer index of each parameter
    ready: set[int] = field(default_factory=set)  # slots whose gradient is in the buffer
    used: set[int] = field(default_factory=set)  # slots whose hook ran since synchronize
    #: Error-feedback residuals of the slots this rank did not use, as they were before
    #: this step (find_unused_parameters): put back for the ones no rank used.
    held: dict[int, Any] = field(default_factory=dict)
    future: concurrent.futures.Future[Any] | None = None

    @property
    def full(self) -> bool:
        return len(self.ready) == len(self.params)


class GradientSync:
    """Average the gradients of ``model_or_params`` across ranks with compressed allreduce.

    ``process_group`` (default WORLD) or an explicit engine ``communicator`` selects the
    ranks; on a non-``cgx`` group a cgx_ucx communicator is made, so construction is
    collective. ``compression_params``, ``layer_min_size``, ``error_feedback``,
    ``policy``, ``policy_params`` and ``log_every`` mean what they mean for
    :class:`~cgx_ucx.torch.hook.CGXState` (paper defaults: 4 bits, bucket 1024, policy
    ``"static"``); the policy's layers are the parameters given here, named after the
    module's ``named_parameters()`` when a module is given. ``find_unused_parameters``:
    leave the gradient of a parameter no rank used as it is, as DDP does (module
    docstring, step 3); every rank must pass the same. Stats: ``steps``,
    ``bytes_sent``, ``bytes_per_step``, and per layer :meth:`stats`.
    """

    def __init__(
        self,
        model_or_params: torch.nn.Module | Iterable[torch.nn.Parameter],
        *,
        process_group: dist.ProcessGroup | None = None,
        communicator: Communicator | None = None,
        compression_params: Mapping[str, Any] | None = None,
        layer_min_size: int = 1024,
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
        error_feedback: bool = False,
        timeout: float | None = None,
        policy: str = "static",
        policy_params: Mapping[str, Any] | None = None,
        log_every: int = DEFAULT_LOG_EVERY,
        find_unused_parameters: bool = False,
    ) -> None:
        self._module = model_or_params if isinstance(model_or_params, torch.nn.Module) else None
        if isinstance(model_or_params, torch.nn.Module):
            named = named_parameters(model_or_params)
        else:  # tensors, or (name, tensor) pairs
            named = named_parameters(list(model_or_params))
        params = [p for _, p in named]
        if not params:
            raise ConfigError("GradientSync got no parameters that require grad")
        if not bucket_cap_mb > 0:
            raise ConfigError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb!r}")
        layer_min_size = check_positive_int(layer_min_size, "layer_min_size", 0)
        policy, policy_params, log_every = check_policy_args(policy, policy_params, log_every)

        if compression_params is not None and not isinstance(compression_params, Mapping):
            raise ConfigError(
                "compression_params must be a mapping of CompressionConfig fields, got "
                f"{compression_params!r}"
            )
        if timeout is not None:
            check_seconds(timeout)
        if not isinstance(find_unused_parameters, bool):
            raise ConfigError(
                f"find_unused_parameters must be True or False, got {find_unused_parameters!r}"
            )
        self._find_unused = find_unused_parameters
        # -- tuned by the user
        self.compression_params = dict(compression_params or {})
        self.layer_min_size = layer_min_size
        self.error_feedback = bool(error_feedback)
        self.policy_name = policy
        self.policy_params = policy_params
        self.log_every = log_every
        config = self.compression  # validate now
        # -- internal
        if communicator is None:
            communicator = get_communicator(process_group)
        self.communicator = communicator
        self.world_size = int(communicator.world_size)
        self.timeout = timeout if timeout is not None else _comm_timeout(process_group)
        self._runner = PolicyRunner(
            policy,
            named,
            config,
            layer_min_size,
            communicator,
            world_size=self.world_size,
            timeout=self.timeout,
            params=self.policy_params,
            log_every=log_every,
        )
        self._config = config
        self._feedback = LayerFeedback(undoable=True) if self.error_feedback else None
        self._lock = threading.Lock()
        self._enabled = True
        self._next = 0  # index of the next bucket to start
        self._buckets = self._make_buckets(params, int(bucket_cap_mb * 1024 * 1024), config)
        self._slot: dict[int, tuple[_Bucket, int]] = {}
        for b in self._buckets:
            for i, p in enumerate(b.params):
                self._slot[id(p)] = (b, i)
        # Per parameter (bucket order): 1 where its hook ran since the last synchronize;
        # summed over the ranks when find_unused_parameters is on.
        self._used_flags = torch.zeros(len(self._slot), dtype=torch.float32)
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]
        # -- stats
        self.steps = 0
        self.bytes_sent = 0
        self.bytes_per_step = 0
        self._step_bytes = 0
        # The first step's assignment (collective at a decision step, e.g. auto's probe).
        self._agree()

    # -- configuration -------------------------------------------------------------------
    @property
    def compression(self) -> CompressionConfig:
        """The configuration buckets use (params > environment > paper defaults).

        An adaptive policy uses its own, resolved at construction (``policy.config``).
        """
        return resolved_compression(PAPER_DEFAULTS, self.compression_params)

    @property
    def find_unused_parameters(self) -> bool:
        """Whether a parameter no rank used keeps its gradient (fixed at construction:
        every rank must run the same collectives)."""
        return self._find_unused

    @property
    def policy(self) -> Policy:
        """The policy that assigns each layer's bits and bucket size."""
        return self._runner.policy

    def stats(self) -> list[LayerStats]:
        """Per layer: name, size, bits (32: uncompressed), bucket size, bytes of one
        encoded copy, and the relative quantization error measured at the last
        ``log_every`` step (NaN before one; 0 uncompressed)."""
        return self._runner.stats()

    def stats_table(self) -> str:
        """:meth:`stats` as a plain-text table."""
        return self._runner.stats_table()

    @property
    def buckets_started(self) -> int:
        """Buckets of the current step whose allreduce has started (0 after synchronize)."""
        return self._next

    @property
    def buckets(self) -> list[list[torch.nn.Parameter]]:
        """The parameters of each bucket, in the order buckets are sent."""
        return [list(b.params) for b in self._buckets]

    def _make_buckets(
        self, params: list[torch.nn.Parameter], cap_bytes: int, config: CompressionConfig
    ) -> list[_Bucket]:
        groups: list[list[torch.nn.Parameter]] = []
        current: list[torch.nn.Parameter] = []
        size = 0
        for p in reversed(params):
            nbytes = p.numel() * p.element_size()
            same_kind = not current or (
                current[0].dtype == p.dtype and current[0].device == p.device
            )
            if current and (not same_kind or size + nbytes > cap_bytes):
                groups.append(current)
                current, size = [], 0
            current.append(p)
            size += nbytes
        if current:
            groups.append(current)
        buckets = []
        for index, group in enumerate(groups):
            offsets, total = [], 0
            for p in group:
                offsets.append(total)
                total += p.numel()
            buffer = torch.zeros(total, dtype=group[0].dtype, device=group[0].device)
            indices = self._runner.indices(group)
            if self.policy_name == "static":
                layout = layer_layout(group, config, self.layer_min_size)
            else:
                layout = self._runner.layout(indices)
            buckets.append(_Bucket(index, group, offsets, buffer, layout, indices))
        return buckets

    # -- hooks ---------------------------------------------------------------------------
    def _on_grad(self, param: torch.Tensor) -> None:
        bucket, slot = self._slot[id(param)]
        if not self._enabled:
            with self._lock:
                bucket.used.add(slot)  # under no_sync() too: its gradient accumulated
            return
        grad = param.grad
        if grad is None:  # nothing accumulated (cannot normally happen): count as zero
            return
        if grad.is_sparse:
            raise ConfigError("GradientSync handles dense gradients only")
        with self._lock:
            if slot in bucket.ready or bucket.future is not None:
                raise ConfigError(
                    "a parameter's gradient became ready twice before synchronize(); "
                    "use `with sync.no_sync():` for the backward passes that accumulate"
                )
            off = bucket.offsets[slot]
            bucket.buffer[off : off + grad.numel()].copy_(grad.reshape(-1))
            bucket.ready.add(slot)
            bucket.used.add(slot)
            self._start_ready()

    def _start_ready(self) -> None:
        """Start, in index order, every bucket that is full (caller holds the lock)."""
        while self._next < len(self._buckets) and self._buckets[self._next].full:
            self._start(self._buckets[self._next])
            self._next += 1

    def _start(self, bucket: _Bucket) -> None:
        config = self._config
        buf = bucket.buffer
        if self._runner.policy.observing(self.steps):
            views = [
                buf[off : off + p.numel()]
                for p, off in zip(bucket.params, bucket.offsets, strict=True)
            ]
            self._runner.observe(self.steps, views, bucket.indices)
        op = average_first(buf, bucket.layout, self._feedback is not None, self.world_size)
        if self._feedback is not None:
            if self._find_unused:
                idle = [s for s in range(len(bucket.params)) if s not in bucket.used]
                bucket.held = self._feedback.hold(bucket.index, idle)
            self._feedback.apply(bucket.index, buf, bucket.layout)
        try:
            bucket.future = self.communicator.allreduce(
                as_array(buf),
                op=op,
                layout=bucket.layout,
                stochastic=config.stochastic,
                seed=bucket_seed(config, self.steps, bucket.index),
            )
        except BaseException:
            # Not sent: a retry refills the bucket from ``param.grad`` and adds the
            # residuals it had before this attempt.
            bucket.ready.clear()
            if self._feedback is not None:
                self._feedback.rollback(bucket.index)
            raise
        self._step_bytes += wire_bytes(bucket.layout, buf.element_size(), self.world_size)

    @contextlib.contextmanager
    def no_sync(self) -> Generator[None, None, None]:
        """Backward passes inside accumulate into ``param.grad`` without communicating."""
        previous, self._enabled = self._enabled, False
        try:
            yield
        finally:
            self._enabled = previous

    # -- synchronization -------------------------------------------------------------------
    def _start_rest(self) -> list[concurrent.futures.Future[Any]]:
        """Fill what no hook delivered, start the rest; return all futures.

        A parameter no hook delivered contributes its ``param.grad`` as it is (what
        backward passes under :meth:`no_sync` accumulated, or what a previous
        synchronize left), or zeros without one or when it no longer requires grad, so
        that a synchronize after accumulating under no_sync() alone, or a second
        synchronize, keeps the gradients."""
        with self._lock:
            self._check_model()
            for b in self._buckets[self._next :]:
                for slot, p in enumerate(b.params):
                    if slot not in b.ready:
                        off = b.offsets[slot]
                        view = b.buffer[off : off + p.numel()]
                        grad = p.grad if p.requires_grad else None
                        if grad is None or grad.is_sparse:
                            view.zero_()
                        else:
                            view.copy_(grad.reshape(-1))
                        b.ready.add(slot)
            self._start_ready()
            futures = [b.future for b in self._buckets if b.future is not None]
            if self._find_unused:
                # After every bucket, on every rank: the same order of collectives.
                futures.append(self._start_used_flags())
            return futures

    def _start_used_flags(self) -> concurrent.futures.Future[Any]:
        """Sum over the ranks, exactly, of each parameter's "used since the last
        synchronize" flag (into :attr:`_used_flags`)."""
        flags = self._used_flags
        used, base = [], 0
        for b in self._buckets:
            used += [base + slot for slot in b.used]
            base += len(b.params)
        flags.zero_()
        flags[used] = 1.0  # one indexed write, not one per parameter
        self._step_bytes += wire_bytes(
            Layout.uniform(flags.numel()), flags.element_size(), self.world_size
        )
        return self.communicator.allreduce(as_array(flags), op="sum")

    def _check_model(self) -> None:
        """A module given at construction that now holds parameters with a gradient and
        no hook (a layer replaced or added later) would leave them un-averaged and the
        replicas apart: refuse."""
        if self._module is None:
            return
        for name, p in self._module.named_parameters():
            if p.grad is not None and id(p) not in self._slot:
                raise ConfigError(
                    f"parameter {name!r} has a gradient but is not synchronized: the model "
                    "changed after GradientSync was built; build a new GradientSync "
                    "(after remove() on this one)"
                )

    def _finish(self) -> None:
        """Write the averages into ``param.grad`` and reset for the next step."""
        used_by = self._used_flags.tolist() if self._find_unused else None
        base = 0  # the bucket's first parameter in the flags
        for b in self._buckets:
            unused = {}
            for slot, (p, off) in enumerate(zip(b.params, b.offsets, strict=True)):
                if not p.requires_grad:
                    continue  # frozen since construction: its gradient stays as it is
                if used_by is not None and used_by[base + slot] == 0.0:
                    # No rank used it: its gradient stays as it is (DDP's rule), and so
                    # does its error-feedback residual (what it added was not used).
                    if slot in b.held:
                        unused[slot] = b.held[slot]
                    continue
                avg = b.buffer[off : off + p.numel()].view_as(p)
                if p.grad is None:
                    p.grad = avg.clone()
                else:
                    p.grad.copy_(avg)
            if unused and self._feedback is not None:
                self._feedback.restore(b.index, unused)
            b.ready.clear()
            b.used.clear()
            b.held = {}
            b.future = None
            base += len(b.params)
        if self._feedback is not None:
            self._feedback.commit()
        self._next = 0
        self.steps += 1
        self.bytes_sent += self._step_bytes
        self.bytes_per_step, self._step_bytes = self._step_bytes, 0
        if self.policy_name != "static":
            return
        # The next step's layouts follow the configuration in force now.
        config = self.compression
        if config != self._config:
            self._config = config
            self._runner.retarget(config, self.layer_min_size)
            for b in self._buckets:
                b.layout = layer_layout(b.params, config, self.layer_min_size)

    def _agree(self) -> None:
        """The policy's agreement for step ``steps`` (collective at decision steps) and
        the buckets' layouts from its assignment."""
        self._runner.step_started(self.steps)
        self._relayout()

    def _relayout(self) -> None:
        if self.policy_name != "static":
            for b in self._buckets:
                b.layout = self._runner.layout(b.indices)

    def _raise_first(self, futures: list[concurrent.futures.Future[Any]]) -> None:
        for f in futures:
            exc = f.exception(timeout=0)
            if exc is not None:
                self._reset_after_error()
                raise exc

    def _reset_after_error(self) -> None:
        # ``used`` stays: a synchronize() repeated after the error averages what the
        # parameters used since the last good one hold (cleared, every flag would read
        # "no rank used it" and no average would be written). The residuals go back to
        # what they were before this step: the retry adds each one once.
        if self._feedback is not None:
            self._feedback.rollback()
        for b in self._buckets:
            b.ready.clear()
            b.future = None
        self._next = 0
        self._step_bytes = 0

    def synchronize(self) -> None:
        """Finish this step's gradient averaging; ``param.grad`` holds the averages."""
        futures = self._start_rest()
        _, pending = concurrent.futures.wait(futures, timeout=self.timeout)
        if pending:
            self._reset_after_error()
            raise CGXTimeoutError(
                f"{len(pending)} gradient bucket(s) not averaged within {self.timeout:.3g} s"
            )
        self._raise_first(futures)
        self._finish()
        self._agree()

    async def synchronize_async(self) -> None:
        """:meth:`synchronize` for asyncio loops: waits without blocking the loop."""
        futures = self._start_rest()
        try:
            await asyncio.wait_for(
                asyncio.gather(*(asyncio.wrap_future(f) for f in futures)), self.timeout
            )
        except TimeoutError as exc:
            self._reset_after_error()
            raise CGXTimeoutError(
                f"gradient buckets not averaged within {self.timeout:.3g} s"
            ) from exc
        except BaseException:
            self._reset_after_error()
            raise
        self._finish()
        if self._runner.due(self.steps):
            # A decision step communicates (and auto probes the link) through the
            # synchronous communicator: on a worker thread, so this loop runs meanwhile.
            await asyncio.to_thread(self._agree)
        else:
            self._agree()  # no communication: at most a log line

    def __await__(self) -> Generator[Any, None, None]:
        return self.synchronize_async().__await__()

    # -- checkpointing and lifetime ----------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Step count, error-feedback residuals and the policy's state (tensors and
        plain values: ``torch.load(weights_only=True)`` reads it). Saved between steps,
        it holds the assignment already agreed for the next step."""
        residuals = self._feedback.state_dict() if self._feedback is not None else {}
        return {"steps": self.steps, "residuals": residuals, "policy": self._runner.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output (between steps; a policy state must be of
        the same policy and parameters, a state without one keeps the fresh policy)."""
        steps, residuals, policy_state = split_state(state, "GradientSync", self._feedback)
        if policy_state is not None:
            self._runner.load_state_dict(policy_state)
            self._relayout()
        if self._feedback is not None:
            self._feedback.load_state_dict(residuals)
        self.steps = steps

    def remove(self) -> None:
        """Unregister the gradient hooks (the communicator stays open)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def __repr__(self) -> str:
        return (
            f"GradientSync({sum(len(b.params) for b in self._buckets)} params in "
            f"{len(self._buckets)} buckets, world_size={self.world_size}, "
            f"compression={self._config}, policy={self.policy_name!r})"
        )


def _comm_timeout(group: dist.ProcessGroup | None) -> float:
    """The wait bound: the cgx group's timeout, else CGX_UCX_TIMEOUT / the default."""
    from .process_group import ProcessGroupCGX

    group = group if group is not None else dist.group.WORLD
    if isinstance(group, ProcessGroupCGX):
        return group.timeout
    return resolve_comm().timeout
