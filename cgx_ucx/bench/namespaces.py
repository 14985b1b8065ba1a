"""Network namespaces of the emulated links: names, ``/etc/netns`` files, veth, clean-up.

Namespace names are ``<prefix>-<owner pid>-<token>-<role>`` (role ``r<rank>``, ``n<node>``
or ``hub``), so :func:`cleanup_stale` can tell the left-overs of a killed run (owner dead)
from the namespaces of a run going on now. Deleting a namespace deletes its devices (a veth
pair dies with either end, a bridge with its namespace, qdiscs with their device); besides,
only its ``/etc/netns`` folder remains to remove.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
from collections.abc import Sequence
from pathlib import Path

from .iproute import run

__all__ = [
    "DEFAULT_PREFIX",
    "IFNAMSIZ",
    "MAX_WORLD",
    "NETNS_ETC",
    "SUBNET",
    "cleanup_stale",
    "delete_namespace",
    "list_namespaces",
    "veth_peer",
    "write_hosts",
]

# The link emulator's logger: its set-up and clean-up messages read as one stream.
log = logging.getLogger("cgx_ucx.bench.netns")

#: Namespace names start with this; :func:`cleanup_stale` only ever touches names it matches.
DEFAULT_PREFIX = "cgxlink"
#: The private /24 of the emulated network (only inside our namespaces). Rank i has .i+1.
SUBNET = "10.213.0"
#: .1 .. .254 are usable host addresses of a /24.
MAX_WORLD = 254
#: Linux limits interface names to 15 characters (IFNAMSIZ - 1); ours are at most 12.
IFNAMSIZ = 15
#: ``ip netns exec NS`` bind-mounts ``/etc/netns/NS/*`` over ``/etc``: each rank namespace
#: gets a ``hosts`` file there in which this machine's hostname is the rank's own address,
#: as on a cluster node. Libraries that find "my address" from the hostname (the engine's
#: rendezvous when it sees a PrefixStore, torch's c10d) then pick the veth, not loopback.
NETNS_ETC = Path("/etc/netns")


def list_namespaces() -> list[str]:
    """The names of all network namespaces (``ip netns list``)."""
    done = run(["ip", "netns", "list"])
    # Lines look like "name" or "name (id: 3)".
    return [line.split()[0] for line in done.stdout.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _namespace_pids(ns: str) -> list[int]:
    done = run(["ip", "netns", "pids", ns], check=False)
    return [int(tok) for tok in done.stdout.split() if tok.isdigit()]


def delete_namespace(ns: str) -> str | None:
    """Kill what still runs in ``ns`` (by pid), delete it; the error text, or None."""
    for pid in _namespace_pids(ns):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    done = run(["ip", "netns", "del", ns], check=False)
    shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)
    if done.returncode != 0 and ns in list_namespaces():
        return done.stderr.strip() or f"exit {done.returncode}"
    return None


def _name_pattern(prefix: str) -> re.Pattern[str]:
    return re.compile(rf"^{re.escape(prefix)}-(\d+)-([0-9a-f]{{6}})-(?:r\d+|n\d+|hub)$")


def cleanup_stale(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Delete namespaces left by killed runs: name matches ``prefix`` and its owner pid is dead.

    Namespaces of live owners (another emulator running now) are never touched. Returns the
    names removed.
    """
    pattern = _name_pattern(prefix)
    removed = []
    etc = sorted(p.name for p in NETNS_ETC.iterdir()) if NETNS_ETC.is_dir() else []
    for ns in sorted(set(list_namespaces()) | set(etc)):
        m = pattern.match(ns)
        if m is None or _pid_alive(int(m.group(1))):
            continue
        err = delete_namespace(ns)
        if err is None:
            removed.append(ns)
            log.info("removed left-over namespace %s (owner pid %s is dead)", ns, m.group(1))
        else:
            log.warning("could not remove left-over namespace %s: %s", ns, err)
    return removed


def write_hosts(ns: str, lines: Sequence[str]) -> None:
    """``/etc/netns/<ns>/hosts``: what ``/etc/hosts`` reads inside ``ip netns exec <ns>``."""
    folder = NETNS_ETC / ns
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "hosts").write_text("\n".join(lines) + "\n")


def veth_peer(name: str, ns: str) -> list[str]:
    """The ``peer`` clause of ``ip link add ... type veth``: the other end made in ``ns``."""
    return ["peer", "name", name, "netns", ns]
