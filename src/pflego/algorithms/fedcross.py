"""FedCross: several middleware models, each trained by one client a round and cross-aggregated.

Hu, Xu, Chen, Wei, Chen, Sha, Zhou. "FedCross: Towards Accurate Federated Learning via
Multi-Model Cross-Aggregation". ICDE 2024; arXiv:2210.08285. PFLlib's ``servercross.py`` /
``clientcross.py`` (contributed by the authors) was read for the details below.

The server keeps K middleware models v_1..v_K, K the cohort size, all the initial model at first.
In round t the k-th client of the cohort receives v_k, trains it locally (the run's schedule and
client optimizer) and returns v_k'. The global model is the N_i-weighted mean of the returned
models (what is evaluated). From round ``first_stage_bound`` on, each middleware model is then
cross-aggregated with one collaborative model,

    v_k <- alpha v_k' + (1 - alpha) v_{c(k)}',

where c(k) != k is, by ``select``: ``lowest`` the model least similar to v_k' (the paper's and
PFLlib's default), ``highest`` the most similar one, or ``in-order`` (k + o_t) mod K with
o_t = t mod (K - 1) + 1. The similarity of two models is the sum over layers (a module's weight
and bias) of the cosine similarity of their flattened parameters. Before ``first_stage_bound``
every middleware model becomes the global model (FedAvg).

Symbols to code: v_1..v_K -> ``server["middleware"]`` ``[K, ...]``; the global model ->
``server["params"]``; alpha -> ``alpha`` (0.99), the first stage -> ``first_stage_bound`` (0),
the collaborative model selection -> ``select`` (PFLlib's defaults); k -> the downlink's and the
upload's ``slot``.

Deliberate differences and choices:
- K is the run's cohort size (rounded; at least 1), fixed when the middleware models are made.
  The cohort's k-th client trains v_{k mod K}; the slot travels with the model and comes back
  with the upload, so a dropped client leaves its middleware model as it was. Where a cohort has
  more than K clients (Bernoulli sampling), a middleware model trained by several becomes the
  N_i-weighted mean of their models before the cross-aggregation; one trained by none this round
  keeps its value.
- The downlink carries the global model beside the middleware model (twice FedAvg's traffic), so
  that every client's prediction reads the model it received; PFLlib evaluates the global model
  on the server's side.
- PFLlib's similarity adds the last layer's cosine twice (once more after its loop); here every
  layer counts once.
- The global model is the weighted mean of the returned models; the server optimizer and
  ``server_lr`` are not used (``server_step = "own"``). Differential privacy and SecAgg+ are
  refused (``sum_aggregate = False``): the server needs each returned model.

FedCross is not personalized: every client, and a client that never trained (``join``: nothing
to do), is evaluated with the global model, as in PFLlib.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from pflego import tree
from pflego.algorithms.base import Algorithm, register
from pflego.fields import between, non_negative, one_of, setting
from pflego.tree import Params
from pflego.types import ClientData, ClientOut, RoundContext, ServerState

OWN, MIDDLEWARE, SLOT = "model.", "middleware.", "slot"
SELECTIONS = ("lowest", "highest", "in-order")


def layer_similarity(models: Params) -> Tensor:
    """``[K, K]``: the sum over layers of the cosine similarity of the stacked models' layers."""
    layers: dict[str, list[Tensor]] = {}
    for k, v in models.items():
        layers.setdefault(k.rsplit(".", 1)[0], []).append(v.flatten(1))
    total = 0
    for parts in layers.values():
        flat = torch.cat(parts, 1)
        unit = flat / flat.norm(dim=1, keepdim=True).clamp(min=1e-8)
        total = total + unit @ unit.T
    return total


