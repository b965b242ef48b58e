"""Figures that read at any length (issue 39, finding 6): every axis has tick labels (a log axis
only where the values span a decade), rounds tick at whole numbers, a panel says "zoomed" only
where it cuts something off, and rows closer than a point get an inset. The figures are drawn for
real and saved under the test's folder."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

import pflego.plots
from pflego.experiments import report_figures
from pflego.experiments.report_rows import RowResult, SeedResult
from pflego.experiments.runs import Plan
from pflego.history import History


def history(name: str, losses: list[float], accuracies: list[float]) -> History:
    records = [
        {"round": t, "algorithm": name, "dataset": "tiny", "train_loss": loss, "test_acc": acc}
        | {"test_acc_p10": acc - 0.05}
        for t, (loss, acc) in enumerate(zip(losses, accuracies))
    ]
    return History(records)


def row(name: str, h: History) -> RowResult:
    result = RowResult("all", name, name, "test_acc", None, None)
    final = h.records[-1]["test_acc"]
    last = h.records[-1]["round"]
    result.seeds = [
        SeedResult(0, Path(name), "done", final=final, window=(1, last, last), history=h)
    ]
    return result


@pytest.fixture
def figures(monkeypatch) -> list:
    """Every figure saved from now on (drawn, so that its tick labels are set)."""
    figure = pflego.plots.pyplot().Figure
    seen: list = []
    real = figure.savefig

    def keep(self, *args, **kwargs):
        real(self, *args, **kwargs)
        seen.append(self)

    monkeypatch.setattr(figure, "savefig", keep)
    monkeypatch.setattr(pflego.plots.pyplot(), "close", lambda fig: None)
    return seen


def labels(axis) -> list[str]:
    ticks = axis.get_ticklabels() + axis.get_ticklabels(minor=True)
    low, high = sorted(axis.get_view_interval())
    return [
        t.get_text()
        for t in ticks
        if t.get_text() and low <= t.get_position()[axis is axis.axes.yaxis] <= high
    ]


def check_axes(fig) -> None:
    for ax in [*fig.axes, *(child for parent in fig.axes for child in parent.child_axes)]:
        assert labels(ax.yaxis), ax.get_ylabel()
        assert labels(ax.xaxis)
        low, high = sorted(ax.get_xlim())
        assert all(float(t).is_integer() for t in ax.get_xticks() if low <= t <= high)


#: Three short runs: losses within a decade, two final accuracies 0.07 points apart.
SHORT = {
    "fedavg": history("fedavg", [2.3, 1.9, 1.6], [0.10, 0.62, 0.7207]),
    "fedper": history("fedper", [2.3, 1.5, 1.2], [0.10, 0.64, 0.7200]),
    "local": history("local", [2.3, 2.0, 1.9], [0.10, 0.30, 0.40]),
}


def test_a_short_report_figure_reads(tmp_path, figures):
    plan = Plan(kind="compare", name="a comparison")
    rows = [row(name, h) for name, h in SHORT.items()]
    report_figures.plot_curves(plan, rows, tmp_path / "report.png")
    (fig,) = figures
    loss, metric = fig.axes
    assert loss.get_yscale() == "linear"  # 1.2 to 2.3: less than a decade
    check_axes(fig)
    assert fig._suptitle.get_text() == "a comparison"  # one seed: no "mean over seeds"
    (inset,) = metric.child_axes  # fedavg and fedper end 0.07 points apart
    low, high = inset.get_ylim()
    assert high - low < 1 and low < 72.0 < 72.07 < high


def test_a_loss_over_decades_is_log_with_labels(tmp_path, figures):
    runs = {"a": history("a", [2.3, 0.2, 0.01], [0.1, 0.5, 0.9]), "b": SHORT["local"]}
    pflego.plots.plot_histories(runs, tmp_path / "curves.png")
    (fig,) = figures
    assert fig.axes[0].get_yscale() == "log"
    check_axes(fig)


@pytest.mark.parametrize(
    ("runs", "zoomed"),
    [
        ({"a": history("a", [2.3, 2.2, 2.1], [0.7, 0.7, 0.7])}, False),  # nothing is cut off
        (SHORT, True),  # round 0's 10% lies below the second half's range
    ],
)
def test_zoomed_is_said_only_where_the_axis_cuts_values_off(tmp_path, figures, runs, zoomed):
    pflego.plots.plot_histories(runs, tmp_path / "curves.png")
    ax = figures[0].axes[1]
    low, high = ax.get_ylim()
    cut = any(not low <= y <= high for line in ax.get_lines() for y in line.get_ydata())
    assert cut == zoomed and ("zoomed" in ax.get_title() or "fitted" in ax.get_title()) == zoomed
    check_axes(figures[0])
    assert not math.isnan(low)
