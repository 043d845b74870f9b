"""Turning model outputs into scores: model-side scores, answer metrics, text metrics."""
