"""FedBN: federated averaging of every layer except batch norm, which each client keeps.

Li, Jiang, Zhang, Kamp, Dou. "FedBN: Federated Learning on Non-IID Features via Local Batch
Normalization". ICLR 2021; arXiv:2102.07623. Authors' code: github.com/med-air/FedBN
(``federated/fed_digits.py``'s ``communication``, read in copies of it: the server averages every
``state_dict`` entry whose name lacks ``bn``, so the BN layers' weight, bias, running statistics
and batch counter stay on each client, and copies the average back to every client).

Algorithm 1 of the paper: each client k trains its full model w_k (weights, biases and its
batch-norm layers: affine gamma, beta and the running statistics mu, sigma^2) for E local epochs
from the aggregate; the server then averages every parameter *except* the batch-norm ones,
w^l <- sum_k n_k / n w_k^l for the non-BN layers l, and sends that back; each client's BN layers
never leave it. Prediction uses the client's own BN layers in evaluation mode (its running
statistics).

Symbols to code: the non-BN layers -> the server's ``body.*`` and ``head.*`` entries (one C-way
head, shared), averaged through the server optimizer on ``w - w_k`` (server SGD with lr 1, the
default, is the paper's n_k-weighted average); gamma, beta -> the client state's
``body.<bn>.weight`` / ``body.<bn>.bias`` (1 and 0 at the first visit, PyTorch's BN init); mu,
sigma^2 -> ``body.<bn>.running_mean`` / ``body.<bn>.running_var`` (0 and 1 at the first visit),
updated at every local step as ``nn.BatchNorm`` does in training mode: ``r <- (1 - m) r + m s``
with the batch's mean and its unbiased variance, m the layer's ``momentum`` (0.1).

The contract extension this needs (in ``pflego.models``): batch-norm layers run functionally,
their running statistics are entries of the parameter dict, and the forward pass takes the
minibatch's sample ``mask`` (so the padding rows of ragged clients under vmap stay out of the
batch statistics) and a ``stats`` dict in which each BN layer records the batch's statistics.

Deliberate differences: the authors' digits experiments give every client the same weight
(their clients hold equal-sized subsets) and all clients train every round; here the weights are
n_k / n as in Algorithm 1, with any participation. A batch of one real sample has no unbiased variance (PyTorch refuses to
train on it); its running variance is updated with the biased one (0). A model without batch
norm makes FedBN FedAvg exactly (every layer is averaged). Other methods run a BN model with
batch statistics at training and at evaluation (they keep no running statistics; evaluation
batches then include any padding rows); FedBN is the method the BN architectures (``mlp-bn``)
are for.

Unseen clients (``join``): the paper has none. A new client starts from fresh BN layers and
trains them alone (affine and running statistics) on ``adapt_schedule``'s batches with the
received layers fixed: its own BN layers, as FedBN's clients have.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor
from torch.func import grad_and_value

from pflego import tree
from pflego.algorithms.base import Algorithm, register
from pflego.loss import masked_cross_entropy
from pflego.models import Layer
from pflego.tree import Params
from pflego.types import ClientData, ClientOut, ClientState, RoundContext

RUNNING = (".running_mean", ".running_var")


@register("fedbn")
@dataclass(frozen=True)
class FedBN(Algorithm):
    default_client_lr: ClassVar[float] = 0.3  # FedAvg's, tuned in the main experiment

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.norms:  # never silently FedAvg
            logging.getLogger(__name__).warning(
                "fedbn on %s, a model without batch norm, is FedAvg exactly (every layer is "
                "averaged); a batch-norm model such as --model mlp-bn keeps its norms local",
                self.model.name or "this model",
            )

    @property
    def norms(self) -> tuple[Layer, ...]:
        """The body's batch-norm layers."""
        return tuple(layer for layer in self.model.layers or () if layer.kind == "batchnorm")

    @property
    def local_keys(self) -> tuple[str, ...]:
        """The parameters that stay on the client: every BN layer's gamma and beta."""
        return tuple(k for layer in self.norms for k in (layer.weight, layer.bias))

    @property
    def features_from_downlink(self) -> bool:
        return False  # the body needs the client's own BN layers

    def init_params(self, seed: int, dtype: torch.dtype = torch.float32) -> Params:
        """The shared model without its BN layers (they live on the clients)."""
        params = super().init_params(seed, dtype)
        return {k: v for k, v in params.items() if k not in self.local_keys}

    def init_client(
        self, downlink: Params, generator: torch.Generator, ctx: RoundContext
    ) -> ClientState:
        """Fresh BN layers: gamma 1, beta 0, running mean 0, running variance 1."""
        dtype = next(iter(downlink.values())).dtype
        state = {}
        for layer in self.norms:
            ones = torch.ones(layer.module.num_features, dtype=dtype)
            state[layer.weight], state[layer.bias] = ones, torch.zeros_like(ones)
            state[layer.key + RUNNING[0]] = torch.zeros_like(ones)
            state[layer.key + RUNNING[1]] = ones.clone()
        return state

    def local_steps(
        self, params: Params, fixed: Params, running: Params, data: ClientData, ctx: RoundContext
    ) -> tuple[Params, Params, Tensor]:
        """The client optimizer's steps on ``params`` (``fixed`` held), the BN layers in training
        mode; every real step also moves the running statistics. Returns the trained
        parameters, the running statistics and the mean loss over the real steps."""

        def loss(p: Params, x: Tensor, y: Tensor, mask: Tensor):
            stats: dict = {}
            logits = self.model.forward({**fixed, **p}, x, mask, stats)
            return masked_cross_entropy(logits, y, mask, data.label_mask), stats

        step = grad_and_value(loss, has_aux=True)
        opt = self.client_optimizer
        opt_state = opt.init(params)
        whole_set = data.batches.shape[-1] == data.x.shape[0]
        total, count = torch.zeros(()), torch.zeros(())
        for idx, bmask in zip(data.batches, data.batch_mask):
            x, y = (data.x, data.y) if whole_set else (data.x[idx], data.y[idx])
            grads, (value, stats) = step(params, x, y, bmask)
            active = bmask.sum() > 0
            params, opt_state = opt.masked_update(params, grads, opt_state, ctx.client_lr, active)
            running = self.track(running, stats, active)
            total = total + torch.where(active, value.detach(), 0.0)
            count = count + active.to(count.dtype)
        return params, running, total / count.clamp(min=1)

    def track(self, running: Params, stats: dict, active: Tensor) -> Params:
        """``nn.BatchNorm``'s running averages after a step with batch statistics ``stats``."""
        new = dict(running)
        for layer in self.norms:
            mean, var, n = (s.detach() for s in stats[layer.key])
            unbiased = var * n / (n - 1).clamp(min=1)
            m = layer.module.momentum
            for key, value in zip(RUNNING, (mean, unbiased), strict=True):
                old = running[layer.key + key]
                new[layer.key + key] = torch.where(active, (1 - m) * old + m * value, old)
        return new

    def split_state(self, state: ClientState) -> tuple[Params, Params]:
        """The state's BN affine parameters and its running statistics."""
        affine = {k: state[k] for k in self.local_keys}
        return affine, {k: v for k, v in state.items() if k not in affine}

    def client_update(self, downlink, state, data: ClientData, ctx: RoundContext):
        affine, running = self.split_state(state)
        trained, running, mean_loss = self.local_steps(
            {**downlink, **affine}, {}, running, data, ctx
        )
        shared = {k: trained[k] for k in downlink}
        new_state = {**{k: trained[k] for k in affine}, **running}
        return ClientOut(tree.sub(downlink, shared), data.num_samples, {"loss": mean_loss}), (
            new_state
        )

    def join(self, downlink, state, data: ClientData, ctx: RoundContext) -> ClientState:
        """A new client trains its own fresh BN layers on the received model."""
        affine, running = self.split_state(state)
        trained, running, _ = self.local_steps(affine, downlink, running, data, ctx)
        return {**trained, **running}
