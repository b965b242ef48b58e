"""Reports of an experiment, built only from its manifest and its run directories.

Because nothing comes from memory, the report written at the end of an experiment and one rebuilt
later with ``pflego report`` are equal. The rows' numbers come from
:mod:`~pflego.experiments.report_rows`; ``report_markdown``, ``report_tables`` (with LaTeX and
CSV) and ``report_figures`` render them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pflego.config import read_yaml
from pflego.errors import ConfigError
from pflego.experiments import report_figures as figures
from pflego.experiments.presets import ALL
from pflego.experiments.report_markdown import render_markdown
from pflego.experiments.report_rows import RowResult, collect, rows_by_block
from pflego.experiments.report_tables import (
    block_title,
    main_table,
    md_table,
    render_csv,
    render_latex,
    window_text,
    windows,
)
from pflego.experiments.runs import MANIFEST, Plan, PlannedRun, read_manifest

FORMATS = ("md", "csv", "latex")
#: Settings never shown as differences between rows (bookkeeping, not the experiment).
BOOKKEEPING = (
    "algorithm",
    "seed",
    "out",
    "data_dir",
    "device",
    "chunk_size",
    "checkpoint_every",
    "divergence",
)


@dataclass
class Report:
    """An experiment's numbers and their renderings."""

    plan: Plan
    rows: list[RowResult]
    target_acc: float | None

    def markdown(self) -> str:
        return render_markdown(self.plan, self.rows, self.target_acc)

    def csv(self) -> str:
        return render_csv(self.rows, self.target_acc)

    def latex(self) -> str:
        return render_latex(self.plan, self.rows)

    def summary(self) -> str:
        """The main table of each block, for the console."""
        lines = []
        for block, block_rows in rows_by_block(self.plan, self.rows).items():
            if list(self.plan.blocks) != [ALL]:
                lines += ["", f"{block_title(self.plan, block)}:"]
            lines += md_table(*main_table(block_rows, bool(self.plan.paper_results)), align="r")
        spans = windows(self.rows)
        if len(spans) == 1:
            lines.append(f"(final value: {window_text(spans.pop())}, round 0 never included)")
        return "\n".join(lines).strip("\n")

    def unfinished(self) -> list[str]:
        """The rows some of whose runs did not finish (diverged, failed, stopped), marked so."""
        return [row.marked for row in self.rows if row.marked != row.label]

    def text(self, fmt_: str) -> str:
        """The report in one of :data:`FORMATS`."""
        return {"md": self.markdown, "csv": self.csv, "latex": self.latex}[fmt_]()


def build_report(root: Path, plan: Plan | None = None, target_acc: float | None = None) -> Report:
    """The report of the experiment at ``root`` (its ``experiment.json`` unless ``plan`` is given)."""
    plan = plan or read_manifest(root)
    target = target_acc if target_acc is not None else plan.target_acc
    return Report(plan, collect(plan, root, target), target)


def write_report(
    root: Path,
    plan: Plan | None = None,
    target_acc: float | None = None,
    out: Path | None = None,
    stem: str = "report",
    latex: bool = False,
) -> Report:
    """Build the report of the experiment at ``root`` and write its files under ``out``.

    Writes ``<stem>.md``, ``<stem>.csv``, ``<stem>.png`` (curves) and, for a sweep, ``sweep.png``;
    ``<stem>.tex`` with ``latex``. ``out`` defaults to ``root``.
    """
    report = build_report(root, plan, target_acc)
    out = out or root
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.md").write_text(report.markdown())
    (out / f"{stem}.csv").write_text(report.csv())
    if latex:
        (out / f"{stem}.tex").write_text(report.latex())
    if any(s.history for r in report.rows for s in r.seeds):
        figures.plot_curves(report.plan, report.rows, out / f"{stem}.png")
        if report.plan.sweep:
            figures.plot_sweep(report.plan, report.rows, out / "sweep.png")
    return report


def plan_from_directories(paths: list[Path]) -> tuple[Plan, Path]:
    """A plan for existing directories: one experiment directory, or run directories.

    Run directories (found recursively) that differ only in their seed form one row, named by
    the algorithm and, where two rows share one, by the settings that tell them apart.

    Returns:
        The plan and the root its run directories are relative to.
    """
    if len(paths) == 1 and (paths[0] / MANIFEST).is_file():
        return read_manifest(paths[0]), paths[0]
    runs = [run for path in paths for run in run_directories(path)]
    configs = [read_yaml(p / "config.yaml") for p in runs]
    groups: dict[str, list[int]] = {}
    for i, config in enumerate(configs):
        groups.setdefault(_row_key(config), []).append(i)
    planned, rows = [], []
    for members in groups.values():
        config = configs[members[0]]
        name = _row_name(config, [configs[g[0]] for g in groups.values()])
        rows.append(
            {"name": name, "algorithm": config["algorithm"], "metric": "test_acc", "runs_as": name}
        )
        planned += [
            PlannedRun(ALL, name, int(configs[i]["seed"]), None, str(runs[i].resolve()), configs[i])
            for i in members
        ]
    plan = Plan(
        kind="runs",
        name="runs",
        description=f"{len(runs)} run director{'y' if len(runs) == 1 else 'ies'}",
        rows=rows,
        seeds=sorted({r.seed for r in planned}),
        runs=planned,
    )
    return plan, Path("/")


def run_directories(path: Path) -> list[Path]:
    """``path`` itself if it is a run directory, else the run directories below it."""
    if not path.is_dir():
        raise ConfigError(f"{path} is not a directory")
    if (path / "metrics.jsonl").is_file():
        return [path]
    found = sorted(p.parent for p in path.rglob("metrics.jsonl"))
    if not found:
        raise ConfigError(f"{path} holds no run (no metrics.jsonl); is it a pflego run directory?")
    return found


def _row_key(config: dict[str, Any]) -> str:
    """Everything but the seed (and bookkeeping): runs equal in it form one row."""
    return repr(
        sorted((k, v) for k, v in config.items() if k not in BOOKKEEPING or k == "algorithm")
    )


def _row_name(config: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """The row's algorithm, with the settings that tell it from the other ``rows`` (one config
    a row) of the same algorithm."""
    twins = [other for other in rows if other["algorithm"] == config["algorithm"]]
    if len(twins) == 1:
        return config["algorithm"]
    differing = sorted(
        k
        for k in config
        if k not in BOOKKEEPING and any(other.get(k) != config.get(k) for other in twins)
    )
    return config["algorithm"] + " (" + ", ".join(f"{k}={config[k]}" for k in differing) + ")"
