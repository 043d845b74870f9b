"""Calibrations that fit a method to one model: layer factors, a static Ms-PoE head order, and the
positional hidden dimension. Each produces a method config to save next to the model."""
