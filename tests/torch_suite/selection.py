"""Which of torch's ``_DistTestBase`` tests run: every CPU test ("full"), or the CI subset.

"full" is every test whose name does not say it needs a GPU (cuda, gpu, nccl): the
collective, point-to-point, subgroup, object-collective, DDP-on-CPU, model-averaging and
backend-API tests. Tests that need a GPU inside their body skip themselves on a CPU-only
machine on every backend.

"ci" (run at world size 2; "ci3", its part where a third rank matters, at 3) is a fixed
representative subset that fits the test command's time budget: each
family of collective once (plain, subgroup and full-group forms), point-to-point, subgroup
creation, object collectives, a few CPU DDP training tests, any-source recv and
all_gather_coalesced.

torch 2.13 runs its ``*_group`` tests (a subgroup of ranks 1 and 2) only at world size 8
or more (``skip_if_small_worldsize``), on gloo as on cgx; at 2 and 3 subgroups are
covered by the ``*_full_group`` tests (``new_group`` of every rank), the object
collectives on a subgroup and ``test_destroy_group``. ``run --world-size 8`` runs them.
"""

from __future__ import annotations

import re

GPU_WORDS = re.compile(r"cuda|gpu|nccl", re.IGNORECASE)

CI: tuple[str, ...] = (
    # collectives, each family once, plain and full-group forms
    "test_all_reduce_sum",
    "test_all_reduce_sum_async",
    "test_all_reduce_full_group_product",
    "test_all_reduce_complex_unsupported_ops",
    "test_broadcast",
    "test_all_gather_full_group",
    "test_reduce_sum",
    "test_gather",
    "test_scatter_full_group",
    "test_barrier",
    # point-to-point, any-source recv, all_gather_coalesced
    "test_all_gather_coalesced_simple",
    "test_send_recv",
    "test_send_recv_any_source",
    "test_isend",
    "test_irecv",
    # subgroups and object collectives
    "test_all_gather_object_subgroup",
    "test_get_rank_size_group",
    "test_destroy_group",
    # DDP on CPU
    "test_DistributedDataParallelCPU",
    "test_static_graph_api_cpu",
    "test_ddp_create_graph",
)


#: At world size 3 (odd: uneven chunks, a middle rank, any-source with two senders) the
#: CI runs the tests where a third rank changes the code path; the rest of ``CI`` is
#: rank-count agnostic and runs at 2 (each test costs ~4 s of process start-up here).
CI3: tuple[str, ...] = (
    "test_all_reduce_sum",
    "test_all_reduce_full_group_product",
    "test_broadcast",
    "test_all_gather_full_group",
    "test_reduce_sum",
    "test_scatter_full_group",
    "test_send_recv_any_source",
    "test_all_gather_object_subgroup",
    "test_DistributedDataParallelCPU",
)


def select(subset: str, all_names: list[str], only: list[str] | None = None) -> list[str]:
    """The test names of ``subset`` ("ci" or "full"), kept to those containing one of
    ``only`` when given."""
    if subset == "full":
        names = [n for n in all_names if not GPU_WORDS.search(n)]
    elif subset in ("ci", "ci3"):
        chosen = CI if subset == "ci" else CI3
        missing = sorted(set(chosen) - set(all_names))
        if missing:
            raise SystemExit(f"CI tests not in this torch's _DistTestBase: {missing}")
        names = list(chosen)
    else:
        raise SystemExit(f"unknown subset {subset!r}: ci, ci3 or full")
    if only:
        names = [n for n in names if any(k in n for k in only)]
    return names
