"""pFedFDA: a Gaussian generative classifier whose class statistics interpolate between the
client's own and the federation's.

Mclaughlin, Su. "Personalized Federated Learning via Feature Distribution Adaptation".
NeurIPS 2024; arXiv:2411.00329. Peer code: FL-bench's ``pfedfda`` (KarhouTam/FL-bench).

The model is a shared feature extractor phi and a generative classifier: class-conditional
Gaussians N(mu_c, Sigma) with one covariance, whose Bayes classifier is linear (LDA),

    g(z)_c = <Sigma~^{-1} mu_c, z> - 1/2 <mu_c, Sigma~^{-1} mu_c> + log pi_c,
    Sigma~ = (1 - eps) Sigma + eps tr(Sigma)/M I,

with pi the client's class priors. In round t the server sends phi^t and the global statistics
(mu^g, Sigma^g); a sampled client i trains phi on the cross-entropy of the classifier of
(mu^g, Sigma^g, pi_i), held fixed; with the trained phi it estimates its own statistics (mu^i,
Sigma^i) and the interpolation beta_i in [0, 1] that minimizes the k-fold cross-validated loss of
the classifier of (beta mu^i + (1 - beta) mu^g, beta Sigma^i + (1 - beta) Sigma^g, pi_i), and
uploads phi and the interpolated statistics. The server averages phi and the statistics weighted
by N_i; they become phi^{t+1} and (mu^g, Sigma^g). A client predicts with phi^t and the
classifier of its interpolated statistics estimated on phi^t's features of its training split.

Symbols to code: phi -> ``body.*``; (mu^g, Sigma^g) -> ``server["gauss"]`` (``gauss.mean`` [C, M],
``gauss.cov`` [M, M] in the downlink); pi_i -> (N_ic / N_i + eps), renormalized; eps -> ``eps``
(1e-4, FL-bench's); k -> ``folds`` (2, FL-bench's); beta -> the best of ``betas`` evenly spaced
values in [0, 1]; the client's estimate: mu^i_c the class mean for a class with more than k
samples (else mu^g_c), Sigma^i the scatter about those means over N_i - 1, plus the identity
(FL-bench's); the local solver -> the run's client optimizer and ``ctx.client_lr``.

Deliberate differences and choices:
- One beta for means and covariance, chosen on a grid (FL-bench: ``single_beta``, else two, by
  10 L-BFGS iterations from 0.5); the folds are stratified by a sample's rank within its class
  (FL-bench shuffles), classes with fewer than k samples are left out of the cross-validation,
  and with nothing to validate on beta is 0 (FL-bench's fallback).
- The personalized classifier is built at evaluation (``adapt``) from the training split;
  FL-bench estimates it from the test split, which it then scores. The global statistics start as
  a seeded uniform draw of the means and the identity (FL-bench's ``torch.rand`` and identity).
- FL-bench also adds eps to every entry of its covariance estimates and projects them to the
  nearest PSD matrix; the scatter plus the identity needs neither. ``test_acc_before_adapt`` is
  the classifier of the global statistics with uniform priors.

Unseen clients (``join``): the same as ``adapt``, estimating their statistics with phi^t.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from pflego import tree
from pflego.algorithms.base import Algorithm, register
from pflego.algorithms.fedproto import one_hot
from pflego.fields import at_least, positive, setting
from pflego.local import train_steps
from pflego.loss import Objective
from pflego.tree import Params
from pflego.types import ClientData, ClientOut, ClientState, RoundContext, ServerState

MEAN, COV = "gauss.mean", "gauss.cov"


def lda_head(mean: Tensor, cov: Tensor, prior: Tensor, eps: float) -> Params:
    """The linear head of the Gaussians N(mean_c, cov) with class priors ``prior``."""
    m = cov.shape[-1]
    eye = torch.eye(m, dtype=cov.dtype, device=cov.device)
    shrunk = (1 - eps) * cov + eps * torch.diagonal(cov, dim1=-2, dim2=-1).sum(-1)[
        ..., None, None
    ] / m * eye
    weight = torch.linalg.solve(shrunk, mean.transpose(-1, -2)).transpose(-1, -2)
    bias = -0.5 * (mean * weight).sum(-1) + prior.log()
    return {"head.weight": weight, "head.bias": bias}


def lda_loss(head: Params, z: Tensor, y: Tensor, mask: Tensor) -> Tensor:
    """Mean cross-entropy of a head over the real samples (0 without any)."""
    logits = z @ head["head.weight"].transpose(-1, -2) + head["head.bias"][..., None, :]
    values = -torch.log_softmax(logits, -1).gather(-1, y[:, None])[:, 0]
    return (values * mask).sum() / mask.sum().clamp(min=1)


@register("pfedfda")
@dataclass(frozen=True)
class PFedFDA(Algorithm):
    eps: float = setting(1e-4, "covariance shrinkage and prior smoothing eps", positive)
    folds: int = setting(2, "folds k of the cross-validation that chooses beta", at_least(2))
    betas: int = setting(
        11, "grid of beta values in [0, 1] the cross-validation tries", at_least(2)
    )

    shared: ClassVar[tuple[str, ...]] = ("body",)
    join_trains: ClassVar[bool] = False  # a newcomer estimates statistics, it takes no steps

    # --- server ---------------------------------------------------------------------------------

    def init_params(self, seed: int, dtype: torch.dtype = torch.float32) -> Params:
        """phi^0 and the initial global statistics (uniform means, identity covariance)."""
        c, m = self.model.num_classes, self.model.feature_dim
        generator = torch.Generator().manual_seed(seed + 1)
        gauss = {
            MEAN: torch.rand(c, m, generator=generator, dtype=dtype),
            COV: torch.eye(m, dtype=dtype),
        }
        return self.model.init_body(seed, dtype) | gauss

    def init_server(self, params: Params) -> ServerState:
        body = tree.select(params, ["body"])
        return {**super().init_server(body), "gauss": tree.select(params, ["gauss"])}

    def downlink(self, server: ServerState, ctx: RoundContext, clients: Tensor | None = None):
        """phi, the global statistics and their classifier with uniform priors."""
        gauss = server["gauss"]
        uniform = torch.full_like(gauss[MEAN][:, 0], 1 / gauss[MEAN].shape[0])
        return {**server["params"], **gauss, **lda_head(gauss[MEAN], gauss[COV], uniform, self.eps)}

    def server_update(self, server: ServerState, aggregated: Params, ctx: RoundContext):
        """phi by the server optimizer; the averaged statistics replace the global ones."""
        body = self.server_optimizer.update(
            server["params"], tree.select(aggregated, ["body"]), server["opt"], ctx.server_lr
        )
        return {
            **server,
            "params": body[0],
            "opt": body[1],
            "gauss": tree.select(aggregated, ["gauss"]),
        }

    # --- client ---------------------------------------------------------------------------------

    def prior(self, data: ClientData) -> Tensor:
        counts = (
            one_hot(data.y, self.model.num_classes, data.mask.dtype) * data.mask[:, None]
        ).sum(0)
        smoothed = counts / data.mask.sum() + self.eps
        return smoothed / smoothed.sum()

    def estimate(self, z: Tensor, y: Tensor, mask: Tensor, glob: Params) -> tuple[Tensor, Tensor]:
        """mu^i (class means of classes with more than k samples, else mu^g) and Sigma^i."""
        weights = one_hot(y, self.model.num_classes, z.dtype) * mask[:, None]
        counts = weights.sum(0)
        means = weights.T @ z / counts.clamp(min=1)[:, None]
        means = torch.where((counts > self.folds)[:, None], means, glob[MEAN])
        centered = (z - means[y]) * mask[:, None]
        eye = torch.eye(z.shape[-1], dtype=z.dtype, device=z.device)
        return means, centered.T @ centered / (mask.sum() - 1).clamp(min=1) + eye

    def interpolation(self, z: Tensor, data: ClientData, glob: Params, prior: Tensor) -> Tensor:
        """beta: the grid value of least k-fold cross-validated loss (0 with nothing to
        validate on)."""
        weights = one_hot(data.y, self.model.num_classes, z.dtype) * data.mask[:, None]
        rank = ((weights.cumsum(0) - 1) * weights).sum(-1)  # rank of a sample within its class
        eligible = data.mask * (weights.sum(0) >= self.folds)[data.y].to(z.dtype)
        grid = torch.linspace(0, 1, self.betas, dtype=z.dtype, device=z.device)
        losses = torch.zeros_like(grid)
        for f in range(self.folds):
            held_out = eligible * (rank % self.folds == f).to(z.dtype)
            mean, cov = self.estimate(z, data.y, eligible - held_out, glob)
            mixed_mean = grid[:, None, None] * mean + (1 - grid[:, None, None]) * glob[MEAN]
            mixed_cov = grid[:, None, None] * cov + (1 - grid[:, None, None]) * glob[COV]
            head = lda_head(mixed_mean, mixed_cov, prior, self.eps)
            losses = losses + torch.vmap(lda_loss, (0, None, None, None))(head, z, data.y, held_out)
        return grid[losses.argmin()]

    def personal_statistics(self, body: Params, data: ClientData, glob: Params) -> Params:
        """beta mu^i + (1 - beta) mu^g and beta Sigma^i + (1 - beta) Sigma^g with ``body``'s
        features of the training split."""
        z = self.model.features(body, data.x).detach()
        prior = self.prior(data)
        beta = self.interpolation(z, data, glob, prior)
        mean, cov = self.estimate(z, data.y, data.mask, glob)
        return {
            MEAN: beta * mean + (1 - beta) * glob[MEAN],
            COV: beta * cov + (1 - beta) * glob[COV],
        }

    def client_update(self, downlink, state, data: ClientData, ctx: RoundContext):
        glob = tree.select(downlink, ["gauss"])
        head = lda_head(glob[MEAN], glob[COV], self.prior(data), self.eps)
        body = tree.select(downlink, ["body"])
        loss = Objective(self.model, data.label_mask, head)
        opt = self.client_optimizer
        trained, _, mean_loss = train_steps(loss, body, data, opt, opt.init(body), ctx.client_lr)
        upload = {**tree.sub(body, trained), **self.personal_statistics(trained, data, glob)}
        return ClientOut(upload, data.num_samples, {"loss": mean_loss}), state

    def adapt(self, downlink, state, data: ClientData, ctx: RoundContext) -> ClientState:
        """The classifier of the client's interpolated statistics under phi^t."""
        glob = tree.select(downlink, ["gauss"])
        own = self.personal_statistics(tree.select(downlink, ["body"]), data, glob)
        return lda_head(own[MEAN], own[COV], self.prior(data), self.eps)
