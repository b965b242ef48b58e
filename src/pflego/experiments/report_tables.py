"""A report's numbers as text: formatting, the tables cell by cell, LaTeX and ``report.csv``.

Accuracies in percent with two decimals, other metrics with four, ``—`` for a missing value;
mean ± std; the paper's numbers as it prints them. Each table function returns a header and rows
of cells (strings) for one block's report rows; ``report.md`` and the console summary write them
as Markdown tables, :func:`render_latex` as one LaTeX ``tabular`` (``report.tex``).
``report.csv`` (:func:`render_csv`) holds the same numbers unrounded (six significant digits),
accuracies as fractions as in ``metrics.jsonl``, for other tools.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Callable

import numpy as np

from pflego.experiments import measures as M
from pflego.experiments.presets import ALL, point_label
from pflego.experiments.report_rows import RowResult, logged, rows_by_block
from pflego.experiments.runs import Plan
from pflego.experiments.seeds import mean_std


def fmt(value: float | None, metric: str, signed: bool = False) -> str:
    """A metric for a table: accuracies in percent with two decimals, others with four."""
    if value is None or math.isnan(value):
        return "—"
    scaled = 100 * value if M.is_accuracy(metric) else value
    spec = "+.2f" if signed else ".2f"
    return format(scaled, spec if M.is_accuracy(metric) else spec.replace("2", "4"))


def fmt_stat(mean: float, std: float, metric: str) -> str:
    if math.isnan(std):
        return fmt(mean, metric)
    return f"{fmt(mean, metric)} ± {fmt(std, metric)}"


def unit(metric: str | None) -> str:
    return " (%)" if metric and M.is_accuracy(metric) else ""


def paper_text(value: float | None, std: float | None = None) -> str:
    """The paper's number as it reports it (percent for accuracies), with its ± when given."""
    if value is None:
        return "—"
    return f"{value:.2f}" + ("" if std is None else f" ± {std:.2f}")


def md_table(header: list[str], lines: list[list[str]], align: str = "l") -> list[str]:
    rule = ["---"] + ["---:" if align == "r" else "---"] * (len(header) - 1)
    out = ["| " + " | ".join(header) + " |", "|" + "|".join(rule) + "|"]
    out += ["| " + " | ".join(line) + " |" for line in lines]
    return out


def windows(rows: list[RowResult]) -> set[tuple[int, int, int]]:
    return {s.window for r in rows for s in r.seeds if s.window}


def window_text(window: tuple[int, int, int]) -> str:
    count, first, last = window
    span = f"round {first}" if first == last else f"rounds {first}–{last}"
    return f"mean of the last {count} evaluation{'s' if count > 1 else ''} ({span})"


def several_seeds(rows: list[RowResult]) -> bool:
    """Whether some row ran with more than one seed (else no ± and no "mean over seeds")."""
    return max((len(r.seeds) for r in rows), default=1) > 1


def seeds_text(rows: list[RowResult]) -> str:
    n = max((len(r.seeds) for r in rows), default=0)
    return "1 seed" if n == 1 else f"mean ± std over {n} seeds"


def block_title(plan: Plan, block: str) -> str:
    overrides = plan.blocks.get(block) or {}
    return f"{block} ({point_label(overrides)})" if overrides else block


def shared_metric(rows: list[RowResult]) -> tuple[str | None, str]:
    """The metric every row reports (``None`` if they differ), and its column's label."""
    metrics = {r.metric for r in rows}
    metric = metrics.pop() if len(metrics) == 1 else None
    return metric, f"{metric}{unit(metric)}" if metric else "metric"


def row_name(row: RowResult, metric: str | None) -> str:
    """The row's label, naming its metric where the rows' metrics differ (``metric`` ``None``)."""
    return row.marked if metric else f"{row.marked} [{row.metric}]"


