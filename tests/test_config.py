import logging
import os

import pytest

from cgx_ucx import (
    CommConfig,
    CompressionConfig,
    ConfigError,
    LayerSpec,
    Layout,
    resolve_comm,
    resolve_compression,
)
from cgx_ucx.config import (
    ENV_BITS,
    ENV_BUCKET_SIZE,
    ENV_MINIMAL_SIZE,
    ENV_STOCHASTIC,
    ENV_TIMEOUT,
    describe_configuration,
    log_configuration,
    validate_environment,
)


def test_defaults_match_torch_cgx():
    cfg = resolve_compression(env={})
    assert (cfg.bits, cfg.bucket_size, cfg.minimal_size) == (32, 512, 16)
    assert not cfg.enabled


def test_keyword_beats_environment_beats_default():
    env = {ENV_BITS: "4", ENV_BUCKET_SIZE: "128", ENV_MINIMAL_SIZE: "3"}
    cfg = resolve_compression(env=env)
    assert (cfg.bits, cfg.bucket_size, cfg.minimal_size) == (4, 128, 16)
    cfg = resolve_compression(env=env, bits=8, bucket_size=None)
    assert (cfg.bits, cfg.bucket_size) == (8, 128)


@pytest.mark.parametrize(
    "env", [{ENV_BITS: "9"}, {ENV_BITS: "four"}, {ENV_BUCKET_SIZE: "0"}, {ENV_BITS: "0"}]
)
def test_bad_environment_is_a_config_error(env):
    with pytest.raises(ConfigError):
        resolve_compression(env=env)


def test_unknown_option_and_bad_timeout():
    with pytest.raises(ConfigError, match="unknown"):
        resolve_compression(env={}, bitz=4)
    with pytest.raises(ConfigError):
        resolve_comm(env={}, timeout=0)


def test_small_layers_go_uncompressed():
    cfg = CompressionConfig(bits=4, bucket_size=64, minimal_size=100)
    layout = Layout.from_sizes([10, 1000, 99, 100], cfg, compressible=[True, True, True, False])
    assert [s.bits for s in layout] == [32, 4, 32, 32]
    assert [s.offset for s in layout] == [0, 10, 1010, 1109]
    assert layout.numel == 1209


def test_layout_digest_and_contiguity():
    a = Layout.uniform(100, 4, 64)
    assert a.digest == Layout.uniform(100, 4, 64).digest
    assert a.digest != Layout.uniform(100, 8, 64).digest
    assert a.digest != Layout.uniform(101, 4, 64).digest
    with pytest.raises(ConfigError):
        Layout((LayerSpec(0, 10), LayerSpec(11, 5)))
    with pytest.raises(ConfigError):
        a.check(99)


@pytest.mark.parametrize(
    ("name", "raw", "accepts"),
    [
        (ENV_BITS, "5x", "an integer in 1..8 or 32"),
        (ENV_BITS, "9", "an integer in 1..8 or 32"),
        (ENV_BUCKET_SIZE, "0", "an integer in 1..4294967295"),
        (ENV_MINIMAL_SIZE, "-1", "an integer >= 0"),
        (ENV_STOCHASTIC, "yes", "0 (nearest) or 1 (stochastic)"),
        (ENV_STOCHASTIC, "2", "0 (nearest) or 1 (stochastic)"),
        (ENV_BUCKET_SIZE, str(2**32), "an integer in 1..4294967295"),
    ],
)
def test_bad_environment_value_names_the_variable(name, raw, accepts):
    with pytest.raises(ConfigError) as info:
        resolve_compression(env={name: raw})
    assert str(info.value).startswith(f"{name}={raw!r} is not {accepts}"), info.value
    with pytest.raises(ConfigError, match=name):
        validate_environment(env={name: raw})


