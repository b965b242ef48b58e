"""FedDBE: domain bias eliminator (FedAvg + DBE).

Zhang, Hua, Cao, Wang, Song, Xue, Ma, Guan. "Eliminating Domain Bias for Federated Learning in
Representation Space". NeurIPS 2023; arXiv:2311.14975. Authors' code: github.com/TsingZ0/DBE
(``clientDBE.py``, ``serverDBE.py``; the same files in PFLlib).

The representation z_i = f(x; theta^f) of the shared body is taken as its global part z^g_i, and
the head h(.; theta^h) reads ``z^g_i + zbar^p_i``: zbar^p_i is the Personalized Representation
Bias Memory (PRBM), one learnable vector of the feature width M per client, trained with the
model and never uploaded. The Mean Regularization (MR) pulls the client's mean global
representation zbar^g_i toward the global mean zbar^g:

    L_i = CE(h(z^g_i + zbar^p_i), y) + kappa * (1/M) sum_k 1/2 (zbar^g_{i,k} - zbar^g_k)^2.

Algorithm 1: (initialization period) every client trains the received model without DBE (plain
CE, no PRBM, no MR) and sends its mean zbar^g_i; the server forms zbar^g = sum_i n_i/n zbar^g_i
and fixes it for the whole run; (iterations t = 1..T) each sampled client starts from
theta^{t-1}, trains theta and zbar^p_i together on L_i with SGD, uploads theta_i, and the server
averages theta^t = sum_i n_i/n theta_i.

Symbols to code: theta^f -> ``body.*``, theta^h -> ``head.*`` (shared, C-way), zbar^p_i -> the
client state ``prbm.z`` ``[M]`` (zero at the first visit, as in the authors' code), zbar^g -> the
server state ``dbe.mean`` (sent in the downlink as ``dbe.mean``, with ``dbe.ready`` 1 once it
exists), kappa -> ``kappa``, zbar^g_i -> the running mean of the batch means below, with
``momentum``; the learning rate of theta and of zbar^p_i -> ``ctx.client_lr`` (the authors' code
uses a separate SGD optimizer with the same rate for the PRBM; here the client optimizer runs on
both, which is the same for SGD).

zbar^g_i as in the authors' code: reset to 0 each round, then at every local step
``m_s = (1 - momentum) * sg(m_{s-1}) + momentum * mean_batch(z^g)`` (sg: no gradient through the
past, the code's ``detach_running``), and the MR of that step is taken at m_s, so its gradient
reaches the body through the current batch's mean. ``momentum = 1`` (the authors' ``run_me.sh``:
``-mo 1``) uses the current batch's mean alone. The initialization-period mean is m_S after the
round's last step (with ``momentum = 1``, the last batch's mean).

Defaults: kappa = 50 and momentum = 1, the authors' ``run_me.sh`` for the 4-layer CNN on FMNIST
(the PFLlib parser's defaults, ``-klw 0 -mo 0.1``, switch MR off).

Deliberate differences:
- The initialization period is round 0 of the run: the round-0 cohort trains without DBE and
  uploads its means (weighted by N_i, the paper's n_i/n); the server keeps zbar^g and, like the
  authors' code, discards the models trained in it (round 1 starts again from theta^0). With
  ``participation < 1`` zbar^g is therefore the mean over the round-0 cohort, not over every
  client (the paper's experiments, like its code, let all clients join the initialization).
- Every upload carries the client's mean (M numbers beside the model); the server reads it only
  once. The global model is averaged through the server optimizer on ``theta^{t-1} - theta_i``
  (server SGD with lr 1, the default, is the paper's weighted average).

Prediction: ``h(f(x) + zbar^p_i)`` (the authors' ``test_metrics``). A client that never trained
(``join``) fits its own PRBM on the frozen body's features with the head fixed (the run's
schedule, from zero), the module DBE makes personal; the paper's new-client experiment fine-tunes
on the new clients, which the authors' code does for the whole model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor
from torch.func import grad_and_value

from pflego import tree
from pflego.algorithms.base import Algorithm, register
from pflego.fields import between, non_negative, setting
from pflego.local import train_steps
from pflego.loss import masked_cross_entropy
from pflego.models import head_logits
from pflego.tree import Params
from pflego.types import ClientData, ClientOut, RoundContext, ServerState

PRBM = "prbm.z"  # zbar^p_i, the client's representation bias
MEAN = "dbe.mean"  # zbar^g in the downlink; zbar^g_i in the upload
READY = "dbe.ready"  # 1 once zbar^g exists (after the initialization period)
MODEL = ("body", "head")


def batch_mean(features: Tensor, mask: Tensor) -> Tensor:
    """Mean of the real samples' features, ``[M]``."""
    return (features * mask[:, None]).sum(0) / mask.sum().clamp(min=1)


