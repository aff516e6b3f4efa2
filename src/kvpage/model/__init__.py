"""Llama-family model: configs, weight loading, tokenizer (the runtime parts import torch)."""
