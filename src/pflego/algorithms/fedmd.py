"""FedMD: federated model distillation; clients agree on their scores over a public data set.

Li, Wang. "FedMD: Heterogenous Federated Learning via Model Distillation". NeurIPS 2019 Workshop
on Federated Learning for Data Privacy and Confidentiality; arXiv:1910.03581. Peer
implementation read: FL-bench (KarhouTam/FL-bench, ``src/server/fedmd.py`` /
``src/client/fedmd.py``, homogeneous models).

Every party k keeps its own model f_k and never sends it. The parties share a public data set
D_0 = {x_j}; in each round they
- communicate: each party computes its class scores f_k(x_j) on D_0 and sends them;
- aggregate: the server averages them into the consensus f~(x_j) = (1/K) sum_k f_k(x_j);
- distribute and digest: each party trains f_k to approach the consensus on D_0;
- revisit: each party trains f_k on its own private data for a few epochs.

Symbols to code: f_k -> the client state (``body.*`` and ``head.*``, a C-way head: the ``global``
label space, so that scores of every client index the same classes); D_0 -> the run's public
inputs ``server["public"]["x"]`` (``public_size`` of them, the contract's public data), sent as
``public.x``; f~ -> ``server["consensus"]["scores"]`` ``[P, C]`` (sent as ``public.consensus``,
with ``public.present`` 0 until the first scores arrive); the digest -> ``digest_steps``
full-batch gradient steps over D_0 on the mean absolute gap
``(1 / (P C)) sum_j |f_k(x_j) - f~(x_j)|_1`` (``digest_loss="mae"``: the authors' code,
diogenes0319/FedMD_clean, matches logits with Keras' ``mean_absolute_error``) or the mean squared
gap (``"mse"``: FL-bench's ``MSELoss``), with the client optimizer and ``ctx.client_lr``; the
revisit -> the
run's local schedule on the cross-entropy. The upload is the scores of the revisited model,
weighted 1 per client, so the server's weighted mean is the plain mean over the cohort (a
weighted sum: privacy may wrap it).

Deliberate differences and choices:
- Order: a sampled client digests toward the consensus of the previous round's scores, revisits,
  then sends its new scores for the next round's consensus; the paper collects the round's scores
  first, from models trained in the previous round. Under full participation the two are the same
  sequence; with partial participation the consensus comes from the previous cohort.
- The public set: ``public_size`` inputs drawn once (seeded) from the run's own dataset's
  training pool and kept for the run, a proxy set whose rows may also be some client's private
  rows, whose labels are never used. The paper takes a different labelled data set (MNIST for
  FEMNIST, CIFAR-10 for CIFAR-100) and first trains every model on it with its labels (transfer
  learning), which is left out; the authors' code draws a new alignment subset of it every round,
  FL-bench 5 batches of 32.
- The digest takes full-batch steps over the whole public set; the authors' code and FL-bench
  take epochs of minibatches.
- Homogeneous models (the paper's point is heterogeneous ones); every party starts from the same
  initial model w^0, which the server keeps and sends, so a first-visit state does not depend on
  what it receives.
- The public inputs go out with every downlink (``public.x``), so ``comm.round_traffic`` counts
  them each round; in the paper every party holds the public set from the start.
- The Flower adapter refuses FedMD: its server holds no data to draw the public set from.

Unseen clients (``join``): w^0, digested toward the current consensus and trained on the client's
data (``adapt_schedule``: the run's local schedule).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from pflego import tree
from pflego.algorithms.base import Algorithm, register
from pflego.fields import at_least, one_of, setting
from pflego.local import train_steps
from pflego.models import init_head
from pflego.tree import Params
from pflego.types import ClientData, ClientOut, ClientState, RoundContext, ServerState

X, CONSENSUS, PRESENT = "public.x", "public.consensus", "public.present"
MODEL = ("body", "head")


@register("fedmd")
@dataclass(frozen=True)
class FedMD(Algorithm):
    public_size: int = setting(
        200, "public inputs P drawn from the dataset's training pool", at_least(1)
    )
    digest_steps: int = setting(
        5, "full-batch steps of the digest toward the consensus on the public set", at_least(0)
    )
    digest_loss: str = setting(
        "mae",
        "the digest's gap: mae (the authors' code) or mse (FL-bench)",
        one_of("mae", "mse", says="must be one of"),
    )

    server_step: ClassVar[str] = "own"  # the server averages the scores
    shared: ClassVar[tuple[str, ...]] = ()
    personal: ClassVar[tuple[str, ...]] = MODEL
    label_space: ClassVar[str] = "global"

    # --- server ---------------------------------------------------------------------------------

    def init_params(self, seed: int, dtype: torch.dtype = torch.float32) -> Params:
        """w^0: the body and a C-way head, every client's starting model."""
        generator = torch.Generator().manual_seed(seed + 1)
        head = init_head(self.head_width, self.model.feature_dim, generator, self.head_init, dtype)
        return self.model.init_body(seed, dtype) | head

    def init_server(self, params: Params) -> ServerState:
        """w^0 and no consensus yet (zeros, ``present`` 0)."""
        reference = next(iter(params.values()))
        scores = reference.new_zeros((self.public_size, self.model.num_classes))
        consensus = {"scores": scores, "present": reference.new_zeros(())}
        return {**super().init_server(params), "consensus": consensus}

    def downlink(self, server: ServerState, ctx: RoundContext, clients: Tensor | None = None):
        """w^0 (for first visits), the public inputs and the consensus."""
        return {
            **server["params"],
            X: server["public"]["x"],
            CONSENSUS: server["consensus"]["scores"],
            PRESENT: server["consensus"]["present"],
        }

    def server_update(self, server: ServerState, aggregated: Params, ctx: RoundContext):
        """The consensus: the mean of the cohort's scores; w^0 is never stepped."""
        present = torch.ones_like(server["consensus"]["present"])
        return {**server, "consensus": {"scores": aggregated["scores"], "present": present}}

    # --- client ---------------------------------------------------------------------------------

    def init_client(self, downlink: Params, generator: torch.Generator, ctx: RoundContext):
        """The client's own model starts as w^0."""
        return {k: v.clone() for k, v in tree.select(downlink, MODEL).items()}

    def digest(
        self, downlink: Params, model: Params, data: ClientData, ctx: RoundContext
    ) -> Params:
        """``digest_steps`` full-batch steps on the gap to the consensus over the public set
        (none before the first consensus); the labels ``y`` are the public rows' indices."""
        x, targets = downlink[X], downlink[CONSENSUS]
        rows = torch.arange(len(x), device=x.device)
        active = downlink[PRESENT].expand(self.digest_steps, len(x)).to(x.dtype)
        public = ClientData(
            x,
            rows,
            torch.ones_like(rows, dtype=x.dtype),
            rows.expand(self.digest_steps, len(x)),
            active,
            data.label_mask,
            torch.full((), len(x), dtype=torch.int64, device=x.device),
        )

        def loss(params: Params, xb: Tensor, yb: Tensor, mask: Tensor) -> Tensor:
            gap = self.model.forward(params, xb) - targets[yb]
            gaps = (gap.abs() if self.digest_loss == "mae" else gap**2).mean(-1) * mask
            return gaps.sum() / mask.sum().clamp(min=1)

        opt = self.client_optimizer
        digested, _, _ = train_steps(loss, model, public, opt, opt.init(model), ctx.client_lr)
        return digested

    def visit(self, downlink: Params, state: ClientState, data: ClientData, ctx: RoundContext):
        """Digest, then revisit: the new model and the revisit's mean loss."""
        return self.train(self.digest(downlink, state, data, ctx), data, ctx)

    def client_update(self, downlink, state, data: ClientData, ctx: RoundContext):
        model, mean_loss = self.visit(downlink, state, data, ctx)
        scores = self.model.forward(model, downlink[X])
        weight = torch.ones_like(data.num_samples)
        return ClientOut({"scores": scores}, weight, {"loss": mean_loss}), model

    def predict(self, downlink: Params, state: ClientState, x: Tensor) -> Tensor:
        """The client's own model f_k."""
        return self.model.forward(state, x)

    def join(self, downlink, state, data: ClientData, ctx: RoundContext) -> ClientState:
        """w^0 digested toward the consensus and trained on the client's data."""
        return self.visit(downlink, state, data, ctx)[0]
