"""The command line's mistakes are answered by the command that was given: its own usage for an unknown option, an unwritable output file before the benchmark runs."""
import sys

import pytest

import hotloop.bench.train
from hotloop.cli import COMMANDS, main

BENCH_SUBCOMMANDS = ["components", "train", "loop", "inference", "distributed"]


@pytest.fixture(autouse=True)
def called_as_module(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["__main__.py"])  # prog: "python -m hotloop"


def refused(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("command", [[c] for c in COMMANDS if c != "bench"] + [["bench", s] for s in BENCH_SUBCOMMANDS],
                         ids=" ".join)
def test_unknown_option_shows_the_subcommands_usage(command, capsys):
    """Once, `hotloop demo --nosuch` printed the top-level usage (the list of commands)."""
    err = refused([*command, "--nosuch"], capsys)
    name = " ".join(command)
    assert err.startswith(f"usage: python -m hotloop {name} "), err
    assert err.rstrip().endswith(f"python -m hotloop {name}: error: unrecognized arguments: --nosuch"), err


def test_unknown_option_before_a_command_still_shows_the_top_usage(capsys):
    err = refused(["--nosuch"], capsys)
    assert err.startswith("usage: python -m hotloop [-h] [--version]")
    assert "error: unrecognized arguments: --nosuch" in err


def test_subcommand_options_still_parse(monkeypatch):
    seen = {}
    monkeypatch.setattr(hotloop.bench.train, "run", lambda args, device: seen.update(vars(args)) or 0)
    assert main(["bench", "train", "--model", "tiny-cnn", "--steps", "3", "--device", "cpu"]) == 0
    assert seen["model"] == "tiny-cnn" and seen["steps"] == 3


@pytest.mark.parametrize("option", ["--csv", "--json", "--plot"])
def test_unwritable_output_fails_before_the_benchmark(option, monkeypatch, capsys, tmp_path):
    """Once, `bench train --csv /nonexistent/x.csv` ran the whole benchmark and then failed to write."""
    monkeypatch.setattr(hotloop.bench.train, "run", lambda args, device: pytest.fail("the benchmark ran"))
    path = tmp_path / "missing-folder" / "out.file"
    assert main(["bench", "train", option, str(path), "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert err.strip() == f"hotloop bench train: {option} {path}: cannot write it: No such file or directory"


def test_writable_output_is_left_as_it_was(monkeypatch, tmp_path):
    """The check opens the file for appending: a file that exists keeps its bytes, one it made is removed."""
    monkeypatch.setattr(hotloop.bench.train, "run", lambda args, device: 0)
    new, old = tmp_path / "new.csv", tmp_path / "old.json"
    old.write_text("earlier run\n")
    assert main(["bench", "train", "--csv", str(new), "--json", str(old), "--device", "cpu"]) == 0
    assert not new.exists() and old.read_text() == "earlier run\n"
