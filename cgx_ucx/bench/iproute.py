"""One iproute2 command (``ip``, ``tc``) run with a deadline; a failure is a typed error.

The link emulator's modules (:mod:`.namespaces`, :mod:`.shaping`, :mod:`.netns`) build and
read the emulated links only through :func:`run`.
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence

from ..errors import ConfigError, TransportError

__all__ = ["COMMAND_TIMEOUT_S", "run"]

#: Every ip/tc call returns within this, or the setup fails (they take milliseconds).
COMMAND_TIMEOUT_S = 20.0


def run(cmd: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run one ip/tc command with a deadline; failures become TransportError with its stderr."""
    try:
        done = subprocess.run(
            list(cmd), capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False
        )
    except FileNotFoundError as exc:
        raise ConfigError(f"{cmd[0]!r} not found: link emulation needs iproute2") from exc
    except subprocess.TimeoutExpired as exc:
        raise TransportError(f"`{' '.join(cmd)}` did not return in {COMMAND_TIMEOUT_S} s") from exc
    if check and done.returncode != 0:
        raise TransportError(
            f"`{' '.join(cmd)}` failed (exit {done.returncode}): {done.stderr.strip()}"
        )
    return done
