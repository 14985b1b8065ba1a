"""Which ranks share a node, learned at rendezvous, and how the allreduce uses the levels.

A *node* is a set of ranks that can use node-local transports with each other (shared
memory, CMA, CUDA IPC/NVLink); ranks on different nodes talk only over the network. Every
rank publishes :class:`NodeHints` at rendezvous; :meth:`Topology.from_hints` turns the
hints of all ranks into the same :class:`Topology` on every rank (a pure function of the
published bytes, so the ranks agree without another round). The source of the node labels
is chosen once for the whole job, the first that every rank has:

1. an explicit label (``CommConfig.node_id``, else the ``CGX_UCX_NODE_ID`` variable); a
   label on some ranks but not on others is a :class:`~cgx_ucx.errors.ConfigError`;
2. the launcher's: torchrun's ``GROUP_RANK`` (the node's index), with ``LOCAL_RANK`` and
   ``LOCAL_WORLD_SIZE`` cross-checked against it (a mismatch is a ConfigError, never a
   silently wrong grouping). A subgroup (``dist.new_group(ranks=...)``) may hold only some
   ranks of a node: its members there are ordered by their ``LOCAL_RANK``;
3. the host identity (:func:`host_identity`): hostname, kernel boot id, and the network and
   IPC namespaces of the process. All namespaces of one machine share one kernel (and boot
   id): the link emulator's "nodes" are network namespaces, and ranks in different ones
   must count as different nodes even though UCX could reach across them by shared memory.

Nodes are numbered by their lowest rank; a rank's *local rank* is the launcher's
``LOCAL_RANK`` where that is the source, else its position among its node's ranks in rank
order.

Two levels (:attr:`Topology.is_hierarchical`): more than one node, and every node holding
more than one rank. The cross-node level then runs in ``shards`` groups, ``shards`` being
the smallest node's size: group j holds the rank of local index j of every node (so every
rank of the smallest node, and as many ranks of every other node, carry cross-node
traffic). On uneven nodes such as 3 + 2, the ranks with local index >= ``shards`` (the
third rank of the 3-node) fold their data into the intra-node reduce-scatter, own no
shard, and get the result in the intra-node allgather. A node of a single rank (3 + 1)
would cap ``shards`` at 1, i.e. one rank per node doing all the cross-node codec work: the
default then falls back to the flat allreduce, which spreads that work over all ranks; the
leader scheme can still be asked for explicitly (``CGX_INTRA_BROADCAST=1``). One node, or
nodes of one rank each, is the flat case.

:class:`HierarchyConfig` holds torch_cgx's knobs for the two levels, with their torch_cgx
meaning where it applies (see its docstring); explicit arguments win over the variables.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from ..config import ENV_NODE_ID, read_env
from ..errors import ConfigError

__all__ = [
    "ENV_CROSS_REDUCTION",
    "ENV_INNER_COMMUNICATOR",
    "ENV_INNER_REDUCTION",
    "ENV_INTRA_BROADCAST",
    "ENV_INTRA_COMPRESS",
    "ENV_INTRA_SHM",
    "ENV_NODE_ID",
    "HierarchyConfig",
    "NodeHints",
    "Topology",
    "hierarchy_problems",
    "host_identity",
    "resolve_hierarchy",
]

#: torch_cgx: intra-node communicator, MPI | SHM | NCCL (P2P in older versions).
ENV_INNER_COMMUNICATOR = "CGX_INNER_COMMUNICATOR_TYPE"
#: torch_cgx: intra-node reduction algorithm, SRA | Ring.
ENV_INNER_REDUCTION = "CGX_INNER_REDUCTION_TYPE"
#: torch_cgx: cross-node reduction algorithm, SRA | Ring.
ENV_CROSS_REDUCTION = "CGX_CROSS_REDUCTION_TYPE"
#: torch_cgx: 1 = only local rank 0 of each node crosses nodes, then broadcasts in the node.
ENV_INTRA_BROADCAST = "CGX_INTRA_BROADCAST"
#: torch_cgx: 1 = quantize the intra-node traffic too.
ENV_INTRA_COMPRESS = "CGX_INTRA_COMPRESS"
#: Ours: 0 = node-local host bytes of the two-level allreduce go through UCX, not
#: shared segments the node peers map (:mod:`cgx_ucx.transport.shm`).
ENV_INTRA_SHM = "CGX_UCX_INTRA_SHM"

#: The launcher's variables (torchrun's names).
ENV_GROUP_RANK = "GROUP_RANK"
ENV_LOCAL_RANK = "LOCAL_RANK"
ENV_LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"

#: Bounds on what a rank may publish (the store is trusted, but sizes are still bounded
#: before anything is parsed, as everywhere on the receive side).
MAX_LABEL_CHARS = 255
MAX_HOST_CHARS = 512
MAX_HINTS_NBYTES = 2048

SOURCE_OVERRIDE = "override"
SOURCE_LAUNCHER = "launcher"
SOURCE_HOST = "host"
SOURCE_GIVEN = "given"


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _ns_inode(kind: str) -> str:
    try:
        return str(os.stat(f"/proc/self/ns/{kind}").st_ino)
    except OSError:
        return ""


def host_identity() -> str:
    """What makes two processes "on one node": same host, kernel boot, net and IPC namespace.

    The boot id alone says "same kernel"; the namespaces are in it because one kernel may
    host several nodes (the link emulator, containers): shared memory between them is
    either impossible (separate IPC namespaces) or not what the launcher meant (separate
    network namespaces stand for separate hosts).
    """
    parts = [
        socket.gethostname(),
        _read("/proc/sys/kernel/random/boot_id"),
        "net:" + _ns_inode("net"),
        "ipc:" + _ns_inode("ipc"),
    ]
    return "|".join(parts)[:MAX_HOST_CHARS]


def _env_int(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name)  # the launcher's variables (torchrun's), not cgx_ucx's
    if raw is None or raw.strip() == "":
        return None
    try:
        value = int(raw)
    except ValueError as exc:
        raise ConfigError(f"{name}={raw!r} is not an integer") from exc
    if value < 0:
        raise ConfigError(f"{name}={raw!r} must be >= 0")
    return value


def _check_label(label: str, what: str) -> str:
    if not isinstance(label, str) or not label or len(label) > MAX_LABEL_CHARS:
        raise ConfigError(f"{what} must be a non-empty string of <= {MAX_LABEL_CHARS} characters")
    return label


@dataclass(frozen=True)
class NodeHints:
    """What one rank publishes at rendezvous so that all ranks can agree on the nodes."""

    host: str
    override: str | None = None
    group_rank: int | None = None
    local_rank: int | None = None
    local_world_size: int | None = None

    @classmethod
    def from_env(
        cls,
        env: Mapping[str, str] | None = None,
        *,
        node_id: str | None = None,
        host: str | None = None,
    ) -> NodeHints:
        """This rank's hints: ``node_id`` (explicit config) > ``CGX_UCX_NODE_ID``; the
        launcher's variables; the host identity."""
        env = os.environ if env is None else env
        override = node_id if node_id is not None else (read_env(ENV_NODE_ID, env) or None)
        if override is not None:
            _check_label(override, f"the node id ({ENV_NODE_ID} / CommConfig.node_id)")
        return cls(
            host=host if host is not None else host_identity(),
            override=override,
            group_rank=_env_int(env, ENV_GROUP_RANK),
            local_rank=_env_int(env, ENV_LOCAL_RANK),
            local_world_size=_env_int(env, ENV_LOCAL_WORLD_SIZE),
        )

    def pack(self) -> bytes:
        """Bytes for the store (JSON: nothing received is ever unpickled)."""
        raw = json.dumps(
            {
                "host": self.host,
                "override": self.override,
                "group_rank": self.group_rank,
                "local_rank": self.local_rank,
                "local_world_size": self.local_world_size,
            },
            separators=(",", ":"),
        ).encode()
        if len(raw) > MAX_HINTS_NBYTES:
            raise ConfigError(f"node hints of {len(raw)} bytes exceed {MAX_HINTS_NBYTES}")
        return raw

    @classmethod
    def unpack(cls, raw: bytes) -> NodeHints:
        """Parse and validate :meth:`pack`'s bytes (from a peer)."""
        if len(raw) > MAX_HINTS_NBYTES:
            raise ConfigError(f"node hints of {len(raw)} bytes exceed {MAX_HINTS_NBYTES}")
        try:
            d = json.loads(raw.decode())
        except (UnicodeDecodeError, ValueError) as exc:
            raise ConfigError("malformed node hints (not JSON)") from exc
        if not isinstance(d, dict) or set(d) != {f.name for f in fields(cls)}:
            raise ConfigError("malformed node hints (wrong fields)")
        host = d["host"]
        if not isinstance(host, str) or len(host) > MAX_HOST_CHARS:
            raise ConfigError("malformed node hints (host)")
        if d["override"] is not None:
            _check_label(d["override"], "a peer's node id")
        for name in ("group_rank", "local_rank", "local_world_size"):
            v = d[name]
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise ConfigError(f"malformed node hints ({name}={v!r})")
        return cls(**d)


