"""Experiment presets shipped with pflego."""
