"""FedCP: a conditional policy that splits every sample's features into a global and a personal part.

Zhang, Hua, Wang, Song, Xue, Ma, Guan. "FedCP: Separating Feature Information for Personalized
Federated Learning via Conditional Policy". KDD 2023; arXiv:2307.01217. Authors' code:
github.com/TsingZ0/FedCP (``clientcp.py``, ``servercp.py``; the same files in PFLlib).

Client i's model: the feature extractor phi (shared), the Conditional Policy Network CPN (shared),
the global head h_g (shared, frozen during local training) and the personalized head h_p,i
(private). For a sample x with features f = phi(x) ``[M]``:

    v_i = normalize(sum_c W_p,i[c, :])                       (the client's conditional vector)
    (s, s') = softmax over the pair of view(ReLU(LayerNorm(A (f * v_i) + a)), [2, M])
    output = h_p,i(f * s) + h_g(f * s'),                      s + s' = 1 per feature

and the client descends ``CE(output, y) + lambda * MMD^2(phi(x), phi^t(x))`` over phi, the CPN and
h_p,i, with h_g and the received feature extractor phi^t held fixed (MMD^2 of the batch's features
under phi and under phi^t, with the sum of four Gaussian kernels ``exp(-d^2 / (2 a))``,
a in (10, 15, 20, 50), the authors' ``MMD(..., 'rbf')``). It uploads phi, the CPN and the head
``(h_p,i + h_g) / 2`` (the authors' ``generate_upload_head``); the server averages the three,
weighted by N_i, and sends them to every client.

Symbols to code: phi -> ``body.*``; CPN -> ``cpn.linear.*`` (Linear(M, 2M)) and ``cpn.norm.*``
(LayerNorm(2M), eps 1e-5); h_g -> ``head.*`` (C-way); h_p,i -> the client state ``phead.*``
(C-way); W_p,i -> ``phead.weight``; lambda -> ``lam`` (default 5, the authors' ``run_me.sh``);
the step size of every trained part -> ``ctx.client_lr``.

v_i is computed from the personal head at the start of the round and held fixed (no gradient)
during it, which is what the authors' code does: it recomputes v_i from h_p,i when the round's
global head arrives (``set_head_g``), and h_p,i does not change until the client's next round.

Deliberate differences:
- The policy is the deterministic softmax over each feature's pair (temperature 1). The authors'
  code draws it with ``F.gumbel_softmax(tau=1, hard=False)``, i.e. with fresh Gumbel noise at
  every forward pass, in training and in evaluation; pflego's backends and Flower nodes must give
  the same numbers from the same data, and ``client_update`` has no random stream.
- Every client receives the current h_g and CPN; the authors' code sends them only to the clients
  that just trained (the others keep stale copies) and sends phi to all.
- A client's first conditional vector comes from its initial personal head (``head_init``, seeded
  by the client id); the authors' code starts from ``torch.rand`` and from a copy of the initial
  global head.
- The global model is averaged through the server optimizer on ``theta^t - theta_i`` (server SGD
  with lr 1, the default, is the authors' weighted average).

Prediction: ``h_p,i(f * s) + h_g(f * s')`` (the authors' ``test_metrics``, without the noise). A
client that never trained (``join``) trains a new h_p on the frozen phi, CPN and h_g (the run's
schedule, from its first-visit head; the MMD term is constant there).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from pflego import tree
from pflego.algorithms.base import Algorithm, register
from pflego.fields import non_negative, setting
from pflego.local import train_steps
from pflego.loss import masked_cross_entropy
from pflego.models import head_logits, init_head
from pflego.tree import Params
from pflego.types import ClientData, ClientOut, RoundContext

SHARED = ("body", "cpn", "head")
BANDWIDTHS = (10.0, 15.0, 20.0, 50.0)  # the authors' 'rbf' kernels
LAYER_NORM_EPS = 1e-5


def as_head(phead: Params) -> Params:
    """``phead.*`` renamed ``head.*``, so that :func:`head_logits` reads it."""
    return {k[1:]: v for k, v in phead.items() if k.startswith("phead.")}


def conditional_vector(phead: Params) -> Tensor:
    """v_i: the L2-normalized sum of the personal head's rows, without gradient."""
    return F.normalize(phead["phead.weight"].detach().sum(0), dim=0)


def policy(params: Params, features: Tensor, vector: Tensor) -> tuple[Tensor, Tensor]:
    """(s, s'): the CPN's per-feature shares of the personal and the global head, summing to 1."""
    hidden = (features * vector) @ params["cpn.linear.weight"].T + params["cpn.linear.bias"]
    hidden = F.layer_norm(
        hidden,
        hidden.shape[-1:],
        params["cpn.norm.weight"],
        params["cpn.norm.bias"],
        LAYER_NORM_EPS,
    )
    pair = torch.relu(hidden).unflatten(-1, (2, -1)).softmax(-2)
    return pair[..., 0, :], pair[..., 1, :]