def _first_appearance(labels: Sequence[Any]) -> tuple[int, ...]:
    """Node index per rank: nodes numbered in the order of their lowest rank."""
    index: dict[Any, int] = {}
    return tuple(index.setdefault(label, len(index)) for label in labels)


def _rank_order_local(node_of: Sequence[int]) -> tuple[int, ...]:
    seen: dict[int, int] = {}
    out = []
    for n in node_of:
        out.append(seen.get(n, 0))
        seen[n] = out[-1] + 1
    return tuple(out)


def _check_launcher_locals(ranks: list[int], values: list[int], size: int | None) -> None:
    """The LOCAL_RANK values of one node's members: 0..n-1 when they are the whole node
    (n = LOCAL_WORLD_SIZE), distinct values below it when they are some of its ranks."""
    if size is None or len(ranks) == size:
        if sorted(values) == list(range(len(ranks))):
            return
        expected = f"0..{len(ranks) - 1}"
    else:
        if len(set(values)) == len(values) and all(0 <= v < size for v in values):
            return
        expected = f"distinct values in 0..{size - 1}"
    raise ConfigError(
        f"the launcher's {ENV_LOCAL_RANK} values on ranks {ranks} are {values}, not {expected}"
    )


@dataclass(frozen=True)
class Topology:
    """The node of every rank and every rank's index inside its node.

    ``node_of[r]`` is rank r's node (nodes numbered by their lowest rank), ``local_rank[r]``
    its index in that node (0..size-1). Build with :meth:`from_hints` (rendezvous),
    :meth:`from_node_sizes` / :meth:`from_labels` (tests, explicit layouts) or
    :meth:`single_node`.
    """

    node_of: tuple[int, ...]
    local_rank: tuple[int, ...]
    source: str = SOURCE_GIVEN

    def __post_init__(self) -> None:
        object.__setattr__(self, "node_of", tuple(self.node_of))
        object.__setattr__(self, "local_rank", tuple(self.local_rank))
        if not self.node_of or len(self.node_of) != len(self.local_rank):
            raise ConfigError("a topology needs one node and one local rank per rank")
        if _first_appearance(self.node_of) != self.node_of:
            raise ConfigError(f"nodes must be numbered by their lowest rank, got {self.node_of}")
        for node, ranks in enumerate(self.nodes):
            locals_ = sorted(self.local_rank[r] for r in ranks)
            if locals_ != list(range(len(ranks))):
                raise ConfigError(
                    f"local ranks of node {node} (ranks {list(ranks)}) must be 0..{len(ranks) - 1},"
                    f" got {[self.local_rank[r] for r in ranks]}"
                )

    # -- constructors ---------------------------------------------------------------------
    @classmethod
    def single_node(cls, world_size: int) -> Topology:
        return cls((0,) * world_size, tuple(range(world_size)))

    @classmethod
    def from_labels(cls, labels: Sequence[Any], source: str = SOURCE_GIVEN) -> Topology:
        """Ranks with equal labels share a node; local ranks in rank order."""
        node_of = _first_appearance(labels)
        return cls(node_of, _rank_order_local(node_of), source)

    @classmethod
    def from_node_sizes(cls, sizes: Sequence[int]) -> Topology:
        """Consecutive ranks per node, as torchrun places them: ``[2, 2]``, ``[3, 1]``."""
        if not sizes or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
            raise ConfigError(f"node sizes must be positive integers, got {list(sizes)!r}")
        return cls.from_labels([n for n, s in enumerate(sizes) for _ in range(s)])

    @classmethod
    def from_hints(cls, hints: Sequence[NodeHints]) -> Topology:
        """The job's topology from every rank's hints (``hints[r]`` is rank r's); see the
        module docstring for which source wins."""
        if not hints:
            raise ConfigError("no node hints")
        overrides = [h.override for h in hints]
        if any(o is not None for o in overrides):
            missing = [r for r, o in enumerate(overrides) if o is None]
            if missing:
                raise ConfigError(
                    f"an explicit node id ({ENV_NODE_ID} / CommConfig.node_id) is set on some "
                    f"ranks but not on ranks {missing}: set it on every rank or on none"
                )
            return cls.from_labels(overrides, SOURCE_OVERRIDE)
        if all(h.group_rank is not None for h in hints):
            return cls._from_launcher(hints)
        return cls.from_labels([h.host for h in hints], SOURCE_HOST)

    @classmethod
    def _from_launcher(cls, hints: Sequence[NodeHints]) -> Topology:
        # The launcher describes the job; this communicator may be a subgroup of it
        # (``dist.new_group(ranks=...)``), holding only some ranks of a node. GROUP_RANK
        # still names each member's node; a node's members are then its ranks in the
        # order of their LOCAL_RANK. Only more members on a node than LOCAL_WORLD_SIZE
        # says it holds, or two members with one LOCAL_RANK, contradict the launcher.
        node_of = _first_appearance([h.group_rank for h in hints])
        by_node: dict[int, list[int]] = {}
        for r, n in enumerate(node_of):
            by_node.setdefault(n, []).append(r)
        for ranks in by_node.values():
            sizes = {hints[r].local_world_size for r in ranks} - {None}
            if len(sizes) > 1 or (sizes and len(ranks) > min(sizes)):
                raise ConfigError(
                    f"the launcher says {ENV_GROUP_RANK}={hints[ranks[0]].group_rank} holds "
                    f"ranks {ranks} but {ENV_LOCAL_WORLD_SIZE}={sorted(sizes)} there"
                )
        if not all(h.local_rank is not None for h in hints):
            return cls(node_of, _rank_order_local(node_of), SOURCE_LAUNCHER)
        local = [0] * len(hints)
        for ranks in by_node.values():
            values = [int(hints[r].local_rank) for r in ranks]  # type: ignore[arg-type]
            _check_launcher_locals(ranks, values, hints[ranks[0]].local_world_size)
            for i, r in enumerate(sorted(ranks, key=lambda r: (hints[r].local_rank, r))):
                local[r] = i
        return cls(node_of, tuple(local), SOURCE_LAUNCHER)

    # -- shape ----------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return len(self.node_of)

    @property
    def nodes(self) -> tuple[tuple[int, ...], ...]:
        """The ranks of each node, in local-rank order."""
        count = max(self.node_of) + 1
        out: list[list[int]] = [[] for _ in range(count)]
        for r in sorted(range(self.world_size), key=lambda r: self.local_rank[r]):
            out[self.node_of[r]].append(r)
        return tuple(tuple(ranks) for ranks in out)

    @property
    def num_nodes(self) -> int:
        return max(self.node_of) + 1

    @property
    def node_sizes(self) -> tuple[int, ...]:
        return tuple(len(ranks) for ranks in self.nodes)

    def local_size(self, rank: int) -> int:
        return self.node_sizes[self.node_of[rank]]

    def same_node(self, a: int, b: int) -> bool:
        return self.node_of[a] == self.node_of[b]

    def local_peers(self, rank: int) -> tuple[int, ...]:
        """The ranks of ``rank``'s node (itself included), in local-rank order."""
        return self.nodes[self.node_of[rank]]

    @property
    def is_hierarchical(self) -> bool:
        """Two levels apply: more than one node, and every node more than one rank."""
        return self.num_nodes > 1 and min(self.node_sizes) > 1

    @property
    def shards(self) -> int:
        """Cross-node groups of the two-level scheme: the smallest node's size."""
        return min(self.node_sizes)

    @property
    def cross_groups(self) -> tuple[tuple[int, ...], ...]:
        """Group j: the rank of local index j on every node (node order), j < :attr:`shards`."""
        return tuple(tuple(node[j] for node in self.nodes) for j in range(self.shards))

    def cross_group(self, rank: int) -> tuple[int, ...] | None:
        """``rank``'s cross-node group, or None when its local index owns no shard."""
        j = self.local_rank[rank]
        return self.cross_groups[j] if j < self.shards else None

    @property
    def leaders(self) -> tuple[int, ...]:
        """Local rank 0 of every node (the leader scheme's cross-node group)."""
        return tuple(node[0] for node in self.nodes)

    def describe(self) -> str:
        """E.g. ``2 nodes [2, 2] (launcher)``: for logs."""
        n = self.num_nodes
        return f"{n} node{'s' if n > 1 else ''} {list(self.node_sizes)} ({self.source})"


