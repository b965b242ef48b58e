"""A generated population's clients as the round loop sees them: a pool of just the clients asked,
generated on demand (the population itself: :mod:`pflego.data.stream`)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from pflego.data.stream import GeneratedClients
from pflego.errors import ConfigError
from pflego.sim.clients import ClientPool


class GeneratedPool:
    """One split of a generated population; :meth:`select` makes a small ``ClientPool``.

    Client ids given to :meth:`cohort` are the population's; the selected pool numbers them
    ``0..len(ids)-1``.
    """

    def __init__(
        self,
        data: GeneratedClients,
        split: str,
        label_space: str,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.data, self.split, self.label_space = data, split, label_space
        self.dtype, self.device = dtype, torch.device(device)
        self.sizes = data.train_counts if split == "train" else data.test_counts

    def select(self, ids: np.ndarray, keep: Callable[[int, int], np.ndarray] | None = None):
        """A ``ClientPool`` of the clients ``ids`` (renumbered in that order); ``keep(i, n)``,
        if given, picks which of client ``i``'s ``n`` samples of the split to keep."""
        ids = np.asarray(ids, np.int64)
        xs, ys, masks = [], [], []
        width = self.data.num_classes
        for i, (x, y) in zip(ids, self.data.clients(ids)):
            n_train = int(self.data.train_counts[i])
            part = np.arange(n_train) if self.split == "train" else np.arange(n_train, len(y))
            if keep is not None:
                part = part[keep(int(i), len(part))]
            labels = y[part]
            mask = np.ones(width, np.float32)
            if self.label_space == "local":  # renumber within the client's training classes
                classes = np.unique(y[:n_train])
                at = np.minimum(np.searchsorted(classes, labels), len(classes) - 1)
                labels = np.where(classes[at] == labels, at, -1)  # -1: a class it never trained on
                mask[len(classes) :] = 0
            xs.append(x[part])
            ys.append(labels)
            masks.append(mask)
        dim = self.data.input_shape
        x = np.concatenate(xs) if xs else np.zeros((0, *dim), np.float32)
        y = np.concatenate(ys) if ys else np.zeros(0, np.int64)
        return ClientPool.of(
            torch.from_numpy(x).to(self.device, self.dtype),
            torch.from_numpy(y.astype(np.int64)).to(self.device),
            np.array([len(y) for y in ys], np.int64),
            torch.from_numpy(np.stack(masks)).to(self.device, self.dtype),
        )

    def cohort(self, clients, run, rng_for, extra=None, validation=None):
        """The round inputs of ``clients`` (population ids), from a pool of just them."""
        clients = np.asarray(clients, np.int64)
        if validation is not None:
            raise ConfigError(f"{self.data.name} has no validation split; set val_fraction=0")
        pool = self.select(clients)
        local = np.arange(len(clients))
        return pool.cohort(local, run, lambda c, stream: rng_for(int(clients[c]), stream), extra)


def generated_pools(
    data: GeneratedClients, label_space: str, dtype: torch.dtype, device: torch.device | str
) -> dict[str, GeneratedPool]:
    return {s: GeneratedPool(data, s, label_space, dtype, device) for s in ("train", "test")}
