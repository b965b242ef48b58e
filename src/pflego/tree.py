"""Algebra on parameter dicts (``dict[str, Tensor]``), the currency of every algorithm.

All functions are pure and work unchanged under ``torch.func.vmap``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch
from torch import Tensor

Params = dict[str, Tensor]


def map_(
    fn: Callable[..., Tensor], tree: Mapping[str, Tensor], *rest: Mapping[str, Tensor]
) -> Params:
    """Apply ``fn`` leaf-wise over one or more dicts with the same keys."""
    return {k: fn(v, *(r[k] for r in rest)) for k, v in tree.items()}


def add(a: Mapping[str, Tensor], b: Mapping[str, Tensor]) -> Params:
    """Leaf-wise ``a + b``."""
    return map_(torch.add, a, b)


def sub(a: Mapping[str, Tensor], b: Mapping[str, Tensor]) -> Params:
    """Leaf-wise ``a - b``."""
    return map_(torch.sub, a, b)


def scale(a: Mapping[str, Tensor], s: float | Tensor) -> Params:
    """Leaf-wise ``s * a``."""
    return {k: v * s for k, v in a.items()}


def axpy(alpha: float | Tensor, x: Mapping[str, Tensor], y: Mapping[str, Tensor]) -> Params:
    """Leaf-wise ``y + alpha * x``."""
    return {k: y[k] + alpha * v for k, v in x.items()}


def zeros_like(a: Mapping[str, Tensor]) -> Params:
    """A dict of zeros shaped like ``a``."""
    return {k: torch.zeros_like(v) for k, v in a.items()}


def dot(a: Mapping[str, Tensor], b: Mapping[str, Tensor]) -> Tensor:
    """Sum over leaves of the inner products ``<a_k, b_k>``."""
    return sum((torch.sum(v * b[k]) for k, v in a.items()), torch.zeros(()))


def sq_norm(a: Mapping[str, Tensor]) -> Tensor:
    """Squared Euclidean norm of all leaves together."""
    return dot(a, a)


def where(cond: Tensor, a: Mapping[str, Tensor], b: Mapping[str, Tensor]) -> Params:
    """Leaf-wise ``a if cond else b`` for a scalar boolean tensor ``cond``.

    A plain ``cond`` on the CPU picks the leaves themselves (no copy: ``torch.where`` copies each
    leaf, at a few times a copy's cost); under a ``torch.func`` transform, or on another device
    (where reading ``cond`` would wait for it), ``torch.where`` chooses.
    """
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor(cond)
    if cond.dim() == 0 and cond.device.type == "cpu" and not wrapped:
        chosen = a if bool(cond) else b
        return {k: chosen[k] for k in a}
    return {k: torch.where(cond, v, b[k]) for k, v in a.items()}


def stack(trees: Iterable[Mapping[str, Tensor]]) -> Params:
    """Stack dicts with the same keys along a new leading axis."""
    trees = list(trees)
    return {k: torch.stack([t[k] for t in trees]) for k in trees[0]} if trees else {}


def weighted_sum(stacked: Mapping[str, Tensor], weights: Tensor) -> Params:
    """``sum_c weights[c] * stacked[k][c]`` for each leaf ``k``."""
    return {k: torch.tensordot(weights.to(v.dtype), v, dims=1) for k, v in stacked.items()}


def mix(stacked: Mapping[str, Tensor], weights: Mapping[str, Tensor]) -> Params:
    """Per-entry combinations of models stacked on axis 0 (``[I, ...]``): entry ``k`` of the
    ``n`` results is ``weights[k] @ stacked[k]``, ``weights[k]`` ``[n, I]`` (per-layer
    aggregation weights: pFedLA's; one row for every entry: FedAP's)."""
    return {k: torch.tensordot(weights[k].to(v), v, dims=1) for k, v in stacked.items()}


def select(tree: Mapping[str, Tensor], prefixes: Iterable[str]) -> Params:
    """The leaves whose names start with one of ``prefixes`` followed by a dot."""
    prefixes = tuple(p + "." for p in prefixes)
    return {k: v for k, v in tree.items() if k.startswith(prefixes)}


def add_prefix(prefix: str, tree: Mapping[str, Tensor]) -> Params:
    """The same leaves with ``prefix`` before every name (``v.`` + ``body.w`` -> ``v.body.w``)."""
    return {prefix + k: v for k, v in tree.items()}


def strip_prefix(prefix: str, tree: Mapping[str, Tensor]) -> Params:
    """The leaves whose names start with ``prefix``, renamed without it."""
    return {k[len(prefix) :]: v for k, v in tree.items() if k.startswith(prefix)}


def detach(tree: Mapping[str, Tensor]) -> Params:
    """Detached copies of every leaf."""
    return {k: v.detach() for k, v in tree.items()}


def to(tree: Mapping[str, Tensor], device: torch.device | str) -> Params:
    """Every leaf moved to ``device``."""
    return {k: v.to(device) for k, v in tree.items()}


def cast(tree: Mapping[str, Tensor], dtype: torch.dtype) -> Params:
    """Every floating-point leaf in ``dtype`` (integer and boolean leaves unchanged)."""
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in tree.items()}


def all_finite(*trees: Mapping[str, Tensor]) -> bool:
    """Whether every leaf of every dict is free of NaN and infinities."""
    return all(bool(torch.isfinite(v).all()) for t in trees for v in t.values())
