"""Federated Reconstruction: personal parameters rebuilt at every visit, never stored.

Singhal, Sidahmed, Garrett, Wu, Rush, Prakash. "Federated Reconstruction: Partially Local
Federated Learning". NeurIPS 2021; arXiv:2102.03448.

Each sampled client i receives the global parameters g, initializes its local parameters l_i,
reconstructs them with k_r steps on its loss with g fixed, then takes k_u steps on g with l_i
fixed, and uploads only the update of g; the server averages the updates. l_i is dropped after
the visit, so clients keep no state and a new client personalizes by the same reconstruction.

Symbols to code: g -> ``body.*`` (shared, averaged by N_i), l_i -> ``head.*`` (a head over the
client's own K_i classes), k_r -> the named schedule ``recon`` (``recon_steps`` /
``recon_epochs``), k_u -> the schedule ``body`` (``body_steps`` / ``body_epochs``); unset, each
phase runs the run's own schedule. Evaluation reconstructs in ``adapt`` on the training split and
predicts on the test split (the paper's reconstruction / evaluation split).

Initialization: l_i starts every visit from the same head W0, drawn once with the run's seed and
held by the server beside the body (sent in the downlink, never updated). The reconstruction
starts afresh each visit and nothing of a visit survives it, as in the paper; W0 is shared by all
clients and visits (the TensorFlow Federated implementation re-runs the layer initializers
instead, and the PFLEGO reference code's ``reset`` mode draws a new U(0, 1) head per visit),
which keeps clients stateless and every backend and Flower node in agreement.

Options:
- ``split_dataset``: reconstruct on the client's even-indexed samples and train the body on the
  odd-indexed ones (TensorFlow Federated's ``split_dataset``); default off, as there.
- ``keep_head``: the PFLEGO paper's variant, compared with PFLEGO at equal tau (its Figure 4 and
  the reference code's default): the reconstructed head is kept across visits, starting at the
  first visit from a per-client draw like PFLEGO's heads; evaluation then uses the kept head.
  With ``body_steps: 1`` and the server optimizer it reproduces the reference code's FedRecon
  (tau head steps, then one body gradient step taken by the server).

Differences: the server weights each update by N_i (the paper's Algorithm 1 leaves the
aggregation weights open). The reconstruction computes the body's features once.

Unseen clients (``join``): reconstruction from their first-visit head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from pflego import tree
from pflego.algorithms.base import FixedHead, register
from pflego.fields import positive_or_unset, setting
from pflego.models import init_head
from pflego.types import ClientData, ClientOut, RoundContext, Schedule


def half(data: ClientData, parity: int) -> ClientData:
    """The data with only the samples whose index has ``parity`` left in its schedule."""
    keep = (data.batches % 2 == parity).to(data.batch_mask.dtype)
    return data._replace(batch_mask=data.batch_mask * keep)


@register("fedrecon")
@dataclass(frozen=True)
class FedRecon(FixedHead):
    recon_steps: int | None = setting(
        None,
        "local steps of the head's reconstruction (unset: recon_epochs or the run's)",
        positive_or_unset,
    )
    recon_epochs: float | None = setting(
        None, "epochs of the head's reconstruction", positive_or_unset
    )
    body_steps: int | None = setting(
        None, "local steps of the body update (unset: body_epochs or the run's)", positive_or_unset
    )
    body_epochs: float | None = setting(None, "epochs of the body update", positive_or_unset)
    split_dataset: bool = setting(
        False, "reconstruct on even-indexed samples, train the body on odd-indexed ones"
    )
    keep_head: bool = setting(
        False, "keep the reconstructed head across visits (the PFLEGO paper's variant)"
    )

    shared: ClassVar[tuple[str, ...]] = ("body",)
    personal: ClassVar[tuple[str, ...]] = ("head",)
    label_space: ClassVar[str] = "local"

    def init_params(self, seed: int, dtype: torch.dtype = torch.float32):
        generator = torch.Generator().manual_seed(seed + 1)
        w0 = init_head(self.head_width, self.model.feature_dim, generator, self.head_init, dtype)
        return self.model.init_body(seed, dtype) | w0

    def init_client(self, downlink, generator: torch.Generator, ctx: RoundContext):
        return super().init_client(downlink, generator, ctx) if self.keep_head else {}

    def schedules(self, run: Schedule) -> dict[str, Schedule]:
        return {
            "recon": run.phase(self.recon_steps, self.recon_epochs),
            "body": run.phase(self.body_steps, self.body_epochs),
        }

    def reconstruct(self, downlink, state, data: ClientData, ctx: RoundContext):
        """Head steps with the body fixed, from the kept head or else from W0."""
        start = {**tree.select(downlink, ["head"]), **state}
        return self.train_head(tree.select(downlink, ["body"]), start, data, ctx)

    def client_update(self, downlink, state, data: ClientData, ctx: RoundContext):
        recon, rest = data.using("recon"), data.using("body")
        if self.split_dataset:
            recon, rest = half(recon, 0), half(rest, 1)
        head = self.reconstruct(downlink, state, recon, ctx)
        body = tree.select(downlink, ["body"])
        trained, mean_loss = self.train(body, rest, ctx, fixed=head)
        out = ClientOut(tree.sub(body, trained), data.num_samples, {"loss": mean_loss})
        return out, (head if self.keep_head else state)

    def adapt(self, downlink, state, data: ClientData, ctx: RoundContext):
        """The reconstructed head this evaluation predicts with (the kept one with ``keep_head``)."""
        return state if self.keep_head else self.reconstruct(downlink, state, data, ctx)

    def join(self, downlink, state, data: ClientData, ctx: RoundContext):
        return self.reconstruct(downlink, state, data, ctx)

    def adapt_schedule(self, run: Schedule) -> Schedule:
        return self.schedules(run)["recon"]
