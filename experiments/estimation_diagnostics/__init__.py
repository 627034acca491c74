"""Diagnostics of the noise-parameter estimation: per-level β offset, score-network accuracy, posterior tails."""
