"""FedAP: each client aggregates the others' models by the similarity of batch-norm statistics.

Lu, Wang, Chen, Qin, Yu. "Personalized Federated Learning with Adaptive Batchnorm for Healthcare".
IEEE Transactions on Big Data 2022; arXiv:2112.00734. Authors' code: github.com/microsoft/
PersonalizedFL (``alg/fedap.py``), ported to FL-bench (``src/server/fedap.py``,
``src/client/fedap.py``), which the rule below follows.

Every client keeps its own batch-norm layers, as in FedBN (this class extends :class:`FedBN`, whose
local steps and running statistics it reuses). After a pre-training of R_w rounds, every client
i measures, on the pre-trained model with its own batch-norm layers, the statistics of the input
of each batch-norm layer l over its training data: the per-channel mean mu_il and variance
sigma_il^2. The distance of two clients is the sum over layers of the 2-Wasserstein distances of
those diagonal Gaussians,

    d_ij = sum_l sqrt(||mu_il - mu_jl||^2 + ||sigma_il - sigma_jl||^2),

and client i's aggregation weights are ``w_ii = lambda`` and
``w_ij = (1 - lambda) (1 / d_ij) / sum_{k != i} (1 / d_ik)`` for j != i. In every later round the
server sends a sampled client ``theta~_i = sum_j w_ij theta_j`` over every client's latest model
(all but the batch-norm layers), the client trains it with its own batch-norm layers, and the
server stores the result as theta_i.

Symbols to code: R_w -> ``warmup_rounds``; lambda -> ``model_momentum`` (0.5, FL-bench's);
the pre-trained (global) model -> ``server["params"]``; theta_1..theta_I -> ``server["models"]``
``[I, ...]`` (``ModelTable``); (mu_il, sigma_il^2) -> ``server["stats"]`` (``<layer>.mean`` /
``<layer>.var``, ``[I, C_l]``) with ``server["measured"]`` ``[I]``; w -> ``server["weights"]``
``[I, I]``; a client's batch-norm layers -> its state, as FedBN's.

Deliberate differences and choices:
- The pre-training is f-FedAP's, the paper's variant without a pre-training split: R_w rounds of
  FedBN on the sampled clients' whole data (the run's schedule), an N_i-weighted mean of the
  models. The original pre-training, every client in turn training the same model on 30% of its
  data, is sequential and is not offered; neither is d-FedAP (only the last layer's statistics).
  R_w is a count of rounds, ``warmup_rounds`` (50: FL-bench's half of its 100 rounds).
- A model without batch norm (the default ``mlp``) has no batch-norm statistics: the statistics
  are then those of the body's output features (mean and variance per feature), the deep
  features d-FedAP reads, and every layer is aggregated (FedBN is FedAvg there).
- The statistics are each layer's input mean and biased variance over the client's whole
  training split at once, the batch-norm layers in training mode (FL-bench merges per-batch
  statistics of its loader's batches into the same moments, up to its unbiased batch variances).
- The authors measure every client once, right after the pre-training. Here a client measures
  when it is first sampled after it: until then it has not trained since the pre-training, so
  its model is the pre-trained one (its row of w is the identity until it is measured), and the
  weights are over the clients measured so far; with every client in every round this is the
  authors' rule from the first personalized round on (where all models still equal the
  pre-trained one). A client measures at every visit; the server keeps the first.
- A zero distance weighs 1e14, as the authors' code; a client measured alone keeps its model.
- Differential privacy and SecAgg+ are refused (``sum_aggregate = False``); the server optimizer
  and ``server_lr`` are not used (``server_step = "own"``).

Prediction: the client's theta_i (the authors' test does not re-aggregate), kept in its state as
well as on the server, with its own batch-norm layers in evaluation mode; during the
pre-training, and until the client trains after it, the model it receives (the global model:
an unmeasured client's row of w is the identity). A client that
never trained (``join``) has no statistics on the server: it trains the model it receives (the
pre-trained model) with fresh batch-norm layers of its own on its data, its first round.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from pflego import tree
from pflego.algorithms.base import Algorithm, register
from pflego.algorithms.fedbn import RUNNING, FedBN
from pflego.algorithms.table import OWN, ModelTable
from pflego.fields import between, non_negative, setting
from pflego.tree import Params
from pflego.types import ClientData, ClientOut, ClientState, RoundContext, ServerState

STATS, TRAINED = "stats.", "trained"
FEATURES = "features"  # the statistics' layer name for a model without batch norm


def wasserstein_weights(stats: Params, measured: Tensor, momentum: float) -> Tensor:
    """w ``[I, I]`` from the statistics ``<layer>.mean`` / ``<layer>.var`` ``[I, C]``: lambda on
    the diagonal and (1 - lambda) times the normalized 1 / d_ij over the other measured clients
    (the identity row for a client that is unmeasured or measured alone)."""
    layers = {k.rsplit(".", 1)[0] for k in stats}
    distance = 0
    for layer in sorted(layers):
        mean, std = stats[layer + ".mean"], stats[layer + ".var"].clamp(min=0).sqrt()
        squared = torch.cdist(mean, mean) ** 2 + torch.cdist(std, std) ** 2
        distance = distance + squared.clamp(min=0).sqrt()
    count = len(measured)
    others = (measured[:, None] > 0) & (measured[None, :] > 0) & ~torch.eye(count, dtype=bool)
    inverse = torch.where(others, 1 / distance.clamp(min=1e-14), 0.0)
    total = inverse.sum(1, keepdim=True)
    alone = total == 0
    eye = torch.eye(count, dtype=inverse.dtype)
    mixed = (1 - momentum) * inverse / torch.where(alone, 1.0, total) + momentum * eye
    return torch.where(alone, eye, mixed)


@register("fedap")
@dataclass(frozen=True)
class FedAP(ModelTable, FedBN):
    warmup_rounds: int = setting(
        50, "rounds of FedBN pre-training before the adaptive aggregation", non_negative
    )
    model_momentum: float = setting(
        0.5, "the weight lambda of a client's own model in its aggregate", between(0, 1)
    )

    personal: ClassVar[tuple[str, ...]] = ("body", "head")

    def __post_init__(self) -> None:
        Algorithm.__post_init__(self)  # without batch norm the features' statistics stand in

    # --- server: the pre-training's mean, then the table of theta_1..theta_I (``ModelTable``) --

    def downlink(
        self, server: ServerState, ctx: RoundContext, clients: Tensor | None = None
    ) -> Params:
        """theta~_i for each of ``clients``; a newcomer gets the global model."""
        if clients is None:
            return server["params"]
        models = self.stored(server, ctx)
        if "weights" not in server:
            return {k: v[clients.to(v.device)] for k, v in models.items()}
        rows = server["weights"][clients.to(server["weights"].device)]
        return tree.mix(models, dict.fromkeys(models, rows))

    def server_round(
        self, server: ServerState, out: ClientOut, ctx: RoundContext, clients: Tensor
    ) -> ServerState:
        """The pre-training's weighted mean; afterwards store the cohort's models, the
        statistics of those measured for the first time, and the weights."""
        if ctx.round < self.warmup_rounds:
            uploads = tree.strip_prefix(OWN, out.upload)
            mean = tree.weighted_sum(uploads, out.weight / out.weight.sum())
            return {"params": {k: v.to(server["params"][k]) for k, v in mean.items()}}
        measured, stats = self.measured(server, ctx, tree.strip_prefix(STATS, out.upload))
        idx = clients.to(measured.device)
        new = measured[idx] == 0
        stats = {k: v.clone() for k, v in stats.items()}
        for k, v in stats.items():
            v[idx] = torch.where(new[:, None], out.upload[STATS + k].to(v), v[idx])
        measured = measured.clone()
        measured[idx] = 1.0
        weights = wasserstein_weights(stats, measured, self.model_momentum)
        stored = self.store(server, out, ctx, clients)
        return {**stored, "stats": stats, "measured": measured, "weights": weights}

    def measured(
        self, server: ServerState, ctx: RoundContext, uploaded: Params
    ) -> tuple[Tensor, Params]:
        """Which clients are measured ``[I]`` and their statistics (zeros for the others)."""
        if "stats" in server:
            return server["measured"], server["stats"]
        first = next(iter(uploaded.values()))
        measured = first.new_zeros(ctx.num_clients)
        return measured, {
            k: first.new_zeros(ctx.num_clients, v.shape[-1]) for k, v in uploaded.items()
        }

    # --- client ---------------------------------------------------------------------------------

    def init_client(
        self, downlink: Params, generator: torch.Generator, ctx: RoundContext
    ) -> ClientState:
        """FedBN's fresh batch-norm layers, and no personal model yet (``trained`` 0)."""
        norms = super().init_client(downlink, generator, ctx)
        first = next(iter(downlink.values()))
        own = tree.add_prefix(OWN, tree.zeros_like(downlink))
        return {**norms, **own, TRAINED: first.new_zeros(())}

    def norm_state(self, state: ClientState) -> ClientState:
        """The client's batch-norm layers (FedBN's state)."""
        return {k: v for k, v in state.items() if not k.startswith(OWN) and k != TRAINED}

    def statistics(self, params: Params, data: ClientData) -> Params:
        """Each batch-norm layer's input mean and biased variance over the training split (the
        body's output features' without batch norm)."""
        if not self.norms:
            features = self.model.features(params, data.x).detach()
            rows = data.mask.to(features.dtype)[:, None]
            count = rows.sum().clamp(min=1)
            mean = (features * rows).sum(0) / count
            var = ((features - mean) ** 2 * rows).sum(0) / count
            return {f"{FEATURES}.mean": mean, f"{FEATURES}.var": var}
        recorded: dict = {}
        training = {k: v for k, v in params.items() if not k.endswith(RUNNING)}
        self.model.features(training, data.x, data.mask, recorded)
        out = {}
        for layer in self.norms:
            mean, var, _ = recorded[layer.key]
            out[f"{layer.key}.mean"], out[f"{layer.key}.var"] = mean.detach(), var.detach()
        return out

    def client_update(self, downlink, state, data: ClientData, ctx: RoundContext):
        """FedBN's local steps from theta~_i with the client's own batch-norm layers; uploads the
        trained model and the statistics measured on theta~_i before training."""
        affine, running = self.split_state(self.norm_state(state))
        stats = self.statistics({**downlink, **affine, **running}, data)
        trained, running, mean_loss = self.local_steps(
            {**downlink, **affine}, {}, running, data, ctx
        )
        model = tree.add_prefix(OWN, {k: trained[k] for k in downlink})
        upload = {**model, **tree.add_prefix(STATS, stats)}
        personal = torch.full_like(state[TRAINED], float(ctx.round >= self.warmup_rounds))
        new_state = {**{k: trained[k] for k in affine}, **running, **model, TRAINED: personal}
        return ClientOut(upload, data.num_samples, {"loss": mean_loss}), new_state

    def personal_model(self, downlink: Params, state: ClientState) -> Params:
        """theta_i once the client trained after the pre-training (or joined), else its downlink,
        with the client's own batch-norm layers."""
        model = tree.where(state[TRAINED] > 0, tree.strip_prefix(OWN, state), downlink)
        return {**model, **self.norm_state(state)}

    def predict(self, downlink: Params, state: ClientState, x: Tensor) -> Tensor:
        return self.model.forward(self.personal_model(downlink, state), x)

    def join(self, downlink, state, data: ClientData, ctx: RoundContext) -> ClientState:
        """A newcomer's first round: the model it receives and fresh batch-norm layers trained."""
        affine, running = self.split_state(self.norm_state(state))
        trained, running, _ = self.local_steps({**downlink, **affine}, {}, running, data, ctx)
        model = tree.add_prefix(OWN, {k: trained[k] for k in downlink})
        done = torch.ones_like(state[TRAINED])
        return {**{k: trained[k] for k in affine}, **running, **model, TRAINED: done}
