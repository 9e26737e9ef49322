"""Workloads, training driver with failure injection, and measurement."""
