"""FedPCL: prototype-wise contrastive learning against global and local prototypes.

Tan, Long, Liu, Zhou, Lu, Jiang, Zhang. "Federated Learning from Pre-Trained Models: A
Contrastive Learning Approach". NeurIPS 2022; arXiv:2209.10083.

Clients share no model weights, only class prototypes of normalized features. Client i keeps
its representation f_i; the server keeps every client's latest local prototypes C_k^(j) (the
mean of the normalized features f(x)/||f(x)|| of class j over client k's data) and the global
prototypes C^(j), the mean of the round's local prototypes of class j over the clients holding
it. A sampled client takes its local steps on (Eq. 5-7)

    L = L_g + L_p,
    L_g = -log [ exp(<z, C^(y)>/tau) / sum_j exp(<z, C^(j)>/tau) ],
    L_p = (1/I) sum_k -log [ exp(<z, C_k^(y)>/tau) / sum_j exp(<z, C_k^(j)>/tau) ],

with z = f_i(x)/||f_i(x)|| and tau the temperature, then uploads its new local prototypes. It
predicts the class whose own local prototype is closest in inner product, argmax_j <z, C_i^(j)>.

Symbols to code: f_i -> the client state's ``body.*`` (no classifier head: the ``global`` label
space indexes the prototypes); C_k^(j) -> ``server["protos"]["table"]`` ``[I, C, M]`` with
``held`` ``[I, C]``; C^(j) -> ``server["protos"]["mean"]`` ``[C, M]`` with ``present`` ``[C]``;
tau -> ``tau`` (default 1, PFLlib's); the client's own prototypes -> the state's ``proto.mean`` /
``proto.present``; the local solver -> the run's client optimizer and ``ctx.client_lr``.

Deliberate differences and choices:
- The representation is the model's whole body, trained; the paper freezes pre-trained backbones
  and trains a projection over their features (PFLlib trains the whole model too).
- A class missing from a prototype set is left out of that softmax: a client k that does not
  hold class j contributes the global C^(j) in its place (PFLlib's padding), a class without a
  global prototype is left out everywhere, and a term whose own class has no prototype is 0
  (PFLlib stacks the prototypes in the order classes arrive, which presumes every class is
  present). A client not yet heard from contributes the global prototypes (PFLlib's padding).
- Before any prototype exists nothing is trained: the first round only computes prototypes
  (PFLlib skips training at each client's first participation instead). Global prototypes of
  classes that no client of the round holds are kept from earlier rounds (PFLlib drops them).
- No gradient clipping (PFLlib clips the gradient norm at 10). Local prototypes are computed after
  the local steps over the whole training split, as PFLlib does.
- The uploads are not a weighted sum, so differential privacy and secure aggregation refuse it.

Unseen clients (``join``): the initial representation f^0 trained on the same loss against the
current prototypes on ``adapt_schedule``'s batches (the run's local schedule); it then predicts
with its own new local prototypes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from pflego import tree
from pflego.algorithms.base import Algorithm, register
from pflego.algorithms.fedproto import class_sums
from pflego.fields import positive, setting
from pflego.local import train_steps
from pflego.tree import Params
from pflego.types import ClientData, ClientOut, ClientState, RoundContext, ServerState

MEAN, PRESENT = "proto.mean", "proto.present"  # global (downlink) or own (state, upload)
TABLE, HELD = "proto.table", "proto.held"  # every client's local prototypes, in the downlink


def normalized_features(model, params: Params, x: Tensor) -> Tensor:
    """z = f(x) / ||f(x)|| (a zero feature stays zero)."""
    z = model.features(params, x)
    return z / z.norm(dim=-1, keepdim=True).clamp(min=torch.finfo(z.dtype).tiny)


def prototype_logits(
    z: Tensor, protos: Tensor, present: Tensor, tau: float, absent: float | None = None
) -> Tensor:
    """``<z, C^(j)> / tau`` ``[..., n, C]`` over prototype sets ``protos`` ``[..., C, M]``;
    classes absent from a set get ``absent`` (default: the lowest value, out of the softmax)."""
    logits = torch.einsum("nm,...cm->...nc", z, protos) / tau
    low = torch.finfo(z.dtype).min if absent is None else absent
    return torch.where(present[..., None, :] > 0, logits, low)


def contrastive(z: Tensor, y: Tensor, protos: Tensor, present: Tensor, tau: float) -> Tensor:
    """Per set and sample ``[..., n]``: -log softmax of the sample's own class over each
    prototype set (0 where its class has no prototype in that set)."""
    log_p = torch.log_softmax(prototype_logits(z, protos, present, tau), -1)
    own = log_p.gather(-1, y.expand(log_p.shape[:-1])[..., None])[..., 0]
    return -own * present[..., y]


@register("fedpcl")
@dataclass(frozen=True)
class FedPCL(Algorithm):
    tau: float = setting(1.0, "temperature tau of the prototype-wise contrastive loss", positive)

    shared: ClassVar[tuple[str, ...]] = ()
    personal: ClassVar[tuple[str, ...]] = ("body",)
    label_space: ClassVar[str] = "global"
    server_step: ClassVar[str] = "own"  # the server only collects and averages prototypes
    sum_aggregate: ClassVar[bool] = False  # every client's prototypes are kept

    # --- server ---------------------------------------------------------------------------------

    def init_params(self, seed: int, dtype: torch.dtype = torch.float32) -> Params:
        """f^0, every client's starting representation, and no global prototype yet (zeros
        ``[C, M]`` and ``present`` 0; a linear model's body holds no tensor to take a dtype
        from)."""
        c, m = self.model.num_classes, self.model.feature_dim
        empty = {MEAN: torch.zeros(c, m, dtype=dtype), PRESENT: torch.zeros(c, dtype=dtype)}
        return self.model.init_body(seed, dtype) | empty

    def init_server(self, params: Params) -> ServerState:
        """f^0 (never stepped) and the prototypes (the table is allocated at first use)."""
        body = tree.select(params, ["body"])
        protos = {"mean": params[MEAN], "present": params[PRESENT]}
        return {**super().init_server(body), "protos": protos}

    def table(self, server: ServerState, ctx: RoundContext) -> Params:
        """Every client's latest local prototypes ``[I, C, M]`` and ``held`` ``[I, C]``."""
        protos = server["protos"]
        if "table" in protos:
            return protos
        zeros = protos["mean"].new_zeros((ctx.num_clients, *protos["mean"].shape))
        return {**protos, "table": zeros, "held": zeros[..., 0]}

    def downlink(self, server: ServerState, ctx: RoundContext, clients: Tensor | None = None):
        """f^0, the global prototypes and every client's local prototypes."""
        protos = self.table(server, ctx)
        return {
            **server["params"],
            MEAN: protos["mean"],
            PRESENT: protos["present"],
            TABLE: protos["table"],
            HELD: protos["held"],
        }

    def server_round(self, server: ServerState, out: ClientOut, ctx: RoundContext, clients):
        """The cohort's prototypes replace theirs in the table; C^(j) is their mean over the
        cohort's holders of class j (kept from before for a class none of them holds)."""
        protos = self.table(server, ctx)
        means, held = out.upload[MEAN], out.upload[PRESENT]
        holders = held.sum(0)
        seen = holders > 0
        mean = (held[..., None] * means).sum(0) / torch.where(seen, holders, 1.0)[:, None]
        rows = clients.to(held.device)
        new = {
            "mean": torch.where(seen[:, None], mean, protos["mean"]),
            "present": torch.where(seen, 1.0, protos["present"]).to(held.dtype),
            "table": protos["table"].index_put((rows,), means),
            "held": protos["held"].index_put((rows,), held),
        }
        return {**server, "protos": new}

    # --- client ---------------------------------------------------------------------------------

    def init_client(self, downlink: Params, generator: torch.Generator, ctx: RoundContext):
        """f^0 and no local prototypes."""
        body = {k: v.clone() for k, v in tree.select(downlink, ["body"]).items()}
        return {**body, MEAN: torch.zeros_like(downlink[MEAN]), PRESENT: downlink[PRESENT] * 0}

    def local_loss(self, downlink: Params):
        """L_g + L_p on a batch, averaged over its real samples."""
        glob, present = downlink[MEAN], downlink[PRESENT]
        held = downlink[HELD][..., None]
        sets = held * downlink[TABLE] + (1 - held) * glob  # a missing class: the global one
        in_set = torch.maximum(downlink[HELD], present)

        def loss(params: Params, x: Tensor, y: Tensor, mask: Tensor) -> Tensor:
            z = normalized_features(self.model, params, x)
            global_term = contrastive(z, y, glob, present, self.tau)
            per_sample = global_term + contrastive(z, y, sets, in_set, self.tau).mean(0)
            return (per_sample * mask).sum() / mask.sum().clamp(min=1)

        return loss

    def train_local(self, downlink: Params, state: ClientState, data: ClientData, ctx):
        """The representation's local steps, then its new local prototypes (the client state)."""
        body = tree.select(state, ["body"])
        opt = self.client_optimizer
        trained, _, mean_loss = train_steps(
            self.local_loss(downlink), body, data, opt, opt.init(body), ctx.client_lr
        )
        z = normalized_features(self.model, trained, data.x)
        sums, counts = class_sums(z, data.y, data.mask, self.model.num_classes)
        own = {
            MEAN: sums / torch.where(counts > 0, counts, 1.0)[:, None],
            PRESENT: (counts > 0).to(z.dtype),
        }
        return {**trained, **own}, mean_loss

    def client_update(self, downlink, state, data: ClientData, ctx: RoundContext):
        new, mean_loss = self.train_local(downlink, state, data, ctx)
        upload = {MEAN: new[MEAN], PRESENT: new[PRESENT]}
        return ClientOut(upload, data.num_samples, {"loss": mean_loss}), new

    def predict(self, downlink: Params, state: ClientState, x: Tensor) -> Tensor:
        """``<z, C_i^(j)>`` for the client's own prototypes; an absent class gets -2, below every
        inner product of unit features with prototypes (means of unit vectors)."""
        z = normalized_features(self.model, state, x)
        return prototype_logits(z, state[MEAN], state[PRESENT], 1.0, absent=-2.0)

    def join(self, downlink, state, data: ClientData, ctx: RoundContext) -> ClientState:
        """f^0 trained on the contrastive loss, with its new local prototypes."""
        return self.train_local(downlink, state, data, ctx)[0]
