"""GPFL: global and personalized feature learning through a conditional valve.

Zhang, Hua, Wang, Song, Xue, Ma, Cao, Guan. "GPFL: Simultaneously Learning Global and Personalized
Feature Information for Personalized Federated Learning". ICCV 2023; arXiv:2308.10279. Authors'
code: github.com/TsingZ0/GPFL (``clientgp.py``, ``servergp.py``; PFLlib's ``clientgpfl.py``,
``servergpfl.py`` are the same).

The body phi (shared) gives features f = phi(x) ``[M]``. The Conditional Valve (CoV, shared) turns
them into a global and a personalized feature by a FiLM-style modulation conditioned on a vector c:

    CoV(f, c) = ReLU(f * (gamma(c) + 1) + beta(c)),
    gamma(c) = LayerNorm(ReLU(W_g c + b_g)),  beta(c) = LayerNorm(ReLU(W_b c + b_b)),

with the generic conditional input g = (1/C) sum_c GCE[c] and client i's personalized one
p_i = sum_c alpha_{i,c} GCE[c] (alpha_{i,c}: the share of class c in client i's training data),
GCE ``[C, M]`` the Global Category Embedding layer (shared). f^G = CoV(f, g), f^P_i = CoV(f, p_i).
Client i descends, per minibatch,

    L_i = CE(h_i(f^P_i), y)                                       (personalized head h_i, private)
        + CE(cos(f^G, GCE), y)                                    (angle-level guidance)
        + lambda * || f^G - sg(GCE^t)[y] ||_2                     (magnitude-level guidance)
        + mu / 2 * (||theta^CoV||^2 + ||GCE||^2),                 (regularizer, see below)

cos(f^G, GCE) the C cosine similarities of f^G with the rows of GCE (unscaled logits), sg(GCE^t)
the GCE received this round (held fixed), ||.||_2 the Frobenius norm of the batch's ``[B, M]``
differences (a sum over the batch, not a mean, as in the authors' code). The server averages phi,
CoV and GCE weighted by N_i; h_i never leaves the client.

Symbols to code: phi -> ``body.*``; CoV -> ``cov.gamma.*`` / ``cov.beta.*`` (``linear.weight``,
``linear.bias``, ``norm.weight``, ``norm.bias``: Linear(M, M), ReLU, LayerNorm(M) with eps 1e-5, as
the authors' module); GCE -> ``gce.embedding`` ``[C, M]`` (N(0, 1) at initialization, as
``nn.Embedding``); h_i -> the client state ``head.*`` (C-way); alpha_i -> the client state
``gpfl.alpha`` ``[C]``; lambda -> ``lam`` (default 0.01), mu -> ``mu`` (default 0.1): the authors'
``run_me.sh`` values for the 4-layer CNN and the 3-layer MLP (0.0001 and 0 for ResNet-18 and
fastText); the step size -> ``ctx.client_lr`` for every part.

Where the authors' code realizes the paper's terms, followed here: the mu term is SGD weight decay
mu on the CoV's and GCE's parameters (the gradient of mu/2 ||.||^2, added to the loss here so that
any client optimizer sees it; the same for SGD; the paper's own normalization of this term, 1/2 or
not, could not be checked offline); the conditional inputs and sg(GCE^t) carry no gradient.

Deliberate differences:
- g and p_i are formed from the GCE received this round. The authors' code forms them, at the end
  of the previous round, from the client's own GCE before it is overwritten by the new global one
  (its locally trained GCE when it trained that round, else the previous global GCE), and uses
  zero conditional inputs in the first round.
- Before a client's first round (the state has no class shares yet) it predicts with the generic
  input g (alpha uniform); the authors' code never evaluates a client before it has them.
- The personal head starts from the run's per-client head initialization (``head_init``); the
  authors' code starts every client from the same initial head.

A client that never trained (``join``) takes its class shares from its training split and fits a
new head on the frozen personalized features CoV(phi(x), p_i) (the run's schedule).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from pflego import tree
from pflego.algorithms.base import Algorithm, register
from pflego.fields import non_negative, setting
from pflego.local import train_steps
from pflego.loss import cross_entropies, masked_cross_entropy
from pflego.models import head_logits
from pflego.tree import Params
from pflego.types import ClientData, ClientOut, RoundContext

GCE = "gce.embedding"  # the Global Category Embedding layer, [C, M]
ALPHA = "gpfl.alpha"  # the client's class shares alpha_i, [C]
SHARED = ("body", "cov", "gce")
LAYER_NORM_EPS = 1e-5


def valve_branch(params: Params, name: str, context: Tensor) -> Tensor:
    """``LayerNorm(ReLU(W c + b))`` of the branch ``cov.<name>``."""
    p = f"cov.{name}."
    hidden = torch.relu(context @ params[p + "linear.weight"].T + params[p + "linear.bias"])
    return F.layer_norm(
        hidden,
        hidden.shape[-1:],
        params[p + "norm.weight"],
        params[p + "norm.bias"],
        LAYER_NORM_EPS,
    )


def conditional_valve(params: Params, features: Tensor, context: Tensor) -> Tensor:
    """CoV(f, c) = ReLU(f * (gamma(c) + 1) + beta(c))."""
    gamma = valve_branch(params, "gamma", context)
    beta = valve_branch(params, "beta", context)
    return torch.relu(features * (gamma + 1) + beta)


def conditional_inputs(embedding: Tensor, alpha: Tensor) -> tuple[Tensor, Tensor]:
    """The generic input g (the mean of GCE's rows) and the personalized p_i = alpha_i @ GCE."""
    embedding = embedding.detach()
    return embedding.mean(0), alpha @ embedding


def class_shares(data: ClientData, num_classes: int) -> Tensor:
    """alpha_i: each class's share of the client's (real) training samples."""
    counts = (F.one_hot(data.y, num_classes).to(data.x.dtype) * data.mask[:, None]).sum(0)
    return counts / counts.sum().clamp(min=1)


def safe_norm(sq: Tensor) -> Tensor:
    """``sqrt(sq)``, with a zero (not NaN) gradient where ``sq`` is 0 (an all-padding step)."""
    positive = sq > 0
    return torch.where(positive, torch.sqrt(torch.where(positive, sq, 1.0)), 0.0)


@register("gpfl")
@dataclass(frozen=True)
class GPFL(Algorithm):
    lam: float = setting(0.01, "strength lambda of the magnitude-level guidance", non_negative)
    mu: float = setting(
        0.1, "strength mu of the regularizer of the valve and the category embedding", non_negative
    )

    shared: ClassVar[tuple[str, ...]] = SHARED
    personal: ClassVar[tuple[str, ...]] = ("head", "gpfl")
    default_client_lr: ClassVar[float] = 0.05  # the defaults study's choice (0.3: 28% below)

    def init_params(self, seed: int, dtype: torch.dtype = torch.float32) -> Params:
        """The body, the CoV (PyTorch's Linear and LayerNorm initializations) and GCE ~ N(0, 1)."""
        params = self.model.init_body(seed, dtype)
        m, c = self.model.feature_dim, self.model.num_classes
        gen = torch.Generator().manual_seed(seed + 2)
        bound = 1 / math.sqrt(m)
        for name in ("gamma", "beta"):
            p = f"cov.{name}."
            params[p + "linear.weight"] = (
                torch.rand(m, m, generator=gen, dtype=torch.float64) * 2 - 1
            ) * bound
            params[p + "linear.bias"] = (
                torch.rand(m, generator=gen, dtype=torch.float64) * 2 - 1
            ) * bound
            params[p + "norm.weight"] = torch.ones(m, dtype=torch.float64)
            params[p + "norm.bias"] = torch.zeros(m, dtype=torch.float64)
        params[GCE] = torch.randn(c, m, generator=gen, dtype=torch.float64)
        return {k: v.to(dtype) for k, v in params.items()}

    def init_client(self, downlink, generator, ctx):
        """A personal head, and uniform class shares until the client trains (input g)."""
        head = super().init_client(downlink, generator, ctx)
        c = self.model.num_classes
        return {**head, ALPHA: torch.full((c,), 1 / c, dtype=head["head.weight"].dtype)}

    def local_loss(self, alpha: Tensor, frozen: Tensor, label_mask: Tensor):
        """L_i on a minibatch, with alpha_i and the received GCE (``frozen``) fixed."""
        generic, personalized = conditional_inputs(frozen, alpha)

        def loss(params: Params, x: Tensor, y: Tensor, mask: Tensor) -> Tensor:
            f = self.model.features(params, x)
            f_p = conditional_valve(params, f, personalized)
            f_g = conditional_valve(params, f, generic)
            personal = masked_cross_entropy(head_logits(params, f_p), y, mask, label_mask)
            cosine = F.normalize(f_g, dim=-1) @ F.normalize(params[GCE], dim=-1).T
            angle = (cross_entropies(cosine, y) * mask).sum() / mask.sum().clamp(min=1)
            gap = ((f_g - frozen[y]) ** 2).sum(-1)
            magnitude = safe_norm((gap * mask).sum())
            decay = tree.sq_norm(tree.select(params, ("cov", "gce")))
            return personal + angle + self.lam * magnitude + self.mu / 2 * decay

        return loss

    def client_update(self, downlink, state, data: ClientData, ctx: RoundContext):
        alpha = class_shares(data, self.model.num_classes)
        shared = tree.select(downlink, SHARED)
        params = {**shared, **tree.select(state, ["head"])}
        loss = self.local_loss(alpha, downlink[GCE], data.label_mask)
        opt = self.client_optimizer
        trained, _, mean_loss = train_steps(
            loss, params, data, opt, opt.init(params), ctx.client_lr
        )
        upload = tree.sub(shared, tree.select(trained, SHARED))
        new_state = {**tree.select(trained, ["head"]), ALPHA: alpha}
        return ClientOut(upload, data.num_samples, {"loss": mean_loss}), new_state

    def personalized_features(self, downlink: Params, alpha: Tensor, x: Tensor) -> Tensor:
        """f^P_i = CoV(phi(x), p_i)."""
        _, personalized = conditional_inputs(downlink[GCE], alpha)
        return conditional_valve(downlink, self.model.features(downlink, x), personalized)

    def predict(self, downlink, state, x):
        """h_i(CoV(phi(x), p_i))."""
        return head_logits(state, self.personalized_features(downlink, state[ALPHA], x))

    def join(self, downlink, state, data, ctx):
        """Class shares from the training split, and a new head on the frozen f^P_i."""
        alpha = class_shares(data, self.model.num_classes)
        features = self.personalized_features(downlink, alpha, data.x).detach()
        opt, head = self.client_optimizer, tree.select(state, ["head"])
        loss = lambda h, f, y, m: masked_cross_entropy(  # noqa: E731
            head_logits(h, f), y, m, data.label_mask
        )
        trained, _, _ = train_steps(
            loss, head, data._replace(x=features), opt, opt.init(head), ctx.client_lr
        )
        return {**trained, ALPHA: alpha}
