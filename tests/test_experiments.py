"""The experiments layer on the tiny dataset: seeds, tuning on validation data (never on test
data), compare's checks and resume, a preset with every feature, reproduce's resume, and the
measures the reports give."""

from __future__ import annotations

import csv
import json
import math

import numpy as np
import pytest
import yaml
from conftest import TINY

import pflego.plots
import pflego.sim as runner
from pflego.cli import main
from pflego.config import load_config
from pflego.data import ArrayDataset, register
from pflego.errors import ConfigError, DataError
from pflego.experiments import measures as M
from pflego.experiments import report_figures
from pflego.experiments.presets import grid_points, point_label
from pflego.experiments.report import build_report
from pflego.experiments.reproduce import reproduce
from pflego.experiments.runs import read_manifest
from pflego.experiments.seeds import parse_seeds
from pflego.experiments.tune import edge_notes, parse_grid, tune
from pflego.history import History
from pflego.sim import Simulation, build_experiment

FLAGS = [
    "--dataset", "tiny", "--clients", "6", "--classes-per-client", "2", "--participation", "0.5",
    "--rounds", "4", "--inner-steps", "3", "--eval-every", "2", "--set", "dtype=float64", "--quiet",
]  # fmt: skip


def _split(name: str, poison: bool) -> ArrayDataset:
    """240 training and 80 test 1x4x4 inputs whose label is the argmax of the first four pixels.

    ``poison`` replaces the test inputs by noise and shuffles the test labels (same label counts,
    so the partition and the validation split are the same as the clean dataset's).
    """
    rng = np.random.default_rng(5)
    x = rng.normal(size=(320, 1, 4, 4)).astype(np.float32)
    y = x.reshape(320, -1)[:, :4].argmax(1).astype(np.int64)
    x_test, y_test = x[240:], y[240:]
    if poison:
        x_test = rng.normal(size=x_test.shape).astype(np.float32) * 5
        y_test = rng.permutation(y_test)
    return ArrayDataset(name, x[:240], y[:240], x_test, y_test, 4)


register("tiny-split", "mlp", False, "tiny with an official test split (tests only)")(
    lambda root, seed=0: _split("tiny-split", False)
)
register("tiny-poisoned", "mlp", False, "tiny-split with a poisoned test split (tests only)")(
    lambda root, seed=0: _split("tiny-poisoned", True)
)


def touch(plan, rows, path):
    path.write_bytes(b"")
    return path


@pytest.fixture(autouse=True)
def _no_figures(monkeypatch):
    """Figures cost seconds of matplotlib each and are not what these tests check (the sweep
    figure is drawn once below; test_presets draws the curves figure)."""
    monkeypatch.setattr(pflego.plots, "plot_histories", lambda *a, **k: None)
    monkeypatch.setattr(report_figures, "plot_curves", touch)
    monkeypatch.setattr(report_figures, "plot_sweep", touch)


SWEEP_FIGURE = report_figures.plot_sweep


def cli(capsys, *argv):
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def count_starts(monkeypatch) -> list[str]:
    """The names of the runner's functions called from now on: fresh runs and resumed ones."""
    calls = []
    for name in ("run_experiment", "resume"):
        real = getattr(runner, name)
        monkeypatch.setattr(
            runner, name, lambda *a, _f=real, _n=name, **k: calls.append(_n) or _f(*a, **k)
        )
    return calls


def numbers(run_dir):
    return [{k: v for k, v in r.items() if k != "seconds"} for r in History.load(run_dir).records]


# --- seeds ---------------------------------------------------------------------------------------


def test_parse_seeds():
    assert parse_seeds("3") == [0, 1, 2]
    assert parse_seeds("3,7,11") == [3, 7, 11]
    assert parse_seeds("5,") == [5]
    assert parse_seeds(None) is None
    for bad in ("0", "a", "1,1", "-1,2", ","):
        with pytest.raises(ConfigError):
            parse_seeds(bad)


def test_seeds_change_partitions_and_results_and_a_seed_reproduces_them(capsys, tmp_path):
    code, out, err = cli(capsys, "run", *FLAGS, "--seeds", "2", "--out", tmp_path / "a")
    assert code == 0, err
    a0, a1 = tmp_path / "a" / "seed-0", tmp_path / "a" / "seed-1"
    assert (a0 / "partition.json").read_text() != (a1 / "partition.json").read_text()
    assert numbers(a0) != numbers(a1)
    assert "mean ± std over 2 seeds" in out
    report = (tmp_path / "a" / "report.md").read_text()
    assert "| seed 0 | seed 1 |" in report
    code, _, _ = cli(capsys, "run", *FLAGS, "--seeds", "0,5", "--out", tmp_path / "b")
    b0 = tmp_path / "b" / "seed-0"
    assert (b0 / "partition.json").read_text() == (a0 / "partition.json").read_text()
    assert numbers(b0) == numbers(a0)
    code, _, err = cli(capsys, "run", *FLAGS, "--seeds", "2", "--seed", "1")
    assert code == 2 and "--seed or --seeds" in err


