"""A report's tables, cell by cell: the main table, more measures and the per-seed values.

Each function returns a header and rows of cells (strings) for one block's report rows;
``report.md`` and the console summary write them as Markdown tables, :func:`render_latex` as one
LaTeX ``tabular`` (``report.tex``).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from pflego.experiments import measures as M
from pflego.experiments.presets import ALL
from pflego.experiments.report_formatting import (
    block_title,
    fmt,
    fmt_stat,
    paper_text,
    seeds_text,
    unit,
)
from pflego.experiments.report_rows import RowResult, logged, rows_by_block
from pflego.experiments.runs import Plan
from pflego.experiments.seeds import mean_std


def main_table(rows: list[RowResult], has_paper: bool) -> tuple[list[str], list[list[str]]]:
    """Header and cells of a block's main table."""
    metrics = {r.metric for r in rows}
    metric = metrics.pop() if len(metrics) == 1 else None
    label = f"{metric}{unit(metric)}" if metric else "metric"
    header = ["algorithm"]
    if has_paper:
        header.append(f"paper{unit(metric) if metric else ''}")
    header.append(f"ours: {label}, {seeds_text(rows)}")
    if has_paper:
        header.append("difference" + (" (pp)" if metric and M.is_accuracy(metric) else ""))
    header += [
        "bottom decile" + (unit(metric) if metric else ""),
        "sample-weighted" + (unit(metric) if metric else ""),
        "training loss L(ψ)",
        "rounds",
        "training time (s)",
    ]
    cells = []
    for row in rows:
        mean, std = row.stat("final")
        name = row.marked if metric else f"{row.marked} [{row.metric}]"
        line = [name]
        if has_paper:
            line.append(paper_text(row.paper, row.paper_std))
        line.append(fmt_stat(mean, std, row.metric))
        if has_paper:
            line.append(fmt(row.difference(), row.metric, signed=True))
        line += [
            fmt_stat(*row.stat("p10"), row.metric),
            fmt_stat(*row.stat("weighted"), row.metric),
            fmt(row.stat("train_loss")[0], "train_loss"),
            "/".join(sorted({str(s.last_round) for s in row.seeds})),
            f"{row.stat('seconds')[0]:.1f}",
        ]
        cells.append(line)
    return header, cells


def ranking_table(rows: list[RowResult]) -> tuple[list[str], list[list[str]]]:
    """A leaderboard: the rows ranked by their final metric (best first), with the bottom decile,
    the training seconds per round and the megabytes a round moves (uploads + downloads)."""
    metric = rows[0].metric if len({r.metric for r in rows}) == 1 else None
    label = f"{metric}{unit(metric)}" if metric else "metric"
    scored = [(row, row.stat("final")[0]) for row in rows]
    scored.sort(key=lambda item: -np.inf if np.isnan(item[1]) else item[1], reverse=True)
    decile = "bottom decile" + (unit(metric) if metric else "")
    header = ["rank", "algorithm", label, decile, "training s per round", "MB per round"]
    cells = []
    for rank, (row, _) in enumerate(scored, start=1):
        rounds = max((s.last_round for s in row.seeds), default=0)
        moved = [row.cost(k) for k in ("bytes_up_per_round", "bytes_down_per_round")]
        cells.append(
            [
                str(rank),
                row.marked if metric else f"{row.marked} [{row.metric}]",
                fmt_stat(*row.stat("final"), row.metric),
                fmt_stat(*row.stat("p10"), row.metric),
                f"{row.stat('seconds')[0] / rounds:.3g}" if rounds else "—",
                "—" if None in moved else f"{sum(moved) / 1e6:.3g}",
            ]
        )
    return header, cells


#: The costs per round the more-measures table gives, with their scale (MB, GFLOP).
COSTS = (
    ("bytes_up_per_round", 1e6),
    ("bytes_down_per_round", 1e6),
    ("client_flops_per_round", 1e9),
)


def best_validation_cell(row: RowResult) -> str:
    """The test value at the best-validation round (mean over seeds) and the rounds chosen."""
    picks = row.best_validations()
    if not picks:
        return "—"
    mean, std = mean_std([v for _, v in picks])
    return f"{fmt_stat(mean, std, row.metric)} (round {', '.join(str(r) for r, _ in picks)})"


