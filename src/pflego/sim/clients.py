"""Per-round client inputs (data and minibatch schedules) and the client state store."""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from pflego.data import FederatedData
from pflego.types import ClientData, ClientState


def seed_for(*keys: int) -> int:
    """A 63-bit seed derived from integer keys, e.g. (seed, round, client)."""
    return int(
        np.random.SeedSequence([int(k) for k in keys]).generate_state(2, np.uint64)[0]
        >> np.uint64(1)
    )


def schedule(
    n: int,
    inner_steps: int,
    batch_size: int | None,
    local_epochs: float | None,
    rng: np.random.Generator,
) -> tuple[Tensor, Tensor]:
    """Minibatch indices ``[S, B]`` and mask for one client's local steps.

    Full batch (``batch_size`` unset): every step sees all ``n`` samples. Minibatches: the samples
    are reshuffled each epoch and cut into batches of ``batch_size`` (the last one smaller). The
    number of steps is ``inner_steps``, or ``ceil(local_epochs * n / batch_size)`` when
    ``local_epochs`` is set.
    """
    if batch_size is None or batch_size >= n:
        steps = inner_steps if local_epochs is None else max(1, math.ceil(local_epochs))
        return torch.arange(n).repeat(steps, 1), torch.ones(steps, n)
    per_epoch = math.ceil(n / batch_size)
    steps = inner_steps if local_epochs is None else max(1, math.ceil(local_epochs * per_epoch))
    idx = np.zeros((steps, batch_size), np.int64)
    mask = np.zeros((steps, batch_size), np.float32)
    order = np.zeros(0, np.int64)
    for s in range(steps):
        if s % per_epoch == 0:
            order = rng.permutation(n)
        batch = order[(s % per_epoch) * batch_size : (s % per_epoch + 1) * batch_size]
        idx[s, : len(batch)], mask[s, : len(batch)] = batch, 1.0
    return torch.from_numpy(idx), torch.from_numpy(mask)


def client_data(
    data: FederatedData,
    client: int,
    label_space: str,
    batches: tuple[Tensor, Tensor],
    dtype: torch.dtype,
) -> ClientData:
    """One client's training data for a round, as the algorithm sees it."""
    sl = data.train_slice(client)
    y = data.y_train_local[sl] if label_space == "local" else data.y_train[sl]
    x = data.inputs(data.x_train[sl]).to(dtype)
    idx, bmask = batches
    return ClientData(
        x=x,
        y=y,
        mask=torch.ones(len(y), dtype=dtype),
        batches=idx,
        batch_mask=bmask.to(dtype),
        label_mask=label_mask(data, client, label_space, dtype),
        num_samples=torch.tensor(float(len(y)), dtype=dtype),
    )


def label_mask(data: FederatedData, client: int, label_space: str, dtype: torch.dtype) -> Tensor:
    """Which logits a client's head has: its own K_i classes (local) or all C (global)."""
    if label_space == "local":
        return (data.client_classes[client] >= 0).to(dtype)
    return torch.ones(data.num_classes, dtype=dtype)


class ClientStore:
    """Every client's private state, stacked as ``[I, ...]`` tensors and allocated on first write.

    Clients never sampled have no entry (``visited`` is False); the round loop initializes them.
    """

    def __init__(self, num_clients: int) -> None:
        self.num_clients = num_clients
        self.tensors: dict[str, Tensor] = {}
        self.visited = torch.zeros(num_clients, dtype=torch.bool)

    def get(self, client: int) -> ClientState:
        return {k: v[client] for k, v in self.tensors.items()}

    def put(self, client: int, state: ClientState) -> None:
        for k, v in state.items():
            if k not in self.tensors:
                self.tensors[k] = torch.zeros((self.num_clients, *v.shape), dtype=v.dtype)
            self.tensors[k][client] = v.detach()
        self.visited[client] = True

    def state_dict(self) -> dict[str, object]:
        return {"tensors": self.tensors, "visited": self.visited}

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.tensors = dict(state["tensors"])
        self.visited = state["visited"].clone()
