"""FedPAC: feature alignment to global prototypes and classifier collaboration.

Xu, Tong, Huang. "Personalized Federated Learning with Feature Alignment and Classifier
Collaboration". ICLR 2023; arXiv:2306.11867.

The model is a shared feature extractor theta and a classifier phi_i per client. In round t the
server sends theta^(t) and the global prototypes c_k; a sampled client i (Algorithm 1)

1. computes its feature statistics with theta^(t) on its training split: the class shares
   p_i(k) = n_ik / n_i, class means mu_ik, ``h_i[k] = p_i(k) mu_ik`` and the variance term
   ``V_i = (1/n_i) sum_k [p_i(k) E_k ||f(x)||^2 - p_i(k)^2 ||mu_ik||^2]``;
2. trains its classifier phi_i with theta fixed (E_phi epochs of cross-entropy);
3. trains its extractor from theta^(t) with phi_i fixed on
   ``CE + lambda (1/n) sum_l ||f_theta(x_l) - c_{y_l}||^2`` (E_theta epochs);
4. sends theta_i, phi_i, its local prototypes (class means of f_{theta_i}, with counts) and
   (V_i, h_i).

The server averages theta_i by N_i, the prototypes per class by counts
(``c_k = sum_i n_ik c_ik / sum_i n_ik``), and for every sampled client i solves the quadratic
program (Sec. 4.3)

    alpha_i = argmin_{alpha >= 0, sum_j alpha_j = 1}
              sum_j alpha_j^2 V_j + || sum_j alpha_j (h_j - h_i) ||^2
            = argmin alpha^T (diag(V) + D_i) alpha,  (D_i)_{jl} = sum_k <h_i[k] - h_j[k], h_i[k] - h_l[k]>

over the round's clients j, and gives client i the classifier phi_hat_i = sum_j alpha_ij phi_j,
which it uses (for evaluation and as the start of its next round).

Symbols to code: theta -> ``body.*`` (``server["params"]``, through the server optimizer: SGD with
lr 1 is the paper's average); phi_hat_i -> ``server["heads"]`` (a C-way head per client, the
``global`` label space, with ``combined`` 1 once client i has one) sent in client i's downlink as
``head.*``; before its first combination a client uses the initial classifier phi^0
(``server["head"]``: every client starts from the same model, as in the authors' code); c_k ->
``server["protos"]`` (``proto.mean`` / ``proto.present`` in the downlink); lambda -> ``lam``
(default 1, the authors' code); E_phi -> the named schedule ``head`` (``head_epochs``, default 1
epoch as in the authors' code, or ``head_steps``); E_theta -> ``body`` (``body_epochs`` /
``body_steps``; unset, the run's local schedule); the step size -> ``ctx.client_lr``.

Choices and differences:
- The alignment term is the authors' ``MSELoss`` (the squared distance averaged over the M feature
  dimensions as well as the batch), so ``lam`` is the authors' lambda; a class without a global
  prototype is aligned to the client's own prototype computed with theta^(t) (the authors' code);
  before any global prototype exists there is no alignment (the authors' round 0).
- V_i is the authors' code's ``statistics_extraction`` (the paper's estimate of the classifier's
  variance; the 1/n_i factor is theirs). Statistics use theta^(t), as in the authors' code.
- The QP is solved to rounding (accelerated projected gradient on the simplex, then the KKT
  system on the support it found, kept where primal and dual feasible; tested against solving
  every support): the authors solve it with cvxpy, drop eigenvalues below 0.01 when the matrix is
  not numerically PSD, zero out weights below 1e-3 and divide the combination by the remaining
  sum; neither clipping nor zeroing is done here. The sum over j runs over the round's clients.
- Global prototypes of classes that no client of the round holds are kept from earlier rounds.
- The authors' local solver is SGD with momentum 0.5 and weight decay 5e-4 in both phases, the
  classifier phase with its own step size 0.1; here the run's client optimizer and
  ``ctx.client_lr`` in both (a fresh optimizer state per phase).

Unseen clients (``join``): the initial classifier phi^0 trained on the frozen global extractor's
features (the ``head`` schedule), as a new client of a personal-head method.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from pflego import tree
from pflego.algorithms.base import FixedHead, register
from pflego.algorithms.fedproto import (
    COUNT,
    MEAN,
    PRESENT,
    SUM,
    aggregate_prototypes,
    class_sums,
    initial_prototypes,
)
from pflego.fields import non_negative, positive_or_unset, setting
from pflego.local import train_steps
from pflego.loss import ModelLoss
from pflego.models import init_head
from pflego.tree import Params
from pflego.types import ClientData, ClientOut, ClientState, RoundContext, Schedule, ServerState

CLS = "cls."  # a client's trained classifier phi_i, uploaded
H, V = "stat.h", "stat.v"  # a client's feature statistics h_i [C, M] and V_i
COMBINED = "combined"
#: Accelerated projected-gradient iterations before the KKT polish of the QP.
QP_ITERATIONS = 500


def project_to_simplex(v: Tensor) -> Tensor:
    """Euclidean projection of each row of ``v`` onto the probability simplex (sort-based)."""
    u = torch.sort(v, dim=-1, descending=True).values
    excess = torch.cumsum(u, -1) - 1
    index = torch.arange(1, v.shape[-1] + 1, device=v.device, dtype=v.dtype)
    rho = (u - excess / index > 0).sum(-1, keepdim=True)  # at least 1
    theta = excess.gather(-1, rho - 1) / rho.to(v.dtype)
    return (v - theta).clamp(min=0)


def simplex_qp(p: Tensor, iterations: int = QP_ITERATIONS) -> Tensor:
    """``argmin_{a >= 0, sum a = 1} a^T P a`` for a batch of PSD matrices ``P [B, n, n]``.

    FISTA from the uniform point, then the equality-constrained KKT system on the support it
    found; the KKT solution replaces the iterate where it is primal and dual feasible.
    """
    n = p.shape[-1]
    p = p / p.abs().amax(dim=(-2, -1), keepdim=True).clamp(min=torch.finfo(p.dtype).tiny)
    lipschitz = 2 * torch.linalg.eigvalsh(p)[..., -1:].clamp(min=torch.finfo(p.dtype).eps)
    a = p.new_full(p.shape[:-1], 1 / n)
    y, t = a, 1.0
    for _ in range(iterations):
        step = project_to_simplex(y - (2 * p @ y[..., None])[..., 0] / lipschitz)
        t_next = (1 + (1 + 4 * t * t) ** 0.5) / 2
        y, a, t = step + (t - 1) / t_next * (step - a), step, t_next
    # KKT on the support S: 2 P_SS a_S = nu 1, sum a_S = 1, a_j = 0 off S
    support = (a > 0).to(p.dtype)
    both = support[..., :, None] * support[..., None, :]
    eye = torch.eye(n, dtype=p.dtype, device=p.device)
    top = torch.cat([both * 2 * p + (1 - support)[..., None] * eye, -support[..., None]], -1)
    bottom = torch.cat([support, p.new_zeros((*p.shape[:-2], 1))], -1)[..., None, :]
    rhs = torch.cat([p.new_zeros(p.shape[:-1]), p.new_ones((*p.shape[:-2], 1))], -1)
    solution, _ = torch.linalg.solve_ex(torch.cat([top, bottom], -2), rhs)
    exact, nu = solution[..., :n], solution[..., n:]
    gradient = 2 * (p @ exact[..., None])[..., 0]
    tolerance = 1e-9 if p.dtype == torch.float64 else 1e-5
    feasible = (
        torch.isfinite(solution).all(-1)
        & (exact >= -tolerance).all(-1)
        & (gradient - nu >= -tolerance).all(-1)
    )
    return torch.where(feasible[..., None], exact.clamp(min=0), a)


def combination_weights(h: Tensor, v: Tensor) -> Tensor:
    """alpha ``[S, S]``: row i solves client i's QP over the round's clients (``h [S, C, M]``,
    ``v [S]``), with ``(D_i)_{jl} = <h_i - h_j, h_i - h_l>`` from the Gram matrix of the h."""
    flat = h.flatten(1)
    gram = flat @ flat.T
    own = gram.diagonal()
    d = own[:, None, None] - gram[:, :, None] - gram[:, None, :] + gram[None, :, :]
    return simplex_qp(d + torch.diag_embed(v).expand_as(d))


@register("fedpac")
@dataclass(frozen=True)
class FedPAC(FixedHead):
    lam: float = setting(
        1.0, "strength lambda of the feature alignment to the global class centroids", non_negative
    )
    head_steps: int | None = setting(
        None, "local steps of the head phase (unset: head_epochs)", positive_or_unset
    )
    head_epochs: float | None = setting(1.0, "epochs of the head phase", positive_or_unset)
    body_steps: int | None = setting(
        None,
        "local steps of the body phase (unset: body_epochs or the run's schedule)",
        positive_or_unset,
    )
    body_epochs: float | None = setting(
        None, "epochs of the body phase (unset: the run's schedule)", positive_or_unset
    )

    shared: ClassVar[tuple[str, ...]] = ("body",)
    personal: ClassVar[tuple[str, ...]] = ("head",)
    label_space: ClassVar[str] = "global"
    per_client_downlink: ClassVar[bool] = True
    sum_aggregate: ClassVar[bool] = False  # the classifiers' weights come from a QP

    def schedules(self, run: Schedule) -> dict[str, Schedule]:
        head_epochs = None if self.head_steps is not None else self.head_epochs
        return {
            "head": run.phase(self.head_steps, head_epochs),
            "body": run.phase(self.body_steps, self.body_epochs),
        }

    def adapt_schedule(self, run: Schedule) -> Schedule:
        return self.schedules(run)["head"]

    # --- server ---------------------------------------------------------------------------------

    def init_params(self, seed: int, dtype: torch.dtype = torch.float32) -> Params:
        """theta^(0) and the initial classifier phi^0 that every client starts from."""
        generator = torch.Generator().manual_seed(seed + 1)
        head = init_head(self.head_width, self.model.feature_dim, generator, self.head_init, dtype)
        return self.model.init_body(seed, dtype) | head

    def init_server(self, params: Params) -> ServerState:
        """theta^(0) (stepped), phi^0 in ``server["head"]`` (never stepped), no prototypes."""
        server = super().init_server(params)
        return {**server, "protos": initial_prototypes(self.model, server["head"]["head.bias"])}

    def downlink(self, server: ServerState, ctx: RoundContext, clients: Tensor | None = None):
        """theta, the prototypes and each client's classifier phi_hat_i (phi^0 before its first
        combination, and for a newcomer)."""
        protos = {MEAN: server["protos"]["mean"], PRESENT: server["protos"]["present"]}
        if clients is None:
            return {**server["params"], **server["head"], **protos}
        heads = self.head_table(server, ctx)
        rows = clients.to(server["head"]["head.bias"].device)
        combined = heads[COMBINED][rows] > 0
        own = {
            k: torch.where(combined.view(-1, *[1] * v.dim()), heads[k][rows], v)
            for k, v in server["head"].items()
        }
        shared = {**server["params"], **protos}
        return {**{k: v.expand(len(rows), *v.shape) for k, v in shared.items()}, **own}

    def head_table(self, server: ServerState, ctx: RoundContext) -> Params:
        """phi_hat_i of every client ``[I, ...]`` and ``combined [I]`` (allocated at first use)."""
        if "heads" in server:
            return server["heads"]
        bias = server["head"]["head.bias"]
        table = {k: v.expand(ctx.num_clients, *v.shape) for k, v in server["head"].items()}
        return {**table, COMBINED: bias.new_zeros((ctx.num_clients,))}

    def server_round(self, server: ServerState, out: ClientOut, ctx: RoundContext, clients):
        up = out.upload
        weights = out.weight / out.weight.sum()
        body = tree.weighted_sum(tree.select(up, ["body"]), weights)
        counts = tree.weighted_sum({SUM: up[SUM], COUNT: up[COUNT]}, weights)
        server = self.server_update(server, body, ctx)
        protos = aggregate_prototypes(server["protos"], counts)

        alpha = combination_weights(up[H], up[V])
        combined = {
            k: torch.tensordot(alpha, v, dims=1) for k, v in tree.strip_prefix(CLS, up).items()
        }
        table = self.head_table(server, ctx)
        rows = clients.to(table[COMBINED].device)
        new_table = {k: table[k].index_put((rows,), v) for k, v in combined.items()}
        new_table[COMBINED] = table[COMBINED].index_put(
            (rows,), torch.ones_like(rows, dtype=table[COMBINED].dtype)
        )
        return {**server, "protos": protos, "heads": new_table}

    # --- client ---------------------------------------------------------------------------------

    def init_client(self, downlink: Params, generator: torch.Generator, ctx: RoundContext):
        """Nothing: the client's classifier is held by the server and sent each round."""
        return {}

    def statistics(self, features: Tensor, data: ClientData) -> tuple[Tensor, Tensor, Tensor]:
        """h_i ``[C, M]``, V_i and the class means mu_ik ``[C, M]`` of ``features``."""
        sums, counts = class_sums(features, data.y, data.mask, self.model.num_classes)
        n = data.mask.sum()
        h = sums / n  # p_i(k) mu_ik
        energy = ((features**2).sum(-1) * data.mask).sum() / n
        v = (energy - (h**2).sum()) / n
        return h, v, sums / torch.where(counts > 0, counts, 1.0)[:, None]

    def client_update(self, downlink, state, data: ClientData, ctx: RoundContext):
        body = tree.select(downlink, ["body"])
        head = tree.select(downlink, ["head"])
        h, v, local_means = self.statistics(self.model.features(body, data.x), data)

        head = self.train_head(body, head, data.using("head"), ctx)

        present = downlink[PRESENT]
        targets = torch.where(present[:, None] > 0, downlink[MEAN], local_means)
        active = present.max().expand_as(present)  # no alignment before any global prototype
        # CE + lam (1/n) sum_s mean_m (z_s - c_{y_s})_m^2: declared, so its SGD steps may fuse
        loss = ModelLoss(
            self.model,
            data.label_mask,
            fixed=head,
            centroids=targets,
            centroid_weights=active * (self.lam / targets.shape[-1]),
        )
        opt = self.client_optimizer
        trained, _, mean_loss = train_steps(
            loss, body, data.using("body"), opt, opt.init(body), ctx.client_lr
        )
        sums, counts = class_sums(
            self.model.features(trained, data.x), data.y, data.mask, self.model.num_classes
        )
        n = data.num_samples.to(sums.dtype)
        upload = {
            **tree.sub(body, trained),
            **tree.add_prefix(CLS, head),
            SUM: sums / n,
            COUNT: counts / n,
            H: h,
            V: v,
        }
        return ClientOut(upload, data.num_samples, {"loss": mean_loss}), {}

    def predict(self, downlink: Params, state: ClientState, x: Tensor) -> Tensor:
        """theta with the client's classifier (a joined newcomer's own, else phi_hat_i)."""
        return self.model.forward({**downlink, **state}, x)

    def join(self, downlink, state, data: ClientData, ctx: RoundContext) -> ClientState:
        """phi^0 trained on the frozen global extractor's features."""
        return self.train_head(downlink, tree.select(downlink, ["head"]), data, ctx)
