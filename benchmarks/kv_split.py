"""Where int8 pages' disagreement with the float32 cache comes from (``python benchmarks/kv_quant.py --split``,
whose module doc lists the cases): a float32 cache written with keys and/or values that went through int8 rows
and back, on all layers or some, with finer scales, with keys per channel (once per block or as they arrive)."""

from __future__ import annotations

import torch

from kvpage.attention.kv_channel import dequantize_block_keys, quantize_block_keys
from kvpage.model.loader import load_model
from kvpage.worker.scoring import chunked_logits

# split()'s cases of keys per channel over 32-key blocks: re-rounded as a filling block's keys arrive (one-byte or
# exact parameters), or rounded once over the complete block (exact or one-byte parameters)
ARRIVING, ARRIVING_FLOAT, ONCE, ONCE_COMPACT = -2, -3, -4, -5
PER_BLOCK = (ARRIVING, ARRIVING_FLOAT, ONCE, ONCE_COMPACT)


def _block_of(group: int) -> int:
    """The block size a split() case runs at (the per-channel key cases round over one block)."""
    return 32 if group in PER_BLOCK else 16


def _channel_round(y: torch.Tensor, compact: bool = True) -> torch.Tensor:
    """Rows ``[n, heads, D]`` rounded per channel over the rows, as a page would hold them: ``compact``, the
    format of attention/kv_channel.py (scale and zero point in one byte each per channel), else with a zero
    point (the channel's minimum) and a step (its range / 255) both exact."""
    if compact:
        return dequantize_block_keys(quantize_block_keys(y))
    lo, hi = y.amin(0), y.amax(0)
    step = ((hi - lo) / 255).clamp_min(1e-30)
    return torch.round((y - lo) / step) * step + lo


def arriving_keys(y: torch.Tensor, compact: bool = True) -> torch.Tensor:
    """One block's keys ``[n, heads, D]`` written one at a time: each arrival re-rounds the block's stored
    values (not the exact keys, which a page no longer has) with the parameters of the widened range."""
    held = _channel_round(y[:1], compact)
    for t in range(1, y.shape[0]):
        held = _channel_round(torch.cat([held, y[t : t + 1]]), compact)
    return held


def split(model: str, positions: int, text: str, only: str = "") -> list[dict]:
    """Top-1 agreement with the float32 cache over ``text`` when only some rows carry int8's rounding (see
    kv_quant.py's module doc); ``only``: just the cases whose name contains it."""
    from kvpage.attention.kv_quant import dequantize_rows, hadamard, quantize_rows
    from kvpage.ops import load_kernels

    lm = load_model(model, dtype="float32")
    ids = lm.tokenizer.encode(text)[: positions + 1]
    n_layers = lm.config.num_layers
    full = {i for i in range(n_layers) if not lm.config.layer_window(i)}
    sliding = set(range(n_layers)) - full

    def round_trip(x: torch.Tensor, rotate: bool, group: int) -> torch.Tensor:
        if group < 0:  # keys per channel over each block of x's tokens (the text's last one short)
            blocks = x.float().split(_block_of(group))
            if group in (ARRIVING, ARRIVING_FLOAT):
                return torch.cat([arriving_keys(y, group == ARRIVING) for y in blocks]).to(x.dtype)
            return torch.cat([_channel_round(y, compact=group == ONCE_COMPACT) for y in blocks]).to(x.dtype)
        y = hadamard(x) if rotate else x.float()
        g = group or y.shape[-1]
        y = dequantize_rows(quantize_rows(y.reshape(*y.shape[:-1], -1, g), torch.int8)).reshape(y.shape)
        return (hadamard(y) if rotate else y).to(x.dtype)

    ops = load_kernels()
    write = ops.reshape_and_cache
    setting: dict = {}
    calls = [0]
    value_sums: dict[int, torch.Tensor] = {}  # per layer, from the last reference pass

    def patched(key, value, cache, slots, packed, *rest):  # chunked_logits writes the layers in order, every chunk
        layer = calls[0] % n_layers
        calls[0] += 1
        if setting["group"] is None:  # the float32 pass: the values' mean per layer and head
            value_sums[layer] = value_sums.get(layer, 0) + value.double().sum(0)
        elif setting["group"] in PER_BLOCK:
            c = (value_sums[layer] / len(ids)).float()
            value = (hadamard(round_trip(hadamard(value.float() - c), False, 0)) + c).to(value.dtype)
        elif layer in setting["v"]:
            value = round_trip(value, False, max(setting["group"], 0))  # values keep rows in the per-channel cases
        if setting["group"] is not None and layer in setting["k"]:
            key = round_trip(key, True, setting["group"])
        return write(key, value, cache, slots, packed, *rest)

    everything = set(range(n_layers))
    cases = [("keys", everything, set(), 0), ("values", set(), everything, 0), ("both", everything, everything, 0),
             ("keys, 64-value scales", everything, set(), 64), ("values, 64-value scales", set(), everything, 64),
             ("both, 64-value scales", everything, everything, 64)]
    if full and sliding:
        cases += [("keys on full-attention layers only", full, set(), 0),
                  ("keys on sliding-window layers only, values everywhere", sliding, everything, 0)]
    cases += [("keys per channel, 16-key blocks", everything, set(), -1),
              ("keys per channel, 16-key blocks; values", everything, everything, -1),
              ("keys per channel as they arrive, 32-key blocks; values", everything, everything, ARRIVING),
              ("keys as they arrive, exact parameters; values", everything, everything, ARRIVING_FLOAT),
              ("keys per channel once, 32-key blocks; values", everything, everything, ONCE),
              ("keys per channel once, one-byte parameters; values", everything, everything, ONCE_COMPACT)]
    refs: dict[int, torch.Tensor] = {}  # the float32 cache's top-1 per block size, run when a case first needs it
    rows = []
    ops.reshape_and_cache = patched
    try:
        for name, k, v, group in (c for c in cases if only in c[0]):
            block = _block_of(group)
            for g in ([None] if block not in refs else []) + [group]:  # None: the reference pass
                setting.update(k=k, v=v, group=g)
                calls[0] = 0
                if g is None:
                    value_sums.clear()
                top = chunked_logits(lm, ids, torch.float32, block_size=block)[:-1].argmax(-1)
                refs.setdefault(block, top)
            rows.append({"model": lm.config.name, "int8 rounding on": name, "positions": len(top),
                         "top1_agreement": float((top == refs[block]).float().mean())})
    finally:
        ops.reshape_and_cache = write
    return rows
