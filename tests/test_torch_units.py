"""Single-process tests of the torch layer: conversions, futures, work, layouts, config."""

from __future__ import annotations

import concurrent.futures
import datetime
import threading
import time

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from cgx_ucx.config import CommConfig, CompressionConfig  # noqa: E402
from cgx_ucx.errors import CGXError, CGXTimeoutError, ConfigError, PeerLostError  # noqa: E402
from cgx_ucx.layout import Layout  # noqa: E402
from cgx_ucx.torch import BACKEND_NAME, CGXOptions, layer_layout, wire_bytes  # noqa: E402
from cgx_ucx.torch._convert import as_array  # noqa: E402
from cgx_ucx.torch.futures import Finished, to_torch_future  # noqa: E402
from cgx_ucx.torch.layers import bucket_op  # noqa: E402
from cgx_ucx.torch.ops import GroupView, _local_reduce, allreduce_into  # noqa: E402
from cgx_ucx.torch.options import comm_config as _comm_config  # noqa: E402
from cgx_ucx.torch.work import CGXWork  # noqa: E402


# -- conversions ---------------------------------------------------------------------------
@pytest.mark.timeout(30)
@pytest.mark.parametrize("n", [0, 1, 1023])
@pytest.mark.parametrize(
    "dtype,np_dtype",
    [
        (torch.float32, np.float32),
        (torch.float16, np.float16),
        (torch.bfloat16, ml_dtypes.bfloat16),
        (torch.int64, np.int64),
        (torch.uint8, np.uint8),
    ],
)
def test_as_array_is_a_view(n: int, dtype: torch.dtype, np_dtype: type) -> None:
    t = torch.zeros(n, dtype=dtype)
    a = as_array(t)
    assert a.dtype == np.dtype(np_dtype) and a.shape == (n,)
    if n:
        a[-1] = 3  # written through the array, seen by the tensor: no copy
        assert t[-1].item() == 3


@pytest.mark.timeout(30)
def test_as_array_rejects_non_contiguous_and_sparse() -> None:
    with pytest.raises(ConfigError, match="contiguous"):
        as_array(torch.zeros(4, 4).t())
    with pytest.raises(ConfigError, match="dense"):
        as_array(torch.zeros(4).to_sparse())


@pytest.mark.timeout(30)
def test_as_array_detaches_requires_grad() -> None:
    p = torch.nn.Parameter(torch.ones(3))
    a = as_array(p)
    a[0] = 5
    assert p[0].item() == 5


# -- futures -------------------------------------------------------------------------------
@pytest.mark.timeout(30)
def test_torch_future_keeps_the_engine_error_type() -> None:
    src: concurrent.futures.Future[object] = concurrent.futures.Future()
    seen: list[BaseException | None] = []
    fut = to_torch_future(src, lambda v: v, done=seen.append)
    err = PeerLostError("rank 1 died", peer=1)
    src.set_exception(err)
    with pytest.raises(PeerLostError) as info:
        fut.wait()
    assert info.value is err and info.value.peer == 1
    deadline = time.monotonic() + 5
    while not seen and time.monotonic() < deadline:
        time.sleep(0.01)
    assert seen == [err]


@pytest.mark.timeout(30)
def test_torch_future_callbacks_run_off_the_completing_thread() -> None:
    """then-callbacks must not run on the engine's loop thread (they may block)."""
    src: concurrent.futures.Future[int] = concurrent.futures.Future()
    fut = to_torch_future(src, lambda v: torch.tensor([v]))
    where: list[str] = []
    chained = fut.then(lambda f: where.append(threading.current_thread().name) or f.value() * 2)
    completer = threading.Thread(target=src.set_result, args=(21,), name="fake-loop")
    completer.start()
    completer.join()
    assert chained.wait().item() == 42
    assert where and where[0].startswith("cgx-complete")


@pytest.mark.timeout(30)
def test_failing_finish_fails_the_future() -> None:
    src: concurrent.futures.Future[int] = concurrent.futures.Future()

    def finish(_: int) -> None:
        raise ConfigError("bad output")

    fut = to_torch_future(src, finish)
    src.set_result(1)
    with pytest.raises(ConfigError, match="bad output"):
        fut.wait()


