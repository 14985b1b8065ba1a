"""UCXX transport: rendezvous over a torch.distributed Store, framing, the peer mesh.

See :mod:`.mesh` for why each peer gets a data channel (worker-address endpoints:
shared memory, CMA, cuda_ipc) and a control channel (error-handling endpoint: liveness,
membership, ABORT/BYE/STATUS). A mesh is built in layers, each a module: :mod:`.peer`
and :mod:`.stats` (records), :mod:`.state` (failure bookkeeping), :mod:`.control` (the
control channel), :mod:`.connection` (connecting), :mod:`.data` and :mod:`.exchange`
(the data channel), :mod:`.mesh` (connect, close, abort). :mod:`.handshake` gives the
trust model (membership proofs, pair keys, secret tag spaces), :mod:`.status` what a
timed-out wait learns about its peer, and :mod:`.progress` the event-driven progress
driver.

What UCX picks (it chooses per pair of ranks; ``UCX_TLS`` / ``UCX_NET_DEVICES`` pass
through untouched):

- one host, host memory: the data channel uses shared memory (posix/sysv) for small
  messages and CMA (``process_vm_readv``, one copy) for large ones; the control channel
  uses TCP over loopback (point-to-point figures: ``python -m cgx_ucx.bench allreduce``).
- one host, CuPy buffers: cuda_ipc between the GPUs (NVLink/PCIe peer access), cuda_copy
  staging otherwise.
- across hosts: TCP (tuned segment sizes, see :mod:`.ucx`) or, where present, InfiniBand
  / RoCE verbs (rc, ud, dc) and GPUDirect RDMA; the control channel stays on TCP
  (through the UCX listener).
- ``UCX_TLS=tcp`` forces TCP everywhere (the tests run both).
"""

from .frames import FRAME_NBYTES, MAX_PAYLOAD_NBYTES, Frame, Kind
from .mesh import MAX_WORLD_SIZE, Mesh
from .rendezvous import PeerAddress, Rendezvous, env_store
from .stats import TransportStats
from .status import PeerStatus
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
    "PeerStatus",
    "Rendezvous",
    "TransportStats",
    "apply_env_defaults",
    "env_store",
]
