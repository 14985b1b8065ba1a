"""The check that every member of a new ``cgx`` group made the same group.

torch names a group by its creation index (``new_group`` counts every group made in the
job, on every rank, members or not) and gives it the store under that name, so ranks
that call ``new_group`` in different orders meet under one name with different ranks,
or under different names with the same ranks, and a connect would wait for peers that
are in another group. Before connecting, each member publishes the group as it sees it
and reads its peers' entries:

1. under the group's own store (a generation per name, as the rendezvous counts its
   connects), ``group/<generation>/<global rank>``: the ranks this rank gave the name;
2. in the job's innermost store, ``cgx_ucx/groups/<digest of the ranks>/<k>/<global
   rank>``: the name this rank gave its ``k``-th group of exactly these ranks (every
   member made as many of them as the others, so ``k`` agrees in a job that made
   groups in one order).

A peer's entry that differs raises :class:`~cgx_ucx.errors.CollectiveMismatchError`
naming both views and each rank's latest groups, here and (through a ``mismatch`` key
under the name) on the peers that wait on this rank.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import CollectiveMismatchError, RendezvousError
from ..transport.rendezvous import POLL_MAX_S, POLL_MIN_S, root_store

__all__ = ["GroupIdentity", "check_group_order"]

#: Key prefix under a group's own store.
GROUP_KEY = "cgx_ucx/group"
#: Key prefix in the job's innermost store.
RANKS_KEY = "cgx_ucx/groups"
#: How many of this process's latest groups an entry names (for the error text).
HISTORY = 8

_lock = threading.Lock()
_made: dict[tuple[int, ...], int] = {}  # groups of exactly these ranks made here so far
_history: list[tuple[str, tuple[int, ...]]] = []  # this process's latest groups


@dataclass(frozen=True)
class GroupIdentity:
    """A group as torch made it here: its name (the creation index, unless named) and
    the global ranks of its members, in group rank order."""

    name: str
    ranks: tuple[int, ...]


def _text(ranks: Sequence[int]) -> str:
    return "[" + ", ".join(str(r) for r in ranks) + "]"


def _made_text(made: Sequence[Sequence[Any]]) -> str:
    return ", ".join(f"{_text(ranks)} as group {name}" for name, ranks in made) or "none"


class _Check:
    """One member's entries and its reads of its peers' (blocking store calls)."""

    def __init__(self, store: Any, group: GroupIdentity, group_rank: int) -> None:
        self.store, self.group = store, group
        self.me = group.ranks[group_rank]
        self.root = root_store(store)
        with _lock:
            k = _made.get(group.ranks, 0)
            _made[group.ranks] = k + 1
            _history.append((group.name, group.ranks))
            del _history[:-HISTORY]
            self.made = [[n, list(r)] for n, r in _history]
        joined = int(store.add(f"{GROUP_KEY}/joined", 1))
        self.prefix = f"{GROUP_KEY}/{(joined - 1) // len(group.ranks)}"
        digest = hashlib.sha256(_text(group.ranks).encode()).hexdigest()[:32]
        self.ranks_prefix = f"{RANKS_KEY}/{digest}/{k}"

    def publish(self) -> None:
        entry = json.dumps(
            {"name": self.group.name, "ranks": list(self.group.ranks), "made": self.made}
        )
        self.store.set(f"{self.prefix}/{self.me}", entry)
        self.root.set(f"{self.ranks_prefix}/{self.me}", entry)

    def key(self, r: int) -> str:
        return f"{self.prefix}/{r}"

    @staticmethod
    def _read(store: Any, key: str) -> dict[str, Any] | None:
        if not store.check([key]):
            return None
        try:
            value = json.loads(bytes(store.get(key)))
        except (ValueError, UnicodeDecodeError):
            return None  # not an entry of ours: the connect's own checks judge that store
        return value if isinstance(value, dict) else None

    def _mismatch(self, text: str, r: int, theirs: dict[str, Any]) -> CollectiveMismatchError:
        full = (
            f"new_group was called in different orders: {text} (groups made so far, latest "
            f"last: global rank {self.me}: {_made_text(self.made)}; global rank {r}: "
            f"{_made_text(theirs.get('made', []))})"
        )
        with contextlib.suppress(Exception):  # best effort: peers find it themselves too
            self.store.set(f"{self.prefix}/mismatch", full)
        return CollectiveMismatchError(f"global rank {self.me}: {full}")

    def peer(self, r: int) -> bool:
        """True when global rank ``r`` made this group; raises when it made another
        under this name or gave these ranks another name."""
        theirs = self._read(self.store, self.key(r))
        if theirs is not None:
            ranks = tuple(int(x) for x in theirs.get("ranks", []))
            if ranks == self.group.ranks:
                return True
            raise self._mismatch(
                f"group {self.group.name} is ranks {_text(self.group.ranks)} on global rank "
                f"{self.me} and ranks {_text(ranks)} on global rank {r}",
                r,
                theirs,
            )
        theirs = self._read(self.root, f"{self.ranks_prefix}/{r}")
        if theirs is not None and theirs.get("name") != self.group.name:
            raise self._mismatch(
                f"ranks {_text(self.group.ranks)} are group {self.group.name} on global rank "
                f"{self.me} and group {theirs.get('name')} on global rank {r}",
                r,
                theirs,
            )
        return False

    def told(self) -> None:
        """Raise the mismatch a peer found, if one did."""
        key = f"{self.prefix}/mismatch"
        if self.store.check([key]):
            text = bytes(self.store.get(key)).decode("utf-8", errors="replace")
            raise CollectiveMismatchError(f"global rank {self.me}: {text}")


def check_group_order(store: Any, group: GroupIdentity, group_rank: int, timeout: float) -> None:
    """Publish ``group`` and wait (at most ``timeout`` seconds) until every member is
    seen to have made it.

    CollectiveMismatchError as soon as a peer made another group under its name or gave
    its ranks another name; RendezvousError naming the members not seen by the deadline.
    Each poll reads the entries of this rank's two neighbours in the group (a mismatch
    anywhere is found by the neighbours of the rank at fault, which tell the rest
    through the name's ``mismatch`` key) and checks for all entries at once.
    """
    if len(group.ranks) < 2:
        return
    deadline = time.monotonic() + timeout
    check = _Check(store, group, group_rank)
    check.publish()
    others = [r for r in group.ranks if r != check.me]
    n = len(group.ranks)
    neighbours = {group.ranks[(group_rank - 1) % n], group.ranks[(group_rank + 1) % n]}
    neighbours.discard(check.me)
    keys = [check.key(r) for r in others]
    pause = POLL_MIN_S
    while True:
        neighbours = {r for r in neighbours if not check.peer(r)}
        if not neighbours and store.check(keys):
            for r in others:
                check.peer(r)
            return
        check.told()
        left = deadline - time.monotonic()
        if left <= 0:
            missing = [r for r in others if not store.check([check.key(r)])]
            raise RendezvousError(
                f"global rank {check.me}: global rank(s) {missing} did not make group "
                f"{group.name} (ranks {_text(group.ranks)}) within the connect timeout "
                f"({timeout:g} s)"
            )
        time.sleep(min(pause, left))
        pause = min(pause * 2, POLL_MAX_S)