# --- tuning ---------------------------------------------------------------------------------------

TUNE_BASE = {
    **{k: v for k, v in TINY.items() if k != "client_lr"},
    "algorithm": "fedavg",
    "classes_per_client": 4,
    "partition": "iid",
    "rounds": 4,
    "eval_every": 1,
    "average_last": 2,
}


def test_tuning_never_reads_test_metrics(tmp_path):
    grid = parse_grid(["client_lr=0.003,0.1,1.0"])
    results = {}
    for dataset in ("tiny-split", "tiny-poisoned"):
        out = tmp_path / dataset
        choice, _ = tune({**TUNE_BASE, "dataset": dataset}, grid, out=out, progress=False)
        text = (out / "tune.md").read_text()
        table = text[text.index("Selection") : text.index("## Test accuracy")]  # grid points only
        final = History.load(out / "final" / "seed-0").records[-1]
        results[dataset] = (choice, table, final)
    clean, poisoned = results["tiny-split"], results["tiny-poisoned"]
    assert clean[0]["values"] == poisoned[0]["values"] and clean[0]["score"] == poisoned[0]["score"]
    assert clean[1] == poisoned[1]  # every grid point's validation score, unchanged
    assert clean[2]["test_acc"] != poisoned[2]["test_acc"]  # while the test split did change
    assert clean[0]["metric"] == "val_acc"
    assert "val_fraction=0.1" in clean[1] and "Test metrics are never read" in clean[1]
    assert "client_lr" in yaml.safe_load((tmp_path / "tiny-split" / "chosen.yaml").read_text())
    at_edge = clean[0]["values"]["client_lr"] in (0.003, 1.0)
    assert bool(clean[0]["edges"]) == at_edge == ("Note: client_lr=" in clean[1])


def test_a_joint_grid_dimension_keeps_algorithm_options_nested():
    grid = parse_grid(["client_lr+options.mu=0.1/0.01,1.0/0.1", "options.lam=2"])
    points = grid_points(grid)
    assert points[0] == {"client_lr": 0.1, "options": {"mu": 0.01, "lam": 2}}
    assert point_label(points[1]) == "client_lr=1.0, options.mu=0.1, options.lam=2"


def test_a_choice_at_the_edge_of_a_numeric_grid_is_noted():
    grid = [
        ("client_lr", [0.01, 0.1, 1.0]),
        ("options.mu", [0.1, 1.0, 10.0]),
        ("local_epochs", [1, 2]),  # two values: always an end, never noted
        ("server", [{"server_lr": 0.1}, {"server_lr": 1.0}, {"server_lr": 3.0}]),  # joint
    ]
    chosen = {"client_lr": 1.0, "options": {"mu": 0.1}, "local_epochs": 2, "server_lr": 3.0}
    assert edge_notes(grid, chosen) == [
        "client_lr=1.0 is the largest value of its grid; a grid reaching beyond it may choose better",
        "options.mu=0.1 is the smallest value of its grid; a grid reaching beyond it may choose better",
    ]
    assert edge_notes(grid, {**chosen, "client_lr": 0.1, "options": {"mu": 1.0}}) == []


def test_tune_command(capsys, tmp_path):
    out = tmp_path / "t"
    argv = ["tune", *FLAGS, "--algorithm", "pflego", "--out", out, "--seeds", "2"]
    grid = ["--grid", "client_lr=0.1,0.3", "--grid", "server_optimizer+server_lr=sgd/0.1,adam/0.01"]
    code, stdout, err = cli(capsys, *argv, *grid)
    assert code == 0, err
    assert stdout.startswith("chosen on val_acc: client_lr=")
    text = (out / "tune.md").read_text()
    points = [line for line in text.splitlines() if line.startswith(("| p0", "| **p0"))]
    assert len(points) == 4 and sum("(chosen)**" in p for p in points) == 1
    assert "## Test accuracy" in text
    chosen = load_config(out / "chosen.yaml")  # a config `pflego run --config` takes
    assert chosen.algorithm == "pflego" and chosen.val_fraction == 0.0
    assert (out / "final" / "seed-1" / "metrics.jsonl").is_file()
    code, _, err = cli(capsys, *argv, "--client-lr", "0.2", *grid)
    assert code == 2 and "both a flag and a --grid" in err


