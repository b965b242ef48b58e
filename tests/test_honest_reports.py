"""Reports that say what ran and what failed (issue 39, findings 2, 3 and 6): a failed or diverged
run is marked in every table and legend and makes the command exit 1, serial and parallel alike,
with its warnings on stderr; a custom comparison is not labelled as a preset; the figures read at
any length."""

from __future__ import annotations

import pytest
import yaml

import pflego.plots
from pflego.cli import main

FLAGS = [
    "--clients", "6", "--participation", "0.5", "--rounds", "4", "--inner-steps", "2",
    "--eval-every", "1", "--quiet",
]  # fmt: skip


def cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture
def legends(monkeypatch) -> list[list[str]]:
    """The legend entries of every figure saved from now on, one list per figure."""
    figure = pflego.plots.pyplot().Figure
    seen: list[list[str]] = []
    real = figure.savefig

    def spy(self, *args, **kwargs):
        seen.append(
            [
                t.get_text()
                for ax in self.axes
                if ax.get_legend()
                for t in ax.get_legend().get_texts()
            ]
        )
        return real(self, *args, **kwargs)

    monkeypatch.setattr(figure, "savefig", spy)
    return seen


@pytest.mark.parametrize(
    ("jobs", "dataset"),
    [
        ("1", "tiny"),
        # spawned workers do not see the suite's registered datasets: built-in offline data
        pytest.param("2", "synthetic", marks=pytest.mark.slow),
    ],
)
def test_a_diverged_run_is_marked_everywhere_and_exits_1(capsys, tmp_path, legends, jobs, dataset):
    source = tmp_path / "cmp.yaml"
    rows = {"fedavg": {"client_lr": 1e6}, "pflego": {}}
    source.write_text(yaml.safe_dump({"settings": {}, "algorithms": rows}))
    out = tmp_path / "c"
    code, stdout, err = cli(
        capsys,
        "compare",
        *FLAGS,
        "--config",
        source,
        "--out",
        out,
        "--jobs",
        jobs,
        "--dataset",
        dataset,
    )
    assert code == 1, err
    assert "warning" not in stdout and "fedavg (diverged)" in err
    assert "| fedavg (diverged) |" in stdout and "| pflego |" in stdout
    main_table = (out / "comparison.md").read_text().split("\n\n")
    assert any("| fedavg (diverged) | " in part and "| pflego | " in part for part in main_table)
    assert any("fedavg (diverged)" in entries for entries in legends[-1:])
    code, latex, _ = cli(capsys, "report", out, "--format", "latex", "--out", tmp_path / "r")
    assert code == 0 and r"fedavg (diverged) &" in latex


@pytest.fixture
def titles(monkeypatch) -> list[str]:
    """The title of every figure saved from now on."""
    figure = pflego.plots.pyplot().Figure
    seen: list[str] = []
    real = figure.savefig

    def spy(self, *args, **kwargs):
        seen.append(" ".join(self._suptitle.get_text().split()) if self._suptitle else "")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(figure, "savefig", spy)
    return seen


def test_a_custom_comparison_is_labelled_by_what_ran(capsys, tmp_path, titles):
    out = tmp_path / "c"
    argv = ["compare", *FLAGS, "--dataset", "tiny", "--algorithms", "fedavg,pflego"]
    code, _, err = cli(capsys, *argv, "--rounds", "2", "--out", out)
    assert code == 0, err
    text = (out / "comparison.md").read_text()
    heading = text.splitlines()[0]
    assert heading.startswith("# compare: fedavg, pflego on tiny, 6 clients, 2 rounds: main's")
    assert "dataset=tiny" in heading and "The main experiment" not in text
    assert titles[-1] == heading[2 : heading.index(": main's")]  # one seed: no "over seeds"
    assert "±" not in text and "over seeds" not in text


def test_a_preset_is_named_only_when_it_ran_unchanged(capsys, tmp_path, titles):
    preset = tmp_path / "mine.yaml"
    settings = {"dataset": "tiny", "clients": 6, "classes_per_client": 2, "rounds": 2}
    values = {"description": "my experiment", "settings": settings, "algorithms": {"fedavg": {}}}
    preset.write_text(yaml.safe_dump(values))
    code, _, err = cli(capsys, "compare", "--config", preset, "--quiet", "--out", tmp_path / "a")
    assert code == 0, err
    assert (tmp_path / "a" / "comparison.md").read_text().startswith("# mine: my experiment\n")
    code, _, err = cli(capsys, "reproduce", preset, "--quiet", "--out", tmp_path / "b")
    assert code == 0, err
    assert (tmp_path / "b" / "report.md").read_text().startswith("# mine: my experiment\n")
    argv = ["reproduce", preset, "--quiet", "--rounds", "1", "--seeds", "2"]
    code, _, err = cli(capsys, *argv, "--out", tmp_path / "r")
    assert code == 0, err
    text = (tmp_path / "r" / "report.md").read_text()
    assert text.startswith("# mine, set rounds=1: not the preset as published: set rounds=1\n")
    assert "my experiment" not in text and "± is the sample standard deviation" in text
    assert titles[-1] == "mine, set rounds=1: mean over seeds, band ± std"