def test_an_infinite_timeout_is_refused_not_a_crash_at_close():
    """Infinite and huge timeouts are refused when resolved: the platform's timed wait
    raises OverflowError on them, at close."""
    for raw in ("inf", "1e309", "2e9"):
        with pytest.raises(ConfigError, match="at most 1e"):
            resolve_comm(env={ENV_TIMEOUT: raw})
    for value in (float("inf"), 2e9):
        with pytest.raises(ConfigError, match="finite, at most"):
            CommConfig(timeout=value)
    assert CommConfig(timeout=1e9).timeout == 1e9


def test_bad_timeout_variable_names_it():
    for raw in ("soon", "0", "-3"):
        with pytest.raises(ConfigError, match=f"{ENV_TIMEOUT}='{raw}' is not a number"):
            resolve_comm(env={ENV_TIMEOUT: raw})
    with pytest.raises(ConfigError, match=ENV_TIMEOUT):
        validate_environment(env={ENV_TIMEOUT: "x"})


def test_validate_environment_returns_the_compression_in_effect():
    cfg = validate_environment(env={ENV_BITS: "4", ENV_BUCKET_SIZE: "1024"})
    assert (cfg.bits, cfg.bucket_size) == (4, 1024)
    assert validate_environment(env={}) == CompressionConfig()


def test_describe_and_log_the_resolved_configuration(caplog):
    comp = CompressionConfig(bits=4, bucket_size=1024)
    assert (
        str(comp) == comp.describe() == ("bits=4 bucket_size=1024 minimal_size=16 rounding=nearest")
    )
    assert "stochastic(seed=7)" in CompressionConfig(bits=2, stochastic=True, seed=7).describe()
    assert CompressionConfig().describe() == "bits=32 (no compression)"
    comm = CommConfig(timeout=30, connect_timeout=10, ucx_env={"UCX_TLS": "tcp"})
    assert str(comm) == "timeout=30s connect_timeout=10s progress_mode=blocking ucx_env=UCX_TLS=tcp"
    with caplog.at_level(logging.INFO, logger="cgx_ucx.config"):
        line = log_configuration(comm, comp, rank=1, world_size=2, policy="static")
    assert line == f"rank 1/2: compression {comp}; {comm}; policy=static"
    (record,) = [r for r in caplog.records if r.name == "cgx_ucx.config"]
    assert record.levelno == logging.INFO and line in record.getMessage()
    # compression read from the environment at each call: the line says so, and never raises
    assert "from CGX_* at each call" in describe_configuration(comm)


@pytest.mark.timeout(60)
def test_init_process_group_rejects_a_bad_variable(monkeypatch, tmp_path):
    """A bad CGX_* value fails at init_process_group, naming it, not at the first call."""
    pytest.importorskip("torch")
    import torch.distributed as dist

    import cgx_ucx  # noqa: F401  (registers the backend)

    monkeypatch.setenv(ENV_BITS, "5x")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    with pytest.raises(ConfigError, match=f"{ENV_BITS}='5x' is not an integer in 1..8 or 32"):
        dist.init_process_group("cgx", store=store, rank=0, world_size=1)
    assert not dist.is_initialized()


@pytest.mark.timeout(60)
def test_init_process_group_names_every_bad_variable_two_level_ones_too(monkeypatch, tmp_path):
    """The two-level (torch_cgx) variables are checked with the others when the group is
    made, all named in one error: no rank is left to fail alone at connect."""
    pytest.importorskip("torch")
    import torch.distributed as dist

    import cgx_ucx  # noqa: F401  (registers the backend)

    monkeypatch.setenv(ENV_BITS, "9")
    monkeypatch.setenv("CGX_UCX_SPIN", "x")
    monkeypatch.setenv("CGX_CROSS_REDUCTION_TYPE", "Tree")
    monkeypatch.setenv("CGX_INTRA_COMPRESS", "x")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    with pytest.raises(ConfigError, match="4 bad variables") as info:
        dist.init_process_group("cgx", store=store, rank=0, world_size=1)
    for name in (ENV_BITS, "CGX_UCX_SPIN", "CGX_CROSS_REDUCTION_TYPE", "CGX_INTRA_COMPRESS"):
        assert name in str(info.value)
    assert not dist.is_initialized()