@register("feddbe")
@dataclass(frozen=True)
class FedDBE(Algorithm):
    kappa: float = setting(50.0, "strength kappa of the mean regularization", non_negative)
    momentum: float = setting(
        1.0,
        "momentum of the running mean of the batch means (1: the last batch's)",
        between(0, 1, "(]"),
    )

    shared: ClassVar[tuple[str, ...]] = ("body", "head")
    personal: ClassVar[tuple[str, ...]] = ("prbm",)

    # --- server -------------------------------------------------------------------------------

    def downlink(self, server: ServerState, ctx: RoundContext, clients: Tensor | None = None):
        """theta^{t-1} and zbar^g (zeros, with ``dbe.ready`` 0, during the initialization)."""
        params = server["params"]
        first = next(iter(params.values()))
        if "dbe" in server:
            mean, ready = server["dbe"]["mean"], torch.ones((), dtype=first.dtype)
        else:
            mean = torch.zeros(self.model.feature_dim, dtype=first.dtype, device=first.device)
            ready = torch.zeros((), dtype=first.dtype)
        return {**params, MEAN: mean, READY: ready.to(first.device)}

    def server_update(self, server: ServerState, aggregated, ctx: RoundContext) -> ServerState:
        """Round 0 fixes zbar^g = sum n_i/n zbar^g_i and keeps theta^0; later rounds average."""
        if "dbe" not in server:  # the initialization period (Algorithm 1, before iteration 1)
            return {**server, "dbe": {"mean": aggregated[MEAN]}}
        return super().server_update(server, tree.select(aggregated, MODEL), ctx)

    # --- client -------------------------------------------------------------------------------

    def init_client(self, downlink, generator, ctx):
        """zbar^p_i = 0 (the authors' code)."""
        first = next(iter(downlink.values()))
        return {PRBM: torch.zeros(self.model.feature_dim, dtype=first.dtype)}

    def local_loss(self, ready: Tensor, global_mean: Tensor, label_mask: Tensor):
        """``L_i`` on a batch given the running mean of the previous steps; returns the loss and
        the new running mean. Without zbar^g (``ready`` 0): plain CE, PRBM and MR off."""

        def loss(params: Params, running: Tensor, x: Tensor, y: Tensor, mask: Tensor):
            z = self.model.features(params, x)
            running = (1 - self.momentum) * running + self.momentum * batch_mean(z, mask)
            logits = head_logits(params, z + ready * params[PRBM])
            reg = (0.5 * (running - global_mean) ** 2).mean()
            value = masked_cross_entropy(logits, y, mask, label_mask) + ready * self.kappa * reg
            return value, running

        return loss

    def client_update(self, downlink, state, data: ClientData, ctx: RoundContext):
        ready, global_mean = downlink[READY], downlink[MEAN]
        params = {**tree.select(downlink, MODEL), **state}
        step = grad_and_value(self.local_loss(ready, global_mean, data.label_mask), has_aux=True)
        opt = self.client_optimizer
        opt_state = opt.init(params)
        running = torch.zeros_like(global_mean)
        total, count = torch.zeros(()), torch.zeros(())
        for idx, bmask in zip(data.batches, data.batch_mask, strict=True):
            grads, (value, new_running) = step(
                params, running.detach(), data.x[idx], data.y[idx], bmask
            )
            active = bmask.sum() > 0
            params, opt_state = opt.masked_update(params, grads, opt_state, ctx.client_lr, active)
            running = torch.where(active, new_running.detach(), running)
            total = total + torch.where(active, value.detach(), 0.0)
            count = count + active.to(count.dtype)
        model = tree.select(params, MODEL)
        upload = {**tree.sub(tree.select(downlink, MODEL), model), MEAN: running}
        metrics = {"loss": total / count.clamp(min=1)}
        return ClientOut(upload, data.num_samples, metrics), {PRBM: params[PRBM]}

    def predict(self, downlink, state, x):
        """``h(f(x) + zbar^p_i)``."""
        return head_logits(downlink, self.model.features(downlink, x) + state[PRBM])

    def join(self, downlink, state, data, ctx):
        """A new client's PRBM, fitted on the frozen body's features with the head fixed."""
        features = self.model.features(downlink, data.x).detach()
        head = tree.select(downlink, ["head"])

        def loss(p: Params, f: Tensor, y: Tensor, m: Tensor) -> Tensor:
            return masked_cross_entropy(head_logits(head, f + p[PRBM]), y, m, data.label_mask)

        opt = self.client_optimizer
        tuned, _, _ = train_steps(
            loss, state, data._replace(x=features), opt, opt.init(state), ctx.client_lr
        )
        return tuned
