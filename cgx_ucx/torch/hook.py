"""The DDP communication hook: ``model.register_comm_hook(CGXState(pg), cgx_hook)``.

As torch_cgx users know it, without its "register layers at step 2" bookkeeping: each
call builds the bucket's layer layout from ``bucket.gradients()`` and sends it with
the allreduce (DESIGN.md, data path step 2), so DDP's bucket rebuild after the first
iteration, and any other all_reduce in the same job, compressed or not, cannot
confuse it (IST-DASLab/torch_cgx#5).

Algorithm of one call (``cgx_hook(state, bucket)``), each step one public method of
:class:`CGXState` (the state holds the fields, the hook the algorithm, as PyTorch's own
hooks):

1. ``state.maybe_start_step()``: the first call of a step, with a policy: ``auto``
   records the time since the previous step's first call; then every rank runs the
   policy's agreement, which communicates only at the policy's decision steps. Every
   rank does it before its first bucket's allreduce, so the collectives pair up in the
   same order everywhere.
2. ``state.bucket_layout(...)``: one layer per gradient in the bucket.
   ``policy="static"`` (the default): the paper's rule
   (:func:`~cgx_ucx.torch.layers.layer_layout`: 1-D and small layers go uncompressed),
   the rest at ``compression_params``. An adaptive policy gives each layer its bits and
   bucket size, after seeing this rank's gradients (``policy.observe``, which works
   only on the steps before a decision and on logging steps). The last bucket of a step
   then calls ``state.end_step()``.
3. Average: a compressed bucket (without error feedback) is sent with op "avg", and
   the engine divides each reduced piece as it requantizes it; any other bucket is
   divided by the world size first (as PyTorch's allreduce_hook, so fp16 sums do not
   overflow) and summed (:func:`~cgx_ucx.torch.layers.bucket_op`).
4. ``state.apply_error_feedback(...)``: with error feedback, add each compressed
   layer's residual from the previous step and keep the new residual
   ``c - decode(encode(c))`` of what is sent.
5. Submit the compressed allreduce to the engine and return a torch future at
   once: backward goes on while the bucket travels.
6. ``state.record_sent(...)``: the stats, from the layout
   (:func:`~cgx_ucx.torch.layers.wire_bytes`).
"""

# No ``from __future__ import annotations`` here: DDP's register_comm_hook compares the
# hook's annotations with dist.GradBucket and torch.futures.Future[torch.Tensor] as
# objects, and string annotations fail that check.
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..arrays import check_positive_int
from ..compression.policies import LayerStats, Policy
from ..config import CompressionConfig, resolve_comm, resolved_compression
from ..errors import ConfigError
from ..layout import Layout
from ._convert import as_array
from ._feedback import LayerFeedback, split_state
from ._policy import (
    DEFAULT_LOG_EVERY,
    ModelLike,
    PolicyRunner,
    check_policy_args,
    named_parameters,
)
from .communicators import get_communicator
from .futures import to_torch_future
from .layers import PAPER_DEFAULTS, average_first, bucket_seed, layer_layout, wire_bytes
from .protocols import Communicator

