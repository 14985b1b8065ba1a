"""Configuration: frozen dataclasses, validated once, resolved in one place.

Precedence is always keyword argument > environment variable > default. The
environment variables are torch_cgx's where torch_cgx has one, with torch_cgx's meaning
and defaults, so a torch_cgx job moves over unchanged. :data:`ENV_VARIABLES` is the one
table of every ``CGX_*`` variable (name, accepted values, default, meaning, the field it
sets); the parsers read the environment only through :func:`read_env`, which refuses a
name the table lacks, and :func:`configuration_page` renders the table as
``docs/configuration.md``.

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
    "ENV_MAILBOX_KERNELS",
    "ENV_MINIMAL_SIZE",
    "ENV_SPIN",
    "ENV_STAGING",
    "ENV_STOCHASTIC",
    "ENV_TIMEOUT",
    "ENV_VARIABLES",
    "NO_COMPRESSION_BITS",
    "CommConfig",
    "CompressionConfig",
    "EnvVar",
    "compression_from_env",
    "configuration_page",
    "describe_configuration",
    "log_configuration",
    "mailbox_kernels_mode",
    "read_env",
    "resolve_comm",
    "resolve_compression",
    "resolved_compression",
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
#: The node-local mailboxes' loads and stores (transport/mailbox.py): "auto", "1", "0".
ENV_MAILBOX_KERNELS = "CGX_UCX_MAILBOX_KERNELS"
#: Staging memory a communicator keeps between collectives (collectives/staging.py).
ENV_STAGING = "CGX_UCX_STAGING_MB"
#: MiB of staging kept idle between collectives unless configured: a few pipeline pieces
#: per role, so calls up to about 64 MiB reuse all their staging and larger ones hold no
#: more after they return (``python -m cgx_ucx.bench memory``).
DEFAULT_STAGING_MB = 32

#: torch_cgx forces its minimal compressed size to at least 16 values.
MIN_COMPRESSED_SIZE = 16


@dataclass(frozen=True)
class EnvVar:
    """One environment variable: a row of :data:`ENV_VARIABLES`.

    ``type`` says which values it accepts, in the words of the error a bad value raises;
    ``default`` applies while it is unset ("unset" where leaving it unset differs from
    every value, as ``meaning`` then says); ``feeds`` names the configuration field it
    sets, or the module or tool that reads it.
    """

    name: str
    type: str
    default: str
    meaning: str
    feeds: str


_FLAG = "an integer (as torch_cgx reads it: > 0 on, else off)"
_LINK_BENCH = "Set by `python -m cgx_ucx.bench link` for each rank it starts"

#: Every ``CGX_*`` environment variable of the project, the one source of
#: ``docs/configuration.md`` (:func:`configuration_page`). Compression and communicator
#: variables are parsed here; the two-level ones by :mod:`cgx_ucx.transport.topology`.
ENV_VARIABLES: tuple[EnvVar, ...] = (
    EnvVar(
        ENV_BITS,
        "an integer in 1..8 or 32",
        "32",
        "Bits per value on the wire; 32 sends values as they are (no compression).",
        "CompressionConfig.bits",
    ),
    EnvVar(
        ENV_BUCKET_SIZE,
        f"an integer in 1..{MAX_BUCKET_SIZE}",
        "512",
        "Values that share one float32 (unit, min) pair.",
        "CompressionConfig.bucket_size",
    ),
    EnvVar(
        ENV_MINIMAL_SIZE,
        "an integer >= 0",
        str(MIN_COMPRESSED_SIZE),
        "Layers with fewer values are sent uncompressed; values below "
        f"{MIN_COMPRESSED_SIZE} count as {MIN_COMPRESSED_SIZE}, as in torch_cgx.",
        "CompressionConfig.minimal_size",
    ),
    EnvVar(
        ENV_STOCHASTIC,
        "0 (nearest) or 1 (stochastic)",
        "0",
        "1: unbiased stochastic rounding from a seeded generator; 0: round to nearest.",
        "CompressionConfig.stochastic",
    ),
    EnvVar(
        ENV_TIMEOUT,
        f"a number of seconds > 0, at most {MAX_SECONDS:g}",
        "300",
        "Longest time any single wait may take: a peer silent for longer is reported "
        "lost (`PeerLostError`).",
        "CommConfig.timeout",
    ),
    EnvVar(
        ENV_SECRET,
        "a string",
        "unset",
        "Out-of-band secret every rank must present to join; unset: whoever can read "
        "the rendezvous store is trusted. Never logged, never written to the store.",
        "CommConfig.secret",
    ),
    EnvVar(
        ENV_NODE_ID,
        "a string of 1..255 characters",
        "unset",
        "This rank's node label (ranks with equal labels share a node); overrides the "
        "launcher's and the host's view of the nodes. Set it on every rank or on none.",
        "CommConfig.node_id",
    ),
    EnvVar(
        ENV_STAGING,
        "an integer >= 0 (MiB)",
        str(DEFAULT_STAGING_MB),
        "Staging memory (MiB) a communicator keeps idle once no collective has used it "
        "for a second, shared segments apart (they have a cap of the same size). While "
        "calls keep coming it reuses all the staging they need; what a burst of large "
        "calls grew goes back to the system a second after the last one, or, in a loop "
        "whose last two pauses between calls were longer, after twice the shorter of "
        "them (at most 10 s).",
        "CommConfig.staging_mb",
    ),
    EnvVar(
        ENV_SPIN,
        "auto, 1 (always spin) or 0 (never)",
        "auto",
        "Whether the progress driver polls briefly after a completion instead of "
        "sleeping; auto polls only while the host has a spare core, and, where the job "
        "has more ranks on the host than cores, only for transfers with a node-local peer "
        "larger than a frame header (those that shared memory raises no event for).",
        "cgx_ucx.transport.progress",
    ),
    EnvVar(
        ENV_MAILBOX_KERNELS,
        "auto, 1 or 0",
        "auto",
        "Whether the node-local mailboxes' loads and stores are compiled Numba functions "
        "(fenced, and spinning without the GIL) or plain NumPy ones. auto: compiled only "
        "where the CPU may reorder stores (not x86-64, which keeps them in order), so that "
        "on x86-64 a job whose codec runs on the GPU, or that sends uncompressed, never "
        "loads Numba (about 115 MiB a rank). 0 is refused on a CPU that reorders stores.",
        "cgx_ucx.transport.mailbox",
    ),
    EnvVar(
        "CGX_INTRA_BROADCAST",
        _FLAG,
        "unset",
        "Two-level allreduce: on, only local rank 0 of each node crosses nodes, then "
        "broadcasts in its node (torch_cgx's default); off or unset, every rank of a node "
        "carries a shard of the buffer across.",
        "HierarchyConfig.scheme",
    ),
    EnvVar(
        "CGX_INNER_COMMUNICATOR_TYPE",
        "SHM, NCCL, P2P or MPI",
        "SHM",
        "Intra-node transport: SHM, NCCL and P2P select UCX's node-local transports "
        "(shared memory, CMA, CUDA IPC); MPI the network path inside the node too.",
        "HierarchyConfig.intra_transport",
    ),
    EnvVar(
        "CGX_INNER_REDUCTION_TYPE",
        "SRA or Ring",
        "SRA",
        "Intra-node reduction: scatter-reduce-allgather or ring.",
        "HierarchyConfig.intra_reduction",
    ),
    EnvVar(
        "CGX_CROSS_REDUCTION_TYPE",
        "SRA or Ring",
        "unset",
        "Cross-node reduction: scatter-reduce-allgather or ring; unset, the allreduce "
        "chooses as on a flat job.",
        "HierarchyConfig.cross_reduction",
    ),
    EnvVar(
        "CGX_INTRA_COMPRESS",
        _FLAG,
        "0",
        "Quantize the intra-node traffic too (torch_cgx's default is 1).",
        "HierarchyConfig.intra_compress",
    ),
    EnvVar(
        "CGX_UCX_INTRA_SHM",
        _FLAG,
        "1",
        "Uncompressed node-local host bytes go through shared segments the node's "
        "ranks map; 0: through UCX's shared-memory transport.",
        "HierarchyConfig.intra_shm",
    ),
    EnvVar(
        "CGX_UCX_KERNEL_CACHE",
        "a directory path",
        "unset",
        "Where the host codec's compiled Numba kernels are kept (the GPU codec's CUDA "
        "kernels go to its `cuda` folder). Unset: `NUMBA_CACHE_DIR` if set, else "
        "`$XDG_CACHE_HOME/cgx_ucx/numba-<numba>-py<X.Y>` (`~/.cache` without "
        "`XDG_CACHE_HOME`; CUDA kernels in `$XDG_CACHE_HOME/cgx_ucx/kernels`), shared by "
        "every virtual environment of the user.",
        "cgx_ucx.compression.kernels, cgx_ucx.compression.gpu",
    ),
    EnvVar(
        "CGX_BENCH_LINK_DEVICE",
        "a network device name",
        "unset",
        f"{_LINK_BENCH}: the shaped device whose byte counter the rank reads. Not a setting.",
        "cgx_ucx.bench.link_worker",
    ),
    EnvVar(
        "CGX_BENCH_LINK_RATE_BPS",
        "an integer (bits per second)",
        "unset",
        f"{_LINK_BENCH}: the shaped link's rate. Not a setting.",
        "cgx_ucx.bench.link_worker",
    ),
    EnvVar(
        "CGX_UCX_GPU",
        "auto, 1 or 0",
        "auto",
        "Whether `scripts/setup_env.sh` installs the gpu extra (CuPy); auto: where "
        "`nvidia-smi -L` finds a GPU.",
        "scripts/setup_env.sh",
    ),
    EnvVar(
        "CGX_UCX_REQUIRE_GPU",
        "1 or unset",
        "unset",
        "1: the GPU tests fail instead of skipping where no GPU is usable.",
        "tests",
    ),
)

_VARIABLES = {var.name: var for var in ENV_VARIABLES}


def read_env(name: str, env: Mapping[str, str] | None = None) -> str | None:
    """The raw value of variable ``name`` in ``env`` (default ``os.environ``), or None.

    ``name`` must be a row of :data:`ENV_VARIABLES`; a variable the table does not
    document cannot be read (KeyError), so the configuration page lists every one.
    """
    if name not in _VARIABLES:
        raise KeyError(f"{name} is not in cgx_ucx.config.ENV_VARIABLES: add a row for it")
    return (os.environ if env is None else env).get(name)


def _accepts(name: str) -> str:
    return _VARIABLES[name].type


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
    #: MiB of staging kept for reuse between collectives (cgx_ucx.collectives.staging).
    staging_mb: int = DEFAULT_STAGING_MB

    def __post_init__(self) -> None:
        check_seconds(self.timeout)
        if not self.connect_timeout > 0:
            raise ConfigError(f"connect_timeout must be > 0 seconds, got {self.connect_timeout!r}")
        if self.progress_mode not in ("blocking", "polling", "thread", "thread-polling"):
            raise ConfigError(f"unknown progress_mode {self.progress_mode!r}")
        if isinstance(self.staging_mb, bool) or not isinstance(self.staging_mb, int):
            raise ConfigError(f"staging_mb must be an int (MiB), got {self.staging_mb!r}")
        if self.staging_mb < 0:
            raise ConfigError(f"staging_mb must be >= 0 MiB, got {self.staging_mb}")

    @property
    def staging_bytes(self) -> int:
        """:attr:`staging_mb` in bytes."""
        return self.staging_mb << 20

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


def _env_number(name: str, env: Mapping[str, str], kind: type, ok: Any) -> Any:
    """The ``kind`` (int or float) in variable ``name``, or None when unset; a value that
    is not one, or fails ``ok``, is a ConfigError naming the variable and what its row of
    :data:`ENV_VARIABLES` says it accepts."""
    raw = read_env(name, env)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = kind(raw)
    except ValueError:
        value = None
    if value is None or not ok(value):
        raise ConfigError(f"{name}={raw!r} is not {_accepts(name)}")
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
    stochastic = _env_number(ENV_STOCHASTIC, env, int, lambda v: v in (0, 1))
    minimal = _env_number(ENV_MINIMAL_SIZE, env, int, lambda v: v >= 0)
    env_values = {
        "bits": _env_number(ENV_BITS, env, int, VALID_BITS.__contains__),
        "bucket_size": _env_number(ENV_BUCKET_SIZE, env, int, lambda v: 1 <= v <= MAX_BUCKET_SIZE),
        # torch_cgx forces the minimal size to at least 16 values.
        "minimal_size": None if minimal is None else max(minimal, MIN_COMPRESSED_SIZE),
        "stochastic": None if stochastic is None else bool(stochastic),
    }
    return _merge(CompressionConfig, base or CompressionConfig(), env_values, kwargs)


def _auto_flag(name: str, env: Mapping[str, str] | None) -> str:
    """Variable ``name``: "auto", "1" or "0" (ConfigError naming the variable otherwise)."""
    value = read_env(name, env)
    raw = ("auto" if value is None else value).strip().lower()
    mode = {"": "auto", "auto": "auto", "1": "1", "on": "1", "0": "0", "off": "0"}.get(raw)
    if mode is None:
        raise ConfigError(f"{name}={raw!r}: expected {_accepts(name)}")
    return mode


def spin_mode(env: Mapping[str, str] | None = None) -> str:
    """``CGX_UCX_SPIN``: "auto", "1" or "0" (ConfigError naming the variable otherwise)."""
    return _auto_flag(ENV_SPIN, env)


def mailbox_kernels_mode(env: Mapping[str, str] | None = None) -> str:
    """``CGX_UCX_MAILBOX_KERNELS``: "auto", "1" or "0" (ConfigError otherwise)."""
    return _auto_flag(ENV_MAILBOX_KERNELS, env)


_COMPRESSION_ENV = (ENV_BITS, ENV_BUCKET_SIZE, ENV_MINIMAL_SIZE, ENV_STOCHASTIC)


def resolved_compression(
    base: CompressionConfig | None = None, params: Mapping[str, Any] | None = None
) -> CompressionConfig:
    """``resolve_compression(base, **params)`` of the current environment, re-resolved
    only when ``base``, ``params`` or one of the four CGX_COMPRESSION_* variables changed:
    hooks and backends ask on every call (the environment may change between calls), and
    resolving costs tens of microseconds. Errors are raised as resolve_compression's."""
    params = params or {}
    key = (base, tuple(sorted(params.items())), tuple(read_env(n) for n in _COMPRESSION_ENV))
    try:
        hash(key)
    except TypeError:  # an unhashable keyword value: resolve_compression names what is wrong
        return resolve_compression(base, **params)
    return _resolved(*key)