# --- compare ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--algorithms", "pflego,fedmissing"], "unknown algorithm 'fedmissing'"),
        (["--algorithm", "fedavg"], "--algorithms"),
        (["--algorithms", ""], "--algorithms is empty"),
        (
            ["--algorithms", "fedavg,pflego", "--set", "options.head_step=eq3"],
            "fedavg has no option",
        ),
        (["--algorithms", "fedavg", "--dataset", "imagenet"], "unknown dataset"),
    ],
)
def test_compare_checks_everything_before_training(capsys, tmp_path, argv, message):
    out = tmp_path / "c"
    code, _, err = cli(capsys, "compare", "--rounds", "2", "--out", out, "--quiet", *argv)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_compare_resume_finishes_without_redoing_finished_runs(capsys, tmp_path, monkeypatch):
    args = ["compare", *FLAGS, "--algorithms", "pflego,fedavg"]
    assert cli(capsys, *args, "--out", tmp_path / "full")[0] == 0
    original = Simulation.run_round

    def crash_in_fedavg(self, t):
        if self.cfg.algorithm == "fedavg" and t == 2:
            raise KeyboardInterrupt
        original(self, t)

    monkeypatch.setattr(Simulation, "run_round", crash_in_fedavg)
    code, _, err = cli(capsys, *args, "--out", tmp_path / "cut")
    assert code == 130 and f"pflego compare --resume {tmp_path / 'cut'}" in err
    monkeypatch.setattr(Simulation, "run_round", original)
    calls = count_starts(monkeypatch)
    code, out, err = cli(capsys, "compare", "--resume", tmp_path / "cut", "--quiet")
    assert code == 0, err
    assert calls == ["resume"]  # pflego was finished; fedavg continues from its checkpoint
    for name in ("pflego", "fedavg"):
        assert numbers(tmp_path / "cut" / name) == numbers(tmp_path / "full" / name)
    assert out.count("| fedavg |") == 1
    code, _, err = cli(capsys, "compare", "--resume", tmp_path / "cut", "--rounds", "9")
    assert code == 2 and "give no other settings" in err


def test_report_of_run_directories_equals_the_comparison(capsys, tmp_path):
    out = tmp_path / "c"
    assert cli(capsys, "compare", *FLAGS, "--algorithms", "pflego,fedavg", "--out", out)[0] == 0
    code, _, _ = cli(capsys, "report", out / "pflego", out / "fedavg", "--out", tmp_path / "r")
    assert code == 0
    table = lambda p: [line for line in p.read_text().splitlines() if line.startswith("|")]  # noqa: E731
    assert table(tmp_path / "r" / "report.md") == table(out / "comparison.md")
    assert "mean of the last 4 evaluations (rounds 1–4)" in (out / "comparison.md").read_text()


# --- a preset with every feature ------------------------------------------------------------------

FEATURES = {
    "description": "every feature on the tiny dataset",
    "paper": "A paper",
    "source": "Table 9",
    "data": ["tiny"],
    "settings": {**TINY, "rounds": 4, "eval_every": 1, "average_last": 2, "val_fraction": 0.2},
    "blocks": {"k2": {"classes_per_client": 2}, "k4": {"partition": "iid"}},
    "algorithms": {
        "fedavg": {"client_lr": 0.3},
        "fedavg-w": {"same_run_as": "fedavg", "metric": "test_acc_weighted"},
        "pflego": {"client_lr": 0.3, "server_lr": 0.3},
    },
    "paper_results": {
        "k2": {"fedavg": 50.0, "pflego": {"test_acc": 60.0, "seconds_per_round": 7.0}}
    },
    "sweep": {"inner_steps": [1, 3]},
}


