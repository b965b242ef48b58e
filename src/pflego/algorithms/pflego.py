"""PFLEGO: personalized federated learning with exact distributed stochastic gradient descent.

Nikoloutsopoulos, Koutsopoulos, Titsias. "Personalized Federated Learning with Exact Distributed
Stochastic Gradient Descent Updates". ALA workshop at AAMAS 2023; arXiv:2202.09848.

Objective ``L(psi) = sum_i alpha_i l_i(W_i, theta)`` with ``alpha_i = N_i / N`` over ALL clients.
A sampled client i (``Pr(i in S_t) = r / I``):

1. computes the features ``phi(x; theta)`` once and takes tau-1 steps
   ``W_i <- W_i - beta grad_W l_i`` on them (theta fixed);
2. computes the joint gradient ``(g_W, g_theta)`` of ``l_i`` at the current ``W_i``;
3. steps ``W_i <- W_i - rho_t (I/r) alpha_i g_W`` (Eq. 5 / Proposition 1) and uploads ``g_theta``.

The server steps ``theta <- theta - rho_t (I/r) sum_i alpha_i g_theta_i`` (Eq. 4). Steps 3 and the
server step together are one SGD step on L(psi) with an unbiased gradient; with tau = 1 and full
participation, exact full-batch gradient descent.

Symbols to code: theta -> ``body.*`` (shared), W_i -> ``head.*`` (personal, K_i x (M+1) with the
bias as ``head.bias``; labels renumbered per client), beta -> ``ctx.client_lr``,
rho_t -> ``ctx.server_lr``, I/r -> ``ctx.inverse_inclusion``, alpha_i -> ``N_i / ctx.total_samples``.

Differences, all options:
- ``head_step="eq3"``: the final head step of Eq. (3) and the reference code, without alpha_i (a
  per-block step 1/alpha_i larger). The default ``exact`` is the Proposition 1 form.
- ``--server-optimizer adam``: the reference code's server Adam on the aggregated gradient.
- ``head_init="uniform"``: the reference code's U(0, 1) head initialization.
- A minibatch ``batch_size`` runs the tau-1 head steps on the run's minibatches (the first
  tau-1 rows of its schedule) and the joint gradient on one batch of B samples drawn uniformly
  without replacement from the client's whole set, by its own seed stream (the named schedule
  ``joint``, seeded by (seed, round, client)). That batch is independent of the head steps'
  batches, so given the head W_i its gradient is an unbiased estimate of grad l_i(W_i, theta)
  (tests/test_pflego.py enumerates every draw). Taking it from the same shuffled epoch as the
  head steps would not be: given W_i it would be the samples the head steps did not see. The
  paper uses the whole local set every step (the default).

A new client (``join``): its first-visit head takes tau head steps on the frozen features of the
learned body (step 1 alone, with ``adapt_schedule``'s steps: by default the run's tau).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch.func import grad_and_value, vjp

from pflego import tree
from pflego.algorithms.base import Algorithm, register
from pflego.fields import one_of, setting
from pflego.local import train_steps
from pflego.loss import ModelLoss
from pflego.types import ClientData, ClientOut, RoundContext, Schedule


@register("pflego")
@dataclass(frozen=True)
class PFLEGO(Algorithm):
    head_step: str = setting(
        "exact",
        "the final head step: exact, or eq3 (the paper's Eq. 3)",
        one_of("exact", "eq3", says="must be one of"),
    )

    shared: ClassVar[tuple[str, ...]] = ("body",)
    personal: ClassVar[tuple[str, ...]] = ("head",)
    label_space: ClassVar[str] = "local"
    # beta and rho (SGD server): the least worst-case regret over six federations in the grid of
    # benchmarks/defaults_study.py (docs/defaults.md); the main experiment's beta = rho = 1
    # diverged on MNIST Dirichlet(0.3) with batch 10, and on Fashion-MNIST (issue 25)
    default_client_lr: ClassVar[float] = 0.3
    default_server_lr: ClassVar[float] = 0.1

    def schedules(self, run: Schedule) -> dict[str, Schedule]:
        """The joint gradient's batch: B samples drawn uniformly, apart from the head steps'."""
        return {"joint": Schedule(1, run.batch_size)}

    def client_update(self, downlink, state, data: ClientData, ctx: RoundContext):
        body, head = downlink, state
        joint = data.using("joint")
        idx, mask = joint.batches[-1], joint.batch_mask[-1]
        if idx.shape[-1] == data.x.shape[0]:
            # The joint batch is the whole local set (its rows in order wherever the mask is 1):
            # the joint gradient is taken at the features' own forward pass, so keep its
            # pullback instead of running the body forward a second time.
            features, pullback = vjp(lambda b: self.model.features(b, data.x), body)
        else:
            features, pullback = self.model.features(body, data.x), None
        head, _, _ = train_steps(
            ModelLoss(None, data.label_mask),  # the head on fixed features
            head,
            data._replace(x=features.detach()),
            self.client_optimizer,
            self.client_optimizer.init(head),
            ctx.client_lr,
            steps=slice(0, -1),
        )
        if pullback is not None:
            head_loss = lambda h, f: self.head_loss(h, f, data.y, mask, data.label_mask)  # noqa: E731
            (head_grads, feature_grads), loss = grad_and_value(head_loss, argnums=(0, 1))(
                head, features.detach()
            )
            grads = {**pullback(feature_grads)[0], **head_grads}  # the one body backward
        else:
            joint_loss = lambda p: self.loss(p, data.x[idx], data.y[idx], mask, data.label_mask)  # noqa: E731
            grads, loss = grad_and_value(joint_loss)({**body, **head})  # forward 2 + backward
        alpha = data.num_samples / ctx.total_samples
        head_scale = (
            ctx.server_lr * ctx.inverse_inclusion * (alpha if self.head_step == "exact" else 1.0)
        )
        new_head = tree.axpy(-head_scale, tree.select(grads, ["head"]), head)
        return ClientOut(tree.select(grads, ["body"]), alpha, {"loss": loss.detach()}), new_head

    def join(self, downlink, state, data: ClientData, ctx: RoundContext):
        return self.fit_head(downlink, state, data, ctx)

    def aggregate(self, out: ClientOut, ctx: RoundContext):
        # (I/r) sum_i alpha_i g_i: an unbiased estimate of grad_theta L, not a cohort mean.
        return tree.weighted_sum(out.upload, out.weight * ctx.inverse_inclusion)
