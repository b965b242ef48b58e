"""No silent no-op (issue 39, finding 5): FedBN without batch norm and MOCHA on a body it never
trains say so on stderr; ``--jobs 0`` is refused like ``--threads 0``."""

from __future__ import annotations

import logging

import pytest
from conftest import tiny_experiment

from pflego.cli import main


@pytest.mark.parametrize(
    ("algorithm", "model", "warned"),
    [
        ("fedbn", "mlp", "fedbn on mlp, a model without batch norm, is FedAvg exactly"),
        ("fedbn", "mlp-bn", None),
        ("mocha", "mlp", "mocha learns linear models on the fixed initial features of mlp"),
        ("mocha", "linear", None),
    ],
)
def test_an_algorithm_says_when_its_model_makes_it_a_no_op(caplog, algorithm, model, warned):
    with caplog.at_level(logging.WARNING, logger="pflego"):
        tiny_experiment(algorithm=algorithm, model=model)
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    if warned is None:
        assert not messages
    else:
        assert len(messages) == 1 and messages[0].startswith(warned)


def test_the_warning_reaches_stderr_not_stdout(capsys, tmp_path):
    argv = ["run", "--algorithm", "fedbn", "--dataset", "tiny", "--clients", "6"]
    argv += ["--classes-per-client", "2", "--rounds", "1", "--inner-steps", "1", "--quiet"]
    assert main([*argv, "--out", str(tmp_path / "r")]) == 0
    captured = capsys.readouterr()
    assert "pflego: warning: fedbn on mlp" in captured.err and "pflego: warning" not in captured.out


@pytest.mark.parametrize("command", [["run"], ["compare"], ["reproduce", "main"], ["tune"]])
def test_jobs_0_is_refused(capsys, command):
    assert main([*command, "--jobs", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pflego: error: argument --jobs: 0 must be at least 1")
