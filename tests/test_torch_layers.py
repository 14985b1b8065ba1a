"""Single-process tests of the layer rules, the wire size, and the hook over CGXState's
public per-call API (with a recording communicator instead of a real one)."""

from __future__ import annotations

import concurrent.futures
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from cgx_ucx.compression import HEADER_NBYTES, encoded_nbytes  # noqa: E402
from cgx_ucx.config import CompressionConfig  # noqa: E402
from cgx_ucx.errors import ConfigError  # noqa: E402
from cgx_ucx.layout import LayerSpec, Layout  # noqa: E402
from cgx_ucx.torch import CGXState, cgx_hook  # noqa: E402
from cgx_ucx.torch import layer_layout as exported_layer_layout  # noqa: E402
from cgx_ucx.torch import wire_bytes as exported_wire_bytes  # noqa: E402
from cgx_ucx.torch.layers import (  # noqa: E402
    PAPER_DEFAULTS,
    bucket_seed,
    compressible,
    layer_layout,
    layer_wire_bytes,
    wire_bytes,
)
from cgx_ucx.torch.protocols import Communicator  # noqa: E402

CFG = CompressionConfig(bits=4, bucket_size=1024, minimal_size=16)


# -- layers ---------------------------------------------------------------------------------
def test_one_home_for_the_layer_helpers() -> None:
    # The names users import from cgx_ucx.torch (and hook.py) are the layers module's.
    assert exported_layer_layout is layer_layout and exported_wire_bytes is wire_bytes


@pytest.mark.parametrize(
    "tensor,expected",
    [
        (torch.zeros(64, 32), True),  # 2-D, large, float32
        (torch.zeros(64, 32, dtype=torch.float16), True),
        (torch.zeros(64, 32, dtype=torch.bfloat16), True),
        (torch.zeros(2048), False),  # 1-D: biases and norms stay exact
        (torch.zeros(31, 33), True),  # 1023 values >= minimal_size, layer_min_size 1000
        (torch.zeros(10, 10), False),  # under layer_min_size
        (torch.zeros(64, 32, dtype=torch.float64), False),  # not a codec dtype
        (torch.zeros(64, 32, dtype=torch.int32), False),
        (torch.zeros(0, 5), False),
    ],
)
def test_compressible_is_the_paper_rule(tensor: torch.Tensor, expected: bool) -> None:
    assert compressible(tensor, CFG, layer_min_size=1000) is expected
    # compression off: nothing is compressible
    assert not compressible(tensor, CompressionConfig(), layer_min_size=0)


def test_minimal_size_wins_over_a_smaller_layer_min_size() -> None:
    cfg = CompressionConfig(bits=4, bucket_size=1024, minimal_size=4096)
    assert not compressible(torch.zeros(64, 32), cfg, layer_min_size=0)
    assert [s.bits for s in layer_layout([torch.zeros(64, 32)], cfg, 0)] == [32]


def test_a_layout_seen_again_is_reused_and_keyed_on_what_the_rule_reads() -> None:
    """Same sizes, ranks and dtypes: the layout built before. A change in any of them,
    in the configuration or in layer_min_size: the rule applied again."""
    grads = [torch.zeros(64, 64), torch.zeros(64)]
    first = layer_layout(grads, CFG, 0)
    assert layer_layout([g.clone() for g in grads], CFG, 0) is first
    flat = layer_layout([torch.zeros(4096), torch.zeros(64)], CFG, 0)  # same sizes, 1-D
    ints = layer_layout([torch.zeros(64, 64, dtype=torch.int32), torch.zeros(64)], CFG, 0)
    big = layer_layout(grads, CFG, 8192)
    two = layer_layout(grads, CompressionConfig(bits=2, bucket_size=1024, minimal_size=16), 0)
    assert [s.bits for s in first] == [4, 32]
    assert [s.bits for s in flat] == [s.bits for s in ints] == [s.bits for s in big] == [32, 32]
    assert [s.bits for s in two] == [2, 32]


