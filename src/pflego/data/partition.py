"""Partitions of a labelled pool over clients.

The label-based partitions (``classes``, ``dirichlet``, ``iid``) are one mechanism: a share matrix
``S[i, c]`` (the fraction of class ``c`` that client ``i`` receives; columns sum to 1) and a dealer
that hands each class's shuffled samples to the clients in those proportions. Applying the same
matrix to the official test split gives every client a test set drawn from its own distribution.
"""

from __future__ import annotations

import numpy as np

from pflego.errors import ConfigError

PERSONALIZATION_PRESETS = {"high": lambda c: 2, "medium": lambda c: c // 2, "none": lambda c: c}


def resolve_classes_per_client(value: int | str, num_classes: int) -> int:
    """Turn ``high`` / ``medium`` / ``none`` or an integer into K, the classes per client."""
    if isinstance(value, str) and not value.lstrip("-").isdigit():
        if value not in PERSONALIZATION_PRESETS:
            raise ConfigError(
                f"classes_per_client={value!r} is not a number or one of high, medium, none"
            )
        return PERSONALIZATION_PRESETS[value](num_classes)
    k = int(value)
    if not 1 <= k <= num_classes:
        raise ConfigError(
            f"classes_per_client={k} must be between 1 and the dataset's {num_classes} classes"
        )
    return k


def assign_classes(
    num_clients: int, num_classes: int, k: int, rng: np.random.Generator
) -> np.ndarray:
    """K distinct classes per client, spread so that classes have as equal a number of holders as possible.

    Each client draws its classes among the least-held ones, with random tie-breaking, so every
    class is held by some client whenever ``num_clients * k >= num_classes``.

    Returns:
        ``[num_clients, k]`` array of class ids.
    """
    if num_clients * k < num_classes:
        raise ConfigError(
            f"{num_clients} clients with {k} classes each cannot cover all {num_classes} classes; "
            "raise classes_per_client or the number of clients"
        )
    holders = np.zeros(num_classes, dtype=np.int64)
    out = np.empty((num_clients, k), dtype=np.int64)
    for i in range(num_clients):
        order = np.lexsort((rng.random(num_classes), holders))
        out[i] = np.sort(order[:k])
        holders[out[i]] += 1
    return out


def class_shares(
    kind: str,
    num_clients: int,
    num_classes: int,
    rng: np.random.Generator,
    classes_per_client: int = 2,
    alpha: float = 0.5,
) -> np.ndarray:
    """The share matrix ``S[i, c]`` of a label partition (columns sum to 1)."""
    if kind == "iid":
        return np.full((num_clients, num_classes), 1.0 / num_clients)
    if kind == "classes":
        held = np.zeros((num_clients, num_classes))
        np.put_along_axis(
            held, assign_classes(num_clients, num_classes, classes_per_client, rng), 1.0, 1
        )
        return held / held.sum(0, keepdims=True)
    if kind == "dirichlet":
        if not alpha > 0:
            raise ConfigError(f"alpha={alpha} must be positive for the dirichlet partition")
        return rng.dirichlet(np.full(num_clients, float(alpha)), size=num_classes).T
    raise ConfigError(f"unknown partition {kind!r}; choose one of classes, dirichlet, iid")


def _largest_remainder(shares: np.ndarray, total: int, rng: np.random.Generator) -> np.ndarray:
    """Integer counts proportional to ``shares`` that add up to ``total``."""
    exact = shares * total
    counts = np.floor(exact).astype(np.int64)
    missing = total - counts.sum()
    if missing:
        frac = exact - counts + 1e-12 * rng.random(len(shares))  # random tie-breaking
        counts[np.argsort(-frac)[:missing]] += 1
    return counts


def deal(labels: np.ndarray, shares: np.ndarray, rng: np.random.Generator) -> list[np.ndarray]:
    """Hand each class's shuffled samples to clients in proportion to ``shares[:, class]``.

    With equal shares among K holders this is round-robin dealing: holders' counts differ by at most one.

    Returns:
        One sorted index array per client.
    """
    num_clients = shares.shape[0]
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c in range(shares.shape[1]):
        idx = rng.permutation(np.flatnonzero(labels == c))
        counts = _largest_remainder(shares[:, c], len(idx), rng)
        for i, chunk in enumerate(np.split(idx, np.cumsum(counts)[:-1])):
            if len(chunk):
                parts[i].append(chunk)
    return [np.sort(np.concatenate(p)) if p else np.zeros(0, np.int64) for p in parts]


def enforce_min_size(
    parts: list[np.ndarray], min_size: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """Move random samples from the largest clients to those below ``min_size``.

    Always terminates: it needs at most ``num_clients * min_size`` moves and fails cleanly
    when the pool is too small.
    """
    total = sum(len(p) for p in parts)
    if total < min_size * len(parts):
        raise ConfigError(
            f"{total} samples cannot give {len(parts)} clients {min_size} samples each; "
            "lower min_client_size or the number of clients"
        )
    parts = [rng.permutation(p) for p in parts]
    sizes = np.array([len(p) for p in parts])
    for i in np.flatnonzero(sizes < min_size):
        while len(parts[i]) < min_size:
            donor = int(np.argmax([len(p) for p in parts]))
            take = min(min_size - len(parts[i]), len(parts[donor]) - min_size)
            parts[i] = np.concatenate([parts[i], parts[donor][:take]])
            parts[donor] = parts[donor][take:]
    return [np.sort(p) for p in parts]


def split_train_test(
    parts: list[np.ndarray], test_fraction: float, rng: np.random.Generator
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Split each client's indices at random into train and test (at least one of each when possible)."""
    train, test = [], []
    for p in parts:
        p = rng.permutation(p)
        n_test = int(round(test_fraction * len(p)))
        if len(p) >= 2:
            n_test = min(max(n_test, 1), len(p) - 1)
        test.append(np.sort(p[:n_test]))
        train.append(np.sort(p[n_test:]))
    return train, test
