"""UCXX transport: rendezvous over a torch.distributed Store, framing, the peer mesh.

See :mod:`.mesh` for why each peer gets a data channel (worker-address endpoints:
shared memory, CMA, cuda_ipc) and a control channel (error-handling endpoint: liveness,
membership, ABORT/BYE).
"""

from .frames import FRAME_NBYTES, MAX_PAYLOAD_NBYTES, Frame, Kind
from .mesh import MAX_WORLD_SIZE, Mesh, TransportStats
from .rendezvous import PeerAddress, Rendezvous, env_store
from .ucx import UCX_DEFAULTS, apply_env_defaults

__all__ = [
    "FRAME_NBYTES",
    "MAX_PAYLOAD_NBYTES",
    "MAX_WORLD_SIZE",
    "UCX_DEFAULTS",
    "Frame",
    "Kind",
    "Mesh",
    "PeerAddress",
    "Rendezvous",
    "TransportStats",
    "apply_env_defaults",
    "env_store",
]
