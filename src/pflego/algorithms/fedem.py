"""FedEM: federated expectation-maximization over a mixture of M shared component models.

Marfoq, Neglia, Bellet, Kameni, Vidal. "Federated Multi-Task Learning under a Mixture of
Distributions". NeurIPS 2021; arXiv:2108.10252.

Client i's data follows a mixture of M distributions with shared component models theta_1..theta_M
and private mixture weights pi_i. A sampled client, given the server's components, runs

1. E-step (Eq. 8): ``q_i(z = m | x_s, y_s) ∝ pi_im exp(-l(theta_m; x_s, y_s))`` over its whole
   training set;
2. M-step for the weights (Eq. 9): ``pi_im = mean_s q_i(z = m | x_s, y_s)``;
3. M-step for the components (Eq. 10, approximated): the run's local schedule (the paper: one
   epoch) of steps on ``sum_m (1 / |B|) sum_{s in B} q_i(m | s) l(theta_m; x_s, y_s)``, one loss per
   component, all components trained together;

and uploads ``theta - theta_i`` per component. The server averages each component with weights N_i
(server SGD with lr 1, the default). Prediction mixes probabilities:
``p_i(y | x) = sum_m pi_im softmax(h_theta_m(x))_y``; ``predict`` returns its log, so evaluation's
log-softmax leaves it unchanged and its argmax is the mixture's.

Symbols to code: theta_m -> ``body.*[m]`` and ``head.*[m]`` (shared; every parameter has a leading
axis of size M; the M components' forward passes run as one ``torch.func.vmap`` over it, and
they train one after the other, as fused SGD steps where the backend allows), pi_i ->
``mixture.weights`` (personal, ``[M]``, uniform at the first visit), q -> ``responsibilities``,
M -> ``components``. Component m is initialized like FedAvg's model with the seed ``seed + 2m``,
so with M = 1 FedEM is FedAvg exactly.

A new client (``join``, Section 3.2): keeps the learned components and computes its weights from
a uniform start by ``join_em_steps`` E-steps and weight updates (the paper: one) on its training
split, each from the weights of the step before; the run's ``join_epochs``, which sets epochs of
local steps for other methods, is refused. Trained clients use the weights of their last round (``adapt`` is the identity), as in the
paper and the authors' code.

Differences from the authors' code (omarfoq/FedEM): the components train on the same minibatches
(the code lets each component draw its own shuffle); the learning rate is constant unless the
config schedules it (the code decays it by steps); the code's unseen clients keep their weights
between evaluations, so after many evaluations they have run many E-steps (``join_em_steps``
larger than 1 comes close); binary tasks use a 2-way softmax head instead of a sigmoid output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor
from torch.func import vmap

from pflego import tree
from pflego.algorithms.base import Algorithm, register
from pflego.fields import at_least, setting
from pflego.local import train_steps
from pflego.loss import ModelLoss, cross_entropies
from pflego.tree import Params
from pflego.types import ClientData, ClientOut, ClientState, RoundContext, Schedule

WEIGHTS = "mixture.weights"


@register("fedem")
@dataclass(frozen=True)
class FedEM(Algorithm):
    components: int = setting(3, "the number M of mixture components (shared models)", at_least(1))
    join_em_steps: int = setting(1, "E-steps and weight updates a new client takes", at_least(1))

    shared: ClassVar[tuple[str, ...]] = ("body", "head")
    personal: ClassVar[tuple[str, ...]] = ("mixture",)
    join_trains: ClassVar[bool] = False  # a new client runs join_em_steps E-steps, not epochs

    # --- the mixture's maths --------------------------------------------------------------------

    def component_logits(self, components: Params, x: Tensor) -> Tensor:
        """Logits ``[M, n, C]`` of every component on ``x``, as one vmapped forward.

        A single component runs without vmap, whose batched products round differently from the
        plain ones: with M = 1 FedEM then computes FedAvg's numbers to the last bit.
        """
        if self.components == 1:
            return self.model.forward({k: v[0] for k, v in components.items()}, x).unsqueeze(0)
        return vmap(self.model.forward, in_dims=(0, None))(components, x)

    def sample_losses(self, components: Params, data: ClientData) -> Tensor:
        """``l(theta_m; x_s, y_s)`` for every component and local sample, ``[M, n]``."""
        return cross_entropies(self.component_logits(components, data.x), data.y, data.label_mask)

    def e_step(
        self, components: Params, weights: Tensor, data: ClientData
    ) -> tuple[Tensor, Tensor]:
        """Responsibilities ``q [M, n]`` (Eq. 8) and the new mixture weights (Eq. 9).

        Padding samples (``data.mask`` 0) get responsibilities but do not enter the weights.
        """
        with torch.no_grad():
            losses = self.sample_losses(components, data)
            responsibilities = torch.softmax(torch.log(weights).unsqueeze(-1) - losses, dim=0)
            new_weights = (responsibilities * data.mask).sum(-1) / data.mask.sum().clamp(min=1)
        return responsibilities, new_weights

    def fit_components(
        self, components: Params, responsibilities: Tensor, data: ClientData, ctx: RoundContext
    ) -> tuple[Params, Tensor]:
        """Eq. (10) approximated: the local schedule on the responsibility-weighted losses.

        The loss is a sum over components, each term depending on its own component only, so
        (with the client optimizer acting leaf by leaf) the components train one after the other
        on the same minibatches: each on a declared loss, whose SGD steps may run fused.
        """
        opt = self.client_optimizer
        trained, total = [], torch.zeros(())
        for m in range(self.components):
            theta = {k: v[m] for k, v in components.items()}
            loss = ModelLoss(self.model, data.label_mask, sample_weights=responsibilities[m])
            theta, _, mean_loss = train_steps(
                loss, theta, data, opt, opt.init(theta), ctx.client_lr
            )
            trained.append(theta)
            total = total + mean_loss
        return tree.stack(trained), total

    def em_round(
        self, components: Params, weights: Tensor, data: ClientData, ctx: RoundContext
    ) -> tuple[Params, Tensor, Tensor]:
        """One client round: E-step, weight update, component training. Returns the trained
        components, the new weights and the mean training loss."""
        responsibilities, new_weights = self.e_step(components, weights, data)
        trained, mean_loss = self.fit_components(components, responsibilities, data, ctx)
        return trained, new_weights, mean_loss

    # --- the contract -------------------------------------------------------------------------

    def init_params(self, seed: int, dtype: torch.dtype = torch.float32) -> Params:
        """M components, each initialized like FedAvg's model (component m with ``seed + 2m``)."""
        return tree.stack(
            super(FedEM, self).init_params(seed + 2 * m, dtype) for m in range(self.components)
        )

    def init_client(
        self, downlink: Params, generator: torch.Generator, ctx: RoundContext
    ) -> ClientState:
        dtype = next(iter(downlink.values())).dtype
        return {WEIGHTS: torch.full((self.components,), 1 / self.components, dtype=dtype)}

    def client_update(self, downlink, state, data: ClientData, ctx: RoundContext):
        trained, weights, mean_loss = self.em_round(downlink, state[WEIGHTS], data, ctx)
        upload = tree.sub(downlink, trained)
        return ClientOut(upload, data.num_samples, {"loss": mean_loss}), {WEIGHTS: weights}

    def mixture_log_probs(self, components: Params, weights: Tensor, x: Tensor) -> Tensor:
        """``log sum_m pi_m softmax(h_theta_m(x))``, ``[n, C]``."""
        log_probs = torch.log_softmax(self.component_logits(components, x), -1)
        return torch.logsumexp(torch.log(weights)[:, None, None] + log_probs, dim=0)

    def predict(self, downlink: Params, state: ClientState, x: Tensor) -> Tensor:
        return self.mixture_log_probs(downlink, state[WEIGHTS], x)

    def join(self, downlink, state, data: ClientData, ctx: RoundContext) -> ClientState:
        """A new client: E-steps and weight updates from its uniform first-visit weights."""
        weights = state[WEIGHTS]
        for _ in range(self.join_em_steps):
            _, weights = self.e_step(downlink, weights, data)
        return {WEIGHTS: weights}

    def adapt_schedule(self, run: Schedule) -> Schedule:
        return Schedule(1)  # the E-step reads the whole local set; no minibatches are needed
