"""Sequences and the scheduler: pure bookkeeping (never imports torch)."""
