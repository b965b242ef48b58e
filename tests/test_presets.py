"""The shipped presets: their format, `reproduce --quick` end to end, missing data, the report
rebuilt from run directories, and the golden results of every preset's quick version."""

from __future__ import annotations

import csv
import itertools
import json

import golden_results as golden
import pytest

import pflego.plots
from pflego.cli import main
from pflego.data import DATASETS
from pflego.errors import ConfigError
from pflego.experiments import report_figures
from pflego.experiments.presets import grid_points, list_presets, load_preset, parse_preset
from pflego.experiments.runs import read_manifest
from pflego.history import History

TABLE1 = ("pflego-mnist", "pflego-fmnist", "pflego-emnist", "pflego-cifar10")


def cli(capsys, *argv):
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def quick_mnist(tmp_path_factory):
    """`pflego reproduce pflego-mnist --quick --offline`, run once for the tests below.

    Each run's own curves.png is not what these tests check, so drawing it is skipped (seconds
    of matplotlib per run); the experiment's figure is drawn.
    """
    out = tmp_path_factory.mktemp("quick") / "pflego-mnist"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pflego.plots, "plot_histories", lambda *a, **k: None)
        code = main(
            ["reproduce", "pflego-mnist", "--quick", "--offline", "--out", str(out), "--quiet"]
        )
    assert code == 0
    return out


def test_every_shipped_preset_loads_and_names_registered_data():
    presets = {p.name: p for p in list_presets()}
    assert {"main", *TABLE1} <= set(presets)
    for preset in presets.values():
        assert preset.description
        assert all(d in DATASETS for d in preset.data)


@pytest.mark.parametrize("name", TABLE1)
def test_table1_presets_tune_every_method_at_the_same_budget(name):
    preset = load_preset(name)
    assert list(preset.blocks) == ["high", "medium", "none"]
    assert set(preset.rows) == {"pflego", "fedavg", "fedper"}
    sizes = {row: len(grid_points(grid)) for row, grid in preset.tune.items()}
    assert set(sizes) == set(preset.rows) and len(set(sizes.values())) == 1, sizes
    optimizers = {p.get("server_optimizer") for p in grid_points(preset.tune["pflego"])}
    assert optimizers == {"sgd", "adam"}
    for block, row in itertools.product(preset.blocks, preset.rows):
        assert preset.rows[row].metric in preset.paper_results[block][row]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"algorithms": {"a": {}}, "colour": 1}, "unknown key 'colour'"),
        ({"algorithms": {"b": {"same_run_as": "a"}}}, "same_run_as='a'"),
        ({"algorithms": {"a": {"learning_rate": 1}}}, "'learning_rate' is not a setting"),
        ({"algorithms": {"a": {}}, "paper_results": {"all": {"z": 1.0}}}, "paper_results.all.z"),
        ({"algorithms": {"a": {}}, "paper_results": {"high": {"a": 1.0}}}, "not a block"),
        ({"algorithms": {"a": {}}, "sweep": {"rounds": [1], "seed": [1]}}, "exactly one setting"),
        ({"algorithms": {"a": {}}, "tune": {"a": {"client_lr": 0.1}}}, "non-empty list"),
        ({"algorithms": {"a": {}}, "data": ["imagenet"]}, "unknown dataset 'imagenet'"),
    ],
)
def test_bad_presets_are_one_line_errors(values, message):
    with pytest.raises(ConfigError, match=message) as info:
        parse_preset(values, "bad")
    assert "\n" not in str(info.value)


def test_reproduce_list(capsys):
    code, out, _ = cli(capsys, "reproduce", "--list")
    assert code == 0
    for name in ("main", *TABLE1):
        assert f"  {name} " in out
    assert "data: mnist" in out and "data: mnist5k (built in)" in out