def masked_mmd(x: Tensor, y: Tensor, mask: Tensor) -> Tensor:
    """MMD^2 of the real rows of ``x`` and ``y`` under the four Gaussian kernels.

    The squared distances are summed from the differences themselves (the authors' code expands
    them as ``|a|^2 + |b|^2 - 2 a.b``, the same function): the expansion's rounding, of the order
    of ``|a|^2``, makes a gradient near x = y that Adam magnifies into disagreements between the
    backends. ``torch.cdist`` without matrix products computes them so, in ``B^2`` memory (the
    explicit ``B x B x M`` differences cost 6x the time of a whole small run).
    """

    def kernel(a: Tensor, b: Tensor) -> Tensor:
        sq = torch.cdist(a, b, compute_mode="donot_use_mm_for_euclid_dist").square()
        return sum(torch.exp(-0.5 * sq / bw) for bw in BANDWIDTHS)

    pairs = mask[:, None] * mask[None, :]
    terms = kernel(x, x) + kernel(y, y) - 2 * kernel(x, y)
    return (terms * pairs).sum() / pairs.sum().clamp(min=1)


@register("fedcp")
@dataclass(frozen=True)
class FedCP(Algorithm):
    lam: float = setting(
        5.0,
        "strength lambda of the MMD term that keeps features near the received body's",
        non_negative,
    )

    shared: ClassVar[tuple[str, ...]] = SHARED
    personal: ClassVar[tuple[str, ...]] = ("phead",)
    default_client_lr: ClassVar[float] = 0.05  # the defaults study's choice (0.3: 36% below)

    def init_params(self, seed: int, dtype: torch.dtype = torch.float32) -> Params:
        """Body and global head as usual, and the CPN (PyTorch's Linear and LayerNorm init)."""
        params = super().init_params(seed, dtype)
        m = self.model.feature_dim
        gen = torch.Generator().manual_seed(seed + 2)
        bound = 1 / math.sqrt(m)
        uniform = lambda *shape: torch.rand(*shape, generator=gen, dtype=torch.float64) * 2 - 1  # noqa: E731
        cpn = {
            "cpn.linear.weight": uniform(2 * m, m) * bound,
            "cpn.linear.bias": uniform(2 * m) * bound,
            "cpn.norm.weight": torch.ones(2 * m, dtype=torch.float64),
            "cpn.norm.bias": torch.zeros(2 * m, dtype=torch.float64),
        }
        return params | {k: v.to(dtype) for k, v in cpn.items()}

    def init_client(self, downlink, generator, ctx):
        """A personal C-way head h_p,i (``head_init``, seeded by the client id)."""
        first = next(iter(downlink.values()))
        head = init_head(
            self.model.num_classes, self.model.feature_dim, generator, self.head_init, first.dtype
        )
        return {"p" + k: v for k, v in head.items()}

    def logits(self, params: Params, phead: Params, features: Tensor, vector: Tensor) -> Tensor:
        """``h_p(f * s) + h_g(f * s')``."""
        s, s_global = policy(params, features, vector)
        return head_logits(as_head(phead), features * s) + head_logits(params, features * s_global)

    def client_update(self, downlink, state, data: ClientData, ctx: RoundContext):
        vector = conditional_vector(state)
        global_head = tree.select(downlink, ["head"])
        trainable = {**tree.select(downlink, ("body", "cpn")), **state}

        def loss(p: Params, x: Tensor, y: Tensor, mask: Tensor) -> Tensor:
            f = self.model.features(p, x)
            logits = self.logits({**p, **global_head}, p, f, vector)
            reference = self.model.features(downlink, x).detach()
            ce = masked_cross_entropy(logits, y, mask, data.label_mask)
            return ce + self.lam * masked_mmd(f, reference, mask)

        opt = self.client_optimizer
        trained, _, mean_loss = train_steps(
            loss, trainable, data, opt, opt.init(trainable), ctx.client_lr
        )
        phead = tree.select(trained, ["phead"])
        uploaded_head = {k: (v + as_head(phead)[k]) / 2 for k, v in global_head.items()}
        new = {**tree.select(trained, ("body", "cpn")), **uploaded_head}
        upload = tree.sub(tree.select(downlink, SHARED), new)
        return ClientOut(upload, data.num_samples, {"loss": mean_loss}), phead

    def predict(self, downlink, state, x):
        """``h_p,i(f * s) + h_g(f * s')`` with the client's conditional vector."""
        return self.logits(
            downlink, state, self.model.features(downlink, x), conditional_vector(state)
        )

    def join(self, downlink, state, data, ctx):
        """A new h_p trained on the frozen phi, CPN and h_g (the policy computed once)."""
        features = self.model.features(downlink, data.x).detach()
        s, s_global = policy(downlink, features, conditional_vector(state))
        generic = head_logits(downlink, features * s_global).detach()
        personal = (features * s).detach()
        indices = torch.arange(features.shape[0], device=features.device)

        def loss(p: Params, i: Tensor, y: Tensor, mask: Tensor) -> Tensor:
            logits = head_logits(as_head(p), personal[i]) + generic[i]
            return masked_cross_entropy(logits, y, mask, data.label_mask)

        opt = self.client_optimizer
        tuned, _, _ = train_steps(
            loss, state, data._replace(x=indices), opt, opt.init(state), ctx.client_lr
        )
        return tuned