def test_a_preset_with_blocks_shared_runs_a_sweep_and_seeds(tmp_path, monkeypatch):
    monkeypatch.setattr(report_figures, "plot_sweep", SWEEP_FIGURE)
    path = tmp_path / "features.yaml"
    path.write_text(yaml.safe_dump(FEATURES))
    out = tmp_path / "out"
    report = reproduce(path, seeds=[0, 1], out=out, target_acc=0.3, progress=False)
    plan = read_manifest(out)
    assert len(plan.unique_runs()) == 2 * 2 * 2 * 2  # blocks x own rows x sweep values x seeds
    shared = [r.dir for r in plan.runs if r.row == "fedavg-w"]
    assert shared == [r.dir for r in plan.runs if r.row == "fedavg"]
    text = (out / "report.md").read_text()
    assert "| algorithm | paper | ours: metric, mean ± std over 2 seeds | difference |" in text
    assert (
        "| fedavg (inner_steps=1) [test_acc] | 50.00 |" in text
        and "| fedavg-w (inner_steps=3) [test_acc_weighted] | — |" in text
    )
    assert "at the best-validation round (%)" in text and "rounds to 30%" in text
    assert "## Other quantities the paper reports" in text and "seconds_per_round" in text
    assert (out / "sweep.png").stat().st_size > 10_000 and (out / "report.png").is_file()
    rows = {
        (r["block"], r["row"], r["sweep"]): r for r in csv.DictReader((out / "report.csv").open())
    }
    row = rows["k2", "fedavg", "inner_steps=3"]
    finals = [
        M.final_value(History.load(out / f"k2/fedavg/inner_steps=3/seed-{s}"), "test_acc", 2)
        for s in (0, 1)
    ]
    assert float(row["mean"]) == pytest.approx(np.mean(finals), abs=1e-6)
    assert float(row["std"]) == pytest.approx(np.std(finals, ddof=1), abs=1e-6)
    assert float(row["difference"]) == pytest.approx(np.mean(finals) - 0.5, abs=1e-6)
    weighted = rows["k2", "fedavg-w", "inner_steps=3"]
    assert float(weighted["mean"]) == pytest.approx(
        np.mean(
            [
                M.final_value(
                    History.load(out / f"k2/fedavg/inner_steps=3/seed-{s}"), "test_acc_weighted", 2
                )
                for s in (0, 1)
            ]
        ),
        abs=1e-6,
    )
    assert report.markdown() == text


def small_preset(tmp_path, **extra):
    values = {
        "settings": {**TINY, "rounds": 4, "eval_every": 1, "average_last": 2},
        "algorithms": {
            "fedavg": {"client_lr": 0.3},
            "pflego": {"client_lr": 0.3, "server_lr": 0.3},
        },
        **extra,
    }
    path = tmp_path / "small.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def test_an_interrupted_reproduction_resumes_without_repeating_runs(tmp_path, monkeypatch):
    path = small_preset(tmp_path)
    reproduce(path, seeds=[0, 1], out=tmp_path / "full", progress=False)
    original, started = Simulation.run_round, []

    def crash_in_third_run(self, t):
        if t == 0:
            started.append(self)
        if len(started) == 3 and t == 2:
            raise KeyboardInterrupt
        original(self, t)

    monkeypatch.setattr(Simulation, "run_round", crash_in_third_run)
    with pytest.raises(KeyboardInterrupt):
        reproduce(path, seeds=[0, 1], out=tmp_path / "cut", progress=False)
    monkeypatch.setattr(Simulation, "run_round", original)
    calls = count_starts(monkeypatch)
    reproduce(path, seeds=[0, 1], out=tmp_path / "cut", progress=False)
    assert calls == ["resume", "run_experiment"]  # the third run resumes, the fourth starts
    for run in read_manifest(tmp_path / "full").runs:
        assert numbers(tmp_path / "cut" / run.dir) == numbers(tmp_path / "full" / run.dir)
    calls.clear()
    reproduce(path, seeds=[0, 1], out=tmp_path / "cut", progress=False)
    assert calls == []  # everything finished: nothing runs again
    with pytest.raises(ConfigError, match="holds a run with client_lr=0.3, not 0.5"):
        reproduce(
            path, seeds=[0, 1], out=tmp_path / "cut", overrides={"client_lr": 0.5}, progress=False
        )


def test_reproduce_tune_runs_the_choice_and_names_it(tmp_path):
    tune_grids = {
        "fedavg": {"client_lr": [0.003, 0.3]},
        "pflego": {
            "server": [
                {"server_optimizer": "sgd", "server_lr": 0.3},
                {"server_optimizer": "adam", "server_lr": 0.01},
            ]
        },
    }
    path = small_preset(tmp_path, tune=tune_grids)
    out = tmp_path / "out"
    reproduce(path, out=out, tune=True, progress=False)
    plan = read_manifest(out)
    for row in ("fedavg", "pflego"):
        choice = plan.tuned["all"][row]
        assert choice["points"] == 2 and choice["metric"] == "val_acc"
        assert (out / choice["report"]).is_file()
        config = yaml.safe_load((out / row / "seed-0" / "config.yaml").read_text())
        for key, value in choice["values"].items():
            assert config[key] == value
        assert config["val_fraction"] == 0.0  # final runs train on the whole training split
    text = (out / "report.md").read_text()
    assert "## Tuned settings" in text and "validation score" in text


