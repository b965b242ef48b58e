"""Population statistics of an evaluation: per-client rows summarized over the clients (L(psi),
accuracy means, deciles, spread) and the participation gap between unseen and training clients."""

from __future__ import annotations

import numpy as np


def summarize(rows: list[dict[str, float]], prefix: str = "") -> dict[str, float]:
    """Population metrics from per-client rows, for the personalized model and every view.

    ``train_loss`` is L(psi) = sum_i alpha_i l_i with alpha_i = N_i / N over ALL clients,
    ``train_acc`` likewise weighted; ``test_acc`` is the unweighted mean over clients with test
    data, ``test_acc_weighted`` the mean weighted by test samples, ``test_acc_p10`` and
    ``test_acc_p90`` the bottom and top deciles of client accuracies (``np.percentile``'s linear
    interpolation), ``test_acc_std`` their standard deviation over clients (population, ddof 0);
    ``test_loss`` the mean over the test samples whose class the
    client trained on (``n_test_known``; the others count only as errors); ``val_*`` as
    ``test_*``. NaN (a diverged client) propagates
    into every mean it enters: no metric skips it. ``prefix`` names the population (``unseen_``).
    """
    col = lambda key: np.array([r[key] for r in rows], dtype=np.float64)  # noqa: E731
    n_train = col("n_train")
    alpha = n_train / n_train.sum()
    views = [k[len("test_acc") :] for k in rows[0] if k.startswith("test_acc")]
    out: dict[str, float] = {}
    for view in views:
        out[f"train_loss{view}"] = float(np.sum(alpha * col(f"train_loss{view}")))
        out[f"train_acc{view}"] = float(np.sum(alpha * col(f"train_acc{view}")))
        for split in ("val", "test"):
            if f"{split}_acc{view}" not in rows[0]:
                continue
            n = col(f"n_{split}")
            known = col(f"n_{split}_known") if f"n_{split}_known" in rows[0] else n
            has, scored = n > 0, known > 0
            acc, loss = col(f"{split}_acc{view}")[has], col(f"{split}_loss{view}")[scored]
            out[f"{split}_loss{view}"] = float(np.sum(known[scored] * loss) / known.sum())
            out[f"{split}_acc{view}"] = float(acc.mean())
            out[f"{split}_acc_weighted{view}"] = float(np.sum(n[has] * acc) / n.sum())
            out[f"{split}_acc_p10{view}"] = float(np.percentile(acc, 10))
            out[f"{split}_acc_p90{view}"] = float(np.percentile(acc, 90))
            out[f"{split}_acc_std{view}"] = float(acc.std())
    return {f"{prefix}{k}": v for k, v in out.items()}


def participation_gap(summary: dict[str, float]) -> dict[str, float]:
    """The participation gap (Yuan et al., ICLR 2022) of every view: the mean test accuracy of
    the clients that never trained minus that of the clients that trained,
    ``participation_gap{view} = unseen_test_acc{view} - test_acc{view}``."""
    prefix = "unseen_test_acc"
    views = [k[len(prefix) :] for k in summary if k.startswith(prefix)]
    return {  # a view's mean has a bottom decile beside it; a statistic (``_p10``...) has not
        f"participation_gap{view}": summary[f"{prefix}{view}"] - summary[f"test_acc{view}"]
        for view in views
        if f"{prefix}_p10{view}" in summary and f"test_acc{view}" in summary
    }