@functools.lru_cache(maxsize=64)
def _resolved(
    base: CompressionConfig | None, params: tuple[tuple[str, Any], ...], values: tuple
) -> CompressionConfig:
    """resolve_compression with the four variables' ``values`` as its environment."""
    env = {n: v for n, v in zip(_COMPRESSION_ENV, values, strict=True) if v is not None}
    return resolve_compression(base, env, **dict(params))


def compression_from_env() -> CompressionConfig:
    """:func:`resolved_compression` with no base and no keywords: the environment's."""
    return resolved_compression()


def resolve_comm(
    base: CommConfig | None = None,
    env: Mapping[str, str] | None = None,
    **kwargs: Any,
) -> CommConfig:
    """Resolve a :class:`CommConfig`: keyword > environment > ``base`` > default."""
    env = os.environ if env is None else env
    timeout = _env_number(ENV_TIMEOUT, env, float, lambda v: 0 < v <= MAX_SECONDS)
    secret = read_env(ENV_SECRET, env) or None
    node_id = read_env(ENV_NODE_ID, env) or None
    staging_mb = _env_number(ENV_STAGING, env, int, lambda v: v >= 0)
    env_values = {
        "timeout": timeout,
        "secret": secret,
        "node_id": node_id,
        "staging_mb": staging_mb,
    }
    return _merge(CommConfig, base or CommConfig(), env_values, kwargs)


