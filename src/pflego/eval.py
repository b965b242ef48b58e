"""Evaluation of every client's personalized model: L(psi) and test accuracy statistics."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

from pflego.algorithms import Algorithm
from pflego.data import FederatedData
from pflego.local import masked_cross_entropy
from pflego.sim.clients import label_mask
from pflego.tree import Params
from pflego.types import ClientState


def _loss_and_correct(
    algorithm: Algorithm, downlink: Params, state: ClientState, x: Tensor, y: Tensor, lmask: Tensor
) -> tuple[float, float]:
    if len(y) == 0:
        return float("nan"), float("nan")
    logits = algorithm.predict(downlink, state, x)
    logits = torch.where(lmask > 0, logits, torch.finfo(logits.dtype).min)
    loss = masked_cross_entropy(logits, y, torch.ones_like(y, dtype=logits.dtype))
    return float(loss), float((logits.argmax(-1) == y).to(torch.float64).mean())


@torch.no_grad()
def evaluate(
    algorithm: Algorithm,
    downlink: Params,
    client_state: Callable[[int], ClientState],
    data: FederatedData,
    dtype: torch.dtype,
) -> tuple[dict[str, float], list[dict[str, float]]]:
    """Evaluate every client's personalized model on its train and test data.

    Returns:
        Summary metrics (``train_loss`` is L(psi) = sum_i alpha_i l_i over ALL clients;
        ``test_acc`` the unweighted mean over clients, ``test_acc_weighted`` weighted by test size,
        ``test_acc_p10`` the bottom decile of client accuracies) and one row per client.
    """
    local = algorithm.label_space == "local"
    rows = []
    for i in range(data.num_clients):
        state, lmask = client_state(i), label_mask(data, i, algorithm.label_space, dtype)
        tr, te = data.train_slice(i), data.test_slice(i)
        y_tr = (data.y_train_local if local else data.y_train)[tr]
        y_te = (data.y_test_local if local else data.y_test)[te]
        train_loss, train_acc = _loss_and_correct(
            algorithm, downlink, state, data.inputs(data.x_train[tr]).to(dtype), y_tr, lmask
        )
        test_loss, test_acc = _loss_and_correct(
            algorithm, downlink, state, data.inputs(data.x_test[te]).to(dtype), y_te, lmask
        )
        rows.append(
            {
                "client": i,
                "n_train": len(y_tr),
                "n_test": len(y_te),
                "train_loss": train_loss,
                "train_acc": train_acc,
                "test_loss": test_loss,
                "test_acc": test_acc,
            }
        )
    return summarize(rows), rows


def summarize(rows: list[dict[str, float]]) -> dict[str, float]:
    """Population metrics from per-client rows."""
    n_train = np.array([r["n_train"] for r in rows], dtype=np.float64)
    n_test = np.array([r["n_test"] for r in rows], dtype=np.float64)
    has_test = n_test > 0
    col = lambda key: np.array([r[key] for r in rows], dtype=np.float64)  # noqa: E731
    alpha = n_train / n_train.sum()
    test_acc = col("test_acc")[has_test]
    return {
        "train_loss": float(np.nansum(alpha * col("train_loss"))),
        "train_acc": float(np.nansum(alpha * col("train_acc"))),
        "test_loss": float(np.sum(n_test[has_test] * col("test_loss")[has_test]) / n_test.sum()),
        "test_acc": float(test_acc.mean()),
        "test_acc_weighted": float(np.sum(n_test[has_test] * test_acc) / n_test.sum()),
        "test_acc_p10": float(np.percentile(test_acc, 10)),
    }
