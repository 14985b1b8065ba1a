"""A compression policy bound to a model's parameters and a communicator.

Shared by :class:`~cgx_ucx.torch.hook.CGXState` (DDP) and
:class:`~cgx_ucx.torch.grad_sync.GradientSync`. The policies themselves live in
:mod:`cgx_ucx.compression.adaptive`; this module only does what the torch side needs:

1. Layers: one per parameter (``model.named_parameters()``, those that require grad),
   indexed by ``id(param)`` so that a DDP bucket's ``bucket.parameters()`` map to layer
   indices whatever order DDP put them in. A parameter of a dtype the codec cannot
   quantize (float64, integers) is given ``ndim=0``, which every policy leaves
   uncompressed, as :func:`~cgx_ucx.torch.hook.layer_layout` does.
2. ``auto`` gets the world size and a link probe over the same communicator that
   carries the gradients (:func:`~cgx_ucx.compression.adaptive.make_link_probe`).
3. Layouts of a bucket's layers are cached until the assignment changes (they are
   rebuilt at decision steps only, not at every call).
4. State dicts hold torch tensors, not NumPy arrays, so that ``torch.load`` with its
   default ``weights_only=True`` reads a checkpoint back.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ..agreement import agree_sync, make_link_probe
from ..arrays import check_positive_int
from ..compression.policies import (
    POLICIES,
    AutoPolicy,
    LayerInfo,
    LayerStats,
    Policy,
    make_policy,
)
from ..config import CompressionConfig
from ..errors import ConfigError
from ..layout import Layout
from ._convert import is_float
from .protocols import Communicator

__all__ = [
    "DEFAULT_LOG_EVERY",
    "POLICY_NAMES",
    "ModelLike",
    "PolicyRunner",
    "check_policy_args",
    "check_policy_name",
    "named_parameters",
]

#: The policy names CGXState and GradientSync accept ("static" is the paper's setting).
POLICY_NAMES = tuple(POLICIES)

#: What ``model=`` takes: the module being trained, or its parameters (tensors, or
#: ``(name, tensor)`` pairs as ``named_parameters()`` yields them).
ModelLike = torch.nn.Module | Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]]

#: Steps between two measurements of the per-layer quantization error (and INFO logs of
#: the assignment): a measurement samples at most 64 Ki values per compressed layer, a
#: small fraction of quantizing the layer for the wire, so one step in a hundred adds
#: well under 1% to a step that quantizes the same layers.
DEFAULT_LOG_EVERY = 100


def check_policy_name(policy: Any) -> str:
    """``policy`` if it names a policy, else a ConfigError listing the names."""
    if not isinstance(policy, str) or policy not in POLICIES:
        raise ConfigError(
            f"unknown compression policy {policy!r}; choose one of {list(POLICY_NAMES)}"
        )
    return policy


def check_policy_args(
    policy: Any, policy_params: Mapping[str, Any] | None, log_every: Any
) -> tuple[str, dict[str, Any], int]:
    """``(policy name, policy_params as a dict, log_every)`` as CGXState and
    GradientSync take them, checked; ConfigError names the bad argument."""
    name = check_policy_name(policy)
    params = dict(policy_params or {})
    if name == "static" and params:
        raise ConfigError("policy_params are for the adaptive policies; 'static' takes none")
    return name, params, check_positive_int(log_every, "log_every", 0)


def named_parameters(model: ModelLike) -> list[tuple[str, torch.Tensor]]:
    """``(name, parameter)`` of ``model`` that require grad, each parameter once.

    ``model`` is a module (a DDP wrapper too: its names then start with ``module.``),
    an iterable of ``(name, tensor)`` pairs, or an iterable of tensors (named by
    position).
    """
    if isinstance(model, torch.nn.Module):
        items: Iterable[Any] = model.named_parameters()
    elif isinstance(model, Iterable):
        items = list(model)
    else:
        raise ConfigError(f"model must be a module or its parameters, got {type(model).__name__}")
    out: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()
    for i, item in enumerate(items):
        if isinstance(item, tuple) and len(item) == 2:
            name, p = item
        else:
            name, p = f"param{i}", item
        if not isinstance(p, torch.Tensor):
            raise ConfigError(f"model parameters must be tensors, got {type(p).__name__}")
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append((str(name), p))
    return out


def _to_torch(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(value).copy())
    if isinstance(value, np.generic):
        return value.item()
    return value


def _to_numpy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    return value


class PolicyRunner:
    """A :class:`~cgx_ucx.compression.adaptive.Policy` over ``named`` parameters.

    ``communicator`` is the engine's synchronous communicator that the gradients travel
    on: :meth:`agree` runs the policy's agreement collectives (and the ``auto`` probe)
    on it, so every rank must call :meth:`agree` at the same point of each step.
    """

    def __init__(
        self,
        name: str,
        named: Sequence[tuple[str, torch.Tensor]],
        config: CompressionConfig,
        layer_min_size: int,
        communicator: Communicator,
        *,
        world_size: int,
        timeout: float,
        params: Mapping[str, Any] | None = None,
        log_every: int = DEFAULT_LOG_EVERY,
    ) -> None:
        self.name = check_policy_name(name)
        if not named:
            raise ConfigError("a compression policy needs at least one parameter")
        self.names = [n for n, _ in named]
        self.index = {id(p): i for i, (_, p) in enumerate(named)}
        self.communicator = communicator
        self.world_size = int(world_size)
        self.timeout = float(timeout)
        self._layers = [
            LayerInfo(int(p.numel()), int(p.dim()) if is_float(p) else 0, n) for n, p in named
        ]
        self._params = dict(params or {})
        self._log_every = log_every
        self.policy = self._make(config, layer_min_size)
        self._layouts: dict[tuple[int, ...], Layout] = {}
        self._layouts_of = self.policy.current
        self._last_start: float | None = None

    def _make(self, config: CompressionConfig, layer_min_size: int) -> Policy:
        kwargs = dict(self._params)
        kwargs.setdefault("log_every", self._log_every)
        if self.name == "auto":
            kwargs.setdefault("world_size", self.world_size)
            if "link_bandwidth" not in kwargs and "link_probe" not in kwargs:
                kwargs["link_probe"] = make_link_probe(
                    self.communicator, world_size=self.world_size, timeout=self.timeout
                )
        try:
            return make_policy(
                self.name, self._layers, config, layer_min_size=layer_min_size, **kwargs
            )
        except TypeError as exc:  # an unknown or misspelled policy_params key
            raise ConfigError(f"policy {self.name!r}: bad policy_params ({exc})") from exc

    @property
    def config(self) -> CompressionConfig:
        return self.policy.config

    def retarget(self, config: CompressionConfig, layer_min_size: int) -> None:
        """Rebuild the policy for another configuration (static: the environment changed)."""
        self.policy = self._make(config, layer_min_size)
        self._layouts.clear()
        self._layouts_of = self.policy.current

    # -- per step -----------------------------------------------------------------------
    def indices(self, params: Iterable[torch.Tensor]) -> tuple[int, ...]:
        """Layer indices of ``params`` (a bucket's parameters, in buffer order)."""
        try:
            return tuple(self.index[id(p)] for p in params)
        except KeyError:
            raise ConfigError(
                "a gradient bucket holds a parameter that is not among the policy's layers: "
                "pass the model being trained (or its parameters) as model="
            ) from None

    def step_started(self, step: int) -> None:
        """First bucket of ``step``: feed ``auto`` the last step time, then agree (blocks
        only at decision steps; every rank calls it before its first bucket's allreduce)."""
        now = time.perf_counter()
        if self._last_start is not None and isinstance(self.policy, AutoPolicy):
            self.policy.record_step_time(now - self._last_start)
        self._last_start = now
        self.agree(step)

    def due(self, step: int) -> bool:
        return self.policy.due(step)

    def agree(self, step: int) -> None:
        """Decide with every rank when ``step`` is a decision step (collective then)."""
        agree_sync(
            self.policy,
            self.communicator,
            step,
            world_size=self.world_size,
            timeout=self.timeout,
        )

    def observe(self, step: int, grads: Sequence[torch.Tensor], indices: Sequence[int]) -> None:
        """Hand the local gradients of layers ``indices`` to the policy (cheap off-window)."""
        if self.policy.observing(step):
            self.policy.observe(step, grads, indices)

    def layout(self, indices: tuple[int, ...]) -> Layout:
        """Layout of layers ``indices`` under the assignment in force (cached)."""
        current = self.policy.current
        if current is not self._layouts_of:
            self._layouts.clear()
            self._layouts_of = current
        lay = self._layouts.get(indices)
        if lay is None:
            lay = self._layouts[indices] = self.policy.layout(indices)
        return lay

    # -- visibility and state -------------------------------------------------------------
    def stats(self) -> list[LayerStats]:
        return self.policy.stats()

    def stats_table(self) -> str:
        return self.policy.stats_table()

    def state_dict(self) -> dict[str, Any]:
        """The policy's state with NumPy arrays as tensors (``weights_only`` loads it)."""
        return {k: _to_torch(v) for k, v in self.policy.state_dict().items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if not isinstance(state, Mapping):
            raise ConfigError(f"a policy state is a mapping, got {type(state).__name__}")
        self.policy.load_state_dict({k: _to_numpy(v) for k, v in state.items()})
        self._layouts.clear()
        self._layouts_of = self.policy.current
