"""Scheduling: which sequences run each step (iteration-level batching, preemption), the waiting queue and admission limits."""
