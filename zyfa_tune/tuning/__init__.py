"""Tuning: the Optuna tuner, isolated worker processes and their runners, verification against
float64 attention, timing and the input families."""
