"""Every benchmark command refuses a bad argument with a usage error (exit 2, the option
named), before it starts any process: no crash later in the run, no silent substitute."""

from __future__ import annotations

import importlib

import pytest

from cgx_ucx.bench.__main__ import BENCHMARKS
from cgx_ucx.bench.report import bits_arg, count_arg, positive_number

BAD = {
    "codec": [["--repeat", "0"], ["--threads", "0"], ["--sizes", "-1"], ["--bits", "9"],
              ["--bucket", "x"]],
    "allreduce": [["--iters", "0"], ["--world", "1"], ["--sizes", "0"], ["--timeout", "nan"]],
    "link": [["--steps", "0"], ["--world", "1"], ["--bits", "0"], ["--budget", "inf"],
             ["--budget", "-1"],
             ["--warmup", "-1"]],
    "nodes": [["--nodes", "1"], ["--ranks-per-node", "0"], ["--hidden", "0"],
              ["--probe-seconds", "0"]],
    "latency": [["--iters", "0"], ["--world", "1"], ["--sizes-kib", "-4"], ["--bits", "16"]],
    "contention": [["--steps", "20"], ["--repeats", "0"], ["--hogs", "-1"], ["--world", "1"]],
    "train": [["--epochs", "0"], ["--batch-size", "0"], ["--lr", "-0.1"], ["--window", "0"]],
}  # fmt: skip


def test_every_benchmark_is_covered():
    assert set(BAD) == set(BENCHMARKS)


@pytest.mark.parametrize(
    "name,argv", [(n, a) for n, cases in BAD.items() for a in cases], ids=lambda v: str(v)
)
def test_bad_argument_is_a_usage_error(name, argv, capsys):
    module = importlib.import_module(f"cgx_ucx.bench.{name}")
    with pytest.raises(SystemExit) as exc:
        module.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {argv[0]}" in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_help_shows_output_options(name, capsys):
    module = importlib.import_module(f"cgx_ucx.bench.{name}")
    with pytest.raises(SystemExit) as exc:
        module.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--out-dir" in out and "--refresh-tracked" in out


def test_argument_types():
    assert count_arg(2)("2") == 2
    assert bits_arg("32") == 32 and bits_arg("1") == 1
    assert positive_number("0.5") == 0.5
    for parse, text in ((count_arg(1), "0"), (count_arg(1), "1.5"), (bits_arg, "33"),
                        (positive_number, "0"), (positive_number, "-inf")):  # fmt: skip
        with pytest.raises(Exception, match=r"must|expected"):
            parse(text)
