"""The masked losses that local training runs on, as a model's objective made of terms.

A loss is any function ``loss(params, x, y, mask)`` of one minibatch. :class:`Objective` is such a
function that also says what it computes: a model (with parameters held ``fixed``) and a tuple of
:class:`Term` (in the style of optax's ``chain``: :class:`CrossEntropy`, :class:`Proximal`,
:class:`Linear`, :class:`Alignment`), each of which gives its value for autograd and, where it
has one, its fused form (:meth:`Term.fused`, a part of the :class:`FusedForm` that
:mod:`pflego.fused` runs without autograd). An algorithm declares its objective; an objective with
a term that has no fused form is differentiated with ``torch.func`` like any other loss.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import NamedTuple

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


class Batch(NamedTuple):
    """What a term's value reads of one minibatch.

    Attributes:
        params: The trained parameters.
        full: The trained and the fixed parameters together.
        features: The model's features (the head's input) of the minibatch.
        y: ``[n]`` labels.
        mask: ``[n]``, 1 for the real rows.
        count: The number of real rows (at least 1).
        label_mask: ``[K]``, the logits the client's head really has.
    """

    params: Params
    full: Params
    features: Tensor
    y: Tensor
    mask: Tensor
    count: Tensor
    label_mask: Tensor


class FusedForm(NamedTuple):
    """What the fused kernel (:mod:`pflego.fused`) computes beside the model's layers: the terms'
    fused forms merged (:meth:`Objective.fused_form`).

    Attributes:
        cross_entropy: Whether the loss has the masked cross-entropy of the head.
        sample_weights: ``[N]``, a weight on each sample's cross-entropy, or ``None``.
        anchor: The point of the proximal term ``strength / 2 ||p - anchor||^2``, or ``None``.
        strength: Its weight.
        linear: ``c`` of the linear term ``-<c, p>``, or ``None``.
        centroids: ``[C, M]``, the points the features of each class are pulled to, or ``None``.
        centroid_weights: ``[C]``, each class's weight in that term.
        class_means: Whether that term averages each class's rows apart.
    """

    cross_entropy: bool = False
    sample_weights: Tensor | None = None
    anchor: Params | None = None
    strength: float = 0.0
    linear: Params | None = None
    centroids: Tensor | None = None
    centroid_weights: Tensor | None = None
    class_means: bool = False


class Term:
    """One additive term of an :class:`Objective`."""

    #: Whether the term reads the samples' own data (see :meth:`on_samples`).
    per_sample: bool = False

    def value(self, batch: Batch) -> Tensor:
        """The term's value on a minibatch (differentiable)."""
        raise NotImplementedError

    def fused(self, form: FusedForm) -> FusedForm | None:
        """``form`` with this term added, or ``None`` when the kernel cannot run it."""
        return None

    def on_samples(self, idx: Tensor) -> Term:
        """The term on the minibatch of samples ``idx`` (default: itself)."""
        return self


@dataclass(frozen=True)
class CrossEntropy(Term):
    """``sum_s w_s mask_s CE_s / sum_s mask_s``: the head's masked cross-entropy, with a weight
    per sample (``weights``, ``[N]`` over the client's data: FedEM's responsibilities) or 1."""

    weights: Tensor | None = None

    @property
    def per_sample(self) -> bool:
        return self.weights is not None

    def value(self, batch: Batch) -> Tensor:
        weights = batch.mask if self.weights is None else batch.mask * self.weights
        logits = head_logits(batch.full, batch.features)
        return (cross_entropies(logits, batch.y, batch.label_mask) * weights).sum() / batch.count

    def fused(self, form: FusedForm) -> FusedForm | None:
        if form.cross_entropy:
            return None
        return form._replace(cross_entropy=True, sample_weights=self.weights)

    def on_samples(self, idx: Tensor) -> Term:
        return self if self.weights is None else CrossEntropy(self.weights[idx])


@dataclass(frozen=True)
class Proximal(Term):
    """``strength / 2 ||p - anchor||^2`` (``anchor`` keyed like the trained parameters)."""

    anchor: Params
    strength: float

    def value(self, batch: Batch) -> Tensor:
        return self.strength / 2 * tree.sq_norm(tree.sub(batch.params, self.anchor))

    def fused(self, form: FusedForm) -> FusedForm | None:
        if form.anchor is not None:
            return None
        return form._replace(anchor=self.anchor, strength=self.strength)


