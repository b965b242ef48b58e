"""A run whose training loss explodes but stays finite is diverged: it stops with exit code 3
and the one-line hint (``divergence=stop``, the default), or warns and trains on
(``divergence=warn``); a loss that spikes once and recovers is not stopped."""

from __future__ import annotations

import json
import math

import pytest
import torch
import yaml
from conftest import TINY

from pflego import plots
from pflego.cli import main
from pflego.config import load_config
from pflego.errors import ConfigError
from pflego.sim import build_experiment
from pflego.sim.guards import (
    DIVERGENCE_EVALUATIONS,
    DIVERGENCE_FACTOR,
    divergence_threshold,
    finite_rows,
    loss_diverged,
)
from pflego.sim.rounds import Simulation


def test_threshold_is_the_factor_times_the_larger_of_first_loss_and_chance():
    assert DIVERGENCE_FACTOR == 100 and DIVERGENCE_EVALUATIONS == 2
    assert divergence_threshold(1.0, 4) == pytest.approx(100 * math.log(4))  # chance dominates
    assert divergence_threshold(0.01, 10) == pytest.approx(100 * math.log(10))  # a warm start
    assert divergence_threshold(50.0, 2) == pytest.approx(5000.0)  # the first loss dominates
    assert divergence_threshold(0.5, 1) == pytest.approx(50.0)  # no chance level: ratio only
    assert divergence_threshold(None, 10) == math.inf
    assert divergence_threshold(math.nan, 10) == math.inf


@pytest.mark.parametrize(
    ("losses", "evaluations", "diverged"),
    [
        ([1.0, 101.0, 101.0], 2, True),  # exactly k evaluations past the threshold
        ([101.0, 101.0], 2, True),  # no more history than k is needed
        ([1.0, 101.0], 2, False),  # k - 1 evaluations past it
        ([1.0, 101.0, 1.0, 101.0], 2, False),  # a spike that recovered, then another
        ([1.0, 101.0, 100.0], 2, False),  # equal to the threshold is not past it
        ([1.0, math.inf, math.inf], 2, True),  # an infinite loss counts
        ([1.0, math.nan, math.nan], 2, False),  # NaN is left to the non-finite checks
        ([1.0, 101.0, 101.0], 3, False),
        ([101.0, 101.0, 101.0], 3, True),
        ([], 2, False),
        ([101.0], 0, False),
    ],
)
def test_loss_diverged_needs_k_consecutive_evaluations_past_the_threshold(
    losses, evaluations, diverged
):
    assert loss_diverged(losses, 100.0, evaluations) is diverged


def exploding_run(out, *settings: str) -> list[str]:
    """FedAvg on the tiny data at client_lr 10: the loss grows ~1000x a round and stays finite."""
    args = ["run", "--dataset", "tiny", "--algorithm", "fedavg", "--clients", "6", "--rounds", "2"]
    args += ["--client-lr", "10", "--classes-per-client", "2", "--out", str(out), "--quiet"]
    for setting in ("inner_steps=3", "eval_every=1", "checkpoint_every=1", "dtype=float64"):
        args += ["--set", setting]
    for setting in settings:
        args += ["--set", setting]
    return args


def test_a_finite_explosion_stops_with_exit_code_3_and_a_resumable_directory(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(exploding_run(out)) == 3
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert "Traceback" not in captured.err + captured.out
    assert err[-1].startswith("pflego: error: the training loss grew from ")
    assert "by round 2" in err[-1] and "client_lr=10" in err[-1] and "lower the step" in err[-1]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [0, 1, 2]
    threshold = divergence_threshold(records[0]["train_loss"], 2)
    assert all(math.isfinite(r["train_loss"]) and r["train_loss"] > threshold for r in records[1:])
    assert (out / "checkpoint.pt").is_file()
    assert yaml.safe_load((out / "config.yaml").read_text())["divergence"] == "stop"


def test_divergence_warn_keeps_the_old_behaviour(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(plots, "plot_histories", lambda *args: None)  # 2 s of drawing, not tested
    out = tmp_path / "run"
    assert main(exploding_run(out, "divergence=warn")) == 0
    captured = capsys.readouterr()
    assert "pflego: warning: the training loss grew from" in captured.out + captured.err
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3


def test_an_unknown_divergence_mode_is_a_one_line_config_error(capsys):
    with pytest.raises(ConfigError, match=r"divergence='maybe' is not one of stop, warn"):
        load_config(TINY, divergence="maybe")
    assert main(["run", "--dataset", "tiny", "--set", "divergence=maybe"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_a_loss_that_spikes_once_and_recovers_is_not_stopped(monkeypatch):
    scripted = {1: 1e6, 2: 1.0, 3: 1e6}  # round -> train loss: a spike, recovery, a spike
    evaluate = Simulation.evaluate

    def spiking(self, completed):
        record = evaluate(self, completed)
        record["train_loss"] = scripted.get(completed, record["train_loss"])
        return record

    monkeypatch.setattr(Simulation, "evaluate", spiking)
    config = load_config(TINY, algorithm="fedavg", rounds=3, eval_every=1)
    simulation = Simulation(build_experiment(config), None)
    simulation.plots = False
    history = simulation.run(progress=False)
    assert [r["train_loss"] for r in history.records][1:] == [1e6, 1.0, 1e6]


def test_finite_rows_agree_with_isfinite_on_nan_infinities_and_overflowing_sums():
    big = torch.finfo(torch.float32).max
    upload = torch.zeros(6, 4)
    upload[1, 2] = float("nan")
    upload[2, 0] = float("inf")
    upload[3, 3] = -float("inf")
    upload[4, :2] = big  # finite entries whose sum overflows: still a finite row
    upload[5, 0], upload[5, 1] = float("inf"), -float("inf")  # a NaN sum
    counts = torch.arange(6 * 3).reshape(6, 3)  # integers are always finite
    expected = torch.isfinite(upload).all(1)
    assert expected.tolist() == [True, False, False, False, True, False]
    assert torch.equal(finite_rows({"w": upload, "n": counts}), expected)
    assert torch.equal(finite_rows({"w": upload[[0, 4]]}), torch.tensor([True, True]))