# layer_layout and wire_bytes live in .layers; re-exported here where users found them.
__all__ = ["CGXState", "cgx_hook", "layer_layout", "wire_bytes"]


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
            environment; missing ones come from the environment, else the paper's
            defaults (4 bits, bucket 1024). With ``policy="static"`` they are read at
            each call (a script may change the environment between steps); an adaptive
            policy resolves them once, here, as its base configuration.
        error_feedback: carry each step's quantization error into the next.
        policy: who decides each layer's bits and bucket size
            (:mod:`cgx_ucx.compression.adaptive`): ``"static"`` (default, the paper's
            setting: ``compression_params`` on every large multi-dimensional layer,
            exactly the hook's behaviour without a policy), ``"kmeans"`` (CGX's
            adjuster), ``"budget"`` (fewest bytes at uniform 4-bit's error) or
            ``"auto"`` (compress a layer only where the measured link and codec say it
            saves time).
        policy_params: keyword arguments of the policy's class (e.g.
            ``{"schedule": Schedule(warmup=50, interval=500, window=20)}``, ``bits_min``,
            ``budget_scale``, ``link_bandwidth``); ``auto`` gets ``world_size`` and a
            link probe over this state's communicator unless given.
        model: the module DDP trains (the DDP wrapper or its ``.module``), or its
            ``named_parameters()``: the policy's layers, one per parameter that
            requires grad. Required by the adaptive policies (every rank must know all
            layers before the first decision); with ``"static"`` it only names the
            layers in :meth:`stats`, else they are found in the first step's buckets.
        log_every: measure each layer's relative quantization error every this many
            steps and log the assignment at INFO (logger ``cgx_ucx.adaptive``; nothing
            is formatted unless INFO is enabled). 0 turns both off.

    Internal: the communicator, the policy, per-bucket residuals. :func:`cgx_hook`
    drives them through the per-call methods (:attr:`call_compression`,
    :meth:`maybe_start_step`, :meth:`bucket_layout`, :meth:`end_step`,
    :meth:`apply_error_feedback`, :meth:`record_sent`); a custom hook may too.

    Stats: ``steps`` (DDP iterations seen), ``bytes_sent`` (payload bytes this rank
    sent through the hook, all steps), ``bytes_per_step`` (of the last full step);
    both computed from the bucket layouts (:func:`wire_bytes`). The communicator's
    ``stats.bytes_sent`` counts everything it really sent, frame headers included.
    :meth:`stats` lists each layer's assignment and error.
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        layer_min_size: int = 1024,
        compression_params: Mapping[str, Any] | None = None,
        *,
        error_feedback: bool = False,
        communicator: Communicator | None = None,
        policy: str = "static",
        policy_params: Mapping[str, Any] | None = None,
        model: ModelLike | None = None,
        log_every: int = DEFAULT_LOG_EVERY,
    ) -> None:
        # -- tuned by the user
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        if self.process_group is None:
            raise ConfigError("CGXState needs torch.distributed initialized or a process_group")
        self.layer_min_size = check_positive_int(layer_min_size, "layer_min_size", 0)
        self.compression_params = dict(compression_params or {})
        self.error_feedback = bool(error_feedback)
        self.policy_name, self.policy_params, self.log_every = check_policy_args(
            policy, policy_params, log_every
        )
        config = self.compression  # validates compression_params now, not at the first backward
        named = named_parameters(model) if model is not None else None
        if self.policy_name != "static" and not named:
            raise ConfigError(
                f"policy {self.policy_name!r} needs model= (the module DDP trains, or its "
                "named_parameters()): every rank must know all layers before the first "
                "decision"
            )
        # -- internal
        self.communicator = (
            communicator if communicator is not None else get_communicator(self.process_group)
        )
        self.world_size = self.process_group.size()
        self._feedback = LayerFeedback() if self.error_feedback else None
        self._lock = threading.Lock()
        self._runner: PolicyRunner | None = None
        self._discovered: list[torch.Tensor] | None = None  # static without model=
        if named:
            self._runner = self._make_runner(named, config)
        elif self.policy_name == "static":
            self._discovered = []
        self._in_step = False  # a bucket of the current step has been seen
        # -- stats
        self.steps = 0
        self.bytes_sent = 0
        self.bytes_per_step = 0
        self._step_bytes = 0

    def _make_runner(
        self, named: list[tuple[str, torch.Tensor]], config: CompressionConfig
    ) -> PolicyRunner:
        return PolicyRunner(
            self.policy_name,
            named,
            config,
            self.layer_min_size,
            self.communicator,
            world_size=self.world_size,
            timeout=_timeout_of(self.communicator),
            params=self.policy_params,
            log_every=self.log_every,
        )

    @property
    def compression(self) -> CompressionConfig:
        """The configuration the next call uses (params > environment > paper).

        An adaptive policy uses its own, resolved at construction (``policy.config``).
        """
        return resolved_compression(PAPER_DEFAULTS, self.compression_params)

    @property
    def policy(self) -> Policy | None:
        """The policy in force (None: ``"static"`` before its layers are known)."""
        return self._runner.policy if self._runner is not None else None

    # -- visibility ----------------------------------------------------------------------
    def stats(self) -> list[LayerStats]:
        """Per layer: name, size, bits (32: uncompressed), bucket size, bytes of one
        encoded copy, and the relative quantization error measured at the last
        ``log_every`` step (NaN before one; 0 uncompressed).

        Empty with ``policy="static"`` and no ``model=`` until the first step has shown
        every parameter.
        """
        return self._runner.stats() if self._runner is not None else []

    def stats_table(self) -> str:
        """:meth:`stats` as a plain-text table."""
        return self._runner.stats_table() if self._runner is not None else "(no layers yet)"

    # -- checkpointing -------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Checkpointable state: step count, error-feedback residuals and the policy's
        state, all tensors and plain values (``torch.load(weights_only=True)`` reads it)."""
        residuals = self._feedback.state_dict() if self._feedback is not None else {}
        state: dict[str, Any] = {"steps": self.steps, "residuals": residuals}
        if self._runner is not None:
            state["policy"] = self._runner.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output (a policy state must be of the same policy
        and model; a state without one keeps the fresh policy)."""
        steps, residuals, policy_state = split_state(state, "CGXState", self._feedback)
        if policy_state is not None and self._runner is not None:
            self._runner.load_state_dict(policy_state)
        # (static without model=: nothing to restore but measured errors; they come back
        # at the next logging step)
        if self._feedback is not None:
            self._feedback.load_state_dict(residuals)
        self.steps = steps

    # -- per call (the steps of cgx_hook) ---------------------------------------------------
    @property
    def call_compression(self) -> CompressionConfig:
        """The configuration of the next bucket: :attr:`compression` with ``"static"``
        (re-read at each call), else the adaptive policy's (resolved at construction)."""
        runner = self._runner
        if self.policy_name == "static" or runner is None:
            return self.compression
        return runner.config

    def maybe_start_step(self) -> None:
        """Mark a bucket of the current step; the first one of a step starts the step.

        A policy then records the step time (``auto``) and runs its agreement, a
        collective at decision steps: every rank does it before its first bucket's
        allreduce, so the collectives pair up in the same order everywhere.
        """
        if self._in_step:
            return
        self._in_step = True
        if self._runner is not None:
            self._runner.step_started(self.steps)

    def bucket_layout(
        self,
        params: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor],
        config: CompressionConfig,
    ) -> Layout:
        """Layout of a bucket holding ``grads`` (of ``params``, in buffer order).

        ``"static"``: the paper's rule under ``config`` (:func:`layer_layout`). An
        adaptive policy first sees this rank's gradients (``policy.observe``: work only
        on the steps before a decision and on logging steps), then assigns each layer's
        bits and bucket size.
        """
        runner = self._runner
        if runner is None:
            if self._discovered is not None:
                self._discovered.extend(params)
            return layer_layout(grads, config, self.layer_min_size)
        indices = runner.indices(params)
        runner.observe(self.steps, grads, indices)
        if self.policy_name == "static":
            # The paper's rule, re-read at each call: bit for bit the hook without a policy.
            if config != runner.config:
                runner.retarget(config, self.layer_min_size)
            return layer_layout(grads, config, self.layer_min_size)
        return runner.layout(indices)

    def end_step(self) -> None:
        """The last bucket of a step has its layout: the next bucket starts a new step.

        ``"static"`` without ``model=`` now knows every parameter (those of this step's
        buckets) and names its layers after them.
        """
        self._in_step = False
        if self._discovered is not None:
            params, self._discovered = self._discovered, None
            named = named_parameters(params)
            if named:
                self._runner = self._make_runner(named, self.compression)

    def apply_error_feedback(self, index: int, buf: torch.Tensor, layout: Layout) -> None:
        """With ``error_feedback``: add bucket ``index``'s residuals to ``buf`` in place
        and keep the new ones (nothing without error feedback)."""
        if self._feedback is not None:
            self._feedback.apply(index, buf, layout)

    def record_sent(self, nbytes: int, *, last: bool) -> None:
        """Count ``nbytes`` sent for one bucket; the ``last`` bucket ends the step."""
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
            f"compression={self.compression}, error_feedback={self.error_feedback}, "
            f"policy={self.policy_name!r})"
        )


