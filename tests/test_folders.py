"""One rule for every output folder (issue 39, finding 1): no command writes into a folder that
holds a run, comparison, reproduction, tuning or report of pflego's unless it continues its own
kind or ``--overwrite`` is given; the refused folder is left exactly as it was."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml
from conftest import TINY

import pflego.plots
from pflego.cli import main
from pflego.experiments import report_figures
from pflego.experiments.folders import kind_of

FLAGS = [
    "--dataset", "tiny", "--clients", "6", "--classes-per-client", "2", "--participation", "0.5",
    "--rounds", "2", "--inner-steps", "2", "--eval-every", "1", "--set", "dtype=float64", "--quiet",
]  # fmt: skip
PRESET = {"settings": {**TINY, "rounds": 2, "eval_every": 1}, "algorithms": {"fedavg": {}}}


def writers(preset: Path, run_dir: Path) -> dict[str, list[str]]:
    """Each command that writes a folder, as the kind it writes -> its argv before ``--out``."""
    return {
        "run": ["run", *FLAGS],
        "run over seeds": ["run", *FLAGS, "--seeds", "2"],
        "comparison": ["compare", *FLAGS, "--algorithms", "fedavg"],
        "reproduction": ["reproduce", str(preset), "--quiet"],
        "tuning": ["tune", *FLAGS, "--algorithm", "fedavg", "--grid", "client_lr=0.1,0.3"],
        "report": ["report", str(run_dir)],
    }


KINDS = ["run", "run over seeds", "comparison", "reproduction", "tuning", "report"]
#: (writer, folder) pairs where the writer continues the folder: rerunning reproduce or tune.
CONTINUES = {("reproduction", "reproduction"), ("tuning", "tuning")}


def cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict[str, Path]:
    """A folder of each kind, written by its own command once for the module."""
    pflego.plots.pyplot()  # the figures are drawn for real once, here
    root = tmp_path_factory.mktemp("kinds")
    preset = root / "preset.yaml"
    preset.write_text(yaml.safe_dump(PRESET))
    run_dir = root / "a-run"
    argv = writers(preset, run_dir)
    folders = {"run": run_dir}
    assert main([*map(str, argv["run"]), "--out", str(run_dir)]) == 0
    for kind in KINDS[1:]:
        folders[kind] = root / kind.replace(" ", "-")
        assert main([*map(str, argv[kind]), "--out", str(folders[kind])]) == 0, kind
    folders["preset"] = preset
    return folders


@pytest.fixture
def quick_figures(monkeypatch):
    monkeypatch.setattr(report_figures, "plot_curves", lambda plan, rows, path: path)


@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_is_recognized(made, kind):
    assert kind_of(made[kind]) == kind


@pytest.mark.parametrize("held", KINDS)
@pytest.mark.parametrize("writer", KINDS)
def test_a_folder_of_pflego_s_is_refused_unless_continued(capsys, tmp_path, made, writer, held):
    if (writer, held) in CONTINUES:
        pytest.skip("the same command continues its own folder (test_rerunning_continues)")
    folder = tmp_path / "held"
    shutil.copytree(made[held], folder)
    before = snapshot(folder)
    argv = writers(made["preset"], made["run"])[writer]
    code, _, err = cli(capsys, *argv, "--out", folder)
    assert code == 2, err
    line = err.strip().splitlines()
    assert len(line) == 1 and "Traceback" not in err, err
    assert f"already holds a {held}" in line[0] and "--overwrite" in line[0]
    assert snapshot(folder) == before


def test_compare_into_its_own_kind_names_resume(capsys, tmp_path, made):
    folder = tmp_path / "c"
    shutil.copytree(made["comparison"], folder)
    code, _, err = cli(capsys, "compare", *FLAGS, "--algorithms", "fedavg", "--out", folder)
    assert code == 2 and f"pflego compare --resume {folder}" in err


def test_rerunning_continues_and_another_preset_is_refused(capsys, tmp_path, made):
    folder = tmp_path / "r"
    shutil.copytree(made["reproduction"], folder)
    code, _, err = cli(capsys, "reproduce", made["preset"], "--quiet", "--out", folder)
    assert code == 0, err  # nothing to run: the reproduction is finished
    argv = ["reproduce", made["preset"], "--quiet", "--rounds", "1", "--out", tmp_path / "r1"]
    assert cli(capsys, *argv)[0] == 0
    code, _, err = cli(capsys, *argv)  # named "preset, set rounds=1": still preset's
    assert code == 0, err
    other = tmp_path / "other.yaml"
    other.write_text(yaml.safe_dump(PRESET))
    code, _, err = cli(capsys, "reproduce", other, "--quiet", "--out", folder)
    assert code == 2 and "holds a reproduction of preset, not of other" in err


@pytest.mark.parametrize(
    ("writer", "held", "gone", "written"),
    [
        ("reproduction", "comparison", "comparison.md", "report.md"),
        ("run", "comparison", "experiment.json", "metrics.jsonl"),
        ("comparison", "run", "checkpoint.pt", "comparison.md"),
        ("report", "reproduction", "experiment.json", "report.md"),
    ],
)
def test_overwrite_replaces_what_pflego_wrote_and_keeps_other_files(
    capsys, tmp_path, made, quick_figures, writer, held, gone, written
):
    folder = tmp_path / "held"
    shutil.copytree(made[held], folder)
    (folder / "notes.txt").write_text("mine")
    argv = writers(made["preset"], made["run"])[writer]
    code, _, err = cli(capsys, *argv, "--out", folder, "--overwrite")
    assert code == 0, err
    assert not (folder / gone).exists() and (folder / written).is_file()
    assert (folder / "notes.txt").read_text() == "mine"
    assert kind_of(folder) == writer