# ---------------------------------------------------------------------------- hierarchy

SCHEMES = ("auto", "flat", "sharded", "leader")
INTRA_TRANSPORTS = ("local", "network")
REDUCTIONS = ("sra", "ring")


@dataclass(frozen=True)
class HierarchyConfig:
    """How the allreduce uses the two levels; torch_cgx's variables where they apply.

    - ``scheme``: ``"auto"`` (default): two levels where :attr:`Topology.is_hierarchical`,
      else flat; ``"sharded"``: the two-level scheme where it applies (every rank of the
      smallest node carries cross-node traffic); ``"leader"``: torch_cgx's
      ``CGX_INTRA_BROADCAST=1`` (local rank 0 of each node crosses nodes, then broadcasts in
      its node; applies wherever there are several nodes and one of them has several
      ranks); ``"flat"``: never two levels. ``CGX_INTRA_BROADCAST=1`` selects ``"leader"``,
      ``=0`` ``"sharded"`` (torch_cgx's 0 has every local rank cross nodes with the whole
      buffer; the sharded scheme does that with 1/L of it each). torch_cgx's default is 1;
      ours is ``"auto"``, because the leader scheme leaves all but one NIC and codec per
      node idle.
    - ``intra_transport``: ``CGX_INNER_COMMUNICATOR_TYPE``: ``SHM`` / ``NCCL`` / ``P2P`` ->
      ``"local"`` (UCX's node-local transports: shared memory, CMA, CUDA IPC), ``MPI`` ->
      ``"network"`` (the generic network path inside the node too).
    - ``intra_reduction`` / ``cross_reduction``: ``CGX_INNER_REDUCTION_TYPE`` /
      ``CGX_CROSS_REDUCTION_TYPE``: ``SRA`` (scatter-reduce-allgather) or ``Ring``.
      ``cross_reduction="auto"`` (default) leaves the choice to the allreduce as on a flat
      job (torch_cgx's default there is Ring).
    - ``intra_compress``: ``CGX_INTRA_COMPRESS``: quantize the intra-node traffic too.
      torch_cgx's default is 1; ours is off (the node-local link is rarely the bottleneck,
      and every quantization stage adds error).
    - ``intra_shm``: ``CGX_UCX_INTRA_SHM``: uncompressed node-local host bytes go through
      shared segments the node peers map and read in place (:mod:`.shm`; on by default,
      where ``intra_transport`` is ``"local"``); off: through UCX's shared-memory
      transport (slower: :mod:`.shm` gives the figures and the benchmark).
    """

    scheme: str = "auto"
    intra_transport: str = "local"
    intra_reduction: str = "sra"
    cross_reduction: str = "auto"
    intra_compress: bool = False
    intra_shm: bool = True

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise ConfigError(f"scheme must be one of {SCHEMES}, got {self.scheme!r}")
        if self.intra_transport not in INTRA_TRANSPORTS:
            raise ConfigError(
                f"intra_transport must be one of {INTRA_TRANSPORTS}, got {self.intra_transport!r}"
            )
        if self.intra_reduction not in REDUCTIONS:
            raise ConfigError(
                f"intra_reduction must be one of {REDUCTIONS}, got {self.intra_reduction!r}"
            )
        if self.cross_reduction not in ("auto", *REDUCTIONS):
            raise ConfigError(
                f"cross_reduction must be 'auto', 'sra' or 'ring', got {self.cross_reduction!r}"
            )
        if not isinstance(self.intra_compress, bool):
            raise ConfigError(f"intra_compress must be a bool, got {self.intra_compress!r}")
        if not isinstance(self.intra_shm, bool):
            raise ConfigError(f"intra_shm must be a bool, got {self.intra_shm!r}")

    def plan(self, topology: Topology) -> str:
        """The scheme this job runs on ``topology``: ``"flat"``, ``"sharded"`` or ``"leader"``.

        Asking for a two-level scheme where it does not apply gives ``"flat"`` (a single
        node, or nodes of one rank, have nothing to gain from it; see the module docstring
        for uneven nodes).
        """
        if self.scheme == "leader":
            several = topology.num_nodes > 1 and max(topology.node_sizes) > 1
            return "leader" if several else "flat"
        if self.scheme in ("auto", "sharded") and topology.is_hierarchical:
            return "sharded"
        return "flat"


