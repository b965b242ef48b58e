"""Per-FedAvg: personalized federated learning as model-agnostic meta-learning.

Fallah, Mokhtari, Ozdaglar. "Personalized Federated Learning with Theoretical Guarantees: A
Model-Agnostic Meta-Learning Approach". NeurIPS 2020; arXiv:2002.07948.

The global model w is trained so that one gradient step from it fits each client:
``F_i(w) = f_i(w - alpha grad f_i(w))``. A sampled client runs R local meta-steps from the
received w, each on fresh minibatches D, D' (and D'' for HF) of ``|D|`` samples:

    w' = w - alpha grad f(w; D)
    FO: w <- w - beta grad f(w'; D')
    HF: w <- w - beta (I - alpha H(w; D'')) grad f(w'; D')

and uploads ``w_t - w``; the server averages (Algorithm 1: the plain mean over the sampled
clients). The personalized model is one step from the received global model on local data,
``w - alpha grad f(w; D)``, taken in ``adapt`` at evaluation time and never stored; an unseen
client (``join``) takes the same step.

Symbols to code: w -> every ``body.*`` / ``head.*`` (shared), alpha -> ``alpha``, beta ->
``ctx.client_lr`` (the training step; defaults alpha 0.03 and beta 0.1, the defaults study's
choice, where the pFedMe paper's Figures 3-4 take 0.005 and 0.001), R -> the run's local steps
(``inner_steps``), |D| -> ``batch_size``. The R groups of 2 (FO) or 3 (HF) minibatches
are the named schedule ``meta``; the evaluation step's minibatch is drawn by ``adapt_schedule``
(one batch of ``batch_size``; the whole local set when unset). An l2 term is ``weight_decay``
of the client optimizer, added to f (and so to its Hessian); the steps themselves are plain
gradient steps, as in the paper, so a run with ``client_optimizer`` momentum or adam is refused (the
PGFed authors' Per-FedAvg also runs plain SGD). ``join_epochs`` is refused too: a new client takes
the evaluation step(s), not epochs. The reported accuracy selection of the pFedMe authors' code
(each run's best round on the test data) is not offered: the library reports the last rounds.

Differences:
- HF: the paper approximates the Hessian-vector product by finite differences of gradients;
  here it is the exact product, forward-over-reverse (``torch.func.jvp`` of the gradient), never
  forming the Hessian. FO drops that term.
- ``weights="samples"``: the pFedMe authors' code averages weighted by N_i; the paper by 1/S.
- ``personalize="code"``: the pFedMe authors' code personalizes with two steps, alpha on one
  minibatch then beta on another (taken from the test split in their code; here always from the
  training split). The default ``paper`` takes the one step.
- ``variant="code"``: the pFedMe authors' Per-FedAvg as it was when the paper's numbers were made
  (fixed in their repository in March 2021) takes the second step from w' instead of w:
  ``w <- w' - beta grad f(w'; D')``, two plain SGD steps. Table 1's (alpha, beta) were tuned for it;
  with the meta-update the same step sizes move w about (alpha + beta) / beta times less.

Speed: FO and ``code`` without weight decay run a client's meta-steps as one fused program
(:mod:`pflego.fused_bilevel`) on the ``fused`` backend, which ``auto`` then picks on CPU; HF's
Hessian-vector product and an l2 term take autograd.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor
from torch.func import grad, grad_and_value, jvp

from pflego import tree
from pflego.algorithms.base import Algorithm, register
from pflego.fields import one_of, positive, setting
from pflego.fused_bilevel import Substep, fused_program, real_rows
from pflego.local import fused_or_none
from pflego.loss import ModelLoss
from pflego.tree import Params
from pflego.types import ClientData, ClientOut, RoundContext, Schedule

VARIANTS = ("fo", "hf", "code")
WEIGHTS = ("uniform", "samples")
PERSONALIZE = ("paper", "code")


@register("perfedavg")
@dataclass(frozen=True)
class PerFedAvg(Algorithm):
    alpha: float = setting(
        0.03,
        "step size alpha of the personalization (inner) step",
        positive.noting(" (the personalization step)"),
    )
    variant: str = setting(
        "fo",
        "the meta-gradient: fo (first order), hf (Hessian-free) or code (the authors' code)",
        one_of(*VARIANTS, says="must be one of"),
    )
    weights: str = setting(
        "uniform",
        "how uploads are averaged: uniform, or by samples (the pFedMe code)",
        one_of(*WEIGHTS, says="must be one of"),
    )
    personalize: str = setting(
        "paper",
        "how a client personalizes before evaluation: paper (one step) or code (two)",
        one_of(*PERSONALIZE, says="must be one of"),
    )

    default_client_lr: ClassVar[float] = 0.1
    client_step: ClassVar[str] = "sgd"  # the paper's plain gradient steps
    join_trains: ClassVar[bool] = False  # one step (two with personalize=code), not epochs

    @property
    def batches_per_step(self) -> int:
        return 3 if self.variant == "hf" else 2

    def objective(self, params: Params, x: Tensor, y: Tensor, mask: Tensor, label_mask) -> Tensor:
        """f on a minibatch: mean cross-entropy plus the optimizer's l2 term, if any."""
        decay = getattr(self.client_optimizer, "weight_decay", 0.0)
        loss = self.loss(params, x, y, mask, label_mask)
        return loss + 0.5 * decay * tree.sq_norm(params) if decay else loss

    def schedules(self, run: Schedule) -> dict[str, Schedule]:
        """R groups of 2 (FO) or 3 (HF) fresh minibatches."""
        m = self.batches_per_step
        epochs = None if run.local_epochs is None else run.local_epochs * m
        return {"meta": Schedule(run.inner_steps * m, run.batch_size, epochs)}

    def adapt_schedule(self, run: Schedule) -> Schedule:
        return Schedule(1 if self.personalize == "paper" else 2, run.batch_size)

    def client_update(self, downlink, state, data: ClientData, ctx: RoundContext):
        meta = data.using("meta")
        fused = fused_or_none(lambda: self.fused_steps(downlink, meta, ctx.client_lr))
        w, mean_loss = fused if fused is not None else self.autograd_steps(downlink, meta, ctx)
        weight = (
            data.num_samples if self.weights == "samples" else torch.ones_like(data.num_samples)
        )
        out = ClientOut(tree.sub(downlink, w), weight, {"loss": mean_loss})
        return out, state

    def autograd_steps(self, downlink: Params, meta: ClientData, ctx: RoundContext):
        """The R meta-steps from ``downlink`` with autograd: the trained w and the mean of
        f(w; D) over the real steps."""
        batches, masks = (
            grouped(meta.batches, self.batches_per_step),
            grouped(meta.batch_mask, self.batches_per_step),
        )
        f = lambda p, b: self.objective(p, *minibatch(meta, b), meta.label_mask)  # noqa: E731
        w = dict(downlink)
        total, count = torch.zeros(()), torch.zeros(())
        for group, group_mask in zip(batches, masks):
            steps = [(group[k], group_mask[k]) for k in range(self.batches_per_step)]
            g_inner, loss = grad_and_value(f)(w, steps[0])
            adapted = tree.axpy(-self.alpha, g_inner, w)
            direction = grad(f)(adapted, steps[1])
            if self.variant == "hf":  # (I - alpha H(w; D'')) g, with H g forward-over-reverse
                gradient_on_third = lambda p, b=steps[2]: grad(f)(p, b)  # noqa: E731
                _, hessian_g = jvp(gradient_on_third, (w,), (direction,))
                direction = tree.axpy(-self.alpha, hessian_g, direction)
            start = adapted if self.variant == "code" else w  # "code": two plain SGD steps
            active = (group_mask.sum(-1) > 0).all()  # padding groups change nothing
            w = tree.where(active, tree.axpy(-ctx.client_lr, direction, start), w)
            total = total + torch.where(active, loss.detach(), 0.0)
            count = count + active.to(count.dtype)
        return w, total / count.clamp(min=1)

    def fused_steps(
        self, downlink: Params, meta: ClientData, lr: float
    ) -> tuple[Params, Tensor] | None:
        """The FO (or ``code``) meta-steps as one fused program, or ``None`` where they do not
        fuse (HF's Hessian-vector product, weight decay, another loss): per group of two real
        minibatches, a step of alpha from a copy w' of w (``code``: from w itself), and a step
        of beta on w with the gradient at w'."""
        rows = real_rows(meta)
        if rows is None or not self.plain_steps or self.variant == "hf":
            return None
        real, size = set(rows), self.batches_per_step
        pad = -meta.batches.shape[0] % size  # as ``grouped``: padding rows come first
        groups = [
            [g * size + k - pad for k in range(size)]
            for g in range((meta.batches.shape[0] + pad) // size)
        ]
        groups = [group for group in groups if all(r in real for r in group)]
        if not groups:
            return {k: v.clone() for k, v in downlink.items()}, torch.zeros(())
        beta = float(lr)
        substeps = []
        for first, second in groups:
            if self.variant == "code":  # point 0 is w
                substeps += [
                    Substep(0, 0, self.alpha, 1.0, first),
                    Substep(0, 0, beta, 1.0, second),
                ]
            else:  # point 0 is w, point 1 is w'
                copy = ((1, 0, 0, 0.0),)  # w' <- w
                substeps += [
                    Substep(1, 1, self.alpha, 1.0, first, copy),
                    Substep(1, 0, beta, 1.0, second),
                ]
        points = [downlink] if self.variant == "code" else [downlink, downlink]
        fused = fused_program(ModelLoss(self.model, meta.label_mask), points, meta, substeps)
        if fused is None:
            return None
        trained, values = fused.points, fused.values
        return trained[0], values[0::2].mean()  # f(w; D) of each meta-step

    @property
    def plain_steps(self) -> bool:
        """Whether f is the model's plain cross-entropy, whose gradient steps may run fused."""
        plain = type(self).loss is Algorithm.loss and type(self).objective is PerFedAvg.objective
        return plain and not getattr(self.client_optimizer, "weight_decay", 0.0)

    def adapt(self, downlink, state, data: ClientData, ctx: RoundContext):
        """One step ``w - alpha grad f(w; D)`` from the received model (``code``: then a beta step)."""
        step_sizes = [self.alpha, float(ctx.client_lr)][: data.batches.shape[0]]
        fused = fused_or_none(lambda: self.fused_adapt(downlink, data, step_sizes))
        if fused is not None:
            return fused
        w = dict(downlink)
        for k, lr in enumerate(step_sizes):
            x, y, mask = minibatch(data, (data.batches[k], data.batch_mask[k]))
            g = grad(self.objective)(w, x, y, mask, data.label_mask)
            w = tree.where(mask.sum() > 0, tree.axpy(-lr, g, w), w)
        return w

    def fused_adapt(
        self, downlink: Params, data: ClientData, step_sizes: list[float]
    ) -> Params | None:
        """:meth:`adapt`'s steps as one fused program, or ``None`` where they do not fuse."""
        rows = real_rows(data)
        if rows is None or not self.plain_steps:
            return None
        substeps = [Substep(0, 0, lr, 1.0, k) for k, lr in enumerate(step_sizes) if k in rows]
        if not substeps:
            return {k: v.clone() for k, v in downlink.items()}
        fused = fused_program(ModelLoss(self.model, data.label_mask), [downlink], data, substeps)
        return None if fused is None else fused.points[0]


def grouped(rows: Tensor, size: int) -> Tensor:
    """``[S, B]`` schedule rows as ``[ceil(S / size), size, B]`` groups, aligned at the end.

    Padding steps come first, so a client's real steps are its last ones; the front is padded
    with empty rows, and a group holding any empty row is skipped.
    """
    pad = -rows.shape[0] % size
    if pad:
        rows = torch.cat([rows.new_zeros(pad, *rows.shape[1:]), rows])
    return rows.reshape(-1, size, *rows.shape[1:])


def minibatch(data: ClientData, step: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """Inputs, labels and mask of one schedule row ``(indices, mask)``."""
    idx, mask = step
    return data.x[idx], data.y[idx], mask
