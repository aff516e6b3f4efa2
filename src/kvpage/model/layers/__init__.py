"""The fast path's layers (packed linear layers); model/llama.py keeps the readable reference layers."""
