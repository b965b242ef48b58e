"""Floco: federated learning over connected modes.

Grinwald, Wiesner, Nakajima. "Federated Learning over Connected Modes". NeurIPS 2024;
arXiv:2403.03333.

The classifier is a solution simplex: m endpoint weight matrices W_1..W_m, and a point alpha of
the simplex gives the classifier W(alpha) = sum_k alpha_k W_k (with one shared bias). Each client
trains a subregion of the simplex: at every forward pass it samples alpha in its subregion and
descends the cross-entropy of W(alpha); the server averages everything (FedAvg). Until round
tau the subregion of every client is the whole simplex (alpha ~ Dirichlet(1)); at round tau the
server places each client i at a point beta_i of the simplex by projecting the clients' gradient
signals (their updates of the endpoints) onto it: PCA of the flattened updates to m components
kappa_i, Euclidean projection of kappa_i onto the simplex scaled by z, renormalized to sum 1,
with z in linspace(1e-4, 1, 1000) chosen for the lowest Riesz s-energy (s = 2) of the projected
points, which spreads them over the simplex; from then on client i samples alpha = beta_i + r u in
the L1 ball of radius rho around beta_i (u uniform on the L1 sphere's directions, r ~ U(0, rho))
and predicts with W(beta_i). Clients similar in their updates get nearby subregions, so the
simplex holds connected modes for the federation's clusters.

Symbols to code: the body -> ``body.*``; W_k -> ``simplex.weight[k]`` (``[m, C, M]``, Xavier
normal), the bias -> ``head.bias``; m -> ``endpoints`` (10, FL-bench's default), tau ->
``tau`` (10), rho -> ``rho`` (0.1); beta_i -> the server's ``floco.beta`` row i, sent as ``beta`` in
client i's downlink with ``projected`` (0 before tau); the clients' gradient signals -> the
server's ``floco.signal`` rows, each client's latest update of the endpoints; alpha -> drawn
per sample by :func:`pflego.rng.counter_uniform` from the client's key (its state, advanced every round).

Deliberate differences:
- One alpha per sample (per forward pass and batch in FL-bench and the authors' code), from
  counter-based draws, so that every backend and Flower draw alike.
- The projection uses each client's latest update of the endpoints, stored by the server as it
  arrives, at the end of round tau - 1; clients that never trained by then stay at the simplex's
  centre. FL-bench has every training client train one extra round at round tau to collect them
  (and projects the trained endpoints, the same up to their common part, which PCA's centring
  removes, and a sign).
- PCA is exact (an SVD), with scikit-learn's signs (the largest entry of each axis positive);
  FL-bench's scikit-learn PCA may pick its randomized solver on large updates;
  with fewer clients than endpoints the missing components are 0.
- alpha in the L1 ball is not renormalized (as FL-bench's current code; its earlier code
  renormalized), so near the simplex's boundary it may leave the simplex by up to rho.
- Floco+ (FL-bench's ``pers_epoch`` > 0: a personal simplex model with a proximal term) is not
  part of this method.

Unseen clients (``join``): nothing; they were never placed, so they predict at the simplex's
centre with the global model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from pflego import tree
from pflego.algorithms.base import Algorithm, register
from pflego.fields import at_least, non_negative, setting
from pflego.local import train_steps
from pflego.loss import masked_cross_entropy
from pflego.rng import counter_uniform, next_key
from pflego.tree import Params
from pflego.types import ClientData, ClientOut, RoundContext

SHARED = ("body", "head", "simplex")
KEY = "key"  # the client's key of its draws of alpha
KEYS = 2**24
GRID = 1000  # the scales z searched for the lowest Riesz energy


def simplex_projection(v: Tensor, z: float) -> Tensor:
    """Each row of ``v`` projected onto the simplex scaled by ``z`` (sum z, entries >= 0)."""
    u = v.sort(-1, descending=True).values
    cssv = u.cumsum(-1) - z
    ind = torch.arange(1, v.shape[-1] + 1, dtype=v.dtype)
    count = (u - cssv / ind > 0).sum(-1)
    theta = cssv.gather(-1, (count - 1).unsqueeze(-1)) / count.unsqueeze(-1)
    return (v - theta).clamp(min=0)


def riesz_log_energy(points: Tensor) -> Tensor:
    """log of the mean over pairs of 1 / distance^2 (distances floored at 1e-4)."""
    n = points.shape[0]
    i, j = torch.triu_indices(n, n, 1)
    distance = (points[i] - points[j]).norm(dim=-1).clamp(min=1e-4)
    return torch.log((1 / distance**2).sum()) - math.log(len(distance))


def pca(rows: Tensor, components: int) -> Tensor:
    """The rows' coordinates on their first ``components`` principal axes (0 beyond their rank),
    with scikit-learn's signs (the largest entry of each axis positive)."""
    u, s, vt = torch.linalg.svd(rows - rows.mean(0), full_matrices=False)
    signs = torch.sign(vt.gather(1, vt.abs().argmax(1, keepdim=True))).squeeze(1)
    scores = u * s * signs
    out = rows.new_zeros(rows.shape[0], components)
    k = min(components, scores.shape[1])
    out[:, :k] = scores[:, :k]
    return out