@register("fedcross")
@dataclass(frozen=True)
class FedCross(Algorithm):
    alpha: float = setting(
        0.99,
        "weight alpha of a middleware model's own update in its cross-aggregation",
        between(0, 1),
    )
    first_stage_bound: int = setting(
        0, "the rounds of plain averaging before the cross-aggregation", non_negative
    )
    select: str = setting(
        "lowest",
        "how each middleware model's collaborator is chosen (lowest, highest similarity, in-order)",
        one_of(*SELECTIONS, says="must be one of"),
    )

    per_client_downlink: ClassVar[bool] = True
    sum_aggregate: ClassVar[bool] = False
    server_step: ClassVar[str] = "own"  # the mean of the returned models, then the crossing
    join_trains: ClassVar[bool] = False

    # --- server ---------------------------------------------------------------------------------

    def middleware(self, server: ServerState, ctx: RoundContext) -> Params:
        """v_1..v_K ``[K, ...]``: the stored ones, or K copies of the initial model."""
        if "middleware" in server:
            return server["middleware"]
        count = max(1, round(ctx.cohort_size))
        return {k: v.expand(count, *v.shape) for k, v in server["params"].items()}

    def downlink(
        self, server: ServerState, ctx: RoundContext, clients: Tensor | None = None
    ) -> Params:
        """The global model, and v_{k mod K} with its slot for the cohort's k-th client; a
        newcomer gets the global model."""
        params = server["params"]
        if clients is None:
            return params
        models = self.middleware(server, ctx)
        count = len(next(iter(models.values())))
        first = next(iter(params.values()))
        slots = torch.arange(len(clients), device=first.device) % count
        stacked = {k: v.expand(len(clients), *v.shape) for k, v in params.items()}
        sent = {k: v[slots.to(v.device)] for k, v in models.items()}
        return {**stacked, **tree.add_prefix(MIDDLEWARE, sent), SLOT: slots.to(first)}

    def evaluation_downlink(
        self, server: ServerState, ctx: RoundContext, clients: Tensor | None = None
    ) -> Params:
        """The global model, for every client (without the middleware models)."""
        if clients is None:
            return server["params"]
        return {k: v.expand(len(clients), *v.shape) for k, v in server["params"].items()}

    def partners(self, similarity: Tensor, t: int) -> Tensor:
        """c(k) for every middleware model k, by ``select``."""
        count = len(similarity)
        if self.select == "in-order":
            offset = t % (count - 1) + 1
            return (torch.arange(count) + offset) % count
        eye = torch.eye(count, dtype=torch.bool, device=similarity.device)
        if self.select == "lowest":
            return similarity.masked_fill(eye, torch.inf).argmin(1)
        return similarity.masked_fill(eye, -torch.inf).argmax(1)

    def server_round(
        self, server: ServerState, out: ClientOut, ctx: RoundContext, clients: Tensor
    ) -> ServerState:
        """The global model, each returned middleware model stored, then crossed (or reset)."""
        uploads = tree.strip_prefix(OWN, out.upload)
        params = server["params"]
        mean = tree.weighted_sum(uploads, out.weight / out.weight.sum())
        glob = {k: v.to(params[k]) for k, v in mean.items()}
        models = self.middleware(server, ctx)
        count = len(next(iter(models.values())))
        if ctx.round < self.first_stage_bound:
            stacked = {k: v.expand(count, *v.shape).clone() for k, v in glob.items()}
            return {"params": glob, "middleware": stacked}
        slots = out.upload[SLOT].to(torch.int64)
        weight = out.weight.to(glob[next(iter(glob))].dtype)
        mass = torch.zeros(count, dtype=weight.dtype).index_add(0, slots, weight)

        def returned(v: Tensor, upload: Tensor) -> Tensor:
            """The weighted mean of the models trained from each slot; the rest unchanged."""
            shape = (-1,) + (1,) * (v.dim() - 1)
            sums = torch.zeros_like(v).index_add(0, slots, upload.to(v) * weight.reshape(shape))
            return torch.where(mass.reshape(shape) > 0, sums / mass.clamp(min=1).reshape(shape), v)

        trained = {k: returned(v, uploads[k]) for k, v in models.items()}
        if count < 2:
            return {"params": glob, "middleware": trained}
        partner = self.partners(layer_similarity(trained), ctx.round)
        crossed = {k: self.alpha * v + (1 - self.alpha) * v[partner] for k, v in trained.items()}
        return {"params": glob, "middleware": crossed}

    # --- client ---------------------------------------------------------------------------------

    def client_update(self, downlink, state, data: ClientData, ctx: RoundContext):
        """The middleware model trained; returned with its slot."""
        model = tree.strip_prefix(MIDDLEWARE, downlink)
        trained, mean_loss = self.train(model, data, ctx)
        upload = {**tree.add_prefix(OWN, trained), SLOT: downlink[SLOT]}
        return ClientOut(upload, data.num_samples, {"loss": mean_loss}), state
