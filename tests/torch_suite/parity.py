"""The one list of torch distributed-suite tests that pass on gloo and not on cgx, and why.

Keys are test names of torch's ``DistributedTest._DistTestBase`` (torch 2.13). Kinds:

- ``GLOO_ONLY``: the test is hard-wired to gloo (``BACKEND != "gloo"`` skips it, or it
  checks gloo's own messages/profiler names); not a gap in cgx.
- ``COMPRESSION``: an exact-equality test, listed only for runs with compression on
  (``bits < 32``); quantized SUM/AVG is within the codec's bound, not bit-equal to gloo.
- ``MISSING_OP``: the op is not implemented by the cgx backend. Each entry names the op;
  remove it when the op is implemented: tests/test_torch_suite.py fails on a listed test
  that passes.
- ``FLAKY``: passes and fails from run to run on both backends (not checked for staleness).

``worlds``: the world sizes where the entry applies (None: all).
"""

from __future__ import annotations

from dataclasses import dataclass

GLOO_ONLY = "hard-wired to gloo"
COMPRESSION = "exact-equality test under compression"
MISSING_OP = "missing op"
FLAKY = "flaky on every backend"


@dataclass(frozen=True)
class Entry:
    kind: str
    reason: str
    worlds: tuple[int, ...] | None = None
    compressed_only: bool = False


def _gloo(reason: str) -> Entry:
    return Entry(GLOO_ONLY, reason)


def _missing(op: str, worlds: tuple[int, ...] | None = None) -> Entry:
    return Entry(MISSING_OP, f"{MISSING_OP}: {op}", worlds)


_GET_FUTURE = _gloo(
    "'get_future is only supported on mpi, nccl and gloo' (name check); test_get_future "
    "passes on cgx with --gloo-gated, the no_sync tests build their model only in "
    "gloo/nccl branches (UnboundLocalError there)"
)
_NO_SYNC = _gloo("require_backend_is_available({'gloo'}); passes on cgx with --gloo-gated")
_COALESCED = _gloo(
    "require_backend_is_available({'gloo'}): torch runs all_reduce_coalesced tests on gloo "
    "only; they pass on cgx with --gloo-gated"
)
_MONITORED = _gloo(
    "monitored_barrier is gloo's own: torch's dist.monitored_barrier raises "
    "'only implemented for GLOO backend' for any other backend"
)
_TIMEOUT = _gloo(
    "'Only gloo backend supports timeouts' (name check); test_barrier_timeout_full_group "
    "passes on cgx with --gloo-gated"
)

PARITY: dict[str, Entry] = {
    # -- missing ops: none (point-to-point, recv from any source and all_gather_coalesced
    # pass at world 2 and 3). Add new ones as _missing("op") entries.
    # -- hard-wired to the name "gloo" in torch's distributed_test.py (skip on cgx)
    "test_all_reduce_coalesced_sum": _COALESCED,
    "test_all_reduce_coalesced_product": _COALESCED,
    "test_all_reduce_coalesced_min": _COALESCED,
    "test_all_reduce_coalesced_max": _COALESCED,
    "test_all_reduce_coalesced_group_sum": _COALESCED,
    "test_all_reduce_coalesced_group_product": _COALESCED,
    "test_all_reduce_coalesced_group_min": _COALESCED,
    "test_all_reduce_coalesced_group_max": _COALESCED,
    "test_all_reduce_coalesced_full_group_sum": _COALESCED,
    "test_all_reduce_coalesced_full_group_product": _COALESCED,
    "test_all_reduce_coalesced_full_group_min": _COALESCED,
    "test_all_reduce_coalesced_full_group_max": _COALESCED,
    "test_accumulate_gradients_no_sync": _GET_FUTURE,
    "test_accumulate_gradients_no_sync_allreduce_hook": _GET_FUTURE,
    "test_accumulate_gradients_no_sync_allreduce_with_then_hook": _GET_FUTURE,
    "test_accumulate_gradients_no_sync_grad_is_view": _GET_FUTURE,
    "test_get_future": _GET_FUTURE,
    "test_grads_same_across_ranks_with_no_sync": _NO_SYNC,
    "test_batch_isend_irecv_gloo": _gloo(
        "'GLOO Batch Send Recv CPU' (name check); passes on cgx with --gloo-gated"
    ),
    "test_batch_isend_irecv_gloo_tags": _gloo(
        "'GLOO Batch Send Recv CPU' (name check); passes on cgx with --gloo-gated"
    ),
    "test_scatter_object_list": _gloo(
        "require_backend_is_available({'gloo'}); passes on cgx with --gloo-gated"
    ),
    "test_sparse_all_reduce_sum": _gloo(
        "'Only Gloo backend supports sparse all reduce' (name check); cgx refuses sparse "
        "tensors with a ConfigError that names .to_dense() and gloo (dense tensors only)"
    ),
    "test_monitored_barrier_gloo": _MONITORED,
    "test_monitored_barrier_gloo_subgroup": _MONITORED,
    "test_monitored_barrier_gloo_rank_0_timeout": _MONITORED,
    "test_monitored_barrier_failure_order": _MONITORED,
    "test_monitored_barrier_wait_all_ranks": _MONITORED,
    "test_barrier_timeout_global": _TIMEOUT,
    "test_barrier_timeout_group": _TIMEOUT,
    "test_barrier_timeout_full_group": _TIMEOUT,
    "test_barrier_timeout_arg": _TIMEOUT,
}


def lookup(name: str, world_size: int, bits: int) -> Entry | None:
    """The entry explaining ``name`` at this world size and compression, or None."""
    entry = PARITY.get(name)
    if entry is None:
        return None
    if entry.worlds is not None and world_size not in entry.worlds:
        return None
    if entry.compressed_only and bits >= 32:
        return None
    return entry
