"""Figures in the style of the papers: training loss and test accuracy against rounds."""

from __future__ import annotations

import math
from pathlib import Path

from pflego.errors import ConfigError
from pflego.history import History


def pyplot():
    """``matplotlib.pyplot`` with the file backend, imported on first use (it takes a second)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def round_axis(ax) -> None:
    """Rounds tick at whole numbers only."""
    from matplotlib import ticker

    ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))


def loss_axis(ax, values: list[float]) -> None:
    """A log-scale y axis where the positive ``values`` span a decade or more, labelled with plain
    numbers (mathtext labels cost seconds per figure); linear otherwise, where a log axis would
    show no tick label at all."""
    from matplotlib import ticker

    finite = [v for v in values if math.isfinite(v) and v > 0]
    if not finite or max(finite) < 10 * min(finite):
        return
    plain = ticker.FuncFormatter(lambda value, _: f"{value:g}")
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(plain)
    if max(finite) <= 100 * min(finite):  # up to two decades: 2 and 5 labelled between them
        ax.yaxis.set_minor_locator(ticker.LogLocator(subs=(2, 5)))
        ax.yaxis.set_minor_formatter(plain)
    else:
        ax.yaxis.set_minor_formatter(ticker.NullFormatter())


def default_title(histories: dict[str, History]) -> str:
    """``"<algorithms> on <datasets>"`` from the runs' records."""
    algorithms = dict.fromkeys(h.records[-1].get("algorithm", n) for n, h in histories.items())
    datasets = dict.fromkeys(h.records[-1].get("dataset", "?") for h in histories.values())
    return f"{', '.join(map(str, algorithms))} on {', '.join(map(str, datasets))}"


def accuracy_range(curves: list[tuple[list[int], list[float]]]) -> tuple[float, float] | None:
    """Y limits (percent) that fit each curve over the second half of its rounds.

    The first evaluations (round 0 is chance level) would otherwise squash the differences that
    matter, such as 92% against 97%.
    """
    values = [
        v
        for rounds, acc in curves
        if rounds and max(rounds) > 0
        for r, v in zip(rounds, acc)
        if r >= max(rounds) / 2 and math.isfinite(v)
    ]
    if not values:
        return None
    low, high = min(values), max(values)
    margin = max(0.5, 0.1 * (high - low))
    return max(0.0, low - margin), min(100.0, high + margin)


def plot_histories(
    histories: dict[str, History], path: str | Path, title: str | None = None
) -> Path:
    """One figure, two panels: the training loss L(psi) (log scale where it spans a decade), and
    the test accuracy of the mean client (solid) and of the bottom decile of clients (dashed),
    its y axis fitted to the second half of training."""
    plt = pyplot()
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4.2))
    curves, losses = [], []
    for label, history in histories.items():
        rounds, loss = history.column("train_loss")
        losses += loss
        (line,) = ax_loss.plot(rounds, loss, label=label)
        for key, style, name in (
            ("test_acc", "-", label),
            ("test_acc_p10", "--", f"{label}, bottom 10% of clients"),
        ):
            rounds, acc = history.column(key)
            if rounds:
                percent = [100 * a for a in acc]
                ax_acc.plot(rounds, percent, style, color=line.get_color(), label=name)
                curves.append((rounds, percent))
    ax_loss.set(xlabel="round", ylabel="training loss L(ψ)")
    loss_axis(ax_loss, losses)
    ax_acc.set(xlabel="round", ylabel="test accuracy (%)")
    limits = accuracy_range(curves)
    if limits:
        ax_acc.set_ylim(*limits)
        if any(
            math.isfinite(v) and not limits[0] <= v <= limits[1] for _, acc in curves for v in acc
        ):
            ax_acc.set_title("y axis fitted to the second half of the rounds", fontsize=9)
    for ax in (ax_loss, ax_acc):
        round_axis(ax)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title if title is not None else default_title(histories))
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as exc:
        raise ConfigError(
            f"cannot write {path} ({exc.strerror or exc}); choose a writable --out"
        ) from None
    finally:
        plt.close(fig)
    return Path(path)