@dataclass(frozen=True)
class Linear(Term):
    """``-<coefficients, p>`` (``coefficients`` keyed like the trained parameters)."""

    coefficients: Params

    def value(self, batch: Batch) -> Tensor:
        return -tree.dot(self.coefficients, batch.params)

    def fused(self, form: FusedForm) -> FusedForm | None:
        if form.linear is not None:
            return None
        return form._replace(linear=self.coefficients)


@dataclass(frozen=True)
class Alignment(Term):
    """The features' pull to their class's centroid:
    ``sum_s mask_s weights[y_s] ||phi(x_s) - centroids[y_s]||^2 / sum_s mask_s``, with ``phi``
    the model's features; with ``class_means``, each row's part is divided by the number of rows
    of its class in the minibatch instead (a sum over the classes of their means).

    Attributes:
        centroids: ``[C, M]``.
        weights: ``[C]``, each class's weight.
        class_means: Whether each class's rows are averaged apart.
    """

    centroids: Tensor
    weights: Tensor
    class_means: bool = False

    def value(self, batch: Batch) -> Tensor:
        y, mask = batch.y, batch.mask
        gaps = ((batch.features - self.centroids[y]) ** 2).sum(-1) * self.weights[y] * mask
        if not self.class_means:
            return gaps.sum() / batch.count
        classes = torch.arange(len(self.centroids), device=y.device)
        rows = ((y[:, None] == classes) * mask[:, None]).sum(0).clamp(min=1)
        return (gaps / rows[y]).sum()

    def fused(self, form: FusedForm) -> FusedForm | None:
        if form.centroids is not None:
            return None
        return form._replace(
            centroids=self.centroids, centroid_weights=self.weights, class_means=self.class_means
        )


@dataclass(frozen=True)
class Objective:
    """A model's local objective: the sum of its terms, as a loss function.

    ``objective(p, x, y, mask) = sum_t term_t(forward({**fixed, **p}, x), ...)``, called like any
    loss function (``train_steps`` differentiates it with ``torch.func``); its terms' fused forms
    let :mod:`pflego.fused` run SGD on it without autograd.

    Attributes:
        model: The split model, or ``None`` for a bare linear head on precomputed features
            (``p`` and ``fixed`` then hold ``head.weight`` and ``head.bias``).
        label_mask: ``[K]``, the logits the client's head really has.
        fixed: Parameters held fixed (the rest of the model).
        terms: The terms, added in this order (without :class:`CrossEntropy`, the head is neither
            read nor trained).
    """

    model: SplitModel | None
    label_mask: Tensor
    fixed: Params = field(default_factory=dict)
    terms: tuple[Term, ...] = (CrossEntropy(),)

    @property
    def per_sample(self) -> bool:
        """Whether a term reads the samples' own data (see :meth:`on_samples`)."""
        return any(term.per_sample for term in self.terms)

    @property
    def cross_entropy(self) -> bool:
        """Whether the objective has the head's cross-entropy."""
        return any(isinstance(term, CrossEntropy) for term in self.terms)

    def on_samples(self, idx: Tensor) -> Objective:
        """The objective on the minibatch of samples ``idx`` (its terms' parts of them)."""
        if not self.per_sample:
            return self
        return dataclasses.replace(self, terms=tuple(t.on_samples(idx) for t in self.terms))

    def fused_form(self) -> FusedForm | None:
        """The terms' fused forms merged, or ``None`` when one has none."""
        form: FusedForm | None = FusedForm()
        for term in self.terms:
            form = term.fused(form)
            if form is None:
                return None
        return form

    def __call__(self, params: Params, x: Tensor, y: Tensor, mask: Tensor) -> Tensor:
        full = {**self.fixed, **params}
        features = x if self.model is None else self.model.features(full, x)
        batch = Batch(params, full, features, y, mask, mask.sum().clamp(min=1), self.label_mask)
        value = features.new_zeros(())
        for term in self.terms:
            value = value + term.value(batch)
        return value