def _timeout_of(communicator: Communicator) -> float:
    """The communicator's per-wait deadline (CommConfig.timeout), for the agreement; a
    communicator without one (a test double) gets the configured default."""
    config = getattr(getattr(communicator, "comm", None), "config", None)
    timeout = getattr(config, "timeout", None)
    return float(timeout) if timeout is not None else resolve_comm().timeout


def cgx_hook(state: CGXState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket`` across ranks with compressed allreduce; returns at once.

    Register with ``ddp_model.register_comm_hook(state, cgx_hook)``. The future's value
    is the averaged bucket buffer, as DDP expects. With an adaptive policy the first
    call of a step may block: at the policy's decision steps, every rank agrees on the
    new assignment (a small allreduce and broadcast, plus ``auto``'s link probe) before
    the step's first bucket is sent.

    The steps are those of the module docstring.
    """
    buf = bucket.buffer()
    index = bucket.index()
    last = bucket.is_last()
    config = state.call_compression
    try:
        # 1. The first bucket of a step starts it (the policy's agreement).
        state.maybe_start_step()
        # 2. The bucket's layer layout, built from its gradients at every call.
        layout = state.bucket_layout(bucket.parameters(), bucket.gradients(), config)
    finally:
        if last:
            state.end_step()
    # 3. Average, not sum: the engine divides a compressed bucket as it requantizes it;
    # any other is divided first, as PyTorch's allreduce_hook (fp16 sums).
    op = average_first(buf, layout, state.error_feedback, state.world_size)
    # 4. Error feedback: add the residuals, keep the new ones.
    state.apply_error_feedback(index, buf, layout)
    # 5. Submit the compressed allreduce; backward goes on while the bucket travels.
    cf = state.communicator.allreduce(
        as_array(buf),
        op=op,
        layout=layout,
        stochastic=config.stochastic,
        seed=bucket_seed(config, state.steps, index),
    )
    # 6. Stats (the last bucket ends the step).
    state.record_sent(wire_bytes(layout, buf.element_size(), state.world_size), last=last)
    # 7. Through a then(): torch's Python Future.set_exception stores the error as the
    # future's value, which DDP's reducer then fails to cast to a Tensor; a callback that
    # raises marks the chained future failed, so DDP re-raises the engine's error itself.
    return to_torch_future(cf, lambda _: buf).then(_unwrap)


def _unwrap(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
    return fut.value()
