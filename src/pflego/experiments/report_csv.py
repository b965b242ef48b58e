"""``report.csv``: one line per report row, accuracies as fractions (as in ``metrics.jsonl``).

The same numbers as ``report.md`` unrounded (six significant digits), for other tools: the mean,
std and per-seed final values, the paper's number and the difference, the more measures (the
top decile, the standard deviation over clients, the participation gap...), the
final window, the costs per round and each seed's status.
"""

from __future__ import annotations

import csv
import io
import math

import numpy as np

from pflego.experiments import measures as M
from pflego.experiments.report_rows import RowResult

CSV_COLUMNS = [
    "block",
    "row",
    "algorithm",
    "sweep",
    "metric",
    "seeds",
    "mean",
    "std",
    "per_seed",
    "paper",
    "paper_std",
    "difference",
    "p10_mean",
    "p90_mean",
    "client_std_mean",
    "participation_gap_mean",
    "weighted_mean",
    "train_loss_mean",
    "window_evaluations",
    "window_first_round",
    "window_last_round",
    "seconds_mean",
    "best_val_rounds",
    "at_best_val_mean",
    "rounds_to_target",
    "gain_over_local_mean",
    "gain_over_local_std",
    "bytes_up_per_round",
    "bytes_down_per_round",
    "client_flops_per_round",
    "status",
]


def render_csv(rows: list[RowResult], target_acc: float | None) -> str:
    """``report.csv``: one line per report row; accuracies as fractions, as in metrics.jsonl."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, CSV_COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(csv_row(row, target_acc) for row in rows)
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
