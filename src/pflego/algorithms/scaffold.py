"""SCAFFOLD: stochastic controlled averaging, local steps corrected by control variates.

Karimireddy, Kale, Mohri, Reddi, Stich, Suresh. "SCAFFOLD: Stochastic Controlled Averaging for
Federated Learning". ICML 2020; arXiv:1910.06378.

The server keeps the model x and a control variate c, client i its own c_i (zero at the first
visit). A sampled client starts from y_i = x and takes K_i local steps

    y_i <- y_i - eta_l (g_i(y_i) - c_i + c),

then refreshes its control variate with option I, ``c_i^+ = g_i(x)`` (the gradient of its loss at
the server model), or option II (the paper's experiments), ``c_i^+ = c_i - c + (x - y_i) /
(K_i eta_l)``, and sends ``(Delta y_i, Delta c_i) = (y_i - x, c_i^+ - c_i)``. The server:

    x <- x + eta_g (1/|S|) sum_{i in S} Delta y_i,    c <- c + (1/N) sum_{i in S} Delta c_i.

Symbols to code: x -> ``server["params"]`` (``body.*`` and ``head.*``, one C-way model), c ->
``server["c"]``, sent in the downlink as ``c.*`` beside x (SCAFFOLD doubles the downlink, as in
the paper); c_i -> the client state ``ci.*``; eta_l -> ``ctx.client_lr``; eta_g ->
``ctx.server_lr`` (default 1); K_i -> the client's real local steps this round (its schedule's
non-padding rows); N -> the population ``ctx.num_clients``; |S| -> the clients that answered;
option -> ``control_option`` (1 or 2, default 2). The upload is ``x - y_i`` (the pseudo-gradient
of every averaging method, ``-Delta y_i``) and ``Delta c_i`` as ``dc.*``. The corrected step is
the gradient of ``f_i(y) + <c - c_i, y>``: an ``Objective`` with the linear term ``c_i - c``, so
plain SGD on it runs fused.

Differences and choices: the mean over S is unweighted, as in the paper's Algorithm 1 (no
official code was released; FL-bench and PFLlib too average the models and the control variates
with a plain mean, no N_i weights). The server's step on x
is the server optimizer's, along the mean of ``x - y_i`` with ``server_lr`` as eta_g: SGD (the
default) is the paper's step, and ``momentum`` / ``adagrad`` / ``yogi`` / ``adam`` give SCAFFOLD
with that server optimizer; c always takes the paper's plain step. Option I's g_i(x) is the
gradient of the mean cross-entropy over the client's whole training split (the paper allows a
minibatch). With the ``momentum`` or ``adam`` client optimizer the corrected gradient goes through
that optimizer (the paper analyzes SGD). ``K_i`` varies per client with ``local_epochs``;
the paper fixes K. With differential privacy the upload (Delta y_i and Delta c_i together) is
clipped and noised.

Unseen clients (``join``): nothing; SCAFFOLD is a global method, every client predicts with x.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch.func import grad

from pflego import tree
from pflego.algorithms.base import Algorithm, register
from pflego.fields import one_of, setting
from pflego.local import train_steps
from pflego.loss import CrossEntropy, Linear, Objective
from pflego.types import ClientData, ClientOut, RoundContext

C = "c."  # the server's control variate c, in the server state's "c" and in the downlink
CI = "ci."  # the client's control variate c_i, in its state
DC = "dc."  # Delta c_i = c_i^+ - c_i, in the upload


@register("scaffold")
@dataclass(frozen=True)
class Scaffold(Algorithm):
    join_trains: ClassVar[bool] = False  # a new client uses the global model as it is
    control_option: int = setting(
        2,
        "how c_i is updated: 1 (c_i = g_i(x)) or 2 (the paper's experiments)",
        one_of(1, 2, says="must be one of"),
    )

    def init_server(self, params):
        return {**super().init_server(params), "c": tree.zeros_like(params)}

    def downlink(self, server, ctx, clients=None):
        return {**server["params"], **tree.add_prefix(C, server["c"])}

    def init_client(self, downlink, generator, ctx):
        return {CI + k: torch.zeros_like(v) for k, v in downlink.items() if not k.startswith(C)}

    def client_update(self, downlink, state, data: ClientData, ctx: RoundContext):
        c = tree.strip_prefix(C, downlink)
        x = {k: v for k, v in downlink.items() if k in c}
        c_i = tree.strip_prefix(CI, state)

        # y <- y - eta_l (g_i(y) - c_i + c): the gradient of f_i(y) - <c_i - c, y>
        terms = (CrossEntropy(), Linear(tree.sub(c_i, c)))
        loss = Objective(self.model, data.label_mask, terms=terms)
        opt = self.client_optimizer
        y, _, mean_loss = train_steps(loss, x, data, opt, opt.init(x), ctx.client_lr)
        delta = tree.sub(x, y)  # x - y_i, the pseudo-gradient

        if self.control_option == 1:  # c_i^+ = g_i(x) over the whole training split
            whole = Objective(self.model, data.label_mask)
            new_c = grad(whole)(x, data.x, data.y, data.mask)
        else:  # c_i^+ = c_i - c + (x - y_i) / (K_i eta_l)
            steps = (data.batch_mask.sum(-1) > 0).sum().to(next(iter(x.values())).dtype)
            scale = 1.0 / (steps.clamp(min=1) * ctx.client_lr)
            new_c = {k: c_i[k] - c[k] + scale * delta[k] for k in x}

        upload = {**delta, **tree.add_prefix(DC, tree.sub(new_c, c_i))}
        weight = torch.ones_like(data.num_samples)  # the paper's unweighted mean over S
        return ClientOut(upload, weight, {"loss": mean_loss}), tree.add_prefix(CI, new_c)

    def aggregate(self, out: ClientOut, ctx: RoundContext):
        """``(1/|S|) sum_S (x - y_i)`` and ``(|S|/N) (1/|S|) sum_S Delta c_i = (1/N) sum_S Delta c_i``.

        A weighted sum of the uploads (with ``out.weight`` as the relative weights, uniform as the
        clients send them), so privacy and the server optimizer wrap it like FedAvg's.
        """
        mean = tree.weighted_sum(out.upload, out.weight / out.weight.sum())
        share = out.weight.shape[0] / ctx.num_clients  # |S| / N
        return {k: share * v if k.startswith(DC) else v for k, v in mean.items()}

    def server_update(self, server, aggregated, ctx):
        step = {k: v for k, v in aggregated.items() if not k.startswith(DC)}
        server = super().server_update(server, step, ctx)
        c = tree.add(server["c"], tree.strip_prefix(DC, aggregated))
        return {**server, "c": c}