_COMMUNICATORS = {"SHM": "local", "NCCL": "local", "P2P": "local", "MPI": "network"}
_REDUCTION_NAMES = {"SRA": "sra", "RING": "ring"}


def _env_choice(env: Mapping[str, str], name: str, table: Mapping[str, str]) -> str | None:
    raw = read_env(name, env)
    if raw is None or raw.strip() == "":
        return None
    value = table.get(raw.strip().upper())
    if value is None:
        raise ConfigError(f"{name}={raw!r}: expected one of {sorted(table)} (torch_cgx's names)")
    return value


def _env_flag(env: Mapping[str, str], name: str) -> bool | None:
    """torch_cgx reads these as integers: any value > 0 is on."""
    raw = read_env(name, env)
    if raw is None or raw.strip() == "":
        return None
    try:
        return int(raw) > 0
    except ValueError as exc:
        raise ConfigError(
            f"{name}={raw!r} is not an integer (as torch_cgx reads it: > 0 on, else off)"
        ) from exc


_HIERARCHY_ENV = (
    (ENV_INTRA_BROADCAST, lambda env: _env_flag(env, ENV_INTRA_BROADCAST)),
    (ENV_INNER_COMMUNICATOR, lambda env: _env_choice(env, ENV_INNER_COMMUNICATOR, _COMMUNICATORS)),
    (ENV_INNER_REDUCTION, lambda env: _env_choice(env, ENV_INNER_REDUCTION, _REDUCTION_NAMES)),
    (ENV_CROSS_REDUCTION, lambda env: _env_choice(env, ENV_CROSS_REDUCTION, _REDUCTION_NAMES)),
    (ENV_INTRA_COMPRESS, lambda env: _env_flag(env, ENV_INTRA_COMPRESS)),
    (ENV_INTRA_SHM, lambda env: _env_flag(env, ENV_INTRA_SHM)),
)