@pytest.mark.parametrize("numel", [0, 1, 1023, 1024, 4097])
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_layer_wire_bytes_is_the_codec_segment_without_its_header(numel: int, bits: int) -> None:
    spec = LayerSpec(0, numel, bits, 1024)
    assert layer_wire_bytes(spec, 4) == encoded_nbytes(numel, bits, 1024) - HEADER_NBYTES
    assert layer_wire_bytes(spec, 4) == 8 * -(-numel // 1024) + (numel * bits + 7) // 8


@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
def test_uncompressed_layers_cost_their_raw_values(itemsize: int) -> None:
    # any dtype (a float64 or int64 DDP bucket too), not only the codec's
    assert layer_wire_bytes(LayerSpec(0, 1000), itemsize) == 1000 * itemsize


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_wire_bytes_counts_both_phases(world: int) -> None:
    layout = Layout.from_sizes([4096, 10, 3000], CFG)
    per_buffer = sum(layer_wire_bytes(s, 2) for s in layout)
    assert wire_bytes(layout, 2, world) == 2 * per_buffer * (world - 1) // world
    assert wire_bytes(layout, 2, 1) == 0  # alone: nothing sent


def test_bucket_seed_differs_per_step_and_bucket_and_stays_in_64_bits() -> None:
    cfg = CompressionConfig(bits=4, seed=7)
    seeds = {bucket_seed(cfg, step, index) for step in range(5) for index in range(50)}
    assert len(seeds) == 250
    assert bucket_seed(cfg, 0, 0) == 7
    top = CompressionConfig(bits=4, seed=2**64 - 1)
    assert 0 <= bucket_seed(top, 3, 5) < 2**64


def test_paper_defaults() -> None:
    assert (PAPER_DEFAULTS.bits, PAPER_DEFAULTS.bucket_size) == (4, 1024)


# -- the hook over CGXState's public API ----------------------------------------------------
class RecordingCommunicator:
    """A communicator of ``world_size`` ranks whose allreduce leaves the buffer as every
    other rank sending zeros would (as it is for a sum, divided by the world size for an
    average) and records its keywords."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.closed = False
        self.calls: list[dict[str, Any]] = []

    def allreduce(self, x: Any, op: str = "sum", **kwargs: Any) -> concurrent.futures.Future[Any]:
        self.calls.append({"x": x, "op": op, **kwargs})
        if op == "avg":
            x /= self.world_size
        f: concurrent.futures.Future[Any] = concurrent.futures.Future()
        f.set_result(x)
        return f

    def broadcast(self, x: Any, root: int = 0) -> concurrent.futures.Future[Any]:
        raise AssertionError("the static hook never broadcasts")

    def allgather(self, x: Any, out: Any = None) -> concurrent.futures.Future[Any]:
        raise AssertionError("the static hook never gathers")

    def barrier(self) -> concurrent.futures.Future[Any]:
        raise AssertionError("the static hook never waits for a barrier")

    def close(self, timeout: float | None = None) -> None:
        self.closed = True


class FakeGroup:
    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


class FakeBucket:
    """The part of dist.GradBucket the hook reads."""

    def __init__(self, index: int, params: list[torch.Tensor], last: bool) -> None:
        self._index = index
        self._params = params
        self._last = last
        self._grads = [torch.full_like(p, float(i + 1)) for i, p in enumerate(params)]
        self._buffer = torch.cat([g.reshape(-1) for g in self._grads])

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._last

    def parameters(self) -> list[torch.Tensor]:
        return self._params

    def gradients(self) -> list[torch.Tensor]:
        return self._grads


def _state(world: int, **kwargs: Any) -> tuple[CGXState, RecordingCommunicator]:
    comm = RecordingCommunicator(world)
    communicator: Communicator = comm  # the Protocol is all the state needs
    state = CGXState(
        FakeGroup(world),  # type: ignore[arg-type]
        compression_params={"bits": 4, "bucket_size": 1024, "seed": 11},
        communicator=communicator,
        **kwargs,
    )
    return state, comm


def _params() -> list[torch.Tensor]:
    return [
        torch.nn.Parameter(torch.zeros(64, 32)),  # compressed
        torch.nn.Parameter(torch.zeros(64)),  # bias: exact
        torch.nn.Parameter(torch.zeros(48, 32)),  # compressed
    ]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("with_model", [False, True])
def test_hook_runs_its_steps_on_the_public_state_api(with_model: bool) -> None:
    params = _params()
    state, comm = _state(4, model=params if with_model else None)
    config = state.call_compression
    assert config == state.compression and config.seed == 11
    buckets = [FakeBucket(0, params[:2], last=False), FakeBucket(1, params[2:], last=True)]
    for step in range(2):
        for bucket in buckets:
            before = bucket.buffer().clone()
            fut = cgx_hook(state, bucket)
            # 3. averaged (by the engine: the layouts are compressed), in place, handed back
            assert torch.equal(fut.wait(), before / 4) and fut.wait() is bucket.buffer()
        assert state.steps == step + 1
    assert len(comm.calls) == 4
    first, second = comm.calls[0], comm.calls[1]
    # 2. the paper's layout of each bucket's layers
    assert first["layout"] == layer_layout(params[:2], config, state.layer_min_size)
    assert [s.bits for s in first["layout"]] == [4, 32]
    assert [s.bits for s in second["layout"]] == [4]
    # 5. AVG (compressed layouts, no error feedback) with a seed per step and bucket
    assert all(c["op"] == "avg" and c["stochastic"] is False for c in comm.calls)
    assert [c["seed"] for c in comm.calls] == [
        bucket_seed(config, step, index) for step in range(2) for index in range(2)
    ]
    # 6. stats from the layouts
    per_step = sum(wire_bytes(c["layout"], 4, 4) for c in comm.calls[:2])
    assert state.bytes_per_step == per_step and state.bytes_sent == 2 * per_step
    # static without model= learns its layers from the first step's buckets
    assert [r.numel for r in state.stats()] == [p.numel() for p in params]


@pytest.mark.timeout(60)
def test_state_step_boundaries_and_accounting() -> None:
    params = _params()
    state, _ = _state(2)
    assert state.stats() == []  # no layers known before a full step
    state.maybe_start_step()
    state.maybe_start_step()  # the second bucket of a step starts nothing
    layout = state.bucket_layout(params, [p.detach() for p in params], state.call_compression)
    assert layout.numel == sum(p.numel() for p in params)
    state.end_step()
    assert len(state.stats()) == 3
    state.record_sent(100, last=False)
    assert (state.steps, state.bytes_sent, state.bytes_per_step) == (0, 100, 0)
    state.record_sent(50, last=True)
    assert (state.steps, state.bytes_sent, state.bytes_per_step) == (1, 150, 150)


@pytest.mark.timeout(60)
def test_error_feedback_through_the_state() -> None:
    params = [torch.nn.Parameter(torch.zeros(64, 32))]
    plain, _ = _state(2)
    buf = torch.linspace(-1, 1, 2048)
    layout = layer_layout(params, plain.call_compression, plain.layer_min_size)
    kept = buf.clone()
    plain.apply_error_feedback(0, kept, layout)  # off: nothing changes
    assert torch.equal(kept, buf)

    ef, _ = _state(2, error_feedback=True)
    first = buf.clone()
    ef.apply_error_feedback(0, first, layout)  # no residual yet: unchanged, one kept
    assert torch.equal(first, buf)
    second = buf.clone()
    ef.apply_error_feedback(0, second, layout)  # the first step's error is added
    assert not torch.equal(second, buf)
    assert set(ef.state_dict()["residuals"]) == {"0.0"}
    # a bucket with nothing compressed and no residual is left alone
    raw = torch.arange(10, dtype=torch.float32)
    ef.apply_error_feedback(5, raw, Layout.uniform(10))
    assert torch.equal(raw, torch.arange(10, dtype=torch.float32))


@pytest.mark.timeout(60)
def test_state_refuses_bad_arguments_with_named_errors() -> None:
    with pytest.raises(ConfigError, match="layer_min_size must be an integer >= 0"):
        _state(2, layer_min_size=-1)
    with pytest.raises(ConfigError, match="log_every must be an integer >= 0"):
        _state(2, log_every=True)
    with pytest.raises(ConfigError, match="'static' takes none"):
        _state(2, policy_params={"bits_min": 2})
    with pytest.raises(ConfigError, match="unknown compression policy"):
        _state(2, policy="fastest")
    with pytest.raises(ConfigError, match="needs model="):
        _state(2, policy="kmeans")
