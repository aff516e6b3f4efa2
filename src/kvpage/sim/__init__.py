"""Simulation of scheduler + KV manager without a model: traces, workloads, pictures."""
