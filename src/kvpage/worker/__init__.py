"""Worker: KV tensors, block copies and swaps, the model runner, the sampler."""
