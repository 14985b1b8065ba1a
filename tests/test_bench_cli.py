"""Every benchmark command refuses a bad argument with a usage error (exit 2, the option
named), before it starts any process: no crash later in the run, no silent substitute."""

from __future__ import annotations

import argparse
import importlib

import pytest

from cgx_ucx.bench import report
from cgx_ucx.bench.__main__ import BENCHMARKS
from cgx_ucx.bench.report import (
    MAX_LOCAL_RANKS,
    bits_arg,
    count_arg,
    max_threads,
    nonnegative_number,
    positive_number,
)

#: Sizes no machine holds (1e9 MiB: about a petabyte).
HUGE = "1e9"
#: One rank past the cap on ranks started on this machine.
TOO_MANY = str(MAX_LOCAL_RANKS + 1)

BAD = {
    "codec": [["--repeat", "0"], ["--threads", "0"], ["--sizes", "-1"], ["--bits", "9"],
              ["--bucket", "x"], ["--sizes", HUGE], ["--sizes", "1", HUGE],
              ["--threads", str(max_threads() + 1)]],
    "allreduce": [["--iters", "0"], ["--world", "1"], ["--sizes", "0"], ["--timeout", "nan"],
                  ["--sizes", HUGE], ["--p2p-sizes", HUGE], ["--world", "1000"],
                  ["--world", "2", TOO_MANY]],
    "link": [["--steps", "0"], ["--world", "1"], ["--bits", "0"], ["--budget", "inf"],
             ["--budget", "-1"],
             ["--warmup", "-1"], ["--sizes", HUGE], ["--plot-size", HUGE],
             ["--max-iters", "2", "--min-iters", "5"], ["--world", TOO_MANY],
             ["--rates", "0"]],
    "nodes": [["--nodes", "1"], ["--ranks-per-node", "0"], ["--hidden", "0"],
              ["--probe-seconds", "0"], ["--sizes", HUGE],
              ["--max-iters", "2", "--min-iters", "5"], ["--nodes", "100"],
              ["--ranks-per-node", "100"], ["--ranks-per-node", "16", "--nodes", "8"]],
    "latency": [["--iters", "0"], ["--world", "1"], ["--sizes-kib", "-4"], ["--bits", "16"],
                ["--sizes-kib", "1e15"], ["--world", "500"]],
    "contention": [["--steps", "20"], ["--repeats", "0"], ["--hogs", "-1"], ["--world", "1"],
                   ["--world", TOO_MANY], ["--hogs", "1000"]],
    "train": [["--epochs", "0"], ["--batch-size", "0"], ["--lr", "-0.1"], ["--window", "0"],
              ["--world", "1"], ["--world", TOO_MANY], ["--link-rate", "0"],
              ["--link-rate", "abc"], ["--link-rate", "1gbps"], ["--policies", ""],
              ["--policies", " , "], ["--policies", "none,bogus"]],
    "memory": [["--calls", "0"], ["--world", "1"], ["--sizes", "0"], ["--bits", "9"],
               ["--sizes", HUGE], ["--world", TOO_MANY], ["--timeout", "nan"],
               ["--link-rate", "0"], ["--link-rate", "abc"]],
    "ft": [["--groups", "1"], ["--steps", "0"], ["--kill-at", "50"], ["--ddp-rate", "abc"],
           ["--diloco-rate", "0"], ["--timeout", "0"], ["--hidden", "0"], ["--sync-every", "0"],
           ["--threads", "0"], ["--groups", TOO_MANY], ["--methods", "nccl"], ["--methods"]],
}  # fmt: skip

