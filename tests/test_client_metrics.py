"""The population statistics of per-client accuracies in every evaluation record, checked against
values worked out by hand (float64), not against numpy."""

from __future__ import annotations

import math

import pytest

from pflego.sim.summary import participation_gap, summarize


def row(test_acc: float, n_test: int, global_acc: float) -> dict[str, float]:
    return {
        "n_train": 3, "n_test": n_test, "train_loss": 1.0, "train_acc": 0.5,
        "test_loss": 0.7, "test_acc": test_acc,
        "train_loss_global": 1.0, "train_acc_global": 0.5,
        "test_loss_global": 0.7, "test_acc_global": global_acc,
    }  # fmt: skip


ROWS = [  # the last client has no test sample: it enters no accuracy statistic
    row(0.9, 4, 0.1),
    row(0.2, 2, 0.1),
    row(0.5, 5, 0.3),
    row(0.4, 1, 0.5),
    row(1.0, 0, 1.0),
]


def test_top_decile_and_std_over_clients_with_test_data():
    summary = summarize(ROWS)
    # sorted accuracies 0.2 0.4 0.5 0.9: p90 at position 0.9 * 3 = 2.7 -> 0.5 + 0.7 * 0.4;
    # p10 at 0.3 -> 0.2 + 0.3 * 0.2; std of deviations -0.3 -0.1 0 0.4 from the mean 0.5
    assert summary["test_acc_p90"] == pytest.approx(0.78, abs=1e-12)
    assert summary["test_acc_p10"] == pytest.approx(0.26, abs=1e-12)
    assert summary["test_acc_std"] == pytest.approx(math.sqrt(0.26 / 4), abs=1e-12)
    # the global view: 0.1 0.1 0.3 0.5, mean 0.25, p90 at 2.7 -> 0.3 + 0.7 * 0.2
    assert summary["test_acc_p90_global"] == pytest.approx(0.44, abs=1e-12)
    assert summary["test_acc_std_global"] == pytest.approx(
        math.sqrt((0.15**2 * 2 + 0.05**2 + 0.25**2) / 4), abs=1e-12
    )


def test_participation_gap_is_unseen_minus_trained_mean_of_every_view():
    trained, unseen = summarize(ROWS), summarize(ROWS[1:], "unseen_")
    gaps = participation_gap(trained | unseen)
    assert gaps == {
        "participation_gap": unseen["unseen_test_acc"] - trained["test_acc"],
        "participation_gap_global": unseen["unseen_test_acc_global"] - trained["test_acc_global"],
    }
    assert participation_gap(trained) == {}  # no unseen clients, no gap