def main_table(rows: list[RowResult], has_paper: bool) -> tuple[list[str], list[list[str]]]:
    """Header and cells of a block's main table."""
    metric, label = shared_metric(rows)
    header = ["algorithm"]
    if has_paper:
        header.append(f"paper{unit(metric)}")
    header.append(f"ours: {label}, {seeds_text(rows)}")
    if has_paper:
        header.append("difference" + (" (pp)" if unit(metric) else ""))
    header += [
        "bottom decile" + unit(metric),
        "sample-weighted" + unit(metric),
        "training loss L(ψ)",
        "rounds",
        "training time (s)",
    ]
    cells = []
    for row in rows:
        line = [row_name(row, metric)]
        if has_paper:
            line.append(paper_text(row.paper, row.paper_std))
        line.append(fmt_stat(*row.stat("final"), row.metric))
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
    metric, label = shared_metric(rows)
    scored = [(row, row.stat("final")[0]) for row in rows]
    scored.sort(key=lambda item: -np.inf if np.isnan(item[1]) else item[1], reverse=True)
    decile = "bottom decile" + unit(metric)
    header = ["rank", "algorithm", label, decile, "training s per round", "MB per round"]
    cells = []
    for rank, (row, _) in enumerate(scored, start=1):
        rounds = max((s.last_round for s in row.seeds), default=0)
        moved = [row.cost(k) for k in ("bytes_up_per_round", "bytes_down_per_round")]
        cells.append(
            [
                str(rank),
                row_name(row, metric),
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


def render_csv(rows: list[RowResult], target_acc: float | None) -> str:
    """``report.csv``: one line per report row (the columns of :func:`csv_row`, in its order)."""
    lines = [csv_row(row, target_acc) for row in rows]
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, list(lines[0]) if lines else [], lineterminator="\n")
    writer.writeheader()
    writer.writerows(lines)
    return buffer.getvalue()


def _number(value: float | None) -> str:
    """Six significant digits, or empty for a missing value (``None`` or NaN)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return f"{value:.6g}"


def csv_row(row: RowResult, target_acc: float | None) -> dict[str, object]:
    """One report row's line of ``report.csv``."""
    g = _number
    mean, std = row.stat("final")
    scale = 100 if M.is_accuracy(row.metric) else 1
    window = next((s.window for s in row.seeds if s.window), None) or ("", "", "")
    picks = row.best_validations()
    reached = row.reached() if target_acc is not None else []
    gain_mean, gain_std = row.gain() or (None, None)
    return {
        "block": row.block,
        "row": row.name,
        "algorithm": row.algorithm,
        "sweep": row.sweep_label,
        "metric": row.metric,
        "seeds": ";".join(str(s.seed) for s in row.seeds),
        "mean": g(mean),
        "std": g(std),
        "per_seed": ";".join(g(s.final) for s in row.seeds),
        "paper": g(row.paper_fraction),
        "paper_std": g(None if row.paper_std is None else row.paper_std / scale),
        "difference": g(row.difference()),
        "p10_mean": g(row.stat("p10")[0]),
        "p90_mean": g(row.stat("p90")[0]),
        "client_std_mean": g(row.stat("client_std")[0]),
        "participation_gap_mean": g(row.stat("gap")[0]),
        "weighted_mean": g(row.stat("weighted")[0]),
        "train_loss_mean": g(row.stat("train_loss")[0]),
        "window_evaluations": window[0],
        "window_first_round": window[1],
        "window_last_round": window[2],
        "seconds_mean": g(row.stat("seconds")[0]),
        "best_val_rounds": ";".join(str(r) for r, _ in picks),
        "at_best_val_mean": g(float(np.mean([v for _, v in picks])) if picks else None),
        "rounds_to_target": g(float(np.mean(reached)) if reached else None),
        "gain_over_local_mean": g(gain_mean),
        "gain_over_local_std": g(gain_std),
        "bytes_up_per_round": g(row.cost("bytes_up_per_round")),
        "bytes_down_per_round": g(row.cost("bytes_down_per_round")),
        "client_flops_per_round": g(row.cost("client_flops_per_round")),
        "status": ";".join(s.status for s in row.seeds),
    }
