"""The documentation agrees with the code: docs/configuration.md is the rendering of
cgx_ucx.config.ENV_VARIABLES, and that table holds every CGX_* variable the package names."""

import ast
import dataclasses
import re
from pathlib import Path

import pytest

from cgx_ucx.config import (
    ENV_VARIABLES,
    PAGE_COMMAND,
    CommConfig,
    CompressionConfig,
    configuration_page,
    read_env,
    resolve_comm,
    resolve_compression,
    spin_mode,
)
from cgx_ucx.transport.topology import HierarchyConfig, resolve_hierarchy

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "configuration.md"
NAME = re.compile(r"CGX_[A-Z0-9_]*[A-Z0-9]")

#: The configuration classes a row may feed, and how each resolves an environment.
RESOLVERS = {
    "CompressionConfig": (CompressionConfig, lambda env: resolve_compression(env=env)),
    "CommConfig": (CommConfig, lambda env: resolve_comm(env=env)),
    "HierarchyConfig": (HierarchyConfig, lambda env: resolve_hierarchy(env=env)),
}


def _names_in_package() -> set[str]:
    """Every string constant of cgx_ucx's source that is exactly a CGX_* name."""
    names = set()
    for path in (ROOT / "cgx_ucx").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            value = getattr(node, "value", None) if isinstance(node, ast.Constant) else None
            if isinstance(value, str) and NAME.fullmatch(value):
                names.add(value)
    return names


def test_configuration_page_is_the_rendering_of_the_table():
    assert PAGE.read_text() == configuration_page(), (
        f"docs/configuration.md differs from cgx_ucx.config.ENV_VARIABLES; run: {PAGE_COMMAND}"
    )


def test_every_variable_the_package_names_is_in_the_table():
    names = _names_in_package()
    assert "CGX_COMPRESSION_QUANTIZATION_BITS" in names  # the scan finds them
    missing = names - {var.name for var in ENV_VARIABLES}
    assert not missing, f"add a row to cgx_ucx.config.ENV_VARIABLES for {sorted(missing)}"


def test_rows_are_unique_and_render_in_one_table_row_each():
    names = [var.name for var in ENV_VARIABLES]
    assert len(names) == len(set(names))
    for var in ENV_VARIABLES:
        assert NAME.fullmatch(var.name), var.name
        assert all(field.strip() and "\n" not in field for field in dataclasses.astuple(var))
        rows = [
            line for line in PAGE.read_text().split("\n") if line.startswith(f"| `{var.name}` |")
        ]
        assert len(rows) == 1, var.name


def test_every_field_a_row_feeds_exists():
    for var in ENV_VARIABLES:
        cls_name, _, field = var.feeds.partition(".")
        if cls_name in RESOLVERS:
            cls = RESOLVERS[cls_name][0]
            assert field in {f.name for f in dataclasses.fields(cls)}, var


@pytest.mark.parametrize(
    "var", [v for v in ENV_VARIABLES if v.default != "unset"], ids=lambda v: v.name
)
def test_the_documented_default_is_the_default(var):
    """Setting a variable to its documented default resolves as leaving it unset."""
    cls_name = var.feeds.partition(".")[0]
    if cls_name in RESOLVERS:
        resolve = RESOLVERS[cls_name][1]
        assert resolve({var.name: var.default}) == resolve({})
    elif var.name == "CGX_UCX_SPIN":
        assert spin_mode({var.name: var.default}) == spin_mode({})


@pytest.mark.parametrize(
    ("name", "raw", "resolve"),
    [
        ("CGX_COMPRESSION_QUANTIZATION_BITS", "9", RESOLVERS["CompressionConfig"][1]),
        ("CGX_COMPRESSION_BUCKET_SIZE", "0", RESOLVERS["CompressionConfig"][1]),
        ("CGX_COMPRESSION_MINIMAL_SIZE", "-1", RESOLVERS["CompressionConfig"][1]),
        ("CGX_COMPRESSION_STOCHASTIC", "2", RESOLVERS["CompressionConfig"][1]),
        ("CGX_UCX_TIMEOUT", "0", RESOLVERS["CommConfig"][1]),
        ("CGX_INTRA_COMPRESS", "x", RESOLVERS["HierarchyConfig"][1]),
        ("CGX_UCX_SPIN", "x", spin_mode),
    ],
)
def test_a_bad_value_says_what_the_page_says_it_accepts(name, raw, resolve):
    (var,) = [v for v in ENV_VARIABLES if v.name == name]
    with pytest.raises(ValueError, match=name) as info:
        resolve({name: raw})
    assert var.type in str(info.value)


def test_only_variables_in_the_table_can_be_read():
    assert read_env("CGX_UCX_TIMEOUT", {"CGX_UCX_TIMEOUT": "5"}) == "5"
    assert read_env("CGX_UCX_TIMEOUT", {}) is None
    with pytest.raises(KeyError, match="ENV_VARIABLES"):
        read_env("CGX_NOT_A_VARIABLE", {"CGX_NOT_A_VARIABLE": "1"})
