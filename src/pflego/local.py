"""The one local training loop, shared by every algorithm, and the masked losses it runs on."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.func import grad_and_value

from pflego import tree
from pflego.optim import SGD, Optimizer, OptState
from pflego.tree import Params
from pflego.types import ClientData

LossFn = Callable[[Params, Tensor, Tensor, Tensor], Tensor]


def masked_cross_entropy(
    logits: Tensor, y: Tensor, mask: Tensor, label_mask: Tensor | None = None
) -> Tensor:
    """Mean cross-entropy over the entries where ``mask`` is 1.

    ``label_mask`` removes logits that a padded personal head does not really have, so the loss
    equals that of a K_i-way head.
    """
    if label_mask is not None:
        logits = torch.where(label_mask > 0, logits, torch.finfo(logits.dtype).min)
    per_sample = -torch.log_softmax(logits, -1).gather(-1, y.unsqueeze(-1)).squeeze(-1)
    return (per_sample * mask).sum() / mask.sum().clamp(min=1)


def train_steps(
    loss_fn: LossFn,
    params: Params,
    data: ClientData,
    optimizer: Optimizer,
    opt_state: OptState,
    lr: float | Tensor,
    steps: slice = slice(None),
) -> tuple[Params, OptState, Tensor]:
    """Run the local steps ``data.batches[steps]``, one optimizer update per step.

    A step whose batch is all padding leaves parameters and optimizer state unchanged, which makes
    ragged clients exact under vmap.

    Args:
        loss_fn: ``loss_fn(params, x, y, mask)`` for one minibatch.
        params: The parameters being trained; anything fixed is closed over by ``loss_fn``.
        data: The client's data and minibatch schedule.
        optimizer: A functional optimizer.
        opt_state: Its state.
        lr: Step size.
        steps: Which rows of the schedule to run.

    Returns:
        Trained parameters, optimizer state, and the mean loss over the real steps.
    """
    step_and_loss = grad_and_value(loss_fn)
    plain_sgd = type(optimizer) is SGD and not optimizer.weight_decay
    total, count = torch.zeros(()), torch.zeros(())
    for idx, bmask in zip(data.batches[steps], data.batch_mask[steps]):
        grads, loss = step_and_loss(params, data.x[idx], data.y[idx], bmask)
        active = bmask.sum() > 0
        if plain_sgd:
            params = masked_sgd_step(params, grads, lr, active)
        else:
            new_params, new_state = optimizer.update(params, grads, opt_state, lr)
            params = tree.where(active, new_params, params)
            opt_state = tree.where(active, new_state, opt_state)
        total = total + torch.where(active, loss.detach(), 0.0)
        count = count + active.to(count.dtype)
    return params, opt_state, total / count.clamp(min=1)


def masked_sgd_step(params: Params, grads: Params, lr: float | Tensor, active: Tensor) -> Params:
    """``params - lr * grads`` where ``active``, else ``params`` unchanged, in one fused op per leaf.

    Equal to ``SGD().update`` followed by ``tree.where``: an inactive (all-padding) step has zero
    gradients and step size 0. Fusing the mask into the step size saves two passes over every
    parameter per step, which dominate minibatch steps of a whole cohort under vmap.
    """
    step = {dtype: active.to(dtype) * lr for dtype in {p.dtype for p in params.values()}}
    return {k: torch.addcmul(p, step[p.dtype], grads[k], value=-1) for k, p in params.items()}