def environment_problems(
    env: Mapping[str, str] | None = None, *, compression: bool = True
) -> list[str]:
    """Every bad value of this module's CGX_* variables, one message each (naming the
    variable and what it accepts); empty when all are good. ``compression=False`` leaves
    out the CGX_COMPRESSION_* ones (a group given explicit compression ignores them)."""
    env = os.environ if env is None else env
    checks: list[Any] = [lambda: resolve_comm(env=env), lambda: spin_mode(env)]
    values = {name: read_env(name, env) for name in _COMPRESSION_ENV} if compression else {}
    checks += [
        functools.partial(resolve_compression, env={name: raw})
        for name, raw in values.items()
        if raw is not None
    ]
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


#: The shell command that writes ``docs/configuration.md`` (tests/test_docs.py checks it).
PAGE_COMMAND = (
    "python -c 'import cgx_ucx.config as c; print(c.configuration_page(), end=\"\")' "
    "> docs/configuration.md"
)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def configuration_page() -> str:
    """``docs/configuration.md``: the precedence rule, then :data:`ENV_VARIABLES` as a table."""
    lines = [
        "# Configuration",
        "",
        f"<!-- Generated from ENV_VARIABLES in cgx_ucx/config.py by: {PAGE_COMMAND} -->",
        "",
        "Every setting resolves in one place, in one order: a keyword argument "
        "(`CompressionConfig(bits=4)`, `CommConfig(timeout=60)`, `CGXOptions`) wins over "
        "the environment variable, which wins over the default.",
        "",
        "The torch backend checks every variable when the process group is made, so a bad "
        "value fails at `init_process_group` and names the variable; it reads the "
        "`CGX_COMPRESSION_*` variables again when each collective starts, so a script may "
        "change them between calls, as with torch_cgx. Where torch_cgx has a variable, "
        "its name and meaning are kept, and its default unless the row says otherwise.",
        "",
        "| Variable | Accepts | Default | Meaning | Sets |",
        "| --- | --- | --- | --- | --- |",
    ]
    for var in ENV_VARIABLES:
        default = var.default if var.default == "unset" else f"`{var.default}`"
        lines.append(
            f"| `{var.name}` | {_cell(var.type)} | {default} | {_cell(var.meaning)} "
            f"| `{var.feeds}` |"
        )
    return "\n".join(lines) + "\n"