#: The message says why: the limit and where it comes from.
EXPLAINED = [
    ("codec", ["--sizes", HUGE], "physical memory"),
    ("allreduce", ["--sizes", HUGE], "physical memory"),
    ("allreduce", ["--p2p-sizes", HUGE], "physical memory"),
    ("latency", ["--sizes-kib", "1e15"], "physical memory"),
    ("link", ["--sizes", HUGE], "physical memory"),
    ("link", ["--plot-size", HUGE], "physical memory"),
    ("nodes", ["--sizes", HUGE], "physical memory"),
    ("codec", ["--threads", str(max_threads() + 1)], f"at most {max_threads()} (4 per CPU"),
    ("allreduce", ["--world", "1000"], f"at most {MAX_LOCAL_RANKS} (ranks"),
    ("latency", ["--world", "500"], f"at most {MAX_LOCAL_RANKS} (ranks"),
    ("link", ["--world", TOO_MANY], f"at most {MAX_LOCAL_RANKS} (ranks"),
    ("contention", ["--world", TOO_MANY], f"at most {MAX_LOCAL_RANKS} (ranks"),
    ("contention", ["--hogs", "1000"], f"at most {MAX_LOCAL_RANKS} (processes"),
    ("train", ["--world", TOO_MANY], f"at most {MAX_LOCAL_RANKS} (ranks"),
    ("train", ["--world", "1"], "must be at least 2"),
    ("nodes", ["--nodes", "100"], f"at most {MAX_LOCAL_RANKS} ranks run on this machine"),
    ("nodes", ["--ranks-per-node", "16", "--nodes", "8"], f"128 ranks, at most {MAX_LOCAL_RANKS}"),
    ("link", ["--max-iters", "2", "--min-iters", "5"], "at least --min-iters (5), got 2"),
    ("nodes", ["--max-iters", "2", "--min-iters", "5"], "at least --min-iters (5), got 2"),
    ("train", ["--link-rate", "0"], "link rate must be at least"),
    ("train", ["--link-rate", "abc"], "link rate must be e.g. '1gbit'"),
    ("train", ["--policies", ""], "at least one policy is needed, of none, static, kmeans"),
    ("train", ["--policies", "none,bogus"], "unknown policies ['bogus']; choose from none,"),
]


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


@pytest.mark.parametrize("name,argv,fragment", EXPLAINED, ids=lambda v: str(v))
def test_limit_is_explained(name, argv, fragment, capsys):
    module = importlib.import_module(f"cgx_ucx.bench.{name}")
    with pytest.raises(SystemExit) as exc:
        module.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" in err and fragment in err, err


def test_memory_limit_counts_every_buffer(monkeypatch, capsys):
    """The bound is on what the run allocates at once: ranks x buffers per rank x size."""
    from cgx_ucx.bench import allreduce

    monkeypatch.setattr(report, "physical_memory", lambda: 1 << 30)  # a 1 GiB machine
    argv = ["--sizes", "256", "--world", "2", "4", "--no-p2p"]
    with pytest.raises(SystemExit) as exc:
        allreduce.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --sizes: 256 MiB on 4 ranks: 4 buffers" in err, err
    assert "need about 4 GiB, more than the 1 GiB of physical memory" in err, err


def test_physical_memory_is_known():
    total = report.physical_memory()
    assert total is None or total > 1 << 20


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
    assert count_arg(2, 4)("4") == 4
    assert bits_arg("32") == 32 and bits_arg("1") == 1
    assert positive_number("0.5") == 0.5
    assert nonnegative_number("0") == 0
    for parse, text in ((count_arg(1), "0"), (count_arg(1), "1.5"), (bits_arg, "33"),
                        (count_arg(1, 4), "5"), (nonnegative_number, "-1"),
                        (positive_number, "0"), (positive_number, "-inf")):  # fmt: skip
        with pytest.raises(Exception, match=r"must|expected"):
            parse(text)


@pytest.mark.parametrize("text", ["0", "-1", "-0.0", "inf", "nan", "-inf"])
def test_positive_number_says_one_thing(text):
    """0 and a negative number get the same message: greater than 0."""
    with pytest.raises(argparse.ArgumentTypeError) as exc:
        positive_number(text)
    assert str(exc.value) == f"must be a finite number greater than 0, got {text}"


def test_count_limit_says_why():
    with pytest.raises(argparse.ArgumentTypeError, match=r"at most 4 \(four\), got 5"):
        count_arg(1, 4, "four")("5")
