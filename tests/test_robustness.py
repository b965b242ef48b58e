"""Correct under stress (issue 13): documented words reach the run, label sets come from the
training split only, non-finite updates on Flower, and the reproducibility record."""

from __future__ import annotations

import hashlib
import json
import math
import platform
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from conftest import TINY, evaluate_pools

import pflego
from pflego.cli import main
from pflego.config import load_config
from pflego.data import ArrayDataset, register
from pflego.data.cache import cached_arrays
from pflego.sim import Simulation, build_experiment, run

TINY_RUN = ["--dataset", "tiny", "--clients", "6", "--rounds", "1", "--inner-steps", "1"]


def classes_per_client_of(out) -> set[int]:
    return {len(row["classes"]) for row in json.loads((out / "partition.json").read_text())}


@pytest.mark.parametrize("word,k", [("high", 2), ("medium", 2), ("none", 4), ("None", 4)])
@pytest.mark.parametrize("route", ["flag", "set", "yaml"])
def test_every_documented_classes_per_client_word_reaches_the_partition(tmp_path, word, k, route):
    """tiny has 4 classes: high = 2, medium = C // 2 = 2, none = C = 4 (no personalization)."""
    out = tmp_path / "run"
    args = ["run", *TINY_RUN, "--out", str(out), "--quiet"]
    if route == "flag":
        args += ["--classes-per-client", word]
    elif route == "set":
        args += ["--set", f"classes_per_client={word}"]
    else:
        path = tmp_path / "config.yaml"
        path.write_text(yaml.safe_dump({"classes_per_client": word}))
        args += ["--config", str(path)]
    assert main(args) == 0
    assert classes_per_client_of(out) == {k}


def test_an_unset_classes_per_client_is_a_one_line_error(tmp_path, capsys):
    path = tmp_path / "config.yaml"
    path.write_text("classes_per_client: ~\n")
    assert main(["run", *TINY_RUN, "--config", str(path), "--quiet"]) == 2
    assert "classes_per_client cannot be empty" in capsys.readouterr().err


# --- a client's classes come from its training split ---------------------------------------------


def test_a_class_only_in_a_clients_test_split_gets_no_output_and_counts_as_an_error(tmp_path):
    """tiny under Dirichlet(0.5): client 2's test split holds class 1, which its training split
    lacks. Its head has no output for class 1; those samples are errors in test_acc and are
    left out of test_loss; partition.json records each split's per-class counts."""
    settings = {**TINY, "algorithm": "pflego", "partition": "dirichlet", "alpha": 0.5}
    run(settings, out=tmp_path / "run", progress=False)
    rows = json.loads((tmp_path / "run" / "partition.json").read_text())
    for row in rows:
        assert row["classes"] == sorted(int(c) for c in row["train_counts"])
        assert sum(row["train_counts"].values()) == row["train"]
        assert sum(row["test_counts"].values()) == row["test"]
    leaks = {r["client"]: set(r["test_counts"]) - set(r["train_counts"]) for r in rows}
    assert leaks[2] == {"1"}

    sim = Simulation(build_experiment(load_config(settings)), None)
    sim.run_round(0)
    record = sim.evaluate(1)
    _, table = sim_rows(sim)
    data, algorithm = sim.exp.data, sim.algorithm
    downlink = algorithm.downlink(sim.server, sim.context(1))
    known_total, loss_total = 0, 0.0
    for i, row in enumerate(table):
        te = data.test_slice(i)
        classes = data.client_classes[i][data.client_classes[i] >= 0]
        logits = algorithm.predict(
            downlink, sim.store.get(i), data.inputs(data.x_test[te]).double()
        )[:, : len(classes)]
        y = data.y_test[te]  # global labels
        accuracy = (classes[logits.argmax(-1)] == y).double().mean()
        known = torch.isin(y, classes)
        local = torch.searchsorted(classes, y[known])
        loss = torch.nn.functional.cross_entropy(logits[known], local, reduction="sum")
        assert row["test_acc"] == pytest.approx(float(accuracy), abs=1e-12)
        assert row["n_test_known"] == int(known.sum())
        assert row["test_loss"] == pytest.approx(float(loss) / int(known.sum()), rel=1e-9)
        known_total, loss_total = known_total + int(known.sum()), loss_total + float(loss)
    assert table[2]["n_test_known"] < table[2]["n_test"]
    assert record["test_loss"] == pytest.approx(loss_total / known_total, rel=1e-9)
    assert math.isfinite(record["test_loss"])


