"""Partitioning the full EMNIST byclass label vector (814,255 samples, 62 classes) over 1,000 clients.

Usage::

    PYTHONPATH=src python benchmarks/partition_speed.py
"""

from __future__ import annotations

import time

import numpy as np

from pflego.data.federated import ArrayDataset, federate


def main() -> None:
    rng = np.random.default_rng(0)
    n_train, n_test = 697_932, 116_323  # EMNIST byclass train / test sizes (814,255 in all)
    data = ArrayDataset(
        "emnist-byclass-labels",
        np.zeros((n_train, 1), np.uint8),  # tiny inputs: this measures the partition itself
        rng.integers(0, 62, n_train),
        np.zeros((n_test, 1), np.uint8),
        rng.integers(0, 62, n_test),
        62,
        groups_train=rng.integers(0, 3_000, n_train),
        groups_test=rng.integers(0, 3_000, n_test),
    )
    for partition, kwargs in [
        ("classes", {"classes_per_client": "high"}),
        ("classes", {"classes_per_client": "medium"}),
        ("dirichlet", {"alpha": 0.4}),
        ("iid", {}),
        ("natural", {}),
    ]:
        t = time.perf_counter()
        fd = federate(data, 1000, partition, **kwargs)
        print(f"{partition} {kwargs}: {time.perf_counter() - t:.2f} s, {fd.num_clients} clients")
    fine = rng.integers(0, 100, 814_255)
    data = ArrayDataset(
        "pachinko-labels",
        np.zeros((len(fine), 1), np.uint8),
        fine,
        None,
        None,
        100,
        extra={"fine_train": fine, "coarse_train": fine // 5},
    )
    t = time.perf_counter()
    federate(data, 1000, "pachinko", alpha=0.4, beta=10.0)
    print(
        f"pachinko (100 fine / 20 coarse labels, 814,255 samples): {time.perf_counter() - t:.2f} s"
    )


if __name__ == "__main__":
    main()
