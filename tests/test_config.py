import pytest

from cgx_ucx import (
    CompressionConfig,
    ConfigError,
    LayerSpec,
    Layout,
    resolve_comm,
    resolve_compression,
)
from cgx_ucx.config import ENV_BITS, ENV_BUCKET_SIZE, ENV_MINIMAL_SIZE


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
