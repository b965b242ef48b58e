"""FedCAC: critical parameters collaborate cautiously, the others globally.

Wu, Liu, Chen, Li, Jin. "Bold but Cautious: Unlocking the Potential of Personalized Federated
Learning through Cautiously Aggressive Collaboration". ICCV 2023; arXiv:2309.11103.

Client i starts its local training from ``theta_i = m_i * u_i + (1 - m_i) * theta_g``: its
critical parameters (mask m_i) from its customized global model u_i, the others from the global
model theta_g. After E local epochs it selects its new critical parameters layer by layer: with
the sensitivity ``s = |(theta_i' - theta_i) * theta_i'|`` (the parameter times its change over
the round, the paper's estimate of |theta * grad|), the top ``tau`` fraction of each layer
(``s >= `` the layer's ``floor(tau * numel)``-th largest value) is critical. It sends theta_i' and
m_i. The server averages all local models into theta_g, computes the overlap of every pair of
the round's clients' critical positions,

    o_ij = 1 - ||m_i - m_j||_1 / (2 ||m_i||_1),

the threshold ``o_avg + (t + 1) / beta * (o_max - o_avg)`` (o_avg and o_max over the pairs i != j,
t the round), and for each client the customized model u_i, the plain mean of the local models of
i and of every j whose overlap o_ij reaches the threshold: collaboration on the critical
parameters tightens as training goes on, until (t + 1 > beta) each client keeps its own.

Symbols to code: theta_g -> ``server["params"]`` (``body.*`` and ``head.*``, one C-way model;
the server optimizer steps along ``theta_g - sum_i (N_i / N) theta_i'``, so SGD with lr 1 is the
average); u_i and m_i -> the server's table ``server["cac"]`` (``custom.*``, ``mask.*``, ``has``:
1 once client i has trained); the composed theta_i is what the downlink sends client i (a newcomer
or a client that never trained gets theta_g); tau -> ``tau`` (default 0.5), beta -> ``beta``
(default 170); E -> the run's local schedule with ``ctx.client_lr``. The authors' configurations
are tau 0.5 / beta 100 for CIFAR-10 and tau 0.4 / beta 170 for CIFAR-100; the default pair is
neither (CIFAR-10's tau with CIFAR-100's beta), kept so that existing results do not move: set
``beta`` 100 for the authors' CIFAR-10 pair, ``tau`` 0.4 for their CIFAR-100 one. FL-bench has
no FedCAC.

Choices and differences (the authors' code is FLAIR-Community/Fling, ``fedcac_client`` /
``fedcac_group``, which this follows):
- "Layer" is each parameter tensor (a weight and its bias apart), as the authors'
  ``named_parameters``. A layer whose ``floor(tau * numel)`` is 0 has no critical parameter; when
  the threshold is below 1e-10 it becomes the smallest sensitivity above 1e-20 (the authors'
  guard against all-zero changes). Ties at the threshold are all critical.
- The server composes theta_i and sends that one model (the paper sends theta_g and u_i and the
  client composes them with its mask: the same model, half the downlink). The masks therefore
  live on the server, which needs them for the overlaps anyway.
- theta_g is the N_i-weighted mean of the local models (FedAvg), as the authors' ``fed_avg``;
  u_i is the plain mean of the collaborators' models, as theirs. Overlaps, o_avg, o_max and u_i
  run over the round's clients (the authors run every client every round); a client's u_i and
  m_i are those of the last round it took part in, composed with the current theta_g. With a
  single client in the round, u_i is its own model.

Unseen clients (``join``): nothing to personalize; they evaluate theta_g.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from pflego import tree
from pflego.algorithms.base import Algorithm, register
from pflego.fields import between, positive, setting
from pflego.tree import Params
from pflego.types import ClientData, ClientOut, RoundContext, ServerState

LOCAL, MASK = "local.", "mask."  # theta_i' and m_i in the upload
CUSTOM = "custom."  # u_i in the server's table
HAS = "has"


def critical_mask(start: Tensor, trained: Tensor, tau: float) -> Tensor:
    """1 for the top ``tau`` fraction of one layer by ``|(trained - start) * trained|``."""
    sensitivity = ((trained - start) * trained).abs()
    flat = sensitivity.flatten()
    count = int(tau * flat.numel())
    if count == 0:  # a shape, not a value: the authors' threshold is then infinite
        return torch.zeros_like(trained)
    threshold = torch.topk(flat, count).values[-1]
    smallest = torch.where(flat > 1e-20, flat, torch.inf).min()
    threshold = torch.where((threshold <= 1e-10) & torch.isfinite(smallest), smallest, threshold)
    return (sensitivity >= threshold).to(trained.dtype)


def collaboration(masks: Tensor, t: int, beta: float) -> Tensor:
    """``[S, S]`` 0/1: row i marks i and the clients whose overlap with i reaches the threshold
    (``masks [S, P]`` of 0/1)."""
    s = masks.shape[0]
    count = masks.sum(1)
    shared = masks @ masks.T
    distance = count[:, None] + count[None, :] - 2 * shared  # ||m_i - m_j||_1 of 0/1 vectors
    overlap = 1 - distance / (2 * torch.where(count > 0, count, 1.0))[:, None]
    eye = torch.eye(s, dtype=torch.bool, device=masks.device)
    pairs = max(s * (s - 1), 1)
    average = torch.where(eye, 0.0, overlap).sum() / pairs
    largest = torch.where(eye, -torch.inf, overlap).max() if s > 1 else average
    threshold = average + (t + 1) / beta * (largest - average)
    return (eye | (overlap >= threshold)).to(masks.dtype)


@register("fedcac")
@dataclass(frozen=True)
class FedCAC(Algorithm):
    join_trains: ClassVar[bool] = False  # a new client uses the global model as it is
    tau: float = setting(
        0.5, "the fraction of each layer's parameters that is critical", between(0, 1)
    )
    beta: float = setting(
        170.0,
        "how fast collaboration on critical parameters tightens (alone after beta rounds)",
        positive,
    )

    per_client_downlink: ClassVar[bool] = True
    sum_aggregate: ClassVar[bool] = False  # the customized models depend on the masks

    # --- server ---------------------------------------------------------------------------------

    def table(self, server: ServerState, ctx: RoundContext) -> Params:
        """u_i, m_i and ``has`` of every client (allocated at first use: nobody trained yet)."""
        if "cac" in server:
            return server["cac"]
        params = server["params"]
        first = next(iter(params.values()))
        n = ctx.num_clients
        return {
            **{CUSTOM + k: v.expand(n, *v.shape) for k, v in params.items()},
            **{MASK + k: v.new_zeros((n, *v.shape)) for k, v in params.items()},
            HAS: first.new_zeros((n,)),
        }

    def downlink(self, server: ServerState, ctx: RoundContext, clients: Tensor | None = None):
        """theta_i = m_i * u_i + (1 - m_i) * theta_g for each of ``clients`` (theta_g for a
        newcomer and for clients that never trained)."""
        params = server["params"]
        if clients is None:
            return params
        table = self.table(server, ctx)
        rows = clients.to(table[HAS].device)
        out = {}
        for k, g in params.items():
            mask = table[MASK + k][rows] * table[HAS][rows].view(-1, *[1] * g.dim())
            out[k] = mask * table[CUSTOM + k][rows] + (1 - mask) * g
        return out

    def server_round(self, server: ServerState, out: ClientOut, ctx: RoundContext, clients):
        local = tree.strip_prefix(LOCAL, out.upload)
        masks = tree.strip_prefix(MASK, out.upload)
        weights = out.weight / out.weight.sum()
        average = tree.weighted_sum(local, weights)
        table = self.table(server, ctx)
        server = self.server_update(server, tree.sub(server["params"], average), ctx)

        flat = torch.cat([m.flatten(1) for m in masks.values()], 1)
        together = collaboration(flat, ctx.round, self.beta)
        mixing = together / together.sum(1, keepdim=True)
        custom = {k: torch.tensordot(mixing, v, dims=1) for k, v in local.items()}

        rows = clients.to(table[HAS].device)
        new = {CUSTOM + k: v for k, v in custom.items()} | {MASK + k: v for k, v in masks.items()}
        new_table = {k: table[k].index_put((rows,), v) for k, v in new.items()}
        new_table[HAS] = table[HAS].index_put((rows,), torch.ones_like(table[HAS][rows]))
        return {**server, "cac": new_table}

    # --- client ---------------------------------------------------------------------------------

    def client_update(self, downlink, state, data: ClientData, ctx: RoundContext):
        trained, mean_loss = self.train(downlink, data, ctx)
        masks = {k: critical_mask(downlink[k], v, self.tau) for k, v in trained.items()}
        upload = tree.add_prefix(LOCAL, trained) | tree.add_prefix(MASK, masks)
        return ClientOut(upload, data.num_samples, {"loss": mean_loss}), {}
