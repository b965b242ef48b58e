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
class Proximal(Optimizer):
    """``inner`` stepping along ``grad + lam (params - anchor) - linear``: a proximal term's
    gradient in closed form, and a linear term's (FedDyn's ``-<linear, params>``; ``None``: none),
    added to the loss's (one fused op per leaf instead of differentiating them).

    The loss, and so the loss that training logs, leaves the terms out. Around plain
    :class:`SGD` on a declared loss, the steps run fused (:mod:`pflego.fused`).
    """

    inner: Optimizer
    lam: float
    anchor: Params
    linear: Params | None = None

    def init(self, params: Params) -> OptState:
        return self.inner.init(params)

    def with_prox(self, params: Params, grads: Params) -> Params:
        pulled = {
            k: torch.add(g, params[k] - self.anchor[k], alpha=self.lam) for k, g in grads.items()
        }
        if self.linear is None:
            return pulled
        return {k: g - self.linear[k] for k, g in pulled.items()}

    def update(self, params, grads, state, lr):
        return self.masked_update(params, grads, state, lr, torch.ones((), dtype=torch.bool))

    def masked_update(self, params, grads, state, lr, active):
        return self.inner.masked_update(params, self.with_prox(params, grads), state, lr, active)


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


@dataclass(frozen=True)
class FedOpt(Optimizer):
    """The adaptive server optimizers of Reddi et al., "Adaptive Federated Optimization", ICLR 2021
    (arXiv:2003.00295), Algorithm 2, written for descent along a pseudo-gradient ``g``.

    The paper's server step uses the averaged model change ``Delta_t = -g``::

        m_t = beta1 m_{t-1} + (1 - beta1) Delta_t
        v_t = (FedAdagrad) v_{t-1} + Delta_t^2
              (FedYogi)    v_{t-1} - (1 - beta2) Delta_t^2 sign(v_{t-1} - Delta_t^2)
              (FedAdam)    beta2 v_{t-1} + (1 - beta2) Delta_t^2
        x_{t+1} = x_t + eta m_t / (sqrt(v_t) + tau)

    with ``m_{-1} = 0`` and ``v_{-1} = tau^2`` (the paper asks ``v_{-1} >= tau^2``). Here the
    moment is kept for ``g`` (``m`` is the paper's ``-m_t``), so ``x <- x - lr m / (sqrt(v) + tau)``
    is the same step; ``lr`` is the server step size eta (``server_lr``). No bias correction, as in
    Algorithm 2. The authors' experiments ran Keras' Adam and Adagrad and their own Keras Yogi
    (google-research/federated ``utils/optimizers``), which correct the bias of Adam and Yogi and
    start Yogi's ``v`` at ``initial_accumulator_value``; those variants are not offered here.

    Defaults: ``beta1 = 0.9`` and ``beta2 = 0.99`` (the paper's fixed values), ``tau = 1e-3``
    (the paper tunes tau per task). ``weight_decay`` adds ``weight_decay * x`` to ``g`` as in the
    other optimizers (0 on the server).
    """

    beta1: float = 0.9
    beta2: float = 0.99
    tau: float = 1e-3
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        if not 0 <= self.beta1 < 1 or not 0 <= self.beta2 < 1:
            raise ConfigError(
                f"{type(self).__name__} betas ({self.beta1}, {self.beta2}) must lie in [0, 1)"
            )
        if not self.tau > 0:
            raise ConfigError(f"{type(self).__name__} tau={self.tau} must be positive")

    def init(self, params: Params) -> OptState:
        state = {f"m.{k}": torch.zeros_like(v) for k, v in params.items()}
        state.update({f"v.{k}": torch.full_like(v, self.tau**2) for k, v in params.items()})
        return state

    def second_moment(self, v: Tensor, g2: Tensor) -> Tensor:
        """``v_t`` from ``v_{t-1}`` and the squared pseudo-gradient."""
        raise NotImplementedError

    def update(self, params, grads, state, lr):
        if self.weight_decay:
            grads = tree.axpy(self.weight_decay, params, grads)
        new_state = {}
        new_params = {}
        for k, g in grads.items():
            m = self.beta1 * state[f"m.{k}"] + (1 - self.beta1) * g
            v = self.second_moment(state[f"v.{k}"], g * g)
            new_state[f"m.{k}"], new_state[f"v.{k}"] = m, v
            new_params[k] = params[k] - lr * m / (v.sqrt() + self.tau)
        return new_params, new_state


@dataclass(frozen=True)
class Adagrad(FedOpt):
    """FedAdagrad (Reddi et al. 2021): ``v_t = v_{t-1} + g^2`` (``beta2`` unused)."""

    def second_moment(self, v: Tensor, g2: Tensor) -> Tensor:
        return v + g2


@dataclass(frozen=True)
class Yogi(FedOpt):
    """FedYogi (Reddi et al. 2021): ``v_t = v_{t-1} - (1 - beta2) g^2 sign(v_{t-1} - g^2)``."""

    def second_moment(self, v: Tensor, g2: Tensor) -> Tensor:
        return v - (1 - self.beta2) * g2 * torch.sign(v - g2)


@dataclass(frozen=True)
class FedAdam(FedOpt):
    """FedAdam exactly as Reddi et al.'s Algorithm 2: ``v_t = beta2 v_{t-1} + (1 - beta2) g^2``,
    no bias correction, ``tau`` outside the square root, ``v_{-1} = tau^2``.

    ``adam`` is :class:`Adam` (``torch.optim.Adam``: bias-corrected, eps 1e-8, beta2 0.999), the
    PFLEGO reference code's server optimizer; ``fedadam`` is this one.
    """

    def second_moment(self, v: Tensor, g2: Tensor) -> Tensor:
        return self.beta2 * v + (1 - self.beta2) * g2


def _step_counter(params: Params) -> Tensor:
    """A zero step count in the parameters' dtype (bias corrections stay exact in float64)."""
    dtype = next(iter(params.values())).dtype if params else torch.get_default_dtype()
    return torch.zeros((), dtype=dtype)


#: Every optimizer by name, for clients and server alike. On the server, ``momentum`` is FedAvgM
#: (Hsu et al. 2019: ``v <- beta v + g``, ``x <- x - lr v`` on the pseudo-gradient g),
#: ``adagrad`` / ``yogi`` / ``fedadam`` are Reddi et al.'s FedAdagrad / FedYogi / FedAdam, and
#: ``adam`` is ``torch.optim.Adam`` (bias-corrected; the PFLEGO reference code's server Adam).
OPTIMIZERS = {
    "sgd": SGD,
    "momentum": Momentum,
    "adam": Adam,
    "adagrad": Adagrad,
    "yogi": Yogi,
    "fedadam": FedAdam,
}


def make_optimizer(name: str, **kwargs: float) -> Optimizer:
    """Build an optimizer by name (a key of ``OPTIMIZERS``)."""
    if name not in OPTIMIZERS:
        raise ConfigError(
            f"unknown optimizer {name!r}; choose one of {', '.join(sorted(OPTIMIZERS))}"
        )
    return OPTIMIZERS[name](**kwargs)
