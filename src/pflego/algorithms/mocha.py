"""MOCHA: federated multi-task learning of linear models with a learned task relationship.

Smith, Chiang, Sanjabi, Talwalkar. "Federated Multi-Task Learning". NeurIPS 2017;
arXiv:1705.10467. Official code: gingsmith/fmtl (MATLAB), which FedEM's Appendix J.2 follows.

Each client t (task) has a linear model w_t on its features; the primal problem is
``min_{W, Omega} sum_t (1/n_t) sum_i hinge(y_i w_t^T x_i) + (lam/2) tr(W Omega W^T)``. MOCHA works
on the dual: client t holds one dual variable alpha_i per sample (``alpha_i y_i`` in [0, 1]) and
``b_t = (1/n_t) sum_i alpha_i x_i``; the models are ``W = (1/lam) B Sigma`` with
``Sigma = Omega^{-1}``. A round:

1. client t receives w_t, Sigma_tt and rho, and runs local SDCA: for ``sdca_fraction * n_t``
   coordinates i (a fresh permutation), with ``u = y_i x_i^T (w_t + rho Dw_t)``,
   ``alpha_i <- y_i clip(lam n_t (1 - u) / (Sigma_tt rho ||x_i||^2) + alpha_i y_i, 0, 1)``,
   ``Dw_t += Sigma_tt Dalpha_i x_i / (lam n_t)`` and ``Db_t += Dalpha_i x_i / n_t``; it uploads
   Db_t;
2. the server adds the uploads to B; every ``omega_every`` rounds it sets
   ``Sigma = (W^T W)^{1/2} / tr((W^T W)^{1/2})`` (eigenvalues of W^T W floored at 1e-7) and
   ``rho = max_t sum_t' |Sigma_tt'| / Sigma_tt``.

Multi-class tasks are one-vs-rest: one dual variable and one model per class, sharing Omega
(``tr(W Omega W^T)`` summed over classes); a binary task has two mirrored models. Predictions are
the margins ``w_{t,c}^T x`` (logits). On a model with a body (not ``linear``) MOCHA learns linear
models on the body's fixed initial features: the body is never trained.

Symbols to code: w_t -> ``mocha.w`` (per-client downlink ``[C, d]``), Sigma_tt -> ``mocha.sigma``,
rho -> ``mocha.rho``, alpha_t -> ``dual.alpha`` (personal, ``[max_samples, C]``, zero at the
first visit), B and Sigma -> ``server["mocha"]["b"]`` ``[I, C, d]`` and ``["sigma"]`` ``[I, I]``
(sized at the first round; W = 0, Sigma = I/I and rho = 1 before), lam -> ``lam``.

A new client (``join``): starts from the average of the clients' models and zero duals, and runs
the same local SDCA steps with the average Sigma_tt; its model is the average plus its Dw.

Differences from the official code: W is recomputed from B with the current Sigma after each Omega
update (the paper's w(alpha)); the code keeps adding increments computed under older Sigmas. The
code's defaults are ``mocha_sdca_frac = 0.5`` and 100 rounds between Omega updates; FedEM tuned
lam on a grid.

Settings MOCHA does not use: its SDCA steps take no client optimizer, weight decay or step size,
and its server only adds the Delta b and recomputes Sigma. A run that sets a client optimizer
other than SGD, a weight decay, a server optimizer or ``server_lr`` is refused; ``client_lr`` is
not refused (one step size is often given to every method of an experiment) and has no effect.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from pflego.algorithms.base import Algorithm, register
from pflego.errors import ConfigError
from pflego.fields import positive, setting
from pflego.tree import Params
from pflego.types import ClientData, ClientOut, ClientState, RoundContext, Schedule, ServerState

ALPHA = "dual.alpha"
DELTA_W = "mocha.delta_w"


@register("mocha")
@dataclass(frozen=True)
class MOCHA(Algorithm):
    lam: float = setting(0.001, "regularization strength lambda", positive)
    sdca_fraction: float = setting(
        0.5, "the share of a client's samples its local SDCA visits per round", positive
    )
    omega_every: int = setting(
        10, "rounds between updates of the task relationship Sigma", positive
    )
    max_samples: int = setting(
        4096, "the most samples a client may hold (its dual variables are stored)", positive
    )

    shared: ClassVar[tuple[str, ...]] = ("body",)
    personal: ClassVar[tuple[str, ...]] = ("dual",)
    per_client_downlink: ClassVar[bool] = True
    sum_aggregate: ClassVar[bool] = False
    server_step: ClassVar[str] = "own"  # B += Delta b, and the Omega step
    client_step: ClassVar[str] = "own"  # local SDCA on the duals

    # --- server -------------------------------------------------------------------------------

    def init_server(self, params: Params) -> ServerState:
        first = next(iter(params.values()), torch.empty(0))
        like = {"dtype": first.dtype, "device": first.device}
        width = (0, self.model.num_classes, self.model.feature_dim)
        return {
            **super().init_server(params),
            "mocha": {
                "b": torch.zeros(width, **like),
                "sigma": torch.zeros(0, 0, **like),
                "rho": torch.ones((), **like),
            },
        }

    def matrices(self, server: ServerState, ctx: RoundContext) -> tuple[Tensor, Tensor, Tensor]:
        """B ``[I, C, d]``, Sigma ``[I, I]`` and rho; before the first round B = 0, Sigma = I/I."""
        state = server["mocha"]
        b, sigma = state["b"], state["sigma"]
        if b.shape[0] == 0:  # sized at the first round, when the population is known
            num = ctx.num_clients
            b = torch.zeros(num, *b.shape[1:], dtype=b.dtype, device=b.device)
            sigma = torch.eye(num, dtype=b.dtype, device=b.device) / num
        return b, sigma, state["rho"]

    def models(self, b: Tensor, sigma_rows: Tensor) -> Tensor:
        """``W = (1/lam) B Sigma`` for the tasks of ``sigma_rows`` ``[k, I]``: ``[k, C, d]``."""
        return torch.tensordot(sigma_rows, b, dims=1) / self.lam

    def downlink(self, server, ctx, clients=None):
        body = server["params"]
        b, sigma, rho = self.matrices(server, ctx)
        if clients is None:  # a newcomer: the average model, the average Sigma_tt
            return {
                **body,
                "mocha.w": self.models(b, sigma).mean(0),
                "mocha.sigma": sigma.diagonal().mean(),
                "mocha.rho": rho,
            }
        ids = clients.to(sigma.device)
        return {
            **{k: v.expand(len(ids), *v.shape) for k, v in body.items()},
            "mocha.w": self.models(b, sigma[ids]),
            "mocha.sigma": sigma[ids, ids],
            "mocha.rho": rho.expand(len(ids)),
        }

    def server_round(self, server, out: ClientOut, ctx: RoundContext, clients: Tensor):
        b, sigma, rho = self.matrices(server, ctx)
        b = b.index_add(0, clients.to(b.device), out.upload["mocha.b"].to(b.dtype))
        if (ctx.round + 1) % self.omega_every == 0:
            sigma, rho = self.task_relationship(b, sigma)
        return {**server, "mocha": {"b": b, "sigma": sigma, "rho": rho}}

    def task_relationship(self, b: Tensor, sigma: Tensor) -> tuple[Tensor, Tensor]:
        """Omega step: ``Sigma = (W^T W)^{1/2} / tr(...)`` and the new rho."""
        w = self.models(b, sigma).reshape(len(b), -1)
        eig, vec = torch.linalg.eigh(w @ w.T)
        root = (vec * eig.clamp(min=1e-7).sqrt()) @ vec.T
        sigma = root / root.trace()
        rho = (sigma.abs().sum(1) / sigma.diagonal()).max()
        return sigma, rho

    # --- client -------------------------------------------------------------------------------

    def init_client(self, downlink, generator, ctx) -> ClientState:
        w = downlink["mocha.w"]
        return {ALPHA: w.new_zeros(self.max_samples, self.model.num_classes)}

    def sdca_schedule(self) -> Schedule:
        """Single coordinates, ``sdca_fraction`` of an epoch (a fresh permutation each round)."""
        return Schedule(1, 1, self.sdca_fraction)

    def schedules(self, run: Schedule) -> dict[str, Schedule]:
        return {"sdca": self.sdca_schedule()}

    def adapt_schedule(self, run: Schedule) -> Schedule:
        return self.sdca_schedule()

    def sdca(
        self, downlink: Params, alpha: Tensor, data: ClientData
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Local SDCA on ``data.batches`` (one coordinate per step).

        Returns the new duals, Dw, Db and the hinge loss of the received model.
        """
        n = data.x.shape[0]
        if n > self.max_samples:
            raise ConfigError(
                f"a client holds {n} training samples but mocha keeps at most "
                f"max_samples={self.max_samples} dual variables; raise options.max_samples"
            )
        features = self.model.features(downlink, data.x).detach()
        signs = 2.0 * torch.nn.functional.one_hot(data.y, self.model.num_classes) - 1.0
        signs = signs.to(features.dtype)
        w, sigma, rho = downlink["mocha.w"], downlink["mocha.sigma"], downlink["mocha.rho"]
        n_t, lam = data.num_samples, self.lam
        margins = signs * (features @ w.T)
        hinge = ((1 - margins).clamp(min=0).mean(-1) * data.mask).sum() / data.mask.sum()
        alpha = alpha[:n]
        positions = torch.arange(n, device=features.device)
        delta_w, delta_b = torch.zeros_like(w), torch.zeros_like(w)
        for idx, mask in zip(data.batches, data.batch_mask):
            i, active = idx[0], mask[0]
            x, y, old = features[i], signs[i], alpha[i]
            u = y * ((w + rho * delta_w) @ x)
            squared = (x * x).sum().clamp(min=torch.finfo(x.dtype).tiny)
            step = lam * n_t * (1 - u) / (sigma * rho * squared) + old * y
            change = (y * step.clamp(0, 1) - old) * active
            delta_w = delta_w + sigma * change[:, None] * x / (lam * n_t)
            delta_b = delta_b + change[:, None] * x / n_t
            alpha = alpha + (positions == i).to(alpha.dtype)[:, None] * change
        return alpha, delta_w, delta_b, hinge

    def client_update(self, downlink, state, data: ClientData, ctx: RoundContext):
        stored = state[ALPHA]
        alpha, _, delta_b, hinge = self.sdca(downlink, stored, data.using("sdca"))
        new_state = {ALPHA: torch.cat([alpha, stored[alpha.shape[0] :]])}
        return ClientOut({"mocha.b": delta_b}, data.num_samples, {"loss": hinge}), new_state

    def predict(self, downlink, state, x):
        w = downlink["mocha.w"] + state[DELTA_W] if DELTA_W in state else downlink["mocha.w"]
        return self.model.features(downlink, x) @ w.T

    def join(self, downlink, state, data: ClientData, ctx: RoundContext) -> ClientState:
        """A new client: SDCA from zero duals on the average model; keeps its own Dw."""
        stored = state[ALPHA]
        alpha, delta_w, _, _ = self.sdca(downlink, stored, data)
        return {ALPHA: torch.cat([alpha, stored[alpha.shape[0] :]]), DELTA_W: delta_w}
