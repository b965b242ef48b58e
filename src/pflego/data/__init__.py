"""Datasets, partitions and the in-memory federated form of a dataset."""

from pflego.data.datasets import DATASETS, load_dataset, register
from pflego.data.federated import ArrayDataset, FederatedData, federate, from_parts

__all__ = [
    "DATASETS",
    "ArrayDataset",
    "FederatedData",
    "federate",
    "from_parts",
    "load_dataset",
    "register",
]