# -- work ----------------------------------------------------------------------------------
@pytest.mark.timeout(30)
def test_work_wait_times_out_with_a_typed_error() -> None:
    src: concurrent.futures.Future[int] = concurrent.futures.Future()
    work = CGXWork.from_future("allreduce", 0.2, src, lambda v: [torch.ones(1)])
    t0 = time.monotonic()
    with pytest.raises(CGXTimeoutError, match="allreduce"):
        work.wait()
    assert time.monotonic() - t0 < 5
    assert not work.is_completed()
    with pytest.raises(CGXTimeoutError):
        work.wait(datetime.timedelta(milliseconds=50))
    src.set_result(0)
    assert work.wait() is True
    assert work.is_completed() and work.is_success() and work.exception() is None
    assert torch.equal(work.get_future().wait()[0], torch.ones(1))


@pytest.mark.timeout(30)
def test_work_releases_every_waiting_thread_once_done() -> None:
    """Several threads wait on one work (one of them completes it inline, the others
    on its latch); all return once the engine future is done, and later waits too."""
    src: concurrent.futures.Future[int] = concurrent.futures.Future()
    work = CGXWork.from_future("allreduce", 10, src, lambda v: [torch.full((1,), float(v))])
    returned: list[bool] = []
    threads = [threading.Thread(target=lambda: returned.append(work.wait())) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.1)
    assert returned == [] and not work.is_completed()
    src.set_result(7)
    for t in threads:
        t.join(5)
    assert returned == [True] * 4
    assert work.wait(datetime.timedelta(seconds=0.01)) is True and work.is_success()
    assert work.get_future().wait()[0].item() == 7.0
    work.mark_done(None)  # a second completion is ignored
    assert work.is_success()


@pytest.mark.timeout(30)
def test_work_is_a_torch_work_completed_through_its_public_api() -> None:
    work = CGXWork("barrier", timeout=5)
    assert isinstance(work, dist.Work)  # what a Python ProcessGroup must return
    fut: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
    work.attach(fut)
    assert work.get_future() is fut and not work.is_completed()
    fut.set_result([])
    work.mark_done(None)
    assert work.wait() is True and work.is_success() and work.result() == []


@pytest.mark.timeout(30)
def test_work_wait_raises_the_collective_error() -> None:
    src: concurrent.futures.Future[int] = concurrent.futures.Future()
    work = CGXWork.from_future("broadcast", 10, src, lambda v: [])
    src.set_exception(PeerLostError("peer 3 lost", peer=3))
    with pytest.raises(PeerLostError, match="peer 3"):
        work.wait()
    assert work.is_completed() and not work.is_success()
    assert isinstance(work.exception(), PeerLostError)


@pytest.mark.timeout(30)
def test_work_of_a_finished_engine_call_hands_out_its_result_and_error() -> None:
    """A Work made from a done engine future (every mailbox call) makes its torch future
    only when asked: the value, the error and the chained callbacks still
    arrive as for a pending one, and the future is the same object on every ask."""
    t = torch.ones(3)
    done: concurrent.futures.Future[int] = concurrent.futures.Future()
    done.set_result(5)
    seen = []
    work = CGXWork.from_future("allreduce", 10, done, lambda v: seen.append(v) or [t])
    assert seen == [5] and work.is_completed() and work.is_success()
    assert work.wait() is True and work.result() == [t]
    fut = work.get_future()
    assert fut is work.get_future() and fut.done() and fut.value() == [t]
    assert fut.then(lambda f: f.value()[0].sum().item()).wait() == 3.0

    failed: concurrent.futures.Future[int] = concurrent.futures.Future()
    failed.set_exception(PeerLostError("peer 1 lost", peer=1))
    work = CGXWork.from_future("allreduce", 10, failed, lambda v: [t])
    assert work.is_completed() and not work.is_success()
    with pytest.raises(PeerLostError, match="peer 1"):
        work.wait()
    with pytest.raises(PeerLostError, match="peer 1"):
        work.get_future().wait()

    def bad_finish(_: int) -> list[torch.Tensor]:
        raise ConfigError("finish failed")

    work = CGXWork.from_future("allreduce", 10, done, bad_finish)
    with pytest.raises(ConfigError, match="finish failed"):
        work.wait()

    cancelled: concurrent.futures.Future[int] = concurrent.futures.Future()
    cancelled.cancel()
    work = CGXWork.from_future("allreduce", 10, cancelled, lambda v: [t])
    with pytest.raises(CGXError, match="shut down"):
        work.wait()


