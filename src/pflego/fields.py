"""Settings declared on their dataclass fields: each one's meaning and rule, and the one check.

A setting is a dataclass field made by :func:`setting`: its default, a line saying what it means
and, optionally, a :class:`Rule` its value must keep (a range, a set of choices). The run's config
(:class:`pflego.config.Config`) and every algorithm's options are declared this way; presets,
config files, ``--set``, the command line and ``options`` all reach :func:`check_value`, which
fails with one line naming the setting, its value and the rule. ``docs/settings.md`` is printed
from the same declarations (``python -m pflego.tools.settings_doc``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pflego.errors import ConfigError


@dataclass(frozen=True)
class Rule:
    """A condition on a setting's value (``None``, an unset value, always passes).

    Attributes:
        holds: Whether a value keeps the rule.
        says: The end of the error message after ``name=value`` (``must be positive``).
        doc: The rule as the settings reference states it (``> 0``).
        quoted: Show the value with ``repr`` in the message (names of choices).
    """

    holds: Callable[[Any], bool]
    says: str
    doc: str
    quoted: bool = False

    def noting(self, note: str) -> Rule:
        """The same rule, its message ending with ``note`` (``" (or unset)"``)."""
        return dataclasses.replace(self, says=self.says + note)


def at_least(low: float) -> Rule:
    """``value >= low``; says ``must be 0 or more`` for 0, else ``must be at least low``."""
    says = "must be 0 or more" if low == 0 else f"must be at least {low}"
    return Rule(lambda v: v >= low, says, f">= {low}")


def between(low: float, high: float, brackets: str = "[]") -> Rule:
    """``value`` in the interval from ``low`` to ``high``, closed or open at each end as
    ``brackets`` says (``[]``, ``(]``, ``[)`` or ``()``)."""
    lower = (lambda v: v > low) if brackets[0] == "(" else (lambda v: v >= low)
    upper = (lambda v: v < high) if brackets[1] == ")" else (lambda v: v <= high)
    interval = f"{brackets[0]}{low}, {high}{brackets[1]}"
    return Rule(lambda v: lower(v) and upper(v), f"must lie in {interval}", f"in {interval}")


def one_of(*choices: Any, says: str = "is not one of") -> Rule:
    """``value`` is one of ``choices``; the message lists them."""
    listed = ", ".join(map(str, choices))
    return Rule(lambda v: v in choices, f"{says} {listed}", f"one of {listed}", quoted=True)


#: ``value > 0``.
positive = Rule(lambda v: v > 0, "must be positive", "> 0")
#: ``value > 0`` for a setting that may also be unset (``None``).
positive_or_unset = positive.noting(" (or unset)")
#: ``value >= 0``.
non_negative = at_least(0)
#: A finite ``value > 0`` (``inf`` is refused).
positive_number = Rule(lambda v: 0 < v < math.inf, "must be a positive number", "> 0")


def setting(
    default: Any = dataclasses.MISSING,
    meaning: str = "",
    rule: Rule | None = None,
    *,
    factory: Callable[[], Any] | None = None,
) -> Any:
    """A dataclass field with its meaning and rule (``factory`` builds a mutable default)."""
    metadata = {"meaning": meaning, "rule": rule}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def rule_of(field: dataclasses.Field) -> Rule | None:
    """The rule declared on ``field``, if any."""
    return field.metadata.get("rule")


def meaning_of(field: dataclasses.Field) -> str:
    """The meaning declared on ``field`` (empty if none)."""
    return field.metadata.get("meaning", "")


def check_value(
    name: str, value: Any, rule: Rule | None, prefix: str = "", optional: bool = True
) -> None:
    """Fail with ``<prefix><name>=<value> <rule.says>`` unless ``value`` keeps ``rule`` (or is
    ``None`` for an ``optional`` setting); a value of another type, which cannot, does not."""
    if rule is None or (value is None and optional):
        return
    with contextlib.suppress(TypeError):
        if rule.holds(value):
            return
    shown = repr(value) if rule.quoted else value
    raise ConfigError(f"{prefix}{name}={shown} {rule.says}")


def check_fields(instance: Any, prefix: str = "") -> None:
    """Check every field of a dataclass ``instance`` against its declared rule (``None`` passes
    where the field may be unset: its default or its annotation says so)."""
    for field in dataclasses.fields(instance):
        optional = field.default is None or "None" in str(field.type)
        check_value(field.name, getattr(instance, field.name), rule_of(field), prefix, optional)