def target_cell(row: RowResult) -> str:
    """The rounds to the target (mean over the seeds that reach it)."""
    reached = row.reached()
    if not reached:
        return "not reached"
    text = f"{np.mean(reached):.0f}"
    if len(reached) < len(row.seeds):
        text += f" ({len(reached)} of {len(row.seeds)} seeds)"
    return text


def gain_cell(row: RowResult) -> str:
    gain = row.gain()
    return "—" if gain is None else f"{100 * gain[0]:+.2f} ± {100 * gain[1]:.2f}"


def cost_cells(row: RowResult) -> list[str]:
    costs = [(row.cost(key), scale) for key, scale in COSTS]
    return ["—" if cost is None else f"{cost / scale:.3g}" for cost, scale in costs]


def spread_columns(rows: list[RowResult]) -> list[tuple[bool, list[str], Callable]]:
    """The columns of the spread over clients and of the participation gap: (shown, names,
    cells of a row); shown where some run logged them."""
    return [
        (
            logged(rows, "p90"),
            ["top decile (%)", "std over clients (pp)"],
            lambda r: [fmt_stat(*r.stat(attr), r.metric) for attr in ("p90", "client_std")],
        ),
        (
            logged(rows, "gap"),
            ["participation gap (pp): unseen − trained"],
            lambda r: [fmt_stat(*r.stat("gap"), "participation_gap")],
        ),
    ]


def measures_table(
    rows: list[RowResult], target_acc: float | None
) -> tuple[list[str], list[list[str]]] | None:
    """More measures: the top decile and the standard deviation over clients, the participation
    gap, best-validation round, rounds to target, gain over local, costs."""
    has_val = any(s.best_val for r in rows for s in r.seeds)
    has_gain = any(s.gain for r in rows for s in r.seeds)
    has_costs = any(s.costs for r in rows for s in r.seeds)
    columns = spread_columns(rows) + [
        (
            has_val,
            ["test value at the best-validation round (%)"],
            lambda r: [best_validation_cell(r)],
        ),
        (
            target_acc is not None,
            [f"rounds to {100 * (target_acc or 0):g}%"],
            lambda r: [target_cell(r)],
        ),
        (has_gain, ["gain over local (pp), mean ± std over clients"], lambda r: [gain_cell(r)]),
        (has_costs, ["MB up per round", "MB down per round", "client GFLOP per round"], cost_cells),
    ]
    shown = [(names, cells) for on, names, cells in columns if on]
    if not shown:
        return None
    header = ["algorithm"] + [name for names, _ in shown for name in names]
    return header, [[row.marked] + [c for _, cells in shown for c in cells(row)] for row in rows]


def seed_table(rows: list[RowResult]) -> tuple[list[str], list[list[str]]]:
    seeds = sorted({s.seed for r in rows for s in r.seeds})
    header = ["algorithm"] + [f"seed {s}" for s in seeds]
    cells = []
    for row in rows:
        by_seed = {s.seed: s for s in row.seeds}
        line = [row.label]
        for seed in seeds:
            s = by_seed.get(seed)
            if s is None:
                line.append("")
                continue
            text = fmt(s.final, row.metric)
            if s.status != "done":
                text = f"{text} ({s.status})"
            line.append(text)
        cells.append(line)
    return header, cells


LATEX_ESCAPES = (("%", r"\%"), ("_", r"\_"), ("±", r"$\pm$"), ("ψ", r"$\psi$"), ("—", "--"))


def render_latex(plan: Plan, rows: list[RowResult]) -> str:
    """The main tables as one LaTeX ``tabular`` (booktabs), a block per ``\\midrule`` section."""
    has_paper = bool(plan.paper_results)
    header, _ = main_table(rows, has_paper)

    def esc(text: str) -> str:
        for old, new in LATEX_ESCAPES:
            text = str(text).replace(old, new)
        return text

    lines = [r"\begin{tabular}{l" + "r" * (len(header) - 1) + "}", r"\toprule"]
    lines.append(" & ".join(esc(h) for h in header) + r" \\")
    for block, block_rows in rows_by_block(plan, rows).items():
        lines.append(r"\midrule")
        if list(plan.blocks) != [ALL]:
            lines.append(
                rf"\multicolumn{{{len(header)}}}{{l}}{{\textit{{{esc(block_title(plan, block))}}}}} \\"
            )
        for cells in main_table(block_rows, has_paper)[1]:
            lines.append(" & ".join(esc(c) for c in cells) + r" \\")
    lines += [r"\bottomrule", r"\end{tabular}"]
    return "\n".join(lines) + "\n"