def place_clients(signals: Tensor, endpoints: int) -> Tensor:
    """beta: the signals' PCA projected onto the simplex at the scale of least Riesz energy."""
    kappa = pca(signals, endpoints)
    best, lowest = None, math.inf
    for z in torch.linspace(1e-4, 1, GRID, dtype=torch.float64).tolist():
        beta = simplex_projection(kappa, z)
        beta = beta / beta.sum(-1, keepdim=True)
        energy = float(riesz_log_energy(beta)) if len(beta) > 1 else 0.0
        if math.isfinite(energy) and energy < lowest:
            best, lowest = beta, energy
    return best


@register("floco")
@dataclass(frozen=True)
class Floco(Algorithm):
    shared: ClassVar[tuple[str, ...]] = SHARED
    per_client_downlink: ClassVar[bool] = True
    join_trains: ClassVar[bool] = False  # a new client predicts at the simplex's centre
    endpoints: int = setting(10, "number m of endpoints of the solution simplex", at_least(1))
    tau: int = setting(10, "round tau at which the clients are placed on the simplex", at_least(1))
    rho: float = setting(
        0.1, "L1 radius rho of a client's subregion around its point", non_negative
    )

    def init_params(self, seed: int, dtype: torch.dtype = torch.float32) -> Params:
        """The body and the head's bias as usual; m endpoints, each Xavier normal."""
        params = super().init_params(seed, dtype)
        c, m = self.model.num_classes, self.model.feature_dim
        gen = torch.Generator().manual_seed(seed + 2)
        std = math.sqrt(2 / (c + m))
        weights = torch.randn(self.endpoints, c, m, generator=gen, dtype=torch.float64) * std
        del params["head.weight"]
        return params | {"simplex.weight": weights.to(dtype)}

    def placement(self, server, ctx: RoundContext) -> dict[str, Tensor]:
        """The server's signals, betas and flag (created at the first use, all at the centre)."""
        if "floco" in server:
            return server["floco"]
        w = server["params"]["simplex.weight"]
        return {
            "signal": w.new_zeros(ctx.num_clients, w.numel()),
            "beta": w.new_full((ctx.num_clients, self.endpoints), 1 / self.endpoints),
            "projected": w.new_zeros(()),
        }

    def downlink(self, server, ctx: RoundContext, clients: Tensor | None = None) -> Params:
        """The model, and for each of ``clients`` its point beta_i and whether it is placed."""
        params, place = server["params"], self.placement(server, ctx)
        if clients is None:
            centre = place["beta"].new_full((self.endpoints,), 1 / self.endpoints)
            return {**params, "beta": centre, "projected": place["projected"]}
        n = len(clients)
        return {
            **{k: v.expand(n, *v.shape) for k, v in params.items()},
            "beta": place["beta"][clients.to(torch.int64)],
            "projected": place["projected"].expand(n),
        }

    def server_round(self, server, out: ClientOut, ctx: RoundContext, clients: Tensor):
        """FedAvg; each client's update of the endpoints kept; at round tau - 1 the placement."""
        place = dict(self.placement(server, ctx))
        signal = place["signal"].clone()
        signal[clients.to(torch.int64)] = out.upload["simplex.weight"].flatten(1).to(signal.dtype)
        place["signal"] = signal
        if ctx.round == self.tau - 1:
            trained = signal.abs().sum(-1) > 0
            beta = place["beta"].clone()
            beta[trained] = place_clients(signal[trained].double(), self.endpoints).to(beta.dtype)
            place["beta"], place["projected"] = beta, torch.ones_like(place["projected"])
        return {**self.server_update(server, self.aggregate(out, ctx), ctx), "floco": place}

    # --- client ---------------------------------------------------------------------------------

    def init_client(self, downlink, generator, ctx):
        first = next(iter(downlink.values()))
        return {KEY: torch.randint(0, KEYS, (), generator=generator).to(first.dtype)}

    def logits(self, params: Params, x: Tensor, alpha: Tensor) -> Tensor:
        """The classifier W(alpha_s) on each sample's features (``alpha`` ``[n, m]`` or ``[m]``)."""
        f = self.model.features(params, x)
        per_endpoint = torch.einsum("nd,kcd->nkc", f, params["simplex.weight"])
        return (alpha.expand(f.shape[0], -1).unsqueeze(-1) * per_endpoint).sum(1) + params[
            "head.bias"
        ]

    def alphas(self, downlink, key: Tensor, n: int, dtype: torch.dtype) -> Tensor:
        """Each sample's alpha: Dirichlet(1) before the placement, the L1 ball after."""
        rows = torch.arange(n, device=key.device)[:, None]
        cols = torch.arange(self.endpoints, device=key.device)[None, :]
        uniform = counter_uniform(key, rows, cols, dtype=dtype)
        dirichlet = -torch.log(uniform)
        dirichlet = dirichlet / dirichlet.sum(-1, keepdim=True)
        v = 2 * counter_uniform(key, rows, cols + self.endpoints, dtype=dtype) - 1
        radius = self.rho * counter_uniform(
            key, rows, torch.full((), 2 * self.endpoints, device=key.device), dtype=dtype
        )
        ball = downlink["beta"] + radius * v / v.abs().sum(-1, keepdim=True)
        return torch.where(downlink["projected"] > 0, ball, dirichlet)

    def client_update(self, downlink, state, data: ClientData, ctx: RoundContext):
        params = tree.select(downlink, SHARED)
        n = data.x.shape[0]
        alpha = self.alphas(downlink, state[KEY], n, data.x.dtype)
        x_all, label_mask = data.x, data.label_mask

        def loss(p: Params, i: Tensor, y: Tensor, mask: Tensor) -> Tensor:
            return masked_cross_entropy(self.logits(p, x_all[i], alpha[i]), y, mask, label_mask)

        opt = self.client_optimizer
        indexed = data._replace(x=torch.arange(n, device=data.x.device))
        trained, _, mean_loss = train_steps(
            loss, params, indexed, opt, opt.init(params), ctx.client_lr
        )
        out = ClientOut(tree.sub(params, trained), data.num_samples, {"loss": mean_loss})
        return out, {KEY: next_key(state[KEY])}

    def predict(self, downlink, state, x):
        """W(beta_i): the client's point of the simplex (the centre before the placement)."""
        return self.logits(downlink, x, downlink["beta"])
