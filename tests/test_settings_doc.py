"""The settings reference, docs/settings.md, is printed from the settings' declarations and kept
in step with them (``python -m pflego.tools.settings_doc > docs/settings.md``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from pflego.algorithms import ALGORITHMS
from pflego.config import Config
from pflego.fields import meaning_of
from pflego.tools.settings_doc import COMMAND, options_of, render

PAGE = Path(__file__).resolve().parents[1] / "docs" / "settings.md"


def test_every_setting_and_option_says_what_it_means():
    fields = [*dataclasses.fields(Config)] + [
        field for cls in ALGORITHMS.values() for field in options_of(cls)
    ]
    assert [field.name for field in fields if not meaning_of(field)] == []


def test_the_settings_reference_is_in_step_with_the_declarations():
    assert PAGE.read_text() == render(), f"docs/settings.md is stale: run `{COMMAND}`"


def test_the_reference_explains_the_settings_documented_nowhere_else():
    rows = {line.split("|")[1].strip(): line for line in render().splitlines() if "| `" in line}
    for name in ("head_init", "min_client_size", "pool_test", "dtype", "eval_train_samples"):
        meaning = rows[f"`{name}`"].rstrip(" |").rsplit("|", 1)[1].strip()
        assert len(meaning) > 15, name
    assert "| `eta` | float | `1.0` | > 0 |" in render()  # an algorithm option and its rule
