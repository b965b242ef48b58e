"""A report's figures: ``report.png`` (curves against rounds) and, for a sweep, ``sweep.png``.

Every curve is the mean over seeds with a ± std band; the sweep figure puts each row's final
value against the sweep's values, with ± std error bars. Matplotlib is imported only when a
figure is drawn.
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import numpy as np

from pflego.experiments import measures as M
from pflego.experiments.presets import ALL
from pflego.experiments.report_rows import RowResult, rows_by_block
from pflego.experiments.report_tables import block_title, several_seeds, unit
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


#: A metric panel gets an inset of its last rounds when the rows' final values lie closer than
#: this (percentage points for accuracies), which a full-range axis cannot show.
CLOSE = 1.0


def plot_curves(plan: Plan, rows: list[RowResult], path: Path) -> Path:
    """Training loss and the metric against rounds: a column per block, with a ± std band over
    seeds where there are several, and an inset of the last rounds where the rows' final values
    differ by less than :data:`CLOSE`."""
    from pflego.plots import loss_axis, pyplot, round_axis

    plt = pyplot()

    by_block = rows_by_block(plan, rows)
    blocks = list(by_block)
    fig, axes = plt.subplots(2, len(blocks), figsize=(5 * len(blocks), 7), squeeze=False)
    for column, block in enumerate(blocks):
        ax_loss, ax_metric = axes[0, column], axes[1, column]
        losses: list[float] = []
        curves = []
        for row in by_block[block]:
            scale = 100.0 if M.is_accuracy(row.metric) else 1.0
            for ax, key, factor in ((ax_loss, "train_loss", 1.0), (ax_metric, row.metric, scale)):
                rounds, mean, std = mean_curve(row, key)
                if not rounds:
                    continue
                (line,) = ax.plot(rounds, factor * mean, label=row.marked)
                ax.fill_between(
                    rounds,
                    factor * (mean - std),
                    factor * (mean + std),
                    color=line.get_color(),
                    alpha=0.2,
                )
                if ax is ax_loss:
                    losses += list(mean)
                else:
                    curves.append((rounds, factor * mean, line.get_color(), row))
        metrics = sorted({r.metric for r in by_block[block]})
        loss_axis(ax_loss, losses)
        ax_loss.set(
            title=block_title(plan, block) if len(blocks) > 1 or block != ALL else "",
            xlabel="round",
            ylabel="training loss L(ψ)",
        )
        ax_metric.set(xlabel="round", ylabel=", ".join(f"{m}{unit(m)}" for m in metrics))
        for ax in (ax_loss, ax_metric):
            round_axis(ax)
            ax.grid(alpha=0.3)
            ax.legend(fontsize="small")
        close_inset(ax_metric, curves)
    title = plan.name + (": mean over seeds, band ± std" if several_seeds(rows) else "")
    fig.suptitle("\n".join(textwrap.wrap(title, 45 * len(blocks))))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def close_rows(rows: list[RowResult]) -> list[int]:
    """The indices of the rows whose final value lies within :data:`CLOSE` of another's."""
    finals = [r.stat("final")[0] * (100.0 if M.is_accuracy(r.metric) else 1.0) for r in rows]
    finite = [(i, v) for i, v in enumerate(finals) if math.isfinite(v)]
    return [i for i, a in finite if any(j != i and abs(a - b) < CLOSE for j, b in finite)]


def close_inset(ax, curves: list[tuple[list[int], np.ndarray, str, RowResult]]) -> None:
    """An inset of the evaluations that the final values average, for the rows whose final values
    lie within :data:`CLOSE` of each other (where the panel spans ten times more)."""
    near = close_rows([row for *_, row in curves])
    if not near:
        return
    last = max(max(rounds) for rounds, *_ in curves)
    windows = [s.window for i in near for s in curves[i][3].seeds if s.window]
    final_from = min((w[1] for w in windows), default=last)  # the final value's evaluations
    tail = [
        [(t, v) for t, v in zip(*curves[i][:2]) if t >= final_from and math.isfinite(v)]
        for i in near
    ]
    fitted = [v for points in tail for _, v in points]
    spread = max(fitted, default=0.0) - min(fitted, default=0.0)
    low, high = ax.get_ylim()
    if spread == 0 or high - low < 10 * spread:
        return
    inset = ax.inset_axes([0.45, 0.12, 0.5, 0.4])
    for i, points in zip(near, tail):
        inset.plot(*zip(*points), color=curves[i][2], marker="o")
    margin = max(0.5, 0.05 * last)
    inset.set(
        ylim=(min(fitted) - 0.2 * spread, max(fitted) + 0.2 * spread),
        xlim=(final_from - margin, last + margin),
        xticks=sorted({t for points in tail for t, _ in points}),
    )
    span = f"round {last}" if final_from == last else f"rounds {final_from}–{last}"
    inset.set_title(f"{span} (the final value's), zoomed", fontsize=8)
    inset.tick_params(labelsize=7)
    inset.grid(alpha=0.3)


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
