"""FedFed: clients share noised performance-sensitive features, and FedAvg trains on them too.

Yang, Wang, Zhang, Liu, Zhang, Zhang. "FedFed: Feature Distillation against Data Heterogeneity in
Federated Learning". NeurIPS 2023; arXiv:2310.05077. FL-bench's ``src/{server,client}/fedfed.py``
(KarhouTam/FL-bench, "modified from the official codes") read for the details below.

Two phases. **Feature distillation** (rounds t < ``warmup_rounds``): client k splits each input
into a performance-robust part x_r = G_phi(x) (the distiller's reconstruction) and a
performance-sensitive part x_s = x - x_r, and trains the distiller phi with the model theta on

    L_k(theta, phi) = re ||G_phi(x) - x||^2 / d + ce CE(f_theta(x_s + sigma eps), y)
                      + x_ce CE(f_theta(x), y),

(FL-bench's third loop: reconstruction, the noised sensitive part classified, the input
classified), then uploads its noised sensitive features x_p = x_s + sigma eps' of its first
``shared_samples`` training samples with their labels; the server averages (theta, phi) as FedAvg
does and keeps every client's latest x_p in a table, the globally shared data. **Classification**
(t >= ``warmup_rounds``): FedAvg on theta, each client's local loss the cross-entropy on its
minibatch plus that on the round's draw of ``shared_batch`` shared features (equal weights, as
FL-bench's training set of the client's samples and as many shared ones).

Symbols to code: G_phi -> ``distiller.0``, ``distiller.1`` (``x -> W1 relu(W0 flat(x) + b0) + b1``,
width ``hidden_dim``, 32 as FL-bench's ``VAE_block_depth``), sigma -> ``noise_std``, re, ce,
x_ce -> ``reconstruction``, ``sensitive_ce``, ``input_ce`` (FL-bench's ``VAE_re`` 5,
``VAE_ce`` 2, ``VAE_x_ce`` 0.4, and ``VAE_noise_std1`` 0.15); the shared table ->
``server["shared"]``: ``x`` ``[I, S, ...]``, ``y``, ``mask`` (S = ``shared_samples``); the
round's draw of it -> the downlink's ``shared.x``, ``shared.y``, ``shared.mask`` (all masked
before any client has shared); eps, eps' -> counter-based normal
draws (:func:`pflego.rng.counter_normal`) of the client's key (its state, drawn at the first visit
and hashed into the next one after every round), the sample's index and the coordinate (offset
by the input's size for the upload's draw), so every backend and Flower node draws alike.

Deliberate differences from the paper and the authors' code (FL-bench's copy of it):
- The distiller is a deterministic two-layer autoencoder on the flattened input, not the authors'
  convolutional beta-VAE: no reparameterized sampling and no KL term (its weight is 0.005 there,
  and the authors share the features of the VAE's mean, which this is), no batch norm.
- One noise level sigma and one noised copy per sample; the authors' code shares two copies, at
  0.15 and 0.25, and trains on both.
- One loss for the distillation phase: FL-bench's first loop (the classifier alone on mixup of the
  inputs) and second (the VAE on reconstruction alone) are left out, the third kept; the
  distiller steps with the run's client optimizer (the authors' AdamW, lr 1e-3, wd 1e-6), and one
  draw of eps per sample and round (a sample seen twice in a round reuses it).
- The distillation is the run's first ``warmup_rounds`` rounds with the run's cohorts (FL-bench's
  15 rounds of their own before the run's); a client uploads its features at every distillation
  round it trains in and the server keeps the last, so a client never sampled in that phase shares
  nothing (the authors collect every client's once, after it); only the first ``shared_samples``
  of a client's training samples are shared (the authors share all).
- Classification: the shared rows are drawn by the server, ``shared_batch`` uniformly with
  replacement from the table each round, and the same draw enters every local step of the round
  (the distiller's entries stay in the model, unchanged). The shared rows' labels are the run's
  labels as the clients hold them.
- ``hidden_dim`` 32: at 64 the distillation diverged on the registry's tiny federation under
  momentum SGD at lr 0.1 (one optimizer steps both networks here).

Prediction is the global model's; a client that never trained uses it as it is (no ``join``).
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
from pflego.models.hypernet import init_linear
from pflego.rng import counter_normal, next_key, seed_for
from pflego.tree import Params
from pflego.types import ClientData, ClientOut, RoundContext, ServerState

KEY = "key"  # the client's key of its counter-based draws
KEYS = 2**24  # keys are drawn below this, exact in float32 state
SHARED = ("shared.x", "shared.y", "shared.mask")  # the round's shared rows in the downlink


def first_rows(t: Tensor, count: int) -> Tensor:
    """The first ``count`` rows of ``t``, padded with zeros where it has fewer."""
    head = t[:count]
    pad = head.new_zeros((count - head.shape[0], *head.shape[1:]))
    return torch.cat([head, pad])


@register("fedfed")
@dataclass(frozen=True)
class FedFed(Algorithm):
    """FedFed (see the module docstring)."""

    shared: ClassVar[tuple[str, ...]] = ("body", "head", "distiller")
    sum_aggregate: ClassVar[bool] = False  # the uploaded features fill the server's table
    join_trains: ClassVar[bool] = False  # a new client uses the global model as it is

    warmup_rounds: int = setting(
        15, "rounds of feature distillation before classification", at_least(1)
    )
    hidden_dim: int = setting(32, "width of the distiller's hidden layer", at_least(1))
    noise_std: float = setting(
        0.15, "std of the noise on the shared sensitive features", non_negative
    )
    reconstruction: float = setting(
        5.0, "weight of the distiller's reconstruction error", non_negative
    )
    sensitive_ce: float = setting(
        2.0, "weight of the noised sensitive part's cross-entropy", non_negative
    )
    input_ce: float = setting(
        0.4, "weight of the input's cross-entropy while distilling", non_negative
    )
    shared_samples: int = setting(32, "training samples each client shares", at_least(1))
    shared_batch: int = setting(64, "shared features each local step adds", at_least(1))

    def init_params(self, seed: int, dtype: torch.dtype = torch.float32) -> Params:
        """The model as usual and the distiller, ``nn.Linear``'s initialization."""
        params = super().init_params(seed, dtype)
        d = math.prod(self.model.input_shape)
        layers = [("distiller.0", self.hidden_dim, d), ("distiller.1", d, self.hidden_dim)]
        gen = torch.Generator().manual_seed(seed_for(seed, 41))
        return params | init_linear(layers, gen, torch.zeros((), dtype=dtype))

    def init_client(self, downlink, generator, ctx):
        """The client's key of its counter-based draws."""
        first = next(iter(downlink.values()))
        return {KEY: torch.randint(0, KEYS, (), generator=generator).to(first.dtype)}

    def robust(self, params: Params, x: Tensor) -> Tensor:
        """x_r = G_phi(x), shaped as x."""
        h = x.flatten(1) @ params["distiller.0.weight"].T + params["distiller.0.bias"]
        out = torch.relu(h) @ params["distiller.1.weight"].T + params["distiller.1.bias"]
        return out.reshape(x.shape)

    # --- server ---------------------------------------------------------------------------------

    def downlink(
        self, server: ServerState, ctx: RoundContext, clients: Tensor | None = None
    ) -> Params:
        """The global model and the round's ``shared_batch`` rows drawn from the shared table
        (none, all masked, before the table holds any)."""
        params = server["params"]
        like = params["head.bias"]
        if "shared" not in server:
            shape = (self.shared_batch, *self.model.input_shape)
            empty = like.new_zeros(self.shared_batch)
            return {
                **params,
                "shared.x": like.new_zeros(shape),
                "shared.y": empty,
                "shared.mask": empty,
            }
        x, y, mask = (server["shared"][k].flatten(0, 1) for k in ("x", "y", "mask"))
        weights = (mask + (mask.sum() == 0).to(mask)).cpu()  # uniform over the rows that exist
        gen = torch.Generator().manual_seed(seed_for(ctx.seed, 42, ctx.round))
        rows = torch.multinomial(weights, self.shared_batch, True, generator=gen).to(mask.device)
        return {**params, "shared.x": x[rows], "shared.y": y[rows], "shared.mask": mask[rows]}

    def evaluation_downlink(self, server, ctx, clients=None) -> Params:
        return server["params"]

    def server_round(
        self, server: ServerState, out: ClientOut, ctx: RoundContext, clients: Tensor
    ) -> ServerState:
        """FedAvg on (theta, phi); while distilling, the cohort's features replace their rows of
        the shared table."""
        model = {k: v for k, v in out.upload.items() if k not in SHARED}
        new = self.server_update(server, self.aggregate(out._replace(upload=model), ctx), ctx)
        if ctx.round >= self.warmup_rounds:
            return new
        rows = {k.removeprefix("shared."): out.upload[k] for k in SHARED}
        table = server.get("shared") or {
            k: v.new_zeros((ctx.num_clients, *v.shape[1:])) for k, v in rows.items()
        }
        ids = clients.to(device=rows["x"].device, dtype=torch.int64)
        return {**new, "shared": {k: table[k].index_copy(0, ids, v) for k, v in rows.items()}}

    # --- client ---------------------------------------------------------------------------------

    def client_update(self, downlink, state, data: ClientData, ctx: RoundContext):
        """Local steps of the round's phase; while distilling, the upload carries the client's
        noised sensitive features."""
        params = {k: v for k, v in downlink.items() if k not in SHARED}
        distilling = ctx.round < self.warmup_rounds
        n = data.x.shape[0]
        if distilling:
            loss = self.distill_objective(
                data.x, self.noise(state[KEY], data.x, 0), data.label_mask
            )
            indexed = data._replace(x=torch.arange(n, device=data.x.device))
        else:
            shared = tuple(downlink[k] for k in SHARED)
            loss, indexed = self.classify_objective(shared, data.label_mask), data
        opt = self.client_optimizer
        trained, _, mean_loss = train_steps(
            loss, params, indexed, opt, opt.init(params), ctx.client_lr
        )
        upload = tree.sub(params, trained)
        if distilling:
            upload |= self.shared_features(trained, state[KEY], data)
        new_state = {**state, KEY: next_key(state[KEY])}
        return ClientOut(upload, data.num_samples, {"loss": mean_loss}), new_state

    def noise(self, key: Tensor, x: Tensor, stream: int) -> Tensor:
        """sigma eps: a counter-based normal draw per sample and coordinate, shaped as x."""
        d = x[0].numel()
        rows = torch.arange(x.shape[0], device=x.device)[:, None]
        cols = torch.arange(stream * d, (stream + 1) * d, device=x.device)[None, :]
        eps = counter_normal(key, rows, cols, dtype=x.dtype)
        return self.noise_std * eps.reshape(x.shape)

    def shared_features(self, params: Params, key: Tensor, data: ClientData) -> Params:
        """x_p = x - G_phi(x) + sigma eps' of the first ``shared_samples`` training samples."""
        x = first_rows(data.x, self.shared_samples)
        mask = first_rows(data.mask, self.shared_samples).to(x.dtype)
        noised = x - self.robust(params, x) + self.noise(key, x, 1)
        return {
            "shared.x": (mask.reshape(-1, *[1] * (x.dim() - 1)) * noised).detach(),
            "shared.y": first_rows(data.y, self.shared_samples).to(x.dtype),
            "shared.mask": mask,
        }

    def distill_objective(self, x_all: Tensor, noise: Tensor, label_mask: Tensor):
        """L_k(theta, phi) on a minibatch given as the indices of its samples."""

        def loss(p: Params, i: Tensor, y: Tensor, mask: Tensor) -> Tensor:
            x = x_all[i]
            x_r = self.robust(p, x)
            error = ((x_r - x) ** 2).flatten(1).mean(1)
            error = (mask * error).sum() / mask.sum().clamp(min=1)
            sensitive = self.model.forward(p, x - x_r + noise[i])
            return (
                self.reconstruction * error
                + self.sensitive_ce * masked_cross_entropy(sensitive, y, mask, label_mask)
                + self.input_ce
                * masked_cross_entropy(self.model.forward(p, x), y, mask, label_mask)
            )

        return loss

    def classify_objective(self, shared: tuple[Tensor, Tensor, Tensor], label_mask: Tensor):
        """CE on the minibatch plus CE on the round's shared rows."""
        x_s, y_s, mask_s = shared
        y_s = y_s.to(torch.int64)

        def loss(p: Params, x: Tensor, y: Tensor, mask: Tensor) -> Tensor:
            own = masked_cross_entropy(self.model.forward(p, x), y, mask, label_mask)
            return own + masked_cross_entropy(self.model.forward(p, x_s), y_s, mask_s)

        return loss