# --- measures -------------------------------------------------------------------------------------


def test_the_final_value_never_includes_round_zero():
    history = History([{"round": t, "test_acc": float(t), "seconds": 0.0} for t in range(3)])
    assert [r["round"] for r in history.final_window(10)] == [1, 2]
    assert history.final(10)["test_acc"] == 1.5
    assert history.final(1)["test_acc"] == 2.0
    assert History([{"round": 0, "test_acc": 0.3, "seconds": 0.0}]).final_window(10) == []


def test_best_validation_round_and_rounds_to_target():
    records = [
        {"round": 0, "val_acc": 0.9, "test_acc": 0.1},
        {"round": 1, "val_acc": 0.5, "test_acc": 0.6},
        {"round": 2, "val_acc": 0.8, "test_acc": 0.7},
        {"round": 3, "val_acc": 0.8, "test_acc": 0.9},
    ]
    history = History(records)
    assert M.best_validation(history, "test_acc") == (2, 0.7)  # not round 0, not the best test
    assert M.rounds_to_target(history, "test_acc", 0.7) == 2
    assert M.rounds_to_target(history, "test_acc", 0.95) is None
    assert M.companion("test_acc_global", "p10") == "test_acc_p10_global"
    assert M.participation_gap_key("unseen_test_acc_global") == "participation_gap_global"
    assert M.participation_gap_key("val_acc") is None
    assert M.validation_metric("unseen_test_acc") == "unseen_val_acc"


