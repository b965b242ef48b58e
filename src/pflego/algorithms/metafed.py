"""MetaFed: cyclic knowledge distillation, each client learning from the one before it.

Chen, Lu, Wang, Qin, Wang. "MetaFed: Federated Learning among Federations with Cyclic Knowledge
Distillation for Personalized Healthcare". IEEE TNNLS 2023; arXiv:2206.08516. FL-bench's
``src/server/metafed.py`` / ``src/client/metafed.py`` (ported from the authors' PersonalizedFL)
were read for the details below.

The clients (federations) form a cycle, client i's teacher being client i - 1's model (modulo I).
At its first visit (warm-up) client i trains its own model theta_i alone on the cross-entropy and
sets its flag ``f_i = [acc_val(theta_i) > tau_1]``, its model's accuracy on its validation split.
At every later visit it trains, from

- its own theta_i when f_i holds, on ``CE + lambda MSE(phi_i(x), phi_{i-1}(x))``, the mean squared
  difference of its body's features and the teacher's (common knowledge accumulated by
  distillation);
- the teacher's model theta_{i-1} otherwise, on the cross-entropy alone (a client whose own
  model is poor inherits its predecessor's).

Symbols to code: theta_i -> the client state ``model.*`` (``warm``: after its warm-up) and the
server's table ``server["models"]`` ``[I, ...]`` (``ModelTable``; the teachers); theta_{i-1} ->
the downlink's ``teacher.*``; f_i -> the state ``flag``; lambda, tau_1 -> ``lam`` (1.0),
``threshold`` (0.6), FL-bench's defaults; phi -> the body's output features.

Deliberate differences and choices:
- The cycle runs in parallel: a round's teachers are the models the server holds when it starts
  (the authors' and FL-bench's clients train one after another within a round, each teacher
  already updated by its turn). With partial participation the cycle's order is the client ids'.
- The warm-up is the client's first visit, the run's schedule (FL-bench: every client at once,
  before the first round, 30 epochs); a teacher that has not warmed up yet is the initial model.
- The flags are set by the warm-up and kept, as in FL-bench; FL-bench's final personalization pass
  (one more distillation with a lambda adapted to the teacher's and student's validation
  accuracies, ``threshold_2``) is not offered: a run has no last round that an algorithm sees.
- The features are the body's output (after its last ReLU in the MLPs); FL-bench distills its
  models' features before the final ReLU.
- The server optimizer and ``server_lr`` are not used (``server_step = "own"``); differential
  privacy and SecAgg+ are refused (``sum_aggregate = False``): the server relays every model.

Prediction: the client's own theta_i (the initial model before its warm-up). A client that never
trained (``join``) warms up: it trains the initial model alone on its data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from pflego import tree
from pflego.algorithms.base import register
from pflego.algorithms.table import OWN, ModelTable
from pflego.fields import between, non_negative, setting
from pflego.local import train_steps
from pflego.loss import masked_cross_entropy
from pflego.tree import Params
from pflego.types import ClientData, ClientOut, ClientState, RoundContext, ServerState

TEACHER, WARM, FLAG = "teacher.", "warm", "flag"


@register("metafed")
@dataclass(frozen=True)
class MetaFed(ModelTable):
    lam: float = setting(
        1.0, "weight lambda of the feature distillation from the teacher", non_negative
    )
    threshold: float = setting(
        0.6, "validation accuracy above which a client keeps its own model (tau_1)", between(0, 1)
    )

    personal: ClassVar[tuple[str, ...]] = ("body", "head")
    uses_validation: ClassVar[bool] = True

    # --- server: the table of theta_1..theta_I (``ModelTable``: the initial model until trained)

    def downlink(
        self, server: ServerState, ctx: RoundContext, clients: Tensor | None = None
    ) -> Params:
        """The initial model and each client's teacher theta_{i-1}; a newcomer gets the initial
        model."""
        if clients is None:
            return self.initial(server)
        models = self.stored(server, ctx)
        count = len(next(iter(models.values())))
        teachers = {k: v[(clients.to(v.device) - 1) % count] for k, v in models.items()}
        return {**self.initial(server, clients), **tree.add_prefix(TEACHER, teachers)}

    def evaluation_downlink(
        self, server: ServerState, ctx: RoundContext, clients: Tensor | None = None
    ) -> Params:
        """The initial model (without the teachers, which only training reads)."""
        return self.initial(server, clients)

    # --- client ---------------------------------------------------------------------------------

    def init_client(
        self, downlink: Params, generator: torch.Generator, ctx: RoundContext
    ) -> ClientState:
        """No own model yet (``warm`` 0: the initial model stands in), no flag."""
        model = self.model_of(downlink)
        zero = next(iter(model.values())).new_zeros(())
        return {**tree.add_prefix(OWN, tree.zeros_like(model)), WARM: zero, FLAG: zero.clone()}

    def model_of(self, downlink: Params) -> Params:
        return {k: v for k, v in downlink.items() if not k.startswith(TEACHER)}

    def own_model(self, downlink: Params, state: ClientState) -> Params:
        """theta_i after the warm-up, else the initial model."""
        return tree.where(state[WARM] > 0, tree.strip_prefix(OWN, state), self.model_of(downlink))

    def distill(
        self, start: Params, teacher: Params, lam: Tensor, data: ClientData, ctx: RoundContext
    ) -> tuple[Params, Tensor]:
        """The local steps on CE + lam MSE(phi(x), phi_teacher(x)) from ``start``."""

        def loss(p: Params, x: Tensor, y: Tensor, mask: Tensor) -> Tensor:
            features = self.model.features(p, x)
            ce = masked_cross_entropy(self.model.forward(p, x), y, mask, data.label_mask)
            target = self.model.features(teacher, x).detach()
            squared = ((features - target) ** 2).mean(-1)
            mse = (squared * mask).sum() / mask.sum().clamp(min=1)
            return ce + lam * mse

        opt = self.client_optimizer
        trained, _, mean_loss = train_steps(loss, start, data, opt, opt.init(start), ctx.client_lr)
        return trained, mean_loss

    def accuracy(self, params: Params, data: ClientData) -> Tensor:
        """Accuracy on the client's validation split."""
        val = data.validation
        logits = self.model.forward(params, val["x"])
        logits = torch.where(data.label_mask > 0, logits, torch.finfo(logits.dtype).min)
        right = (logits.argmax(-1) == val["y"]).to(logits.dtype) * val["mask"]
        return right.sum() / val["mask"].sum().clamp(min=1)

    def client_update(self, downlink, state, data: ClientData, ctx: RoundContext):
        """The warm-up at the first visit (and the flag); later the distillation from the own
        model, or plain training from the teacher's."""
        warm, flag = state[WARM] > 0, state[FLAG] > 0
        own, teacher = self.own_model(downlink, state), tree.strip_prefix(TEACHER, downlink)
        start = tree.where(warm & ~flag, teacher, own)
        lam = torch.where(warm & flag, self.lam, 0.0)
        trained, mean_loss = self.distill(start, teacher, lam, data, ctx)
        good = (self.accuracy(trained, data) > self.threshold).to(state[FLAG])
        new_state = {
            **tree.add_prefix(OWN, trained),
            WARM: torch.ones_like(state[WARM]),
            FLAG: torch.where(warm, state[FLAG], good),
        }
        out = ClientOut(tree.add_prefix(OWN, trained), data.num_samples, {"loss": mean_loss})
        return out, new_state

    def predict(self, downlink: Params, state: ClientState, x: Tensor) -> Tensor:
        return self.model.forward(self.own_model(downlink, state), x)

    def join(self, downlink, state, data: ClientData, ctx: RoundContext) -> ClientState:
        """A newcomer's warm-up: the initial model trained alone."""
        model = self.model_of(downlink)
        trained, _ = self.train(model, data, ctx)
        return {**state, **tree.add_prefix(OWN, trained), WARM: torch.ones_like(state[WARM])}
