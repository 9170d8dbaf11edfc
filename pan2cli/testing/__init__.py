"""Test support: random weights and small checkpoints for tests and benchmarks; `pan2` never imports it."""
