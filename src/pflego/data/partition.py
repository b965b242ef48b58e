"""Partitions of a labelled pool over clients.

The label-based partitions (``classes``, ``dirichlet``, ``iid``) are one mechanism: a share matrix
``S[i, c]`` (the fraction of class ``c`` that client ``i`` receives; columns sum to 1) and a dealer
that hands each class's shuffled samples to the clients in those proportions. Applying the same
matrix to the official test split gives every client a test set drawn from its own distribution.
"""

from __future__ import annotations

import numpy as np

from pflego.errors import ConfigError

PARTITIONS = ("auto", "classes", "dirichlet", "iid", "pachinko", "natural", "natural-dirichlet")

PERSONALIZATION_PRESETS = {"high": lambda c: 2, "medium": lambda c: c // 2, "none": lambda c: c}


def resolve_classes_per_client(value: int | str, num_classes: int) -> int:
    """Turn ``high`` / ``medium`` / ``none`` or an integer into K, the classes per client."""
    if isinstance(value, str) and value.strip().lower() in PERSONALIZATION_PRESETS:
        return PERSONALIZATION_PRESETS[value.strip().lower()](num_classes)
    try:
        k = int(value)
    except ValueError:
        raise ConfigError(
            f"classes_per_client={value!r} is not a number or one of high, medium, none"
        ) from None
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
            f"use at least {-(-num_classes // k)} clients (--clients, or --nodes with Flower) or "
            f"--classes-per-client {-(-num_classes // num_clients)} (or more)"
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
    if not alpha > 0:  # dirichlet (federate has refused other partitions)
        raise ConfigError(f"alpha={alpha} must be positive for the dirichlet partition")
    return rng.dirichlet(np.full(num_clients, float(alpha)), size=num_classes).T


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


# --- natural groups ------------------------------------------------------------------------------


def select_groups(groups: np.ndarray, num_clients: int, rng: np.random.Generator) -> np.ndarray:
    """The natural groups that become clients, in increasing id order.

    All groups when ``num_clients`` equals their number; otherwise a uniformly random subset of
    ``num_clients`` of them (seeded), as FedEM samples FEMNIST writers.
    """
    present = np.unique(groups)
    if num_clients == len(present):
        return present
    if num_clients > len(present):
        raise ConfigError(
            f"clients={num_clients} but the dataset has only {len(present)} natural clients "
            f"(writers / roles / alphabets); set clients to at most {len(present)}"
        )
    return np.sort(rng.choice(present, num_clients, replace=False))


def group_parts(groups: np.ndarray, selected: np.ndarray) -> list[np.ndarray]:
    """For each selected group, the sorted indices of its samples (one stable sort, no loops over samples)."""
    order = np.argsort(groups, kind="stable")
    sorted_groups = groups[order]
    lo = np.searchsorted(sorted_groups, selected, side="left")
    hi = np.searchsorted(sorted_groups, selected, side="right")
    return [order[a:b] for a, b in zip(lo, hi)]


def split_fraction(
    parts: list[np.ndarray], fraction: float, rng: np.random.Generator
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Split each part at random into ``(1 - fraction, fraction)``; nothing is split off at 0."""
    if fraction <= 0:
        return parts, [np.zeros(0, np.int64) for _ in parts]
    return split_train_test(parts, fraction, rng)


# --- pachinko allocation (FedEM, CIFAR-100) ------------------------------------------------------


def coarse_of_fine(fine: np.ndarray, coarse: np.ndarray) -> np.ndarray:
    """The coarse label of every fine label up to the largest (-1 for fine labels never seen).

    Each fine label must belong to exactly one coarse label.
    """
    parent = np.full(int(fine.max()) + 1, -1, dtype=np.int64)
    pairs = np.unique(np.stack([fine, coarse], 1), axis=0)
    if len(np.unique(pairs[:, 0])) != len(pairs):
        raise ConfigError("the pachinko partition needs each fine label inside one coarse label")
    parent[pairs[:, 0]] = pairs[:, 1]
    return parent


def pachinko_distributions(
    parent: np.ndarray, num_clients: int, alpha: float, beta: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Per client ``Dirichlet(alpha)`` over coarse labels and per (client, coarse) ``Dirichlet(beta)``
    over that coarse label's fine labels.

    Returns:
        ``coarse_p [I, n_coarse]`` and ``fine_p [I, n_fine]``, where ``fine_p[i]`` sums to 1 over the
        fine labels of each coarse label.
    """
    if not (alpha > 0 and beta > 0):
        raise ConfigError(f"pachinko needs alpha > 0 and beta > 0 (got {alpha}, {beta})")
    num_coarse = int(parent.max()) + 1
    coarse_p = rng.dirichlet(np.full(num_coarse, float(alpha)), size=num_clients)
    fine_p = np.zeros((num_clients, len(parent)))
    for c in range(num_coarse):
        members = np.flatnonzero(parent == c)
        if len(members):
            fine_p[:, members] = rng.dirichlet(np.full(len(members), float(beta)), size=num_clients)
    return coarse_p, fine_p


def pachinko_counts(
    available: np.ndarray,
    parent: np.ndarray,
    coarse_p: np.ndarray,
    fine_p: np.ndarray,
    sizes: np.ndarray,
    rng: np.random.Generator,
) -> np.ndarray:
    """How many samples of each fine label each client draws, without replacement.

    Clients draw in turn (as FedEM does). A client draws its ``n_i`` samples in batches from
    ``p(f) = p(coarse(f)) p(f | coarse(f))``, where exhausted fine labels are removed and their
    coarse label's fine distribution renormalized, and exhausted coarse labels removed and the
    coarse distribution renormalized, so no label is over-drawn and the loop ends after a few
    batches.

    Returns:
        ``[I, n_fine]`` integer counts; column sums never exceed ``available``.
    """
    remaining = available.astype(np.int64).copy()
    num_coarse = coarse_p.shape[1]
    parent = np.where(parent >= 0, parent, 0)  # fine labels absent from the data: never drawn
    counts = np.zeros((len(sizes), len(parent)), dtype=np.int64)
    for i, n in enumerate(sizes):
        need = int(min(n, remaining.sum()))
        while need > 0:
            open_fine = remaining > 0
            fine = fine_p[i] * open_fine
            fine_mass = np.bincount(parent, weights=fine, minlength=num_coarse)
            coarse = coarse_p[i] * (fine_mass > 0)
            if coarse.sum() <= 0:
                p = open_fine / open_fine.sum()  # underflow: fall back to uniform over what is left
            else:
                with np.errstate(invalid="ignore", divide="ignore"):
                    within = np.where(fine_mass[parent] > 0, fine / fine_mass[parent], 0.0)
                p = coarse[parent] / coarse.sum() * within
                p = p / p.sum()
            draw = np.minimum(rng.multinomial(need, p), remaining)
            counts[i] += draw
            remaining -= draw
            need -= int(draw.sum())
    return counts


def deal_counts(
    labels: np.ndarray, counts: np.ndarray, rng: np.random.Generator
) -> list[np.ndarray]:
    """Hand out shuffled samples of each label: client ``i`` gets ``counts[i, c]`` samples of ``c``."""
    parts: list[list[np.ndarray]] = [[] for _ in range(counts.shape[0])]
    for c in range(counts.shape[1]):
        idx = rng.permutation(np.flatnonzero(labels == c))
        for i, chunk in enumerate(
            np.split(idx[: counts[:, c].sum()], np.cumsum(counts[:, c])[:-1])
        ):
            if len(chunk):
                parts[i].append(chunk)
    return [np.sort(np.concatenate(p)) if p else np.zeros(0, np.int64) for p in parts]


def even_sizes(total: int, num_clients: int) -> np.ndarray:
    """``total`` split into ``num_clients`` sizes differing by at most one."""
    return np.full(num_clients, total // num_clients) + (
        np.arange(num_clients) < total % num_clients
    )
