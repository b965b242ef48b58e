"""FedGC: private class embeddings per client, whose gradients the server corrects with a
cross-client softmax regularizer.

Niu, Deng. "Federated Learning for Face Recognition with Gradient Correction". AAAI 2022;
arXiv:2112.07246. Peer code: PFLlib's FedGC (TsingZ0/PFLlib), whose classification variant is
followed here.

The model is a shared backbone theta and, for every client k, class embeddings W_k: one row per
class the client holds (its head; softmax over its own classes only). In round t the server sends
theta^t and W_k; a sampled client trains both on its softmax cross-entropy and returns them. The
server averages the backbones (weighted by N_k), keeps each client's W_k, and takes one gradient
step of step size eta_s on every client's embeddings along the regularizer

    Reg = sum_k sum_{c held by k} -log [ exp(<e_c, e_c>)
            / (exp(<e_c, e_c>) + sum_{j not holding c} sum_{c' held by j} exp(<W_j^{c'}, e_c>)) ],

with e_c the mean over the clients holding class c of their rows W_k^c, held fixed (PFLlib's
``reg_train``): it pushes every other client's class embeddings away from class c, the
cross-client term a client cannot compute alone.

Symbols to code: theta -> ``body.*`` (``server["params"]``, through the server optimizer: SGD with
lr 1 is the average); W_k -> the rows ``head.weight`` of the server's table ``server["gc"]`` (a
C-way head per client, the ``global`` label space, with ``held`` [C] marking the client's classes:
the rows it has; its softmax and its predictions range over them), sent in client k's downlink;
before its first upload a client uses the initial head phi^0 (``server["head"]``); eta_s ->
``client_lr * lam`` (PFLlib's ``local_learning_rate * lamda``; ``lam`` default 1).

Deliberate differences and choices:
- Heads keep their bias (trained locally, left out of the regularizer); PFLlib's have none.
- The regularizer ranges over the clients the server has heard from (it learns a client's classes
  from its first upload); PFLlib knows every client's classes from the start and includes the
  initial heads of clients that never trained. Every client starts from the same phi^0 (PFLlib
  draws each client's head at random).
- PFLlib's classification variant (class-mean embeddings e_c, inner products without the face
  recognition paper's normalization and margin) is followed.
- The heads are not a weighted sum, so differential privacy and secure aggregation refuse FedGC.

Prediction: theta with the client's head over its own classes (all C before it first trains).
Unseen clients (``join``): phi^0 trained on the frozen global backbone's features over the
classes of their training split (``adapt_schedule``: the run's local schedule).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from pflego import tree
from pflego.algorithms.base import FixedHead, register
from pflego.fields import positive, setting
from pflego.local import train_steps
from pflego.models import init_head
from pflego.tree import Params
from pflego.types import ClientData, ClientOut, ClientState, RoundContext, ServerState

HEAD = ("head.weight", "head.bias")
HELD = "held"  # [C]: the classes a client holds (its head's rows)


def held_classes(data: ClientData, num_classes: int) -> Tensor:
    """1 for every class among the client's real training samples ``[C]``."""
    classes = torch.arange(num_classes, device=data.y.device)
    hits = (data.y[:, None] == classes) & (data.mask[:, None] > 0)
    return hits.any(0).to(data.mask.dtype)


def regularizer(weights: Tensor, held: Tensor) -> Tensor:
    """Reg over the clients' embeddings ``weights [K, C, M]`` with ``held [K, C]``: for each
    class c, ``holders_c * -log softmax`` of ``<e_c, e_c>`` against ``<W_j^{c'}, e_c>`` over the
    rows c' of the clients j that do not hold c, with e_c held fixed."""
    holders = held.sum(0)
    e = ((held[..., None] * weights).sum(0) / holders.clamp(min=1)[:, None]).detach()  # [C, M]
    own = (e * e).sum(-1)
    others = torch.einsum("jdm,cm->cjd", weights, e)  # <W_j^{c'}, e_c>: [C, K, C']
    rival = (1 - held).T[:, :, None] * held[None, :, :]  # j lacks c, c' is a row of j
    terms = torch.where(rival > 0, others, torch.finfo(weights.dtype).min).flatten(1)
    log_denominator = torch.logsumexp(torch.cat([own[:, None], terms], 1), 1)
    return (holders * (log_denominator - own)).sum()