def test_compression_from_env_follows_every_change(monkeypatch):
    from cgx_ucx.config import compression_from_env

    for name in (ENV_BITS, "CGX_COMPRESSION_BUCKET_SIZE", "CGX_COMPRESSION_MINIMAL_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("CGX_COMPRESSION_STOCHASTIC", raising=False)
    assert compression_from_env() == resolve_compression()
    monkeypatch.setenv(ENV_BITS, "4")
    assert compression_from_env().bits == 4
    assert compression_from_env() is compression_from_env()  # cached while unchanged
    monkeypatch.setenv("CGX_COMPRESSION_BUCKET_SIZE", "256")
    assert compression_from_env().bucket_size == 256
    monkeypatch.setenv(ENV_BITS, "9")
    with pytest.raises(ConfigError, match=ENV_BITS):
        compression_from_env()
    monkeypatch.setenv(ENV_BITS, "8")
    assert compression_from_env().bits == 8
    monkeypatch.delenv(ENV_BITS)
    assert compression_from_env() == resolve_compression()
    # An os.environ without CPython's bytes dict (replaced by a plain mapping): the
    # public reads, same answers.
    monkeypatch.setattr(os, "environ", {ENV_BITS: "2"})
    assert compression_from_env().bits == 2
    os.environ[ENV_BITS] = "4"
    assert compression_from_env().bits == 4


def test_bad_spin_mode_is_caught_with_the_other_variables():
    with pytest.raises(ConfigError, match="CGX_UCX_SPIN"):
        validate_environment({"CGX_UCX_SPIN": "sometimes"})


def test_explicit_configs_refuse_values_that_would_fail_later():
    """Values that would fail at the first call (a struct.error) or mean something else
    (a truthy string) are refused when the config is made."""
    with pytest.raises(ConfigError, match="bucket_size"):
        CompressionConfig(bits=4, bucket_size=2**32)
    assert CompressionConfig(bits=4, bucket_size=2**32 - 1).bucket_size == 2**32 - 1
    with pytest.raises(ConfigError, match="stochastic"):
        CompressionConfig(bits=4, stochastic="no")
    assert CompressionConfig(bits=4, stochastic=1).stochastic == 1
    with pytest.raises(ConfigError, match="timeout"):
        CommConfig(timeout="5")
    with pytest.raises(ConfigError, match="layer bucket_size"):
        LayerSpec(0, 10, 4, 2**32)


def test_cgx_options_check_their_parts():
    pytest.importorskip("torch")
    from cgx_ucx.torch import CGXOptions

    with pytest.raises(ConfigError, match="CompressionConfig"):
        CGXOptions(compression="x")
    with pytest.raises(ConfigError, match="CommConfig"):
        CGXOptions(comm={"timeout": 5})


def test_resolved_compression_follows_the_keywords_and_the_environment(monkeypatch):
    from cgx_ucx.config import resolved_compression

    monkeypatch.delenv(ENV_BITS, raising=False)
    base = CompressionConfig(bits=4, bucket_size=512)
    first = resolved_compression(base, {"bucket_size": 128})
    assert (first.bits, first.bucket_size) == (4, 128)
    assert resolved_compression(base, {"bucket_size": 128}) is first  # kept while unchanged
    assert resolved_compression(base, {"bucket_size": 256}).bucket_size == 256
    monkeypatch.setenv(ENV_BITS, "2")
    assert resolved_compression(base, {"bucket_size": 128}).bits == 2
    assert resolved_compression(base, {"bits": 8}).bits == 8  # a keyword beats the variable
    monkeypatch.setenv(ENV_BITS, "9")
    with pytest.raises(ConfigError, match=ENV_BITS):
        resolved_compression(base, {})
    monkeypatch.delenv(ENV_BITS)
    with pytest.raises(ConfigError, match="unknown"):
        resolved_compression(base, {"bitz": 4})
    with pytest.raises(ConfigError):
        resolved_compression(base, {"bits": [4]})  # unhashable: still checked, not cached
