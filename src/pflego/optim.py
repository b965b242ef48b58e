"""Functional optimizers in the ``init`` / ``update`` style (see optax), pure and vmappable.

``update(params, grads, state, lr) -> (params, state)`` follows ``torch.optim`` step by step, so
the same numbers come out whether a client runs in the loop backend, under vmap, or on Flower.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from pflego import tree
from pflego.errors import ConfigError
from pflego.tree import Params

OptState = dict[str, Tensor]


class Optimizer:
    """The interface every functional optimizer implements."""

    def init(self, params: Params) -> OptState:
        raise NotImplementedError

    def update(
        self, params: Params, grads: Params, state: OptState, lr: float | Tensor
    ) -> tuple[Params, OptState]:
        raise NotImplementedError

    def masked_update(
        self, params: Params, grads: Params, state: OptState, lr: float | Tensor, active: Tensor
    ) -> tuple[Params, OptState]:
        """``update`` where the scalar boolean ``active`` holds, else everything unchanged.

        This is how padding steps of ragged clients become no-ops under vmap.
        """
        new_params, new_state = self.update(params, grads, state, lr)
        return tree.where(active, new_params, params), tree.where(active, new_state, state)


@dataclass(frozen=True)
class SGD(Optimizer):
    """Plain gradient descent, optionally with L2 weight decay."""

    weight_decay: float = 0.0

    def init(self, params: Params) -> OptState:
        return {}

    def update(self, params, grads, state, lr):
        if self.weight_decay:
            grads = tree.axpy(self.weight_decay, params, grads)
        return tree.axpy(-lr, grads, params), state

    def masked_update(self, params, grads, state, lr, active):
        # One fused op per leaf: a zero step size makes an inactive step a no-op (SGD is stateless).
        if self.weight_decay:
            grads = tree.axpy(self.weight_decay, params, grads)
        steps = {dtype: active.to(dtype) * lr for dtype in {p.dtype for p in params.values()}}
        return {
            k: torch.addcmul(p, steps[p.dtype], grads[k], value=-1) for k, p in params.items()
        }, state


@dataclass(frozen=True)
class Momentum(Optimizer):
    """Heavy-ball momentum as in ``torch.optim.SGD(momentum=m)``.

    The first step copies the gradient into the buffer; later steps use ``m * buf + g``.
    """

    momentum: float = 0.9
    weight_decay: float = 0.0

    def init(self, params: Params) -> OptState:
        state = {f"buf.{k}": torch.zeros_like(v) for k, v in params.items()}
        state["step"] = _step_counter(params)
        return state

    def update(self, params, grads, state, lr):
        if self.weight_decay:
            grads = tree.axpy(self.weight_decay, params, grads)
        first = state["step"] == 0
        new_state = {"step": state["step"] + 1}
        new_params = {}
        for k, g in grads.items():
            buf = torch.where(first, g, self.momentum * state[f"buf.{k}"] + g)
            new_state[f"buf.{k}"] = buf
            new_params[k] = params[k] - lr * buf
        return new_params, new_state


@dataclass(frozen=True)
class Adam(Optimizer):
    """Adam as in ``torch.optim.Adam`` (bias-corrected moments, eps outside the square root)."""

    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0

    def init(self, params: Params) -> OptState:
        state = {f"m.{k}": torch.zeros_like(v) for k, v in params.items()}
        state.update({f"v.{k}": torch.zeros_like(v) for k, v in params.items()})
        state["step"] = _step_counter(params)
        return state

    def update(self, params, grads, state, lr):
        if self.weight_decay:
            grads = tree.axpy(self.weight_decay, params, grads)
        step = state["step"] + 1
        correction1 = 1 - self.beta1**step
        correction2 = 1 - self.beta2**step
        new_state = {"step": step}
        new_params = {}
        for k, g in grads.items():
            m = self.beta1 * state[f"m.{k}"] + (1 - self.beta1) * g
            v = self.beta2 * state[f"v.{k}"] + (1 - self.beta2) * g * g
            new_state[f"m.{k}"], new_state[f"v.{k}"] = m, v
            denom = (v / correction2).sqrt() + self.eps
            new_params[k] = params[k] - lr * (m / correction1) / denom
        return new_params, new_state


def _step_counter(params: Params) -> Tensor:
    """A zero step count in the parameters' dtype (bias corrections stay exact in float64)."""
    dtype = next(iter(params.values())).dtype if params else torch.get_default_dtype()
    return torch.zeros((), dtype=dtype)


OPTIMIZERS = {"sgd": SGD, "momentum": Momentum, "adam": Adam}


def make_optimizer(name: str, **kwargs: float) -> Optimizer:
    """Build an optimizer by name (``sgd``, ``momentum`` or ``adam``)."""
    if name not in OPTIMIZERS:
        raise ConfigError(
            f"unknown optimizer {name!r}; choose one of {', '.join(sorted(OPTIMIZERS))}"
        )
    return OPTIMIZERS[name](**kwargs)