@pytest.mark.timeout(30)
def test_allreduce_into_hands_a_call_done_here_to_its_work_without_a_future() -> None:
    """The engine's allreduce_now returns a call that completed on the calling thread as
    its value (no future made): the Work completes from it; a pending call
    still comes as its future, and a communicator of the protocol (allreduce only)
    still works."""

    class Now:  # the engine's SyncCommunicator's shape
        def __init__(self, pending=None):
            self.pending = pending

        def allreduce_now(self, x, op, **kwargs):
            assert op == "sum" and kwargs["layout"].numel == x.size
            if self.pending is not None:
                return None, self.pending
            x *= 2
            return x, None

        def allreduce(self, x, op, **kwargs):
            raise AssertionError("allreduce_now is this class's path")

        allreduce.without_future = "allreduce_now"

    class Plain:  # the Communicator protocol: futures only
        def allreduce(self, x, op, **kwargs):
            x += 1
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.set_result(x)
            return done

    t = torch.ones(4)
    cfg = CompressionConfig(bits=4, minimal_size=16)
    src, _ = allreduce_into(GroupView(Now(), 0, 2), t, dist.ReduceOp.SUM, cfg)
    assert type(src) is Finished and src.value is not None
    work = CGXWork.from_future("allreduce", 10, src, lambda v: [t])
    assert work.wait() and work.result() == [t] and t.tolist() == [2.0] * 4
    assert work.get_future().value() == [t]

    pending: concurrent.futures.Future = concurrent.futures.Future()
    src, _ = allreduce_into(GroupView(Now(pending), 0, 2), t, dist.ReduceOp.SUM, cfg)
    assert src is pending
    work = CGXWork.from_future("allreduce", 10, src, lambda v: [t])
    assert not work.is_completed()
    pending.set_exception(PeerLostError("peer 1 lost", peer=1))
    with pytest.raises(PeerLostError, match="peer 1"):
        work.wait()

    src, _ = allreduce_into(GroupView(Plain(), 0, 2), t, dist.ReduceOp.SUM, cfg)
    assert isinstance(src, concurrent.futures.Future) and src.done()
    assert CGXWork.from_future("allreduce", 10, src, lambda v: [t]).wait()
    assert t.tolist() == [3.0] * 4

    class Wrapper(Plain):  # its own allreduce; the rest passed through to the engine's
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

    class Override(Now):  # a subclass that overrides allreduce only
        allreduce = Plain.allreduce

    for comm in (Wrapper(Now()), Override()):
        src, _ = allreduce_into(GroupView(comm, 0, 2), t, dist.ReduceOp.SUM, cfg)
        assert isinstance(src, concurrent.futures.Future), type(comm)  # its allreduce ran
    assert t.tolist() == [5.0] * 4


# -- layouts and bytes ---------------------------------------------------------------------
@pytest.mark.timeout(30)
def test_layer_layout_follows_the_paper_rules() -> None:
    cfg = CompressionConfig(bits=4, bucket_size=1024, minimal_size=16)
    tensors = [
        torch.zeros(64, 32),  # 2048 values, 2-D: compressed
        torch.zeros(2048),  # 1-D (bias/norm): uncompressed
        torch.zeros(10, 10),  # 100 < layer_min_size: uncompressed
        torch.zeros(32, 32, dtype=torch.int64),  # not floating: uncompressed
        torch.zeros(0, 5),  # empty
    ]
    layout = layer_layout(tensors, cfg, layer_min_size=1024)
    assert [s.numel for s in layout] == [2048, 2048, 100, 1024, 0]
    assert [s.bits for s in layout] == [4, 32, 32, 32, 32]
    assert layout.numel == sum(t.numel() for t in tensors)
    off = layer_layout(tensors, CompressionConfig(), layer_min_size=1024)
    assert not off.compressed  # bits=32: nothing quantized


@pytest.mark.timeout(30)
def test_wire_bytes() -> None:
    layout = Layout.from_sizes([4096, 10], CompressionConfig(bits=4, bucket_size=1024))
    # compressed: 4 buckets * 8 B meta + 4096 * 4 / 8 code bytes; raw: 10 * 4 B
    per_buffer = 4 * 8 + 2048 + 40
    assert wire_bytes(layout, 4, world_size=2) == per_buffer  # 2 * (1/2) of the buffer
    assert wire_bytes(layout, 4, world_size=4) == 2 * per_buffer * 3 // 4
    assert wire_bytes(Layout.uniform(0), 4, world_size=2) == 0


@pytest.mark.timeout(30)
def test_buckets_averaged_by_the_engine_only_when_compressed_without_feedback() -> None:
    compressed = Layout.from_sizes([4096, 10], CompressionConfig(bits=4, bucket_size=1024))
    raw = Layout.from_sizes([4096, 10], CompressionConfig())
    assert bucket_op(compressed, error_feedback=False) == "avg"
    # Residuals are kept on the averaged values; uncompressed sums equal gloo's.
    assert bucket_op(compressed, error_feedback=True) == "sum"
    assert bucket_op(raw, error_feedback=False) == "sum"
    assert bucket_op(Layout.uniform(0), error_feedback=False) == "sum"


