"""kvpage's compiled CPU kernels: the C++ sources (csrc/), their build (build.py) and typed wrappers
(kernels.py). The model, the attention backend and the sampler reach the kernels only through here."""

from kvpage.ops.build import kernels_error, load_kernels
from kvpage.ops.kernels import ACT_GELU_TANH, ACT_NONE, ACT_SILU, I8_ALL_ROWS, PARTITION_SIZE, Kernels, kernels
from kvpage.ops.kv_layout import pack_kv_rows, unpack_kv_rows

__all__ = ["ACT_GELU_TANH", "ACT_NONE", "ACT_SILU", "I8_ALL_ROWS", "PARTITION_SIZE", "Kernels", "kernels",
           "kernels_error", "load_kernels", "pack_kv_rows", "unpack_kv_rows"]
