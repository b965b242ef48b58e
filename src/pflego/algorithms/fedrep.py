"""FedRep: federated representation learning with personal heads.

Collins, Hassani, Mokhtari, Shakkottai. "Exploiting Shared Representations for Personalized
Federated Learning". ICML 2021; arXiv:2102.07078.

Each sampled client i first trains its own head with the representation fixed, then the
representation with its new head fixed (Algorithm 1):

    h_i <- GRD(f_i(h, phi^t), h_i, alpha)      tau_h steps (head only)
    phi_i <- GRD(f_i(h_i, phi), phi^t, alpha)  tau_phi steps (body only)

and the server averages the representations, phi^{t+1} = mean of phi_i; the head never leaves
the client. Symbols to code: phi -> ``body.*`` (shared), h_i -> ``head.*`` (personal, over the
client's own K_i classes as in the PFLEGO paper's comparison), alpha -> ``ctx.client_lr``,
tau_h / tau_phi -> the named schedules ``head`` / ``body`` (options ``head_steps`` /
``head_epochs``, ``body_steps`` / ``body_epochs``; unset, each phase runs the run's own schedule).

The authors' code (lgcollins/FedRep) runs 10 head epochs and 1 body epoch per round on CIFAR-10
(``options: {head_epochs: 10, body_epochs: 1}``) with SGD momentum 0.5 (``client_optimizer:
momentum``, ``momentum: 0.5``); the PFLEGO reference code splits its tau steps into
``tau - local_rep_steps`` head steps and ``local_rep_steps`` body steps.

Phase lengths, decided: unset, each phase runs the run's own schedule, not the 10 + 1 epochs of
the authors' code. The run's schedule (``inner_steps`` / ``local_epochs``) is the local budget
that every method of a comparison shares; a fixed 10 + 1 epochs default would leave it without
effect for FedRep, a silently ignored setting. The comparisons that fix a split say so: the
PFLEGO presets set ``head_steps`` / ``body_steps`` (the reference code's split), and the PGFed
presets run the run's 5 epochs per phase, which is the PGFed authors' FedRep default
(``plocal_steps`` 5 head epochs, then ``local_steps`` 5 body epochs, plain SGD). The FedRep
paper's split is one line: ``options: {head_epochs: 10, body_epochs: 1}``.

Differences: the server weights each body by N_i (the authors' code; Algorithm 1 writes the
uniform mean, equal for the paper's equal-sized clients). The head phase computes the body's
features once and reuses them (the same numbers, since the body is fixed in that phase). Each
phase starts a fresh optimizer state, where the authors' code keeps one optimizer for both.

Unseen clients (``join``): a new head trained on the frozen representation (the head schedule).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pflego import tree
from pflego.algorithms.base import Algorithm, register
from pflego.fields import positive_or_unset, setting
from pflego.types import ClientData, ClientOut, RoundContext, Schedule


@register("fedrep")
@dataclass(frozen=True)
class FedRep(Algorithm):
    head_steps: int | None = setting(
        None, "local steps of the head phase (unset: head_epochs or the run's)", positive_or_unset
    )
    head_epochs: float | None = setting(None, "epochs of the head phase", positive_or_unset)
    body_steps: int | None = setting(
        None, "local steps of the body phase (unset: body_epochs or the run's)", positive_or_unset
    )
    body_epochs: float | None = setting(None, "epochs of the body phase", positive_or_unset)

    shared: ClassVar[tuple[str, ...]] = ("body",)
    personal: ClassVar[tuple[str, ...]] = ("head",)
    label_space: ClassVar[str] = "local"

    def schedules(self, run: Schedule) -> dict[str, Schedule]:
        return {
            "head": run.phase(self.head_steps, self.head_epochs),
            "body": run.phase(self.body_steps, self.body_epochs),
        }

    def client_update(self, downlink, state, data: ClientData, ctx: RoundContext):
        head = self.train_head(downlink, state, data.using("head"), ctx)
        body, mean_loss = self.train(downlink, data.using("body"), ctx, fixed=head)
        return ClientOut(tree.sub(downlink, body), data.num_samples, {"loss": mean_loss}), head

    def join(self, downlink, state, data: ClientData, ctx: RoundContext):
        return self.train_head(downlink, state, data, ctx)

    def adapt_schedule(self, run: Schedule) -> Schedule:
        return self.schedules(run)["head"]