@register("fedgc")
@dataclass(frozen=True)
class FedGC(FixedHead):
    lam: float = setting(
        1.0, "the server's regularizer step size as a multiple of client_lr", positive
    )

    personal: ClassVar[tuple[str, ...]] = ("head",)
    label_space: ClassVar[str] = "global"
    per_client_downlink: ClassVar[bool] = True
    sum_aggregate: ClassVar[bool] = False  # every client's embeddings are kept

    def init_params(self, seed: int, dtype: torch.dtype = torch.float32) -> Params:
        """theta^0 and the initial head phi^0 every client starts from."""
        generator = torch.Generator().manual_seed(seed + 1)
        head = init_head(self.head_width, self.model.feature_dim, generator, self.head_init, dtype)
        return self.model.init_body(seed, dtype) | head

    # --- server ---------------------------------------------------------------------------------

    def table(self, server: ServerState, ctx: RoundContext) -> Params:
        """Every client's head ``[I, ...]`` and ``held`` ``[I, C]`` (0: not heard from)."""
        if "gc" in server:
            return server["gc"]
        heads = {k: v.expand(ctx.num_clients, *v.shape) for k, v in server["head"].items()}
        bias = server["head"]["head.bias"]
        return {**heads, HELD: bias.new_zeros((ctx.num_clients, *bias.shape))}

    def downlink(self, server: ServerState, ctx: RoundContext, clients: Tensor | None = None):
        """theta and each client's head and classes (phi^0 and none for a newcomer)."""
        if clients is None:
            return {**server["params"], **server["head"], HELD: server["head"]["head.bias"] * 0}
        table = self.table(server, ctx)
        rows = clients.to(table[HELD].device)
        body = {k: v.expand(len(rows), *v.shape) for k, v in server["params"].items()}
        return {**body, **{k: v[rows] for k, v in table.items()}}

    def server_round(self, server: ServerState, out: ClientOut, ctx: RoundContext, clients):
        """FedAvg of theta; the cohort's heads into the table; one step of eta_s on Reg."""
        up = out.upload
        weights = out.weight / out.weight.sum()
        server = self.server_update(
            server, tree.weighted_sum(tree.select(up, ["body"]), weights), ctx
        )
        table = self.table(server, ctx)
        rows = clients.to(table[HELD].device)
        table = {k: table[k].index_put((rows,), up[k]) for k in (*HEAD, HELD)}
        with torch.enable_grad():
            w = table["head.weight"].detach().requires_grad_(True)
            (g,) = torch.autograd.grad(regularizer(w, table[HELD]), [w])
        step = ctx.client_lr * self.lam
        return {**server, "gc": {**table, "head.weight": table["head.weight"] - step * g}}

    # --- client ---------------------------------------------------------------------------------

    def init_client(self, downlink: Params, generator: torch.Generator, ctx: RoundContext):
        """Nothing: the client's head is held by the server and sent each round."""
        return {}

    def client_update(self, downlink, state, data: ClientData, ctx: RoundContext):
        held = held_classes(data, self.model.num_classes)
        start = tree.select(downlink, ["body", "head"])
        loss = self.model_objective(held)
        opt = self.client_optimizer
        trained, _, mean_loss = train_steps(loss, start, data, opt, opt.init(start), ctx.client_lr)
        upload = {
            **tree.sub(tree.select(downlink, ["body"]), tree.select(trained, ["body"])),
            **tree.select(trained, ["head"]),
            HELD: held,
        }
        return ClientOut(upload, data.num_samples, {"loss": mean_loss}), {}

    def predict(self, downlink: Params, state: ClientState, x: Tensor) -> Tensor:
        """theta with the client's head, over its own classes (all before it first trains)."""
        params = {**downlink, **state}
        logits = self.model.forward(params, x)
        held = params[HELD]
        classes = torch.where(held.sum() > 0, held, torch.ones_like(held))
        return torch.where(classes > 0, logits, torch.finfo(logits.dtype).min)

    def join(self, downlink, state, data: ClientData, ctx: RoundContext) -> ClientState:
        """phi^0 trained on the frozen global backbone's features over the client's classes."""
        held = held_classes(data, self.model.num_classes)
        head = self.train_head(
            downlink, tree.select(downlink, ["head"]), data._replace(label_mask=held), ctx
        )
        return {**head, HELD: held}
