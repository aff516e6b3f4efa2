"""A minimal greedy loop over the real KVCacheManager + ModelRunner, for tests.

The production scheduler comes with the engine; this driver exists so the model-on-paged-cache tests can
exercise chunked prefill, prefix-cache hits, forks (copy-on-write) and swaps directly.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvpage.kv import KVPoolConfig, KVSequence, PrefixHit
from kvpage.model.loader import LoadedModel
from kvpage.worker.kv_cache import KVCache, model_layout
from kvpage.worker.model_runner import BlockOps, ModelRunner, ScheduledSeq


class PagedGreedy:
    def __init__(self, lm: LoadedModel, *, block_size: int = 16, num_blocks: int = 1024, chunk: int | None = None,
                 prefix_caching: bool = True, swap_blocks: int = 0, kv_dtype: torch.dtype | None = None,
                 argmax_only: bool = False) -> None:
        self.lm = lm
        self.argmax_only = argmax_only  # steps ask the runner for the argmax alone, as the engine's greedy steps do
        layout = model_layout(lm.config)  # the model's KV groups (sliding windows keep only their window)
        self.m = KVPoolConfig(num_blocks, block_size, watermark=0.0, enable_prefix_caching=prefix_caching,
                              num_swap_blocks=swap_blocks).build(None, layout)
        self.runner = ModelRunner(lm.model, KVCache(lm.config, num_blocks, block_size, kv_dtype or lm.dtype,
                                                    num_host_blocks=swap_blocks, layout=layout))
        self.chunk = chunk
        self.seqs: dict[str, KVSequence] = {}
        self.computed: dict[str, int] = {}
        self.outputs: dict[str, list[int]] = {}
        self.max_new: dict[str, int] = {}
        self.hits: dict[str, PrefixHit] = {}
        self.active: list[str] = []
        self.pending = BlockOps()
        self.cached_tokens: dict[str, int] = {}
        self.stop_ids = set(lm.tokenizer.eos_token_ids)

    def add(self, prompt: Sequence[int], max_new: int, seq_id: str | None = None) -> str:
        sid = seq_id or f"s{len(self.seqs)}"
        seq = KVSequence(sid, list(prompt))
        self.seqs[sid], self.outputs[sid], self.max_new[sid] = seq, [], max_new
        self.hits[sid] = self.m.lookup_prefix(seq)
        self.computed[sid] = self.cached_tokens[sid] = self.hits[sid].num_tokens
        self.active.append(sid)
        return sid

    def fork(self, parent: str, child: str) -> None:
        p = self.seqs[parent]
        alloc = self.m.fork(p, child)
        assert alloc is not None
        self.pending.copies.extend(alloc.copies)
        self.seqs[child] = KVSequence(child, list(p.token_ids))
        self.computed[child], self.outputs[child] = self.computed[parent], list(self.outputs[parent])
        self.max_new[child] = self.max_new[parent]
        self.active.append(child)

    def swap_out(self, sid: str) -> None:
        mapping = self.m.swap_out(sid)
        assert mapping is not None
        self.pending.swap_out.extend(mapping)
        self.active.remove(sid)

    def swap_in(self, sid: str) -> None:
        mapping = self.m.swap_in(self.seqs[sid])
        assert mapping is not None
        self.pending.swap_in.extend(mapping)
        self.active.append(sid)

    def step(self) -> None:
        batch, ops, counts = [], self.pending, {}
        self.pending = BlockOps()
        for sid in self.active:
            s = self.seqs[sid]
            left = len(s.token_ids) - self.computed[sid]
            n = min(left, self.chunk) if self.chunk else left
            alloc = self.m.allocate_slots(s, n, self.hits.pop(sid, None))
            assert alloc is not None, "test pool too small"
            ops.copies.extend(alloc.copies)
            counts[sid] = n
            c = self.computed[sid]
            tables = self.m.block_tables(sid)
            batch.append(ScheduledSeq(sid, s.token_ids[c : c + n], c, tables[0], need_logits=c + n == len(s.token_ids),
                                      block_tables=tables))
        logits = self.runner.execute(batch, ops, self.argmax_only)
        for sid in list(self.active):
            self.computed[sid] += counts[sid]
            self.m.cache_computed_blocks(self.seqs[sid], self.computed[sid])
            if sid in logits:
                tok = int(logits.argmax_rows[logits.row(sid)]) if self.argmax_only else int(torch.argmax(logits[sid]))
                self.seqs[sid].token_ids.append(tok)
                self.outputs[sid].append(tok)
                if len(self.outputs[sid]) >= self.max_new[sid] or tok in self.stop_ids:
                    self.m.free(sid)
                    self.active.remove(sid)

    def run(self) -> dict[str, list[int]]:
        while self.active:
            self.step()
        self.m.check_invariants()
        assert self.m.num_free_blocks == self.m.num_blocks, "blocks leaked"
        return self.outputs


def generate(lm: LoadedModel, prompts: Sequence[Sequence[int]], max_new: int, **kw) -> list[list[int]]:
    d = PagedGreedy(lm, **kw)
    ids = [d.add(p, max_new) for p in prompts]
    out = d.run()
    return [out[i] for i in ids]
