"""FedBABU: federated averaging of the body only, a fixed shared head, fine-tuning at evaluation.

Oh, Kim, Yun. "FedBABU: Toward Enhanced Representation for Federated Image Classification".
ICLR 2022; arXiv:2106.06042.

One head h is initialized at the server and never updated while training. Each sampled client
starts from the global body theta and runs local steps on f_i(theta, h) with h fixed; the server
averages the bodies. At evaluation each client fine-tunes a copy of (theta, h), the whole model
or the head only, for tau_f epochs on its training data and predicts with it; the copy is never
stored.

Symbols to code: theta -> ``body.*`` (shared, averaged by N_i), h -> the server's frozen
``server["head"]`` (``head.*`` in the downlink; a C-way head), tau_f -> ``finetune_epochs``
(the authors' ``--ft_ep`` default 5), whole / head -> ``finetune``.

The head is not a shared parameter of the server optimizer: it lives beside the body in the
server state and is sent with it, so no upload, server optimizer or weight decay can move it.
``fixed_head="orthogonal"`` (the default, as the PFLEGO paper describes FedBABU) gives the weight
orthonormal rows (columns when C > M; ``torch.nn.init.orthogonal_``) and a zero bias; ``random`` draws it like any
head (the run's ``head_init``).

Differences: the authors' code averages the bodies uniformly over the cohort; here they are
weighted by N_i as in FedAvg. The PFLEGO reference code orthogonalizes the weight and bias
together (an SVD of a uniform K x (M+1) matrix) and evaluates without fine-tuning.

Unseen clients (``join``): the same fine-tuning from the global model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from pflego import tree
from pflego.algorithms.base import FixedHead, register
from pflego.fields import one_of, positive, setting
from pflego.models import init_head
from pflego.types import ClientData, ClientOut, RoundContext, Schedule

HEADS = ("orthogonal", "random")
FINETUNE = ("whole", "head")


@register("fedbabu")
@dataclass(frozen=True)
class FedBABU(FixedHead):
    fixed_head: str = setting(
        "orthogonal",
        "how the fixed shared head is drawn: orthogonal rows or random",
        one_of(*HEADS, says="must be one of"),
    )
    finetune: str = setting(
        "whole",
        "what fine-tunes before evaluation: the whole model or the head",
        one_of(*FINETUNE, says="must be one of"),
    )
    finetune_epochs: float = setting(5.0, "epochs of that fine-tuning (tau_f)", positive)

    shared: ClassVar[tuple[str, ...]] = ("body",)
    personal: ClassVar[tuple[str, ...]] = ()
    label_space: ClassVar[str] = "global"
    default_client_lr: ClassVar[float] = 0.05  # the defaults study's choice (0.3: 17% below)

    def init_params(self, seed: int, dtype: torch.dtype = torch.float32):
        generator = torch.Generator().manual_seed(seed + 1)
        shape = (self.model.num_classes, self.model.feature_dim)
        if self.fixed_head == "orthogonal":
            weight = torch.nn.init.orthogonal_(
                torch.empty(shape, dtype=torch.float64), generator=generator
            )
            head = {
                "head.weight": weight.to(dtype),
                "head.bias": torch.zeros(shape[0], dtype=dtype),
            }
        else:
            head = init_head(*shape, generator, self.head_init, dtype)
        return self.model.init_body(seed, dtype) | head

    def client_update(self, downlink, state, data: ClientData, ctx: RoundContext):
        body, head = tree.select(downlink, ["body"]), tree.select(downlink, ["head"])
        trained, mean_loss = self.train(body, data, ctx, fixed=head)
        return ClientOut(tree.sub(body, trained), data.num_samples, {"loss": mean_loss}), state

    def adapt(self, downlink, state, data: ClientData, ctx: RoundContext):
        """The fine-tuned copy (whole model or head), which ``predict`` lays over the downlink."""
        if self.finetune == "head":
            head = tree.select(downlink, ["head"])
            return self.train_head(tree.select(downlink, ["body"]), head, data, ctx)
        return self.train(downlink, data, ctx)[0]

    def adapt_schedule(self, run: Schedule) -> Schedule:
        return run.phase(epochs=self.finetune_epochs)