def hierarchy_problems(env: Mapping[str, str] | None = None) -> list[str]:
    """Every bad two-level variable (torch_cgx's and CGX_UCX_INTRA_SHM), one message
    each; empty when all are good. :func:`resolve_hierarchy` stops at the first."""
    env = os.environ if env is None else env
    problems = []
    for _, read in _HIERARCHY_ENV:
        try:
            read(env)
        except ConfigError as exc:
            problems.append(str(exc))
    return problems


def resolve_hierarchy(
    base: HierarchyConfig | None = None,
    env: Mapping[str, str] | None = None,
    **kwargs: Any,
) -> HierarchyConfig:
    """Resolve a :class:`HierarchyConfig`: keyword > torch_cgx variable > ``base`` > default.

    Keywords whose value is ``None`` count as not given.
    """
    env = os.environ if env is None else env
    known = {f.name for f in fields(HierarchyConfig)}
    unknown = set(kwargs) - known
    if unknown:
        raise ConfigError(f"unknown HierarchyConfig option(s): {sorted(unknown)}")
    broadcast = _env_flag(env, ENV_INTRA_BROADCAST)
    from_env = {
        "scheme": None if broadcast is None else ("leader" if broadcast else "sharded"),
        "intra_transport": _env_choice(env, ENV_INNER_COMMUNICATOR, _COMMUNICATORS),
        "intra_reduction": _env_choice(env, ENV_INNER_REDUCTION, _REDUCTION_NAMES),
        "cross_reduction": _env_choice(env, ENV_CROSS_REDUCTION, _REDUCTION_NAMES),
        "intra_compress": _env_flag(env, ENV_INTRA_COMPRESS),
        "intra_shm": _env_flag(env, ENV_INTRA_SHM),
    }
    values = {k: v for k, v in from_env.items() if v is not None}
    values.update({k: v for k, v in kwargs.items() if v is not None})
    return replace(base or HierarchyConfig(), **values)
