"""APFL: adaptive personalized federated learning, a mixture of a global and a local model.

Deng, Kamani, Mahdavi. "Adaptive Personalized Federated Learning". arXiv:2003.13461, 2020.

Each client keeps a local model v_i and a mixing weight alpha_i; its personalized model is
``v-bar_i = alpha_i v_i + (1 - alpha_i) w``. Per local step on a minibatch (Algorithm 1), all at
the step's starting point:

- ``w_i <- w_i - eta grad f_i(w_i)`` (the local copy of the global model, as in FedAvg);
- ``v_i <- v_i - eta grad_v f_i(v-bar_i) = v_i - eta alpha_i grad f_i(v-bar_i)``;
- with ``adaptive_alpha``: ``alpha_i <- alpha_i - eta <v_i - w_i, grad f_i(v-bar_i)>``, projected
  onto [0, 1].

The server averages the w_i (N_i-weighted). Prediction uses v-bar_i with the current global w.

Symbols to code: w -> ``body.*`` / ``head.*`` (shared), v_i -> the client state ``v.*``, alpha_i ->
``alpha`` in the state (initialized to the option ``alpha``), eta -> ``ctx.client_lr``. Every
evaluation logs ``alpha_mean`` / ``alpha_min`` / ``alpha_max`` over the clients that have trained.

When alpha_i steps (``alpha_update``). Algorithm 1 takes alpha_i's gradient at every local step
against the local copy w_i (``"step"``, the default). After many local steps w_i has itself fit
the client's data, so ``<v_i - w_i, grad f_i(v-bar_i)>`` is positive and alpha_i is driven to 0;
there v_i's gradient ``alpha_i grad f_i`` vanishes and v_i stops moving. The personalized model,
however, mixes v_i with the *global* w. On MNIST with 20 clients of 2 classes, one epoch of batch
10 (300 steps) and lr 0.01, alpha_i falls from 0.5 to 0.02 within the first 100 steps of round 0
and stays near 0 (mean below 0.002 until round 30), so APFL's accuracy is FedAvg's (84.1 / 86.4 /
87.7% at rounds 10 / 20 / 30, 92.2% at round 50). The authors' code (FedTorch,
``train_and_validate_federated_apfl``) takes alpha_i's step once per round, at the round's first
local step, where w_i is still the global model: ``alpha_update="round"`` does that (the gradient
of Algorithm 1 at the first step's starting point and minibatch; the code's extra ``0.02 alpha``
term is not added). On the same MNIST run it gives 98.3 / 98.6% at rounds 10 / 50 (alpha_i 0.54 to
0.58 at round 50), as a fixed alpha = 0.5 does (98.3% at round 10). Algorithm 1 stays the default,
as the paper's rule.

Deliberate differences: the three updates run as one step of the client optimizer on (w_i, v_i,
alpha_i), so with ``client_optimizer: momentum`` (the PGFed paper's setting) v_i and alpha_i get
momentum too; with plain SGD this is the paper's Algorithm 1. The optimizer's weight decay acts on
w_i and v_i only, never on alpha_i (which it would pull toward 0). The authors of PGFed run APFL
with plain SGD and a fixed alpha = 0.5. v_i starts as the global model of the first round the
client trains in (the authors' code: the initial model), and a client that has not trained yet
predicts with w.

A client that never trained runs these local steps once from the global model (``v_i = w``) on its
training split (the run's schedule) and predicts with the resulting mixture.

Speed: with alpha_i fixed through each step (not ``adaptive_alpha`` with ``alpha_update="step"``),
a client's steps are one step program with the client optimizer, which runs fused
(:mod:`pflego.fused_bilevel`) for plain SGD on the ``fused`` backend (``auto`` then picks it on
CPU); otherwise autograd, step by step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from pflego import tree
from pflego.algorithms.base import Algorithm, register
from pflego.fields import between, one_of, setting
from pflego.local import run_program, train_steps
from pflego.optim import Optimizer, OptState
from pflego.program import Step
from pflego.tree import Params
from pflego.types import ClientData, ClientOut, RoundContext

MIXING = "alpha"
ALPHA_UPDATES = ("step", "round")


@dataclass(frozen=True)
class DecayModelsOnly(Optimizer):
    """``inner`` (built without weight decay) with the L2 term ``decay * p`` added to the gradient
    of every parameter but the mixing weight: weight decay regularizes the models w_i and v_i,
    not alpha_i (which it would otherwise pull toward 0)."""

    inner: Optimizer
    decay: float

    def decayed(self, params: Params, grads: Params) -> Params:
        return {k: g if k == MIXING else g + self.decay * params[k] for k, g in grads.items()}

    def init(self, params: Params) -> OptState:
        return self.inner.init(params)

    def update(
        self, params: Params, grads: Params, state: OptState, lr: float | Tensor
    ) -> tuple[Params, OptState]:
        return self.inner.update(params, self.decayed(params, grads), state, lr)

    def masked_update(
        self, params: Params, grads: Params, state: OptState, lr: float | Tensor, active: Tensor
    ) -> tuple[Params, OptState]:
        return self.inner.masked_update(params, self.decayed(params, grads), state, lr, active)


@register("apfl")
@dataclass(frozen=True)
class APFL(Algorithm):
    alpha: float = setting(
        0.5,
        "weight of the personal model in alpha v + (1 - alpha) w (the start, with adaptive_alpha)",
        between(0, 1),
    )
    adaptive_alpha: bool = setting(
        False, "learn each client's alpha by gradient steps, projected onto [0, 1]"
    )
    alpha_update: str = setting(
        "step",
        "when alpha steps: every local step, or once per round as the authors' code",
        one_of(*ALPHA_UPDATES, says="must be one of"),
    )

    shared: ClassVar[tuple[str, ...]] = ("body", "head")
    # eta of the models' and of alpha's steps: the least worst-case regret over three federations
    # of benchmarks/defaults_study.py (docs/defaults.md); 0.05 was 12% below the best
    default_client_lr: ClassVar[float] = 0.3

    def init_client(self, downlink, generator, ctx):
        """No v_i yet (``trained`` = 0): it starts as the global model of the first round the client
        trains in, and the client predicts with w until then; alpha_i = ``alpha``."""
        first = next(iter(downlink.values()))
        return {
            **tree.add_prefix("v.", tree.zeros_like(downlink)),
            "alpha": first.new_tensor(self.alpha),
            "trained": first.new_zeros(()),
        }

    def local_model(self, downlink, state):
        """v_i once the client has trained, else the global model w."""
        v = tree.strip_prefix("v.", state)
        return tree.where(state["trained"] > 0, {k: v[k] for k in downlink}, downlink)

    def mixture(self, w, v, alpha):
        """``alpha v + (1 - alpha) w``, leaf by leaf (one ``lerp`` pass each, as the fused step
        mixes)."""
        return {k: torch.lerp(w[k], v[k], alpha) for k in w}

    def local_optimizer(self) -> Optimizer:
        """The client optimizer, its weight decay (if any) kept off the mixing weight alpha_i."""
        decay = getattr(self.client_optimizer, "weight_decay", 0.0)
        if not (self.adaptive_alpha and self.alpha_update == "step" and decay):
            return self.client_optimizer
        return DecayModelsOnly(dataclasses.replace(self.client_optimizer, weight_decay=0.0), decay)

    def first_step_alpha(
        self, w: Params, v: Params, alpha: Tensor, data: ClientData, lr: float
    ) -> Tensor:
        """alpha_i after one projected gradient step taken at the round's first real local step,
        at its starting point (w_i = the global model) and on its minibatch:
        ``alpha - lr <v - w, grad f_i(v-bar)>`` (unchanged for a client with no real step)."""
        real = data.batch_mask.sum(-1) > 0
        first = torch.argmax(real.to(torch.int64)).reshape(1)
        idx, mask = (
            data.batches.index_select(0, first)[0],
            data.batch_mask.index_select(0, first)[0],
        )
        x, y = data.x[idx], data.y[idx]

        def risk(a: Tensor) -> Tensor:
            return self.loss(self.mixture(w, v, a), x, y, mask, data.label_mask)

        stepped = (alpha - lr * torch.func.grad(risk)(alpha)).clamp(0, 1)
        return torch.where(real.any(), stepped, alpha)

    def client_update(self, downlink, state, data: ClientData, ctx: RoundContext):
        v, alpha = self.local_model(downlink, state), state["alpha"]
        optimizer = self.local_optimizer()
        if self.adaptive_alpha and self.alpha_update == "step":  # alpha_i a parameter of each step
            w, v, alpha, mean_loss = self.autograd_steps(
                downlink, v, alpha, optimizer, data, ctx.client_lr
            )
        else:  # alpha_i fixed within each step: a step program (fused where it can)
            once = None
            if self.adaptive_alpha:  # alpha_update "round"
                once = self.first_step_alpha(downlink, v, alpha, data, ctx.client_lr)
            steps = self.program(alpha, once, data, ctx.client_lr)
            objective = self.model_objective(data.label_mask)
            outcome = run_program(objective, [downlink, v, None], data, steps, optimizer)
            w, v, _ = outcome.points
            alpha = alpha if once is None else once
            mean_loss = outcome.mean_value(stride=2)
        new_state = {
            **tree.add_prefix("v.", v),
            "alpha": alpha,
            "trained": torch.ones_like(state["trained"]),
        }
        metrics = {"loss": mean_loss}  # f_i(w) + f_i(v-bar), per step
        return ClientOut(tree.sub(downlink, w), data.num_samples, metrics), new_state

    def autograd_steps(
        self, w: Params, v: Params, alpha: Tensor, optimizer: Optimizer, data: ClientData, lr: float
    ) -> tuple[Params, Params, Tensor, Tensor]:
        """The round's local steps with alpha_i a parameter, one ``train_steps`` call each (alpha_i
        projected onto [0, 1] after it); returns w_i, v_i, alpha_i and the mean loss over the
        real steps."""

        def objective(p, x, y, m):
            w, v = tree.strip_prefix("w.", p), tree.strip_prefix("v.", p)
            # w enters the mixture as a constant: its own gradient is grad f_i(w) alone.
            mixed = self.mixture(tree.detach(w), v, p["alpha"])
            return self.loss(w, x, y, m, data.label_mask) + self.loss(
                mixed, x, y, m, data.label_mask
            )

        params = {**tree.add_prefix("w.", w), **tree.add_prefix("v.", v), "alpha": alpha}
        opt_state = optimizer.init(params)
        total, count = torch.zeros(()), torch.zeros(())
        for s in range(data.batches.shape[0]):
            params, opt_state, loss = train_steps(
                objective, params, data, optimizer, opt_state, lr, slice(s, s + 1)
            )
            params["alpha"] = params["alpha"].clamp(0, 1)
            real = data.batch_mask[s].sum() > 0
            total, count = total + loss, count + real.to(count.dtype)
        w, v = tree.strip_prefix("w.", params), tree.strip_prefix("v.", params)
        return w, v, params["alpha"], total / count.clamp(min=1)

    def program(
        self, alpha: Tensor, once: Tensor | None, data: ClientData, lr: float
    ) -> list[Step]:
        """The round's steps with alpha_i fixed within each step, on the points w (0), v (1)
        and v-bar (2, scratch): per step, w's step at w and v's at the mixture v-bar of the step's
        starting point, whose gradient in v is ``a grad f_i(v-bar)``, with ``a`` the old alpha_i
        until the first real step and ``once`` (when given) after it."""
        real = (data.batch_mask.sum(-1) > 0).to(alpha.dtype)
        before = torch.cumsum(real, 0) - real  # the real steps before each
        weights = alpha.expand_as(real) if once is None else torch.where(before > 0, once, alpha)
        steps = []
        for row, a in enumerate(weights.unbind(0)):
            mix = ((2, 0, 1, a),)  # v-bar <- w + a (v - w)
            steps += [Step(0, 0, lr, 1.0, row, mix), Step(2, 1, lr, 1.0, row, scale=a)]
        return steps

    def population_metrics(self, server, states):
        """alpha_i over the clients that have trained: ``alpha_mean``, ``alpha_min``, ``alpha_max``
        (the option ``alpha`` while none has)."""
        if "alpha" not in states:
            return {}
        alpha, trained = states["alpha"], states["trained"] > 0
        count = trained.sum()
        start = alpha.new_tensor(self.alpha)
        mean = torch.where(trained, alpha, 0.0).sum() / count.clamp(min=1)
        low = torch.where(trained, alpha, torch.inf).min()
        high = torch.where(trained, alpha, -torch.inf).max()
        some = count > 0
        return {
            "alpha_mean": torch.where(some, mean, start),
            "alpha_min": torch.where(some, low, start),
            "alpha_max": torch.where(some, high, start),
        }

    def predict(self, downlink, state, x):
        """The personalized model v-bar_i = alpha_i v_i + (1 - alpha_i) w."""
        mixed = self.mixture(downlink, self.local_model(downlink, state), state["alpha"])
        return self.model.forward(mixed, x)

    def join(self, downlink, state, data, ctx):
        """The local steps of a round from the global model; the w copy is dropped."""
        return self.client_update(downlink, state, data, ctx)[1]