def test_missing_data_stops_before_training_with_one_line(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("PFLEGO_NO_DOWNLOAD", "1")
    out = tmp_path / "out"
    code, _, err = cli(
        capsys,
        "reproduce",
        "pflego-mnist",
        "--quick",
        "--data-dir",
        tmp_path / "empty",
        "--out",
        out,
    )
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert "train-images-idx3-ubyte.gz" in err and "t10k-labels-idx1-ubyte.gz" in err
    assert not out.exists()  # nothing trained, nothing written


def test_reproduce_quick_end_to_end(quick_mnist):
    out = quick_mnist
    plan = read_manifest(out)
    assert {r.dir for r in plan.runs} == {
        f"{b}/{a}/seed-0"
        for b in ("high", "medium", "none")
        for a in ("pflego", "fedavg", "fedper")
    }
    for run in plan.runs:
        for name in ("metrics.jsonl", "clients.csv", "config.yaml", "checkpoint.pt", "costs.json"):
            assert (out / run.dir / name).is_file()
    report = (out / "report.md").read_text()
    for heading in ("## high (classes_per_client=high)", "## medium", "## none (partition=iid)"):
        assert heading in report
    assert (
        "mean of the last 1 evaluation (round 2); round 0 (the untrained model) is never included"
        in report
    )
    assert "Offline form: dataset=mnist5k replaces the preset's data (mnist)" in report
    assert report.count("| pflego |") >= 3 * 3  # main table, measures, per seed: every block
    with (out / "report.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 9 and {r["metric"] for r in rows} == {"test_acc"}
    assert all(0 <= float(r["mean"]) <= 1 for r in rows)  # fractions, as in metrics.jsonl
    assert (out / "report.png").stat().st_size > 10_000


def test_report_rebuilt_from_the_directories_equals_the_written_one(
    capsys, quick_mnist, tmp_path, monkeypatch
):
    monkeypatch.setattr(report_figures, "plot_curves", lambda plan, rows, path: path.touch())
    code, out, _ = cli(capsys, "report", quick_mnist, "--out", tmp_path, "--format", "latex")
    assert code == 0
    assert (tmp_path / "report.md").read_text() == (quick_mnist / "report.md").read_text()
    assert (tmp_path / "report.csv").read_text() == (quick_mnist / "report.csv").read_text()
    assert r"\begin{tabular}" in out and (tmp_path / "report.tex").read_text() == out
    assert r"$\pm$" not in out  # one seed: no standard deviation to show


def test_report_format_is_checked_first(capsys, quick_mnist, tmp_path):
    code, _, err = cli(capsys, "report", quick_mnist, "--out", tmp_path, "--format", "html")
    assert code == 2 and "--format 'html'" in err and not tmp_path.joinpath("report.md").exists()


@pytest.fixture(scope="module")
def golden_cache(quick_mnist):
    """Final metrics of runs already made: presets whose quick forms share configs run once."""
    plan = read_manifest(quick_mnist)
    metric = {r["name"]: r["metric"] for r in plan.rows}
    return {
        golden.config_key(run.config) + metric[run.row]: golden.run_metrics(
            History.load(quick_mnist / run.dir), run.config, metric[run.row]
        )
        for run in plan.unique_runs()
    }


#: Golden presets whose quick form takes half a minute: checked in the slow tier, which keeps the
#: default suite under its 10 minutes on 2 cores.
SLOW_GOLDEN = {"pfedme-table1"}


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(p.name, marks=[pytest.mark.slow] if p.name in SLOW_GOLDEN else [])
        for p in list_presets()
    ],
)
def test_golden_offline(name, golden_cache, tmp_path, monkeypatch):
    missing = golden.unregistered(load_preset(name))
    if missing:
        pytest.skip(f"{name} names algorithms not registered yet: {', '.join(missing)}")
    monkeypatch.setattr(pflego.plots, "plot_histories", lambda *a, **k: None)
    problems = golden.check(name, "offline", tmp_path, golden_cache)
    assert not problems, "\n".join(problems)


def test_golden_files_state_their_tolerances():
    for path in golden.golden_dir().glob("*.json"):
        content = json.loads(path.read_text())
        assert content["tolerance"] == golden.TOLERANCE and "--update" in content["about"]


@pytest.mark.slow
@pytest.mark.parametrize("name", [p.name for p in list_presets()])
def test_golden_real_data(name, tmp_path, monkeypatch):
    from pathlib import Path

    data = Path(__file__).resolve().parents[1].parent / "shared" / "data"  # CI: beside the checkout
    path = golden.golden_dir() / f"{name}.json"
    content = json.loads(path.read_text()) if path.is_file() else {"forms": {}}
    if not content["forms"].get("real"):
        pytest.skip(f"{name}: no real-data golden results recorded")
    if not data.is_dir():
        pytest.skip(f"no data folder at {data}")
    monkeypatch.setattr(pflego.plots, "plot_histories", lambda *a, **k: None)
    problems = golden.check(name, "real", tmp_path, data_dir=str(data))
    assert not problems, "\n".join(problems)
