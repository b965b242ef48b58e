"""A report's figures: ``report.png`` (curves against rounds) and, for a sweep, ``sweep.png``.

Every curve is the mean over seeds with a ± std band; the sweep figure puts each row's final
value against the sweep's values, with ± std error bars. Matplotlib is imported only when a
figure is drawn.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from pflego.experiments import measures as M
from pflego.experiments.presets import ALL
from pflego.experiments.report_formatting import block_title, unit
from pflego.experiments.report_rows import RowResult, rows_by_block
from pflego.experiments.runs import Plan


def mean_curve(row: RowResult, key: str) -> tuple[list[int], np.ndarray, np.ndarray]:
    """Rounds every seed evaluated, and the mean and std of ``key`` over seeds there."""
    histories = [s.history for s in row.seeds if s.history is not None]
    if not histories:
        return [], np.array([]), np.array([])
    columns = [dict(zip(*h.column(key))) for h in histories]
    rounds = sorted(set.intersection(*(set(c) for c in columns)))
    values = np.array([[c[t] for t in rounds] for c in columns], dtype=np.float64)
    std = values.std(0, ddof=1) if len(values) > 1 else np.zeros(len(rounds))
    return rounds, values.mean(0), std


def plain_log_axis(ax) -> None:
    """Log-scale y with plain tick labels (0.1, 1): mathtext labels cost seconds per figure."""
    from matplotlib import ticker

    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(ticker.LogFormatter())
    ax.yaxis.set_minor_formatter(ticker.NullFormatter())


def plot_curves(plan: Plan, rows: list[RowResult], path: Path) -> Path:
    """Training loss and the metric against rounds: a column per block, mean ± std over seeds."""
    from pflego.plots import pyplot

    plt = pyplot()

    by_block = rows_by_block(plan, rows)
    blocks = list(by_block)
    fig, axes = plt.subplots(2, len(blocks), figsize=(5 * len(blocks), 7), squeeze=False)
    for column, block in enumerate(blocks):
        ax_loss, ax_metric = axes[0, column], axes[1, column]
        for row in by_block[block]:
            for ax, key, scale in (
                (ax_loss, "train_loss", 1.0),
                (ax_metric, row.metric, 100.0 if M.is_accuracy(row.metric) else 1.0),
            ):
                rounds, mean, std = mean_curve(row, key)
                if not rounds:
                    continue
                (line,) = ax.plot(rounds, scale * mean, label=row.marked)
                ax.fill_between(
                    rounds,
                    scale * (mean - std),
                    scale * (mean + std),
                    color=line.get_color(),
                    alpha=0.2,
                )
        metrics = sorted({r.metric for r in by_block[block]})
        plain_log_axis(ax_loss)
        ax_loss.set(
            title=block_title(plan, block) if len(blocks) > 1 or block != ALL else "",
            xlabel="round",
            ylabel="training loss L(ψ)",
        )
        ax_metric.set(xlabel="round", ylabel=", ".join(f"{m}{unit(m)}" for m in metrics))
        for ax in (ax_loss, ax_metric):
            ax.grid(alpha=0.3)
            ax.legend(fontsize="small")
    several = max((len(r.seeds) for r in rows), default=1) > 1
    fig.suptitle(plan.name + (": mean over seeds, band ± std" if several else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_sweep(plan: Plan, rows: list[RowResult], path: Path) -> Path:
    """The final metric against the sweep's values, a panel per block, error bars ± std."""
    from pflego.plots import pyplot

    plt = pyplot()

    key, values = plan.sweep
    by_block = rows_by_block(plan, rows)
    blocks = list(by_block)
    fig, axes = plt.subplots(1, len(blocks), figsize=(5 * len(blocks), 4), squeeze=False)
    for ax, block in zip(axes[0], blocks):
        for spec in plan.rows:
            series = [r for r in by_block[block] if r.name == spec["name"]]
            if not series:
                continue
            scale = 100.0 if M.is_accuracy(spec["metric"]) else 1.0
            stats = [r.stat("final") for r in series]
            ax.errorbar(
                [str(r.sweep) for r in series],
                [scale * m for m, _ in stats],
                yerr=[0 if math.isnan(s) else scale * s for _, s in stats],
                marker="o",
                capsize=3,
                label=spec["name"],
            )
        ax.set(
            title=block_title(plan, block) if block != ALL else "",
            xlabel=key,
            ylabel=f"{plan.metric}{unit(plan.metric)}, final value",
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
