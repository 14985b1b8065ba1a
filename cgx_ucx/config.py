"""Configuration: frozen dataclasses, validated once, resolved in one place.

Precedence is always keyword argument > environment variable > default. The
environment variables are torch_cgx's, with torch_cgx's meaning and defaults, so a
torch_cgx job moves over unchanged:

====================================  ==========  =========================================
variable                              default     meaning
====================================  ==========  =========================================
CGX_COMPRESSION_QUANTIZATION_BITS     32          bits per value; 32 means no compression
CGX_COMPRESSION_BUCKET_SIZE           512         values sharing one (unit, min) pair
CGX_COMPRESSION_MINIMAL_SIZE          16          layers with fewer values go uncompressed
CGX_COMPRESSION_STOCHASTIC            0           1: unbiased stochastic rounding
CGX_UCX_TIMEOUT                       300         seconds any single wait may take
====================================  ==========  =========================================

Nothing here reads the environment at import time: :func:`resolve_compression` and
:func:`resolve_comm` read it when they are called (the backend calls them when each
collective starts, so a script may change the variables between calls, as with
torch_cgx). :func:`validate_environment` reads them once up front (the backend calls it
when the group is made) so that a bad value fails at ``init_process_group``, and a bad
value always names its variable. :func:`describe_configuration` is the one line a
communicator logs at INFO with what it resolved.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

# NO_COMPRESSION_BITS (torch_cgx's 32: do not quantize) and VALID_BITS live with the validators.
from .arrays import (
    MAX_BUCKET_SIZE,
    MAX_SECONDS,
    NO_COMPRESSION_BITS,
    VALID_BITS,
    check_bits,
    check_positive_int,
    check_seconds,
    check_seed,
)
from .errors import ConfigError

__all__ = [
    "ENV_BITS",
    "ENV_BUCKET_SIZE",
    "ENV_MINIMAL_SIZE",
    "ENV_SPIN",
    "ENV_STOCHASTIC",
    "ENV_TIMEOUT",
    "NO_COMPRESSION_BITS",
    "CommConfig",
    "CompressionConfig",
    "compression_from_env",
    "describe_configuration",
    "log_configuration",
    "resolve_comm",
    "resolve_compression",
    "spin_mode",
    "validate_environment",
]

log = logging.getLogger("cgx_ucx.config")

ENV_BITS = "CGX_COMPRESSION_QUANTIZATION_BITS"
ENV_BUCKET_SIZE = "CGX_COMPRESSION_BUCKET_SIZE"
ENV_MINIMAL_SIZE = "CGX_COMPRESSION_MINIMAL_SIZE"
ENV_STOCHASTIC = "CGX_COMPRESSION_STOCHASTIC"
ENV_TIMEOUT = "CGX_UCX_TIMEOUT"
ENV_NODE_ID = "CGX_UCX_NODE_ID"
#: Out-of-band membership secret (transport/handshake.py); the launcher sets it on every rank.
ENV_SECRET = "CGX_UCX_SECRET"
#: Progress after a completion (transport/progress.py): "auto", "1" (always spin), "0".
ENV_SPIN = "CGX_UCX_SPIN"

#: torch_cgx forces its minimal compressed size to at least 16 values.
MIN_COMPRESSED_SIZE = 16


@dataclass(frozen=True)
class CompressionConfig:
    """How values are quantized on the wire.

    ``bits`` 1..8 quantize (max-min bucketed, as CGX); 32 sends values as they are.
    ``bucket_size`` values share one float32 (unit, min) pair. Layers with fewer
    than ``minimal_size`` values are sent uncompressed. ``stochastic`` selects
    unbiased stochastic rounding from a generator seeded with ``seed``.
    """

    bits: int = NO_COMPRESSION_BITS
    bucket_size: int = 512
    minimal_size: int = MIN_COMPRESSED_SIZE
    stochastic: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        check_bits(self.bits)
        check_positive_int(self.bucket_size, "bucket_size", limit=MAX_BUCKET_SIZE + 1)
        check_positive_int(self.minimal_size, "minimal_size", minimum=0)
        check_seed(self.seed)
        if not (isinstance(self.stochastic, bool) or self.stochastic in (0, 1)):
            raise ConfigError(f"stochastic must be True or False, got {self.stochastic!r}")

    @property
    def enabled(self) -> bool:
        """True when values are quantized (bits < 32)."""
        return self.bits != NO_COMPRESSION_BITS

    def bits_for(self, numel: int) -> int:
        """Bits used for a layer of ``numel`` values (small layers go uncompressed)."""
        if numel < max(self.minimal_size, 1):
            return NO_COMPRESSION_BITS
        return self.bits

    def describe(self) -> str:
        """One line for logs: ``bits=4 bucket_size=1024 minimal_size=16 rounding=nearest``."""
        if not self.enabled:
            return "bits=32 (no compression)"
        rounding = f"stochastic(seed={self.seed})" if self.stochastic else "nearest"
        return (
            f"bits={self.bits} bucket_size={self.bucket_size} "
            f"minimal_size={self.minimal_size} rounding={rounding}"
        )

    def __str__(self) -> str:
        return self.describe()


@dataclass(frozen=True)
class CommConfig:
    """How a communicator waits and moves bytes.

    ``timeout`` bounds every single wait (seconds): a peer that dies or goes
    silent is reported as :class:`~cgx_ucx.errors.PeerLostError` within it.
    ``progress_mode`` is UCXX's ("blocking", the default, drives UCX from the caller's
    event loop: low latency and no idle CPU; "thread" adds threads and longer tails).
    ``ucx_env`` holds UCX variables applied only where the user has not set them.
    """

    timeout: float = 300.0
    connect_timeout: float = 60.0
    progress_mode: str = "blocking"
    ucx_env: Mapping[str, str] = field(default_factory=dict)
    #: Out-of-band secret every rank must know to join (None: the store is the root of
    #: trust); never logged, never written to the store.
    secret: str | bytes | None = field(default=None, repr=False)
    #: This rank's node label (ranks with equal labels share a node): overrides the
    #: launcher's and the host's view of the nodes (cgx_ucx.transport.topology).
    node_id: str | None = None

    def __post_init__(self) -> None:
        check_seconds(self.timeout)
        if not self.connect_timeout > 0:
            raise ConfigError(f"connect_timeout must be > 0 seconds, got {self.connect_timeout!r}")
        if self.progress_mode not in ("blocking", "polling", "thread", "thread-polling"):
            raise ConfigError(f"unknown progress_mode {self.progress_mode!r}")

    def describe(self) -> str:
        """One line for logs: timeouts, progress mode, and the UCX defaults it adds."""
        text = (
            f"timeout={self.timeout:g}s connect_timeout={self.connect_timeout:g}s "
            f"progress_mode={self.progress_mode}"
        )
        if self.ucx_env:
            text += " ucx_env=" + ",".join(f"{k}={v}" for k, v in sorted(self.ucx_env.items()))
        if self.secret:
            text += " secret=(set)"
        return text

    def __str__(self) -> str:
        return self.describe()


def _env_int(name: str, env: Mapping[str, str], what: str, ok: Any) -> int | None:
    """The integer in variable ``name``, or None when unset; a bad value is a ConfigError
    naming the variable and what it accepts (``what``), checked by ``ok``."""
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or not ok(value):
        raise ConfigError(f"{name}={raw!r} is not {what}")
    return value


def _env_float(name: str, env: Mapping[str, str], what: str, ok: Any) -> float | None:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = float(raw)
    except ValueError:
        value = None
    if value is None or not ok(value):
        raise ConfigError(f"{name}={raw!r} is not {what}")
    return value


def _merge(cls: type, defaults: Any, env_values: dict[str, Any], kwargs: dict[str, Any]) -> Any:
    known = {f.name for f in fields(cls)}
    unknown = set(kwargs) - known
    if unknown:
        raise ConfigError(f"unknown {cls.__name__} option(s): {sorted(unknown)}")
    values = {k: v for k, v in env_values.items() if v is not None}
    values.update({k: v for k, v in kwargs.items() if v is not None})
    return replace(defaults, **values)


def resolve_compression(
    base: CompressionConfig | None = None,
    env: Mapping[str, str] | None = None,
    **kwargs: Any,
) -> CompressionConfig:
    """Resolve a :class:`CompressionConfig`: keyword > environment > ``base`` > default.

    Keywords whose value is ``None`` count as not given.
    """
    env = os.environ if env is None else env
    stochastic = _env_int(
        ENV_STOCHASTIC, env, "0 (nearest) or 1 (stochastic)", lambda v: v in (0, 1)
    )
    minimal = _env_int(ENV_MINIMAL_SIZE, env, "an integer >= 0", lambda v: v >= 0)
    env_values = {
        "bits": _env_int(ENV_BITS, env, "an integer in 1..8 or 32", VALID_BITS.__contains__),
        "bucket_size": _env_int(
            ENV_BUCKET_SIZE,
            env,
            f"an integer in 1..{MAX_BUCKET_SIZE}",
            lambda v: 1 <= v <= MAX_BUCKET_SIZE,
        ),
        # torch_cgx forces the minimal size to at least 16 values.
        "minimal_size": None if minimal is None else max(minimal, MIN_COMPRESSED_SIZE),
        "stochastic": None if stochastic is None else bool(stochastic),
    }
    return _merge(CompressionConfig, base or CompressionConfig(), env_values, kwargs)


def spin_mode(env: Mapping[str, str] | None = None) -> str:
    """``CGX_UCX_SPIN``: "auto", "1" or "0" (ConfigError naming the variable otherwise)."""
    raw = (os.environ if env is None else env).get(ENV_SPIN, "auto").strip().lower()
    mode = {"": "auto", "auto": "auto", "1": "1", "on": "1", "0": "0", "off": "0"}.get(raw)
    if mode is None:
        raise ConfigError(f"{ENV_SPIN}={raw!r}: expected auto, 1 (always spin) or 0 (never)")
    return mode


_COMPRESSION_ENV = (ENV_BITS, ENV_BUCKET_SIZE, ENV_MINIMAL_SIZE, ENV_STOCHASTIC)
_from_env: tuple[tuple[str | None, ...], CompressionConfig] | None = None


def compression_from_env() -> CompressionConfig:
    """``resolve_compression()`` of the current environment, re-resolved only when one of
    the four CGX_COMPRESSION_* variables changed: a backend asks on every call (the
    environment may change between calls), and resolving costs tens of microseconds."""
    global _from_env
    get = os.environ.get
    key = (get(ENV_BITS), get(ENV_BUCKET_SIZE), get(ENV_MINIMAL_SIZE), get(ENV_STOCHASTIC))
    cached = _from_env
    if cached is not None and cached[0] == key:
        return cached[1]
    config = resolve_compression()
    _from_env = (key, config)
    return config


def resolve_comm(
    base: CommConfig | None = None,
    env: Mapping[str, str] | None = None,
    **kwargs: Any,
) -> CommConfig:
    """Resolve a :class:`CommConfig`: keyword > environment > ``base`` > default."""
    env = os.environ if env is None else env
    timeout = _env_float(
        ENV_TIMEOUT,
        env,
        f"a number of seconds > 0, at most {MAX_SECONDS:g}",
        lambda v: 0 < v <= MAX_SECONDS,
    )
    secret = env.get(ENV_SECRET) or None
    node_id = env.get(ENV_NODE_ID) or None
    env_values = {"timeout": timeout, "secret": secret, "node_id": node_id}
    return _merge(CommConfig, base or CommConfig(), env_values, kwargs)


def environment_problems(
    env: Mapping[str, str] | None = None, *, compression: bool = True
) -> list[str]:
    """Every bad value of this module's CGX_* variables, one message each (naming the
    variable and what it accepts); empty when all are good. ``compression=False`` leaves
    out the CGX_COMPRESSION_* ones (a group given explicit compression ignores them)."""
    env = os.environ if env is None else env
    checks: list[Any] = [lambda: resolve_comm(env=env), lambda: spin_mode(env)]
    names = [name for name in _COMPRESSION_ENV if name in env] if compression else []
    checks += [functools.partial(resolve_compression, env={name: env[name]}) for name in names]
    problems = []
    for check in checks:
        try:
            check()
        except ConfigError as exc:
            problems.append(str(exc))
    if compression and not problems:
        try:  # the variables together (each alone was good)
            resolve_compression(env=env)
        except ConfigError as exc:
            problems.append(str(exc))
    return problems


def raise_problems(problems: list[str]) -> None:
    """One ConfigError naming every problem (nothing when there are none)."""
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        raise ConfigError(f"{len(problems)} bad variables: " + "; ".join(problems))


def validate_environment(env: Mapping[str, str] | None = None) -> CompressionConfig:
    """Check every CGX_* variable of this module now and return the compression they
    select.

    The backend calls this (with the two-level variables of
    :func:`cgx_ucx.transport.topology.hierarchy_problems`) when a group is made, so that
    a bad value fails at ``init_process_group`` (naming the variable) rather than at the
    first all_reduce; the variables are still read again when each collective starts.
    Several bad values are all named in one ConfigError.
    """
    env = os.environ if env is None else env
    raise_problems(environment_problems(env))
    return resolve_compression(env=env)


def describe_configuration(
    comm: CommConfig,
    compression: CompressionConfig | None = None,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    policy: str | None = None,
) -> str:
    """The resolved configuration of one communicator, on one line (for the INFO log and
    bug reports). ``compression=None`` says it is read from CGX_* at each call."""
    who = f"rank {rank}/{world_size}: " if rank is not None else ""
    if compression is None:
        try:
            now = str(validate_environment())
        except ConfigError as exc:  # a log line must not raise; the call itself will
            now = f"invalid: {exc}"
        comp = f"compression from CGX_* at each call (now: {now})"
    else:
        comp = f"compression {compression}"
    text = f"{who}{comp}; {comm}"
    if policy is not None:
        text += f"; policy={policy}"
    return text


def log_configuration(
    comm: CommConfig, compression: CompressionConfig | None = None, **kw: Any
) -> str:
    """Log :func:`describe_configuration` once at INFO (on the ``cgx_ucx.config`` logger);
    returns the line."""
    line = describe_configuration(comm, compression, **kw)
    log.info("cgx_ucx configuration: %s", line)
    return line
