"""What one communicator's transport counts: traffic, refused connections, transports."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["TransportStats"]


@dataclass
class TransportStats:
    """Traffic of one communicator (payload and header bytes, as posted to UCX), and the
    connections refused because they could not prove membership."""

    bytes_sent: int = 0
    bytes_received: int = 0
    messages_sent: int = 0
    messages_received: int = 0
    collectives: int = 0
    by_collective: dict[str, int] = field(default_factory=dict)
    refused_connections: int = 0
    #: The transports UCX gave the data endpoint to each peer (``"tcp/eth0"``), and per
    #: level (``{"node-local": "sysv/memory+posix/memory", "cross-node": "tcp/eth0"}``).
    transports: dict[int, str] = field(default_factory=dict)
    levels: dict[str, str] = field(default_factory=dict)
