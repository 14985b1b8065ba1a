"""PyTorch integration: the ``cgx`` torch.distributed backend, the DDP comm hook, and
per-parameter gradient hooks (GradientSync).

Importing this package registers the ``cgx`` backend (idempotent), so
``dist.init_process_group("cgx")`` works after ``import cgx_ucx``.
"""

from ._policy import POLICY_NAMES
from .backend import register
from .communicators import close_communicators, get_communicator
from .grad_sync import GradientSync
from .hook import CGXState, cgx_hook, layer_layout, wire_bytes
from .options import CGXOptions
from .process_group import BACKEND_NAME, ProcessGroupCGX
from .work import CGXWork

register()

__all__ = [
    "BACKEND_NAME",
    "POLICY_NAMES",
    "CGXOptions",
    "CGXState",
    "CGXWork",
    "GradientSync",
    "ProcessGroupCGX",
    "cgx_hook",
    "close_communicators",
    "get_communicator",
    "layer_layout",
    "register",
    "wire_bytes",
]
