"""Evaluation of every client's personalized model: L(psi) and test accuracy statistics.

All clients are evaluated together: ``predict`` runs under ``torch.func.vmap`` over chunks of
clients whose samples are gathered, padded, from a :class:`~pflego.sim.clients.ClientPool` that
already lives on the device.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor
from torch.func import vmap

from pflego import tree
from pflego.algorithms import Algorithm
from pflego.data import FederatedData
from pflego.sim.clients import ClientPool
from pflego.tree import Params
from pflego.types import ClientState

#: Default budget of padded input elements per evaluation chunk (128 MB of float32).
EVAL_BUDGET = 2**25


def _client_metrics(
    algorithm: Algorithm,
    downlink: Params,
    state: ClientState,
    x: Tensor,
    y: Tensor,
    mask: Tensor,
    lmask: Tensor,
) -> tuple[Tensor, Tensor]:
    """Mean loss and accuracy of one client over its real samples (NaN without samples)."""
    logits = algorithm.predict(downlink, state, x)
    logits = torch.where(lmask > 0, logits, torch.finfo(logits.dtype).min)
    per_sample = -torch.log_softmax(logits, -1).gather(-1, y.unsqueeze(-1)).squeeze(-1)
    correct = (logits.argmax(-1) == y).to(mask.dtype)
    n = mask.sum()
    return (per_sample * mask).sum() / n, (correct * mask).sum() / n


def split_metrics(
    algorithm: Algorithm,
    downlink: Params,
    states: ClientState,
    pool: ClientPool,
    chunk_size: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Per-client mean loss and accuracy on one split, vectorized over chunks of clients.

    Args:
        algorithm: Supplies ``predict``.
        downlink: The shared parameters, on the pool's device.
        states: Every client's private state stacked ``[I, ...]`` (any device).
        pool: The split's data.
        chunk_size: Clients per chunk; by default as many as fit ``EVAL_BUDGET`` input elements.

    Returns:
        ``(loss, acc)`` as float64 arrays ``[I]``.
    """
    num = len(pool.sizes)
    if chunk_size is None:
        per_client = max(1, int(pool.sizes.max(initial=1)) * math.prod(pool.x.shape[1:]))
        chunk_size = max(1, EVAL_BUDGET // per_client)
    fn = vmap(
        lambda s, x, y, m, lm: _client_metrics(algorithm, downlink, s, x, y, m, lm),
        randomness="different",
    )
    losses, accs = [], []
    for start in range(0, num, chunk_size):
        ids = np.arange(start, min(num, start + chunk_size))
        x, y, mask = pool.padded(ids)
        chunk_states = {k: v[start : start + len(ids)].to(pool.device) for k, v in states.items()}
        lmask = pool.label_masks[start : start + len(ids)]
        loss, acc = fn(chunk_states, x, y, mask, lmask)
        losses.append(loss)
        accs.append(acc)
    return (
        torch.cat(losses).double().cpu().numpy(),
        torch.cat(accs).double().cpu().numpy(),
    )


@torch.no_grad()
def evaluate_pools(
    algorithm: Algorithm,
    downlink: Params,
    states: ClientState,
    train: ClientPool,
    test: ClientPool,
    chunk_size: int | None = None,
) -> tuple[dict[str, float], list[dict[str, float]]]:
    """Evaluate every client's personalized model on its train and test data.

    Returns:
        Summary metrics (``train_loss`` is L(psi) = sum_i alpha_i l_i over ALL clients;
        ``test_acc`` the unweighted mean over clients, ``test_acc_weighted`` weighted by test size,
        ``test_acc_p10`` the bottom decile of client accuracies) and one row per client.
    """
    train_loss, train_acc = split_metrics(algorithm, downlink, states, train, chunk_size)
    test_loss, test_acc = split_metrics(algorithm, downlink, states, test, chunk_size)
    columns = {
        "client": np.arange(len(train.sizes)),
        "n_train": train.sizes,
        "n_test": test.sizes,
        "train_loss": train_loss,
        "train_acc": train_acc,
        "test_loss": test_loss,
        "test_acc": test_acc,
    }
    lists = {k: v.tolist() for k, v in columns.items()}
    rows = [dict(zip(lists, values)) for values in zip(*lists.values())]
    return summarize(rows), rows


def evaluate(
    algorithm: Algorithm,
    downlink: Params,
    client_state: Callable[[int], ClientState],
    data: FederatedData,
    dtype: torch.dtype,
) -> tuple[dict[str, float], list[dict[str, float]]]:
    """Evaluate from a per-client state function (convenience form of :func:`evaluate_pools`)."""
    states = tree.stack(client_state(i) for i in range(data.num_clients))
    device = next(iter(downlink.values())).device
    pools = [
        ClientPool.build(data, split, algorithm.label_space, dtype, device)
        for split in ("train", "test")
    ]
    return evaluate_pools(algorithm, downlink, states, *pools)


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