def write_run(path, partition, per_client):
    """A run directory with rounds 0..2 and the given per-client test accuracies at each round."""
    path.mkdir()
    (path / "partition.json").write_text(json.dumps(partition))
    (path / "metrics.jsonl").write_text("".join(json.dumps({"round": t}) + "\n" for t in range(3)))
    with (path / "clients.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["round", "client", "n_train", "n_test", "test_acc"])
        for t in range(3):
            for client, accs in per_client.items():
                writer.writerow([t, client, 10, 5, accs[t]])


def test_gain_over_local_per_client(tmp_path):
    partition = [{"client": 0, "train": 10}, {"client": 1, "train": 10}]
    write_run(tmp_path / "fedper", partition, {0: [0.1, 0.8, 0.9], 1: [0.1, 0.6, 0.6]})
    write_run(tmp_path / "local", partition, {0: [0.0, 0.5, 0.7], 1: [0.9, 0.7, 0.7]})
    mean, std = M.gain_over_local(tmp_path / "fedper", tmp_path / "local", "test_acc", 2)
    gains = [(0.8 + 0.9) / 2 - (0.5 + 0.7) / 2, 0.6 - 0.7]  # rounds 1 and 2; never round 0
    assert mean == pytest.approx(np.mean(gains)) and std == pytest.approx(np.std(gains))
    write_run(tmp_path / "other", partition[:1], {0: [0.0, 0.5, 0.7]})
    assert M.gain_over_local(tmp_path / "fedper", tmp_path / "other", "test_acc", 2) is None


def test_costs_count_the_payloads_and_the_clients_flops():
    costs = {}
    for name in ("fedavg", "pflego", "fedper"):
        experiment = build_experiment(load_config({**TINY, "algorithm": name}))
        params = experiment.algorithm.init_params(0, experiment.dtype)
        body = sum(v.numel() for k, v in params.items() if k.startswith("body."))
        everything = sum(v.numel() for v in params.values())
        costs[name] = M.measure_costs(experiment)
        expected = 8 * (everything if name == "fedavg" else body)  # float64
        assert (
            costs[name]["bytes_up_per_client"] == expected == costs[name]["bytes_down_per_client"]
        )
        assert costs[name]["bytes_up_per_round"] == expected * 3  # r = 0.5 x 6 clients
        assert costs[name]["client_flops_per_round"] > 0
    # tau = 3: PFLEGO's client does two body forwards and one backward, FedPer three of each
    assert costs["pflego"]["client_flops_per_round"] < costs["fedper"]["client_flops_per_round"]
    assert not math.isnan(costs["fedavg"]["cohort_size"])


def test_report_of_a_missing_run_is_marked(tmp_path):
    path = small_preset(tmp_path)
    out = tmp_path / "out"
    reproduce(path, out=out, progress=False)
    for name in ("metrics.jsonl", "clients.csv"):
        (out / "pflego" / "seed-0" / name).unlink()
    text = build_report(out).markdown()
    assert "| pflego | — (missing) |" in text


def test_report_shows_the_spread_over_clients_and_the_participation_gap(tmp_path):
    path = small_preset(tmp_path)
    values = yaml.safe_load(path.read_text())
    values["settings"] |= {"unseen_fraction": 0.34, "val_fraction": 0.3}
    path.write_text(yaml.safe_dump(values))
    out = tmp_path / "out"
    reproduce(path, out=out, progress=False)
    report = build_report(out)
    window = History.load(out / "fedavg" / "seed-0").final_window(2)
    final = {k: np.mean([r[k] for r in window]) for k in ("test_acc_p90", "participation_gap")}
    line = next(r for r in csv.DictReader(report.csv().splitlines()) if r["row"] == "fedavg")
    assert float(line["p90_mean"]) == pytest.approx(final["test_acc_p90"], rel=1e-5)
    assert float(line["participation_gap_mean"]) == pytest.approx(
        final["participation_gap"], rel=1e-5
    )
    assert line["client_std_mean"] and line["best_val_rounds"]
    text = report.markdown()
    assert "top decile (%) | std over clients (pp) | participation gap (pp)" in text
    assert f"{100 * final['participation_gap']:.2f}" in text and "Participation gap (Yuan" in text


def test_blocks_with_their_own_data_and_row_overrides(tmp_path, monkeypatch):
    monkeypatch.setenv("PFLEGO_NO_DOWNLOAD", "1")
    path = small_preset(
        tmp_path,
        blocks={
            "here": {"data": ["tiny"], "algorithms": {"fedavg": {"client_lr": 0.5}}},
            "absent": {"data": ["mnist"], "dataset": "mnist"},
        },
        paper_results={"here": {"fedavg": 50.0}},
        paper_std={"here": {"fedavg": 1.5}},
        paper_results_by_group={"Art": {"fedavg": 20.0}},
    )
    out = tmp_path / "out"
    reproduce(path, out=out, data_dir=tmp_path / "empty", progress=False)
    assert {r.block for r in read_manifest(out).runs} == {"here"}
    assert yaml.safe_load((out / "here/fedavg/seed-0/config.yaml").read_text())["client_lr"] == 0.5
    assert yaml.safe_load((out / "here/pflego/seed-0/config.yaml").read_text())["client_lr"] == 0.3
    text = (out / "report.md").read_text()
    assert "Block absent skipped: its data is missing" in text and "train-images" in text
    assert "| fedavg | 50.00 ± 1.50 |" in text
    assert "| algorithm | Art: paper / ours (%) |" in text and "| fedavg | 20.00 / — |" in text
    with pytest.raises(DataError, match="train-images-idx3-ubyte.gz"):
        reproduce(path, out=tmp_path / "o2", data_dir=tmp_path / "empty", blocks=["absent"])


def test_a_ranked_preset_opens_with_its_leaderboard(tmp_path):
    path = small_preset(
        tmp_path,
        ranked=True,
        algorithms={
            "fedavg": {"client_lr": 0.3},
            "crawl": {"algorithm": "fedavg", "client_lr": 1e-6},
        },
    )
    reproduce(path, out=tmp_path / "out", progress=False)
    rows = {r["row"]: r for r in csv.DictReader((tmp_path / "out" / "report.csv").open())}
    assert float(rows["fedavg"]["mean"]) > float(rows["crawl"]["mean"])  # a real step beats a crawl
    text = (tmp_path / "out" / "report.md").read_text()
    header = "| rank | algorithm | test_acc (%) | bottom decile (%) | training s per round | MB per round |"
    assert header in text
    ranked = [
        line.split(" | ")[1] for line in text.splitlines() if line.startswith(("| 1 |", "| 2 |"))
    ]
    assert ranked == ["fedavg", "crawl"]
    seconds = float(rows["fedavg"]["seconds_mean"]) / 4
    assert f"| 1 | fedavg | {100 * float(rows['fedavg']['mean']):.2f} |" in text
    assert f"| {seconds:.3g} |" in text
    with pytest.raises(ConfigError, match="ranked='yes' must be true or false"):
        reproduce(small_preset(tmp_path, ranked="yes"), out=tmp_path / "bad", progress=False)