# -- configuration ---------------------------------------------------------------------------
@pytest.mark.timeout(30)
def test_comm_config_uses_the_given_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CGX_UCX_TIMEOUT", raising=False)
    cfg = _comm_config(datetime.timedelta(seconds=7), None)
    assert cfg.timeout == 7 and cfg.connect_timeout == 7
    # torch's default (30 min) means "not given": CGX's own default applies, capped by it.
    cfg = _comm_config(dist.default_pg_timeout, None)
    assert cfg.timeout == CommConfig().timeout
    monkeypatch.setenv("CGX_UCX_TIMEOUT", "12")
    assert _comm_config(dist.default_pg_timeout, None).timeout == 12
    base = CGXOptions(comm=CommConfig(progress_mode="polling"))
    assert _comm_config(datetime.timedelta(seconds=3), base).progress_mode == "polling"
    with pytest.raises(ConfigError):
        _comm_config(datetime.timedelta(seconds=0), None)


@pytest.mark.timeout(30)
def test_backend_is_registered() -> None:
    assert BACKEND_NAME in dist.Backend.backend_list
    assert dist.Backend.backend_capability[BACKEND_NAME] == ["cpu", "cuda"]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "kind,expected",
    [("max", [3, 5, 4]), ("min", [1, -2, 0]), ("prod", [3, -10, 0]), ("bxor", [2, -5, 4])],
)
def test_local_reduce(kind: str, expected: list[int]) -> None:
    gathered = torch.tensor([[1, 5, 4], [3, -2, 0]])
    out = torch.empty(3, dtype=torch.int64)
    _local_reduce(kind, gathered, out)
    assert out.tolist() == expected


@pytest.mark.timeout(30)
def test_split_state_refuses_bad_checkpoints() -> None:
    from cgx_ucx.torch._feedback import LayerFeedback, split_state

    fb = LayerFeedback()
    state = {"steps": "3", "residuals": {"0.1": torch.zeros(2)}}
    steps, residuals, policy = split_state(state, "CGXState", fb)
    assert (steps, residuals, policy) == (3, state["residuals"], None)
    for bad in ({}, {"steps": "x", "residuals": {}}, [1, 2]):
        with pytest.raises(ConfigError, match="not a GradientSync state dict"):
            split_state(bad, "GradientSync", fb)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="error_feedback is off"):
        split_state(state, "CGXState", None)
    assert split_state({"steps": 0, "residuals": {}}, "CGXState", None) == (0, {}, None)


@pytest.mark.timeout(30)
def test_work_of_a_cancelled_engine_call_raises_a_typed_error() -> None:
    """destroy_process_group with async work pending cancels the engine's calls; waiting
    on their Work raises a CGXError saying the engine shut down, not a bare
    concurrent.futures.CancelledError."""
    from cgx_ucx.errors import CGXError

    src: concurrent.futures.Future[int] = concurrent.futures.Future()
    work = CGXWork.from_future("allreduce", 10, src, lambda v: [])
    src.cancel()
    with pytest.raises(CGXError, match="shut down"):
        work.wait()
    assert work.is_completed() and not work.is_success()
    with pytest.raises(CGXError):
        work.get_future().wait()


def test_a_sum_of_a_dtype_the_engine_cannot_add_names_the_dtype() -> None:
    """The error for a SUM the engine cannot do names the dtype (uint16), not the op."""
    import torch.distributed as dist

    from cgx_ucx.torch.ops import _local_kind

    with pytest.raises(ConfigError, match=r"cannot SUM tensors of torch.uint16"):
        _local_kind(torch.zeros(2, dtype=torch.uint16), dist.ReduceOp.SUM)
    assert _local_kind(torch.zeros(2, dtype=torch.uint16), dist.ReduceOp.MAX) == "max"


def test_gradient_sync_refuses_bad_arguments_before_touching_a_group() -> None:
    """A list as compression_params, a negative or a non-number timeout: ConfigErrors,
    raised before any process group is looked up."""
    from cgx_ucx.torch import GradientSync

    model = torch.nn.Linear(4, 4)
    for kwargs in ({"compression_params": [1, 2]}, {"timeout": -1}, {"timeout": "5"}):
        with pytest.raises(ConfigError):
            GradientSync(model, **kwargs)