def test_a_client_without_a_test_sample_of_its_classes_has_no_loss_but_an_accuracy():
    from pflego.sim.summary import summarize

    rows = [
        {"n_train": 2, "n_test": 2, "n_test_known": 0, "train_loss": 1.0, "train_acc": 1.0,
         "test_loss": math.nan, "test_acc": 0.0},
        {"n_train": 2, "n_test": 4, "n_test_known": 4, "train_loss": 1.0, "train_acc": 1.0,
         "test_loss": 0.5, "test_acc": 1.0},
    ]  # fmt: skip
    summary = summarize(rows)
    assert summary["test_loss"] == 0.5 and summary["test_acc"] == 0.5
    rows[1]["test_loss"] = math.nan  # a diverged client still makes the mean NaN
    assert math.isnan(summarize(rows)["test_loss"])


def sim_rows(sim: Simulation, completed: int = 1):
    ctx = sim.context(completed)
    downlink = sim.algorithm.downlink(sim.server, ctx)
    return evaluate_pools(sim.algorithm, downlink, sim.store.tensors, sim.pools)


# --- the reproducibility record and the checkpoint format ----------------------------------------


@register("tinyfile", "mlp", True, "tiny, read from <data-dir>/tiny.npz (tests only)")
def load_tinyfile(root, seed: int = 0) -> ArrayDataset:
    path = Path(root) / "tiny.npz"

    def decode():
        with np.load(path) as z:
            return {"x": z["x"], "y": z["y"]}

    a = cached_arrays("tinyfile", 1, [path], decode)
    return ArrayDataset("tinyfile", a["x"], a["y"], None, None, 4)


def test_every_run_directory_records_its_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("PFLEGO_CACHE", str(tmp_path / "cache"))
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(240, 1, 4, 4)).astype(np.float32)
    np.savez(data / "tiny.npz", x=x, y=x.reshape(240, -1)[:, :4].argmax(1))
    out = tmp_path / "run"
    assert main(["run", *TINY_RUN, "--dataset", "tinyfile", "--data-dir", str(data),
                 "--out", str(out), "--quiet", "--threads", "2"]) == 0  # fmt: skip
    env = json.loads((out / "environment.json").read_text())
    digest = hashlib.sha256((data / "tiny.npz").read_bytes()).hexdigest()
    assert env["data_files"] == {str((data / "tiny.npz").resolve()): f"sha256:{digest}"}
    assert env["pflego"] == pflego.__version__ and env["checkpoint_format"] == 2
    assert env["torch"] == torch.__version__ and env["numpy"] == np.__version__
    assert env["python"] == platform.python_version()
    assert env["device"] == "cpu" and env["torch_threads"] == 2
    head = subprocess.run(
        ["git", "-C", str(Path(pflego.__file__).parents[2]), "rev-parse", "HEAD"],
        capture_output=True,
        text=True,
    )
    if head.returncode == 0:  # pflego runs from a checkout
        assert env["git"]["commit"] == head.stdout.strip()
    # A resumed run adds the environment it continued in.
    assert main(["run", "--resume", str(out), "--quiet"]) == 0
    assert len(json.loads((out / "environment.json").read_text())["resumed"]) == 1


@pytest.mark.parametrize("change", ["no format", "future format"])
def test_resume_refuses_a_checkpoint_of_another_format(tmp_path, capsys, change):
    out = tmp_path / "run"
    assert main(["run", *TINY_RUN, "--out", str(out), "--quiet"]) == 0
    state = torch.load(out / "checkpoint.pt", weights_only=False)
    if change == "no format":  # written before formats were numbered (format 1)
        del state["format"], state["pflego"]
    else:
        state["format"] = 99
    torch.save(state, out / "checkpoint.pt")
    capsys.readouterr()
    assert main(["run", "--resume", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "checkpoint format" in err and "start a new run" in err


def test_resume_refuses_a_config_that_does_not_match_the_checkpoint(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["run", *TINY_RUN, "--out", str(out), "--quiet"]) == 0
    config = yaml.safe_load((out / "config.yaml").read_text())
    (out / "config.yaml").write_text(yaml.safe_dump({**config, "clients": 5}))
    capsys.readouterr()
    assert main(["run", "--resume", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not match the run's checkpoint (clients=5" in err
