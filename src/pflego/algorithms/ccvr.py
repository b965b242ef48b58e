"""CCVR: FedAvg whose classifier is calibrated on virtual features from class-wise Gaussians.

Luo, Chen, Hu, Zhang, Liang, Feng. "No Fear of Heterogeneity: Classifier Calibration for
Federated Learning with Non-IID Data". NeurIPS 2021; arXiv:2106.05001.

Training is FedAvg's. Before an evaluation, every training client k computes, with the global
model's feature extractor f, the class-wise statistics of its data: N_{c,k}, the mean mu_{c,k}
and the (unbiased) covariance Sigma_{c,k} of f(x) over its samples of class c. The server pools
them (Sec. 4.2),

    mu_c    = sum_k (N_{c,k} / N_c) mu_{c,k}
    Sigma_c = sum_k (N_{c,k} - 1)/(N_c - 1) Sigma_{c,k} + sum_k N_{c,k}/(N_c - 1) mu_{c,k} mu_{c,k}^T
              - N_c/(N_c - 1) mu_c mu_c^T,

draws M_c virtual features per class from N(mu_c, Sigma_c) and retrains the classifier g on
them with cross-entropy (Algorithm 1); the evaluation uses f with the calibrated g.

Symbols to code: the statistics -> :meth:`CCVR.statistics` (the contract's evaluation-time
``statistics``, summed over every training client: the counts ``stat.count`` [C], the sums
``stat.sum`` [C, M] and the second moments ``stat.moment`` [C, M, M] of f(x), from which the
pooled mu_c and Sigma_c above follow exactly: Sigma_c = (sum f f^T - N_c mu_c mu_c^T)/(N_c - 1));
M_c -> ``samples_per_class`` (default 200, FL-bench's); the retraining -> :meth:`CCVR.calibrate`:
``calibration_epochs`` epochs of SGD of step ``client_lr`` on shuffled minibatches of
``calibration_batch_size`` virtual features (FL-bench: one epoch of the run's batch size, with the
client step size), from the global classifier.

Deliberate differences and choices:
- Calibration runs before every evaluation, on every training client's statistics, and is never
  stored: training continues from the uncalibrated global model (FL-bench does the same; the
  paper calibrates once, after training).
- A class with fewer than two samples in the federation has no covariance and no virtual
  features (FL-bench's rule). The draws are mu_c + L_c e with e ~ N(0, I) and L_c the symmetric
  square root of Sigma_c, its eigenvalues below sqrt(eps) times the largest dropped (see
  :func:`pooled_gaussians`; NumPy's ``multivariate_normal``, which FL-bench uses, factors Sigma_c
  by an SVD: the same distribution, other draws). The draws come from a generator seeded by the run's seed and the round
  (FL-bench draws from NumPy's global state).
- The statistics travel outside the rounds, so differential privacy does not cover them, and the
  Flower adapter, whose nodes answer only training and evaluation, refuses CCVR.

Unseen clients (``join``): the calibrated global model, as it is (FedAvg's).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from pflego import tree
from pflego.algorithms.base import register
from pflego.algorithms.fedavg import FedAvg
from pflego.algorithms.fedproto import one_hot
from pflego.fields import positive, setting
from pflego.loss import cross_entropies
from pflego.models import head_logits
from pflego.rng import seed_for
from pflego.tree import Params
from pflego.types import ClientData, RoundContext, ServerState

COUNT, SUM, MOMENT = "stat.count", "stat.sum", "stat.moment"
CALIBRATION_STREAM = 5  # the key of the virtual features' generator beside (seed, round)


def pooled_gaussians(statistics: Params) -> tuple[Tensor, Tensor, Tensor]:
    """Per class: mu_c ``[C, M]``, the symmetric square root L_c of Sigma_c ``[C, M, M]`` and
    whether the class has virtual features (N_c > 1) ``[C]``.

    L_c = V sqrt(Lambda) V^T from the eigendecomposition, with the eigenvalues below sqrt(eps)
    times the largest set to 0: the symmetric root does not depend on the basis of a repeated
    eigenvalue (a covariance of fewer samples than features has a null space), and without the
    smallest eigenvalues it moves by rounding's order when Sigma_c does, so that every backend
    draws the same virtual features."""
    n = statistics[COUNT]
    usable = n > 1
    mean = statistics[SUM] / n.clamp(min=1)[:, None]
    outer = mean[:, :, None] * mean[:, None, :]
    cov = (statistics[MOMENT] - n[:, None, None] * outer) / (n - 1).clamp(min=1)[:, None, None]
    values, vectors = torch.linalg.eigh(torch.where(usable[:, None, None], cov, 0.0))
    tolerance = torch.finfo(values.dtype).eps ** 0.5 * values[:, -1:].clamp(min=0)
    roots = torch.where(values > tolerance, values, 0.0).sqrt()
    return mean, (vectors * roots[:, None, :]) @ vectors.transpose(1, 2), usable


@register("ccvr")
@dataclass(frozen=True)
class CCVR(FedAvg):
    samples_per_class: int = setting(
        200, "virtual features M_c drawn per class for the calibration", positive
    )
    calibration_epochs: int = setting(
        1, "epochs of the classifier's calibration over the virtual features", positive
    )
    calibration_batch_size: int = setting(
        32, "virtual features in a minibatch of the calibration", positive
    )

    def statistics(self, downlink: Params, data: ClientData, ctx: RoundContext) -> Params:
        """N_{c,k}, the sums and the second moments of f(x) per class over the training split."""
        z = self.model.features(downlink, data.x)
        weights = one_hot(data.y, self.model.num_classes, z.dtype) * data.mask[:, None]
        moments = torch.einsum("nc,nm,nl->cml", weights, z, z)
        return {COUNT: weights.sum(0), SUM: weights.T @ z, MOMENT: moments}

    def virtual_features(self, statistics: Params, ctx: RoundContext) -> tuple[Tensor, Tensor]:
        """M_c draws from N(mu_c, Sigma_c) for every class with N_c > 1, and their labels."""
        mean, root, usable = pooled_gaussians(statistics)
        generator = torch.Generator().manual_seed(seed_for(ctx.seed, CALIBRATION_STREAM, ctx.round))
        c, m = mean.shape
        noise = torch.randn(c, self.samples_per_class, m, generator=generator, dtype=mean.dtype)
        virtual = mean[:, None, :] + noise.to(mean.device) @ root.transpose(1, 2)
        labels = torch.arange(c, device=mean.device)[:, None].expand(c, self.samples_per_class)
        keep = usable[:, None].expand_as(labels)
        return virtual[keep], labels[keep]

    def calibrate(self, server: ServerState, statistics: Params, ctx: RoundContext):
        """The global classifier retrained on the virtual features (SGD, ``client_lr``)."""
        z, y = self.virtual_features(statistics, ctx)
        generator = torch.Generator().manual_seed(
            seed_for(ctx.seed, CALIBRATION_STREAM, ctx.round, 1)
        )
        head = tree.select(server["params"], ["head"])
        for _ in range(self.calibration_epochs):
            order = torch.randperm(len(y), generator=generator).to(y.device)
            for batch in order.split(self.calibration_batch_size):
                with torch.enable_grad():
                    leaves = {k: v.detach().requires_grad_(True) for k, v in head.items()}
                    loss = cross_entropies(head_logits(leaves, z[batch]), y[batch]).mean()
                    grads = torch.autograd.grad(loss, list(leaves.values()))
                head = {k: v - ctx.client_lr * g for (k, v), g in zip(head.items(), grads)}
        return {**server, "params": {**server["params"], **head}}
