"""ADCOL: adversarial collaborative learning on non-IID features.

Li, Wang, He. "Adversarial Collaborative Learning on Non-IID Features". ICML 2023 (PMLR
202:19504-19526; no arXiv id).

No model averaging: every party i trains its own model (encoder f_i and classifier h_i), and the
server trains a discriminator D that tells from a representation z = f_i(x) which party it comes
from; the parties learn representations that D cannot tell apart, i.e. one common representation
distribution across the parties' feature shifts. Party i minimizes on its minibatches

    CE(h_i(f_i(x)), y) + mu KL(u || D(f_i(x))),   u = (1/I, ..., 1/I),

with D(z) = softmax over the I parties, KL(u || p) = -log I - (1/I) sum_k log p_k; the server
minimizes sum_i sum_{x in D_i} CE(D(f_i(x)), i) over the parties' representations.

Symbols to code: f_i, h_i -> the client state (``body.*``, ``head.*`` over its own K_i classes),
starting from the initial model w^0 the server holds (``init.*`` in the downlink, as ``local``);
D -> ``disc.*``, an MLP M -> ``hidden`` -> ``hidden`` -> I with ReLUs (PyTorch's Linear init,
seeded by the run's seed), I the training population; party i's id -> the one-hot ``id`` of its
downlink (one per client); mu -> ``mu`` (0.5, FL-bench's default); the local solver ->
``pflego.local.train_steps`` with ``ctx.client_lr``; the discriminator's step -> plain SGD of
size ``dis_lr`` (default 0.1; FL-bench's is 0.01, for many steps a round). The server's
parameters are w^0, which never move, so a run that sets a server optimizer or ``server_lr`` is
refused.

Deliberate differences:
- The discriminator takes one full-batch gradient step per round, and the representations never
  leave the parties: after its local steps, each sampled party computes the gradient of the mean
  of CE(D(f_i(x)), i) over its training split (its representations at its trained model) and
  uploads it; the server steps D along the N_i-weighted mean, the gradient of the cohort's
  pooled discriminator loss. The paper and FL-bench upload the representations themselves and
  train D for ``dis_epoch`` (3) epochs of minibatch SGD (lr 0.01) on them; the upload here is a
  weighted sum, so clipping, noise and secure aggregation apply to it.
- D has no batch normalization (FL-bench's has BatchNorm1d after each hidden layer, and no
  biases), which a functional, vectorized step cannot carry; here its layers have biases.
- FL-bench also averages the parties' models (it inherits FedAvg's aggregation); the paper, as
  here, keeps each party's model its own.
- Representations are those of the trained model over the whole training split; FL-bench
  collects them during the last local epoch, at the models of its steps.

Unseen clients (``join``): they train their own model from w^0 on one visit's schedule with the
same loss against the current D (its KL term needs no id), as a party's first visit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.func import grad

from pflego import tree
from pflego.algorithms.base import Algorithm, register
from pflego.fields import at_least, non_negative, positive, setting
from pflego.local import train_steps
from pflego.loss import masked_cross_entropy
from pflego.models import init_head
from pflego.rng import seed_for
from pflego.tree import Params
from pflego.types import ClientData, ClientOut, RoundContext

INIT = "init."  # the initial model w^0, in the downlink
DISC = "disc."  # the discriminator D, in the server state, the downlink and the upload
ID = "id"  # the client's one-hot id among the I parties, in its downlink
DISC_STREAM = 11  # the random stream of D's initialization


@register("adcol")
@dataclass(frozen=True)
class ADCOL(Algorithm):
    shared: ClassVar[tuple[str, ...]] = ()
    personal: ClassVar[tuple[str, ...]] = ("body", "head")
    label_space: ClassVar[str] = "local"
    per_client_downlink: ClassVar[bool] = True
    server_step: ClassVar[str] = "own"  # D moves by plain steps of dis_lr
    mu: float = setting(
        0.5, "weight mu of the KL term that makes parties indistinguishable", non_negative
    )
    hidden: int = setting(512, "width of the discriminator's two hidden layers", at_least(1))
    dis_lr: float = setting(0.1, "step size of the discriminator's gradient step", positive)

    # --- server ---------------------------------------------------------------------------------

    def init_params(self, seed: int, dtype: torch.dtype = torch.float32) -> Params:
        """The initial model w^0 every party starts from."""
        generator = torch.Generator().manual_seed(seed + 1)
        head = init_head(self.head_width, self.model.feature_dim, generator, self.head_init, dtype)
        return self.model.init_body(seed, dtype) | head

    def init_server(self, params: Params):
        return {"params": params}

    def discriminator(self, server, ctx: RoundContext) -> Params:
        """D: the server's, or before any step the initial one (I outputs, from the run's seed)."""
        if "disc" in server:
            return server["disc"]
        first = next(iter(server["params"].values()))
        gen = torch.Generator().manual_seed(seed_for(ctx.seed, DISC_STREAM))
        widths = (self.model.feature_dim, self.hidden, self.hidden, ctx.num_clients)
        disc = {}
        for j, (fan_in, fan_out) in enumerate(zip(widths[:-1], widths[1:])):
            bound = 1 / math.sqrt(fan_in)
            for name, shape in (("weight", (fan_out, fan_in)), ("bias", (fan_out,))):
                draw = torch.rand(*shape, generator=gen, dtype=torch.float64) * 2 - 1
                disc[f"{j}.{name}"] = (draw * bound).to(first.dtype).to(first.device)
        return disc

    def downlink(self, server, ctx: RoundContext, clients: Tensor | None = None) -> Params:
        """w^0 and D for each of ``clients``, and its one-hot id (zeros for a newcomer)."""
        shared = {
            **tree.add_prefix(INIT, server["params"]),
            **tree.add_prefix(DISC, self.discriminator(server, ctx)),
        }
        first = next(iter(shared.values()))
        if clients is None:
            return {**shared, ID: first.new_zeros(ctx.num_clients)}
        own = F.one_hot(clients.to(torch.int64), ctx.num_clients).to(first.dtype).to(first.device)
        return {**{k: v.expand(len(clients), *v.shape) for k, v in shared.items()}, ID: own}

    def server_update(self, server, aggregated: Params, ctx: RoundContext):
        """One step of D along the cohort's mean gradient of its loss."""
        disc = self.discriminator(server, ctx)
        step = tree.strip_prefix(DISC, aggregated)
        return {**server, "disc": {k: v - self.dis_lr * step[k] for k, v in disc.items()}}

    # --- client ---------------------------------------------------------------------------------

    def init_client(self, downlink, generator, ctx):
        """w^0."""
        return {k: v.clone() for k, v in tree.strip_prefix(INIT, downlink).items()}

    def party_logits(self, disc: Params, z: Tensor) -> Tensor:
        """D's logits over the I parties."""
        h = torch.relu(F.linear(z, disc["0.weight"], disc["0.bias"]))
        h = torch.relu(F.linear(h, disc["1.weight"], disc["1.bias"]))
        return F.linear(h, disc["2.weight"], disc["2.bias"])

    def train_party(self, downlink, state, data: ClientData, ctx: RoundContext):
        """The party's local steps on CE + mu KL(u || D(f(x))); the trained model and mean loss."""
        disc = tree.strip_prefix(DISC, downlink)
        label_mask = data.label_mask

        def loss(params: Params, x: Tensor, y: Tensor, mask: Tensor) -> Tensor:
            z = self.model.features(params, x)
            ce = masked_cross_entropy(self.model.forward(params, x), y, mask, label_mask)
            log_p = torch.log_softmax(self.party_logits(disc, z), -1)
            kl = -math.log(log_p.shape[-1]) - log_p.mean(-1)
            return ce + self.mu * (kl * mask).sum() / mask.sum().clamp(min=1)

        opt = self.client_optimizer
        trained, _, mean_loss = train_steps(loss, state, data, opt, opt.init(state), ctx.client_lr)
        return trained, mean_loss

    def client_update(self, downlink, state, data: ClientData, ctx: RoundContext):
        trained, mean_loss = self.train_party(downlink, state, data, ctx)
        disc = tree.strip_prefix(DISC, downlink)
        z = self.model.features(trained, data.x).detach()
        mask = data.mask / data.mask.sum().clamp(min=1)

        def disc_loss(d: Params) -> Tensor:
            log_p = torch.log_softmax(self.party_logits(d, z), -1)
            return -((log_p @ downlink[ID]) * mask).sum()

        upload = tree.add_prefix(DISC, grad(disc_loss)(disc))
        return ClientOut(upload, data.num_samples, {"loss": mean_loss}), trained

    def join(self, downlink, state, data: ClientData, ctx: RoundContext):
        return self.train_party(downlink, state, data, ctx)[0]
