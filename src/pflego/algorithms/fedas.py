"""FedAS: parameter alignment and Fisher-weighted client synchronization.

Yang, Huang, Ye. "FedAS: Bridging Inconsistency in Personalized Federated Learning". CVPR 2024.
(No arXiv version is known to us.) Authors' code: github.com/xiyuanyang45/FedAS, also contributed
to PFLlib (``clientas.py``, ``serveras.py``), which the update follows; the paper was not
available offline, so where the two may differ is stated below as an assumption.

Client i keeps a whole local model theta_i = (phi_i, h_i): the body phi_i is refreshed from the
server every time it is sampled, the head h_i never leaves it. In round t a sampled client

1. (parameter alignment) computes its class prototypes with its own body, P_c = mean of
   phi_i(x) over its training samples of class c (no gradient), then fine-tunes the received
   global body phi^t on its data toward them, by plain SGD with step ``align_lr`` for
   ``align_epochs`` epochs of ``align_batch_size`` samples per step, on the per-batch loss
   ``sum_{c in batch} MSE(phi(x_{y=c}), P_c)`` (the mean over the class's samples and the M
   features of the squared differences);
2. trains the aligned body and its head together on the cross-entropy (the run's schedule and
   client optimizer), giving theta_i;
3. (client synchronization) measures the trace of its empirical Fisher information at theta_i,
   F_i = sum over one epoch of the run's batches of ||grad_theta mean-NLL(batch)||^2 (body and
   head), and uploads its body with the weight F_i; the server averages the bodies with weights
   F_i / sum_j F_j.

Symbols to code: phi^t -> ``server["params"]`` (``body.*``); phi_i -> the client state
``local.body.*`` (with ``trained``: before its first round a client's body is the received one);
h_i -> the client state ``head.*`` (C-way); F_i -> ``ClientOut.weight`` (the default aggregate
normalizes it); ``align_lr`` (0.01), ``align_epochs`` (1), ``align_batch_size`` (16): the values
fixed in the authors' ``set_parameters``; the Fisher pass is the named schedule ``fisher`` (one
epoch of the run's batch size), the alignment the named schedule ``align``.

Assumptions and deliberate differences:
- Client synchronization uses one scalar per client, the Fisher trace F_i, as the authors' code
  does; if the paper weighs each parameter by its own (diagonal) Fisher information, this is the
  code's simplification, not the paper's rule (we could not check the paper offline).
- In the authors' repository the alignment optimizer acts on the server's global model in place,
  so each sampled client in turn aligns the body the previous one already aligned, and the last
  one's result stays in the server's model; current PFLlib deep-copies the model before aligning,
  and so does pflego: every client aligns its own copy of phi^t.
- The authors' code also lets clients that were not sampled compute their Fisher trace each
  round; only the sampled clients' traces weigh the aggregate, so it is not computed here.
- The server in the authors' code averages the heads too, but no client ever receives them; only
  the body is shared here.
- Differential privacy and SecAgg+ are refused (``sum_aggregate = False``): the aggregation
  weights F_i depend on the clients' data, so the sensitivity of the weighted mean has no bound.
- The global model is averaged through the server optimizer on ``phi^t - phi_i`` (server SGD with
  lr 1, the default, is the authors' weighted average).

Prediction: the client's own model theta_i (the authors' ``evaluate``). A client that never trained
(``join``) fine-tunes the received body with its first-visit head on the cross-entropy (the run's
schedule; its own body is the received one, so it has no local prototypes to align it to).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from pflego import tree
from pflego.algorithms.base import Algorithm, register
from pflego.fields import non_negative, positive, setting
from pflego.local import run_program, train_steps
from pflego.loss import Alignment, Objective
from pflego.optim import SGD
from pflego.program import Step
from pflego.tree import Params
from pflego.types import ClientData, ClientOut, RoundContext, Schedule

LOCAL = "local."  # the client's own body phi_i
TRAINED = "trained"  # 1 once the client has its own body


@register("fedas")
@dataclass(frozen=True)
class FedAS(Algorithm):
    align_lr: float = setting(
        0.01, "step size of the parameter alignment toward the client's prototypes", non_negative
    )
    align_epochs: float = setting(1.0, "epochs of the parameter alignment", positive)
    align_batch_size: int = setting(16, "samples per step of the parameter alignment", positive)

    shared: ClassVar[tuple[str, ...]] = ("body",)
    personal: ClassVar[tuple[str, ...]] = ("head", "local")
    #: The weights F_i are computed from the clients' data and models, so no bound on one
    #: client's influence holds: differential privacy and secure aggregation refuse it.
    sum_aggregate: ClassVar[bool] = False

    def schedules(self, run: Schedule) -> dict[str, Schedule]:
        """The alignment's epochs of ``align_batch_size``, and one epoch for the Fisher trace."""
        return {
            "align": Schedule(run.inner_steps, self.align_batch_size, self.align_epochs),
            "fisher": run.phase(epochs=1.0),
        }

    def init_client(self, downlink, generator, ctx):
        """A personal head; no own body yet (``trained`` 0: the received body stands in)."""
        head = super().init_client(downlink, generator, ctx)
        body = tree.select(downlink, ["body"])
        return {
            **head,
            **tree.add_prefix(LOCAL, tree.zeros_like(body)),
            TRAINED: torch.zeros((), dtype=head["head.weight"].dtype),
        }

    def own_body(self, downlink: Params, state) -> Params:
        """phi_i, or the received body before the client's first round."""
        local = tree.strip_prefix(LOCAL, state)
        body = tree.select(downlink, ["body"])
        return tree.where(state[TRAINED] > 0, local, body)

    def one_hot(self, y: Tensor, dtype: torch.dtype) -> Tensor:
        """``[n, C]`` indicators of the labels (by comparison: ``F.one_hot`` checks values)."""
        classes = torch.arange(self.model.num_classes, device=y.device)
        return (y[:, None] == classes).to(dtype)

    def prototypes(self, body: Params, data: ClientData) -> Tensor:
        """``[C, M]``: the mean feature of each class over the client's training samples."""
        features = self.model.features(body, data.x).detach()
        onehot = self.one_hot(data.y, features.dtype) * data.mask[:, None]
        return (onehot.T @ features) / onehot.sum(0).clamp(min=1)[:, None]

    def alignment_loss(self, prototypes: Tensor, label_mask: Tensor) -> Objective:
        """sum over the batch's classes of MSE(phi(x_{y=c}), P_c) (the mean over the class's
        rows and the M features), declared so that its SGD steps may run fused."""
        weights = prototypes.new_full((len(prototypes),), 1 / prototypes.shape[-1])
        terms = (Alignment(prototypes, weights, class_means=True),)
        return Objective(self.model, label_mask, terms=terms)

    def fisher_trace(self, params: Params, data: ClientData) -> Tensor:
        """sum over the batches of ||grad mean-NLL(batch)||^2, all parameters: a step program
        writing each batch's gradient into a second point (``g <- 0 g - (-1) grad``) and
        recording its squared norm."""
        head = params["head.weight"]
        nll = Objective(self.model, head.new_ones(head.shape[0]))  # the NLL of the whole head
        steps = [Step(0, 1, -1.0, 0.0, row, record=True) for row in range(data.batches.shape[0])]
        return run_program(nll, [params, tree.zeros_like(params)], data, steps).norms.sum()

    def local_round(self, downlink, state, data: ClientData, ctx: RoundContext):
        """Alignment of phi^t, then the cross-entropy steps; returns theta_i and the mean loss."""
        received = tree.select(downlink, ["body"])
        align = data.using("align")
        prototypes = self.prototypes(self.own_body(downlink, state), data)
        loss = self.alignment_loss(prototypes, data.label_mask)
        sgd = SGD()
        aligned, _, _ = train_steps(loss, received, align, sgd, sgd.init(received), self.align_lr)
        params = {**aligned, **tree.select(state, ["head"])}
        return self.train(params, data, ctx)

    def client_update(self, downlink, state, data: ClientData, ctx: RoundContext):
        trained, mean_loss = self.local_round(downlink, state, data, ctx)
        weight = self.fisher_trace(trained, data.using("fisher"))
        body = tree.select(trained, ["body"])
        upload = tree.sub(tree.select(downlink, ["body"]), body)
        new_state = {
            **tree.select(trained, ["head"]),
            **tree.add_prefix(LOCAL, body),
            TRAINED: torch.ones_like(state[TRAINED]),
        }
        return ClientOut(upload, weight, {"loss": mean_loss, "fisher_trace": weight}), new_state

    def predict(self, downlink, state, x):
        """The client's own model (phi_i, h_i)."""
        return self.model.forward({**self.own_body(downlink, state), **state}, x)

    def join(self, downlink, state, data, ctx):
        """The received body and the first-visit head, fine-tuned on the cross-entropy."""
        params = {**tree.select(downlink, ["body"]), **tree.select(state, ["head"])}
        tuned, _ = self.train(params, data, ctx)
        return {
            **tree.select(tuned, ["head"]),
            **tree.add_prefix(LOCAL, tree.select(tuned, ["body"])),
            TRAINED: torch.ones_like(state[TRAINED]),
        }
