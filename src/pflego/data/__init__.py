"""Datasets, partitions and the in-memory federated form of a dataset."""

from pflego.data.datasets import DATASETS, FAMILIES, dataset_info, load_dataset, register
from pflego.data.federated import ArrayDataset, FederatedData, federate, from_parts

# Loaders register themselves with the dataset registry on import.
from pflego.data import huggingface, leaf, medmnist, mixture, officehome  # noqa: E402, F401  isort: skip
from pflego.data import omniglot, pfedme, rotated, stream, vision  # noqa: E402, F401  isort: skip

__all__ = [
    "DATASETS",
    "FAMILIES",
    "ArrayDataset",
    "FederatedData",
    "dataset_info",
    "federate",
    "from_parts",
    "load_dataset",
    "register",
]
