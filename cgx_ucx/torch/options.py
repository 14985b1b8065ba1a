"""The configuration of a ``cgx`` group: :class:`CGXOptions` and the communicator's config.

``CGXOptions`` is what ``pg_options=`` of ``init_process_group`` takes;
:func:`comm_config` turns it and init_process_group's ``timeout`` into the
communicator's :class:`~cgx_ucx.config.CommConfig`.
"""

from __future__ import annotations

import dataclasses
import datetime
from dataclasses import dataclass

import torch.distributed as dist

from ..config import CommConfig, CompressionConfig, resolve_comm
from ..errors import ConfigError

__all__ = ["CGXOptions", "comm_config"]


@dataclass(frozen=True)
class CGXOptions:
    """Explicit configuration of a ``cgx`` group (``pg_options=`` of init_process_group).

    ``compression`` set here takes precedence over the CGX_COMPRESSION_* environment
    variables; None keeps reading them at each all_reduce. ``comm`` is the base of the
    communicator's configuration (the init_process_group ``timeout``, when given,
    overrides its ``timeout``).

    ``policy`` is ``"static"`` only: a group's ``all_reduce`` sees one flat tensor (DDP
    without a hook sends whole buckets), not the model's layers that the adaptive
    policies assign bits to, nor the step boundaries at which ranks agree on a new
    assignment. Select those where the layers are known:
    ``CGXState(..., policy="kmeans", model=model)`` for DDP, ``GradientSync(model,
    policy=...)`` otherwise; any other value here is a ConfigError saying so.
    """

    compression: CompressionConfig | None = None
    comm: CommConfig | None = None
    policy: str = "static"

    def __post_init__(self) -> None:
        if self.compression is not None and not isinstance(self.compression, CompressionConfig):
            raise ConfigError(
                "CGXOptions.compression must be a CompressionConfig or None, got "
                f"{self.compression!r}"
            )
        if self.comm is not None and not isinstance(self.comm, CommConfig):
            raise ConfigError(f"CGXOptions.comm must be a CommConfig or None, got {self.comm!r}")
        if self.policy == "static":
            return
        from ..compression.policies import POLICIES

        if self.policy in POLICIES:
            raise ConfigError(
                f"policy {self.policy!r} assigns bits per model layer, which a process "
                "group's all_reduce does not see: use cgx_ucx.CGXState(..., "
                f"policy={self.policy!r}, model=model) with DDP, or cgx_ucx.GradientSync("
                f"model, policy={self.policy!r})"
            )
        raise ConfigError(f"unknown compression policy {self.policy!r}; a cgx group takes 'static'")


def comm_config(timeout: datetime.timedelta | None, options: CGXOptions | None) -> CommConfig:
    """The communicator's config: init_process_group's timeout bounds every wait.

    torch always passes a timeout (its 30 min default when the user gave none). When it
    is the default, the user did not choose one: CGX_UCX_TIMEOUT / CommConfig apply,
    capped by torch's value. A timeout the user gave is used as is, for the rendezvous
    too (gloo's connect uses it the same way).
    """
    base = options.comm if options is not None else None
    if timeout is None or timeout == dist.default_pg_timeout:
        cfg = resolve_comm(base)
        if timeout is not None:
            cap = timeout.total_seconds()
            cfg = dataclasses.replace(
                cfg, timeout=min(cfg.timeout, cap), connect_timeout=min(cfg.connect_timeout, cap)
            )
        return cfg
    secs = timeout.total_seconds()
    if not secs > 0:
        raise ConfigError(f"the process group timeout must be > 0, got {timeout}")
    return resolve_comm(base, timeout=secs, connect_timeout=secs)
