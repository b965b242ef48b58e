"""FedSR: simple representations for domain generalization in federated learning.

Nguyen, Torr, Lim. "FedSR: A Simple and Effective Domain Generalization Method for Federated
Learning". NeurIPS 2022 (OpenReview mrLBFM-L5K; no arXiv id).

FedAvg over a probabilistic representation: the encoder maps x to a Gaussian
p(z|x) = N(mu(x), diag sigma(x)^2), the classifier reads a sample z = mu + sigma * eps, and each
client minimizes, on its minibatches,

    CE(h(z), y) + alpha_L2R E||z||^2 + alpha_CMI KL(p(z|x) || r(z|y)),

where the L2 term (L2R) keeps the representation small and the conditional mutual information
term (CMI, an upper bound of I(x; z | y)) pulls p(z|x) to a learned reference distribution of
its class, r(z|y) = N(r_mu[y], diag r_sigma[y]^2):

    KL = sum_j log(r_sigma_j / sigma_j) + (sigma_j^2 + (mu_j - r_mu_j)^2) / (2 r_sigma_j^2) - 1/2.

The server averages every parameter, the reference distribution included, weighted by N_i
(server SGD with lr 1 on ``w - w_i``).

Symbols to code: the encoder is the model's body followed by the linear map ``sr.map.*``
(``[2M, M]``): its output's first M entries are mu, the last M give sigma = softplus(.) + 1e-6;
h -> ``head.*`` (C-way, shared); r_mu -> ``sr.r_mu`` ``[C, M]`` (zeros at first), r_sigma ->
softplus(``sr.r_sigma``) + 1e-6 (``sr.r_sigma`` ones at first, as the authors' code);
alpha_L2R -> ``l2r`` (0.01), alpha_CMI -> ``cmi`` (5e-4), the defaults of the authors' code and
FL-bench; eps -> :func:`pflego.rng.counter_normal` of the client's key, the sample's index and
the coordinate; the key, the client's state, is drawn at its first visit and hashed into the
next one after every round. The expectations are the masked means over the minibatch's real
samples of one draw each.

Deliberate differences:
- One draw of eps per sample and round: a sample seen twice in a round (``local_epochs`` > 1)
  reuses its draw (the authors redraw at every step). Counter-based draws are the same in every
  backend and on Flower.
- The L2 term is the paper's squared norm E||z||^2; the authors' code and FL-bench take the
  norm itself, ``z.norm(dim=1).mean()``.
- The authors' code and FL-bench scale mu and sigma by a learnable scalar C inside the KL only;
  the paper has no such scale and neither has this file. FL-bench also applies a ReLU to the
  encoder's output, before the split into mu and sigma (so mu >= 0 and sigma >= log 2); here,
  as in the paper, mu is unconstrained.
- Both scales are floored, softplus(.) + 1e-6, so that the KL and its gradient stay finite
  where a scale's softplus underflows to 0 (the authors' code would divide by 0 there).
- Prediction uses the mean representation, ``h(mu(x))``; the authors' and FL-bench's forward
  draw one z at test time as well.

Unseen clients (``join``): nothing; FedSR is a global method, every client predicts with the
global model.
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
from pflego.loss import masked_cross_entropy
from pflego.models import head_logits
from pflego.rng import counter_normal, next_key
from pflego.tree import Params
from pflego.types import ClientData, ClientOut, RoundContext

SHARED = ("body", "head", "sr")
KEY = "key"  # the client's key of its draws of eps
KEYS = 2**24  # keys are drawn below this, exact in float32 state
FLOOR = 1e-6  # added to every scale, sigma and r_sigma, so that the KL stays finite


def scale(a: Tensor) -> Tensor:
    """A positive scale from an unconstrained value: softplus(a) + 1e-6."""
    return F.softplus(a) + FLOOR


@register("fedsr")
@dataclass(frozen=True)
class FedSR(Algorithm):
    shared: ClassVar[tuple[str, ...]] = SHARED
    join_trains: ClassVar[bool] = False  # a new client uses the global model as it is
    l2r: float = setting(
        0.01, "weight alpha_L2R of the representation's squared norm", non_negative
    )
    cmi: float = setting(
        5e-4, "weight alpha_CMI of KL(p(z|x) || r(z|y)), the conditional MI bound", non_negative
    )

    def init_params(self, seed: int, dtype: torch.dtype = torch.float32) -> Params:
        """Body and head as usual; the map to (mu, sigma) with PyTorch's Linear init, and the
        reference distribution r(z|y) (means 0, softplus^-1 of the scales 1)."""
        params = super().init_params(seed, dtype)
        m, c = self.model.feature_dim, self.model.num_classes
        gen = torch.Generator().manual_seed(seed + 2)

        def uniform(*shape: int) -> Tensor:
            return torch.rand(*shape, generator=gen, dtype=torch.float64) * 2 - 1

        sr = {
            "sr.map.weight": uniform(2 * m, m) / math.sqrt(m),
            "sr.map.bias": uniform(2 * m) / math.sqrt(m),
            "sr.r_mu": torch.zeros(c, m, dtype=torch.float64),
            "sr.r_sigma": torch.ones(c, m, dtype=torch.float64),
        }
        return params | {k: v.to(dtype) for k, v in sr.items()}

    def init_client(self, downlink, generator, ctx):
        """The client's key of its draws of eps."""
        first = next(iter(downlink.values()))
        return {KEY: torch.randint(0, KEYS, (), generator=generator).to(first.dtype)}

    def distribution(self, params: Params, x: Tensor) -> tuple[Tensor, Tensor]:
        """``(mu(x), sigma(x))``, each ``[n, M]``."""
        out = F.linear(
            self.model.features(params, x), params["sr.map.weight"], params["sr.map.bias"]
        )
        m = self.model.feature_dim
        return out[..., :m], scale(out[..., m:])

    def objective(self, x_all: Tensor, eps: Tensor, label_mask: Tensor):
        """The local loss on a minibatch given as the indices of its samples."""

        def loss(params: Params, i: Tensor, y: Tensor, mask: Tensor) -> Tensor:
            mu, sigma = self.distribution(params, x_all[i])
            z = mu + sigma * eps[i]
            ce = masked_cross_entropy(head_logits(params, z), y, mask, label_mask)
            r_mu, r_sigma = params["sr.r_mu"][y], scale(params["sr.r_sigma"])[y]
            kl = (
                torch.log(r_sigma / sigma) + (sigma**2 + (mu - r_mu) ** 2) / (2 * r_sigma**2) - 0.5
            ).sum(-1)
            per_sample = self.l2r * (z**2).sum(-1) + self.cmi * kl
            return ce + (per_sample * mask).sum() / mask.sum().clamp(min=1)

        return loss

    def client_update(self, downlink, state, data: ClientData, ctx: RoundContext):
        n, m = data.x.shape[0], self.model.feature_dim
        rows, cols = torch.arange(n)[:, None], torch.arange(m)[None, :]
        eps = counter_normal(state[KEY], rows, cols, dtype=data.x.dtype)
        loss = self.objective(data.x, eps, data.label_mask)
        opt = self.client_optimizer
        indexed = data._replace(x=torch.arange(n, device=data.x.device))
        trained, _, mean_loss = train_steps(
            loss, downlink, indexed, opt, opt.init(downlink), ctx.client_lr
        )
        out = ClientOut(tree.sub(downlink, trained), data.num_samples, {"loss": mean_loss})
        return out, {KEY: next_key(state[KEY])}

    def predict(self, downlink, state, x):
        """The classifier on the mean representation, ``h(mu(x))``."""
        return head_logits(downlink, self.distribution(downlink, x)[0])
