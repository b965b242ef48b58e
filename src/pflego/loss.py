"""The masked losses that local training runs on.

:class:`ModelLoss` is a model's masked cross-entropy with optional proximal and linear terms,
declared by its fields, so that :mod:`pflego.fused` can run SGD on it without autograd and
:mod:`pflego.local` can differentiate it with ``torch.func`` like any other loss.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from torch import Tensor

from pflego import tree
from pflego.models import SplitModel, head_logits
from pflego.tree import Params


def cross_entropies(logits: Tensor, y: Tensor, label_mask: Tensor | None = None) -> Tensor:
    """Per-sample cross-entropy ``-log softmax(logits)[y]`` (``logits [..., n, K]``, ``y [n]``).

    ``label_mask`` removes logits that a padded personal head does not really have, so the loss
    equals that of a K_i-way head.
    """
    if label_mask is not None:
        logits = torch.where(label_mask > 0, logits, torch.finfo(logits.dtype).min)
    labels = y.expand(logits.shape[:-1]).unsqueeze(-1)
    return -torch.log_softmax(logits, -1).gather(-1, labels).squeeze(-1)


def masked_cross_entropy(
    logits: Tensor, y: Tensor, mask: Tensor, label_mask: Tensor | None = None
) -> Tensor:
    """Mean cross-entropy over the entries where ``mask`` is 1 (see :func:`cross_entropies`)."""
    return (cross_entropies(logits, y, label_mask) * mask).sum() / mask.sum().clamp(min=1)


@dataclass(frozen=True)
class ModelLoss:
    """A model's masked cross-entropy with optional regularizers, as a declared loss function.

    ``loss(p, x, y, mask) = CE(forward({**fixed, **p}, x), y; mask, label_mask)
    + strength / 2 * ||p - anchor||^2 - <linear, p> + alignment``

    With ``sample_weights``, the cross-entropy is ``sum_s w_s mask_s CE_s / sum_s mask_s``.
    With ``centroids``, the feature-alignment term (FedPAC's, FedProto's) is
    ``sum_s mask_s centroid_weights[y_s] ||phi(x_s) - centroids[y_s]||^2 / sum_s mask_s``, with
    ``phi`` the model's features (the head's input); with ``class_means``, each row's term is
    divided by the number of rows of its class in the minibatch instead (FedAS's sum over the
    classes of their means). Without ``cross_entropy``, the loss is its other terms only.

    Called like any loss function (``train_steps`` differentiates it with ``torch.func``); its
    fields let :mod:`pflego.fused` run SGD on it without autograd.

    Attributes:
        model: The split model, or ``None`` for a bare linear head on precomputed features
            (``p`` and ``fixed`` then hold ``head.weight`` and ``head.bias``).
        label_mask: ``[K]``, the logits the client's head really has.
        fixed: Parameters held fixed (the rest of the model).
        anchor: The point of the proximal term (FedProx, Ditto, pFedMe, FedDyn), keyed like ``p``.
        strength: The proximal term's weight (``lambda``, ``mu``, ``alpha``).
        linear: The linear term's coefficients (FedDyn's ``grad L_k``), keyed like ``p``.
        sample_weights: ``[n]``, a weight per sample of the client's data (FedEM's
            responsibilities), or ``None``. ``train_steps`` calls the loss on a minibatch
            ``idx`` as :meth:`on_samples` ``(idx)``, whose weights are the batch's.
        centroids: ``[C, M]``, the point each class's features are pulled to, or ``None``.
        centroid_weights: ``[C]``, each class's weight in the alignment term (with
            ``centroids``; FedPAC's ``lambda / M`` for its mean over the M features).
        class_means: Whether the alignment term is a sum over the minibatch's classes of their
            rows' means (else the mean over its rows).
        cross_entropy: Whether the loss has the cross-entropy term (without it, the head is
            neither read nor trained).
    """

    model: SplitModel | None
    label_mask: Tensor
    fixed: Params = field(default_factory=dict)
    anchor: Params | None = None
    strength: float = 0.0
    linear: Params | None = None
    sample_weights: Tensor | None = None
    centroids: Tensor | None = None
    centroid_weights: Tensor | None = None
    class_means: bool = False
    cross_entropy: bool = True

    def on_samples(self, idx: Tensor) -> ModelLoss:
        """The loss on the minibatch of samples ``idx``: its sample weights are theirs."""
        if self.sample_weights is None:
            return self
        return dataclasses.replace(self, sample_weights=self.sample_weights[idx])

    def __call__(self, params: Params, x: Tensor, y: Tensor, mask: Tensor) -> Tensor:
        full = {**self.fixed, **params}
        features = x if self.model is None else self.model.features(full, x)
        count = mask.sum().clamp(min=1)
        value = features.new_zeros(())
        if self.cross_entropy:
            weights = mask if self.sample_weights is None else mask * self.sample_weights
            logits = head_logits(full, features)
            value = (cross_entropies(logits, y, self.label_mask) * weights).sum() / count
        if self.centroids is not None:
            gaps = ((features - self.centroids[y]) ** 2).sum(-1) * self.centroid_weights[y] * mask
            if self.class_means:  # each row over its class's rows in the minibatch
                classes = torch.arange(len(self.centroids), device=y.device)
                rows = ((y[:, None] == classes) * mask[:, None]).sum(0).clamp(min=1)
                value = value + (gaps / rows[y]).sum()
            else:
                value = value + gaps.sum() / count
        if self.anchor is not None:
            value = value + self.strength / 2 * tree.sq_norm(tree.sub(params, self.anchor))
        if self.linear is not None:
            value = value - tree.dot(self.linear, params)
        return value
