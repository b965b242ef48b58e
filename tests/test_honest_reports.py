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
