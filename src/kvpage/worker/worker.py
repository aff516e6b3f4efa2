"""The worker: loads the model, sizes and owns the KV tensors, runs steps (the engine loop's ``StepWorker``)."""

from __future__ import annotations

import logging
from collections.abc import Sequence as Seq
from pathlib import Path

import torch

from kvpage.attention.kv_quant import is_quantized
from kvpage.config import CacheConfig, ModelRunConfig, fast_path, resolve_dtype
from kvpage.core.beam import Candidates
from kvpage.core.engine_core import Sample, SampleTask, blocked_ids
from kvpage.core.prompt_scores import PromptScore, score_span
from kvpage.core.scheduler import ScheduledWork, SchedulerOutput
from kvpage.core.sequence import Sequence
from kvpage.distributed.config import ParallelConfig
from kvpage.distributed.group import CommStats, VocabParallelHead, make_row_parallel
from kvpage.distributed.kv_shards import BlockShards
from kvpage.distributed.ranks import RankFailure, RankGroup, StepPlan
from kvpage.distributed.shard import check_tensor_parallel
from kvpage.envs import kernel_config, read
from kvpage.kv import KVCacheManager, KVPoolConfig
from kvpage.kv.disk_tier import DiskTier
from kvpage.kv.host_tier import HostTier
from kvpage.kv.offload import PrefixTiers
from kvpage.model.loader import load_model
from kvpage.model.logits import LogitsBuffer
from kvpage.model.registry import load_model_config
from kvpage.ops.build import build_tag
from kvpage.units import format_bytes
from kvpage.worker.heap import trim_heap
from kvpage.worker.kv_cache import KVCache, kv_bytes_per_block, kv_dtype_name, kv_torch_dtype, model_layout
from kvpage.worker.kv_calibration import calibrate_kv_transforms
from kvpage.worker.model_runner import BlockOps, ModelRunner, ScheduledSeq, StepLogits
from kvpage.worker.pass_draws import DrawSetting, drawn_samples, logits_pass_draws
from kvpage.worker.sampler import (
    SampleRequest,
    argmax_suffices,
    beam_candidates,
    sample_isolated,
    seeded_generator,
)
from kvpage.worker.transform_cache import default_dir

logger = logging.getLogger(__name__)


def _scores(w: ScheduledWork) -> tuple[int, list[int], int] | None:
    """What the runner scores in this work's chunk (prompt logprobs): core/prompt_scores.py names the positions."""
    span = score_span(w)
    if span is None:
        return None
    first, last = span
    ids = w.seq.token_ids
    return first - w.start_pos, ids[first + 1 : last + 1], int(w.seq.request.params.prompt_logprobs)


class Worker:
    """One rank's worker. With ``parallel`` (tensor parallelism, on rank 0's process) it starts the other
    ranks and sends them each step's plan; ``tp`` = (rank, size) says which shard this worker holds."""

    def __init__(self, model_config: ModelRunConfig | None = None, cache_config: CacheConfig | None = None,
                 parallel: ParallelConfig | None = None, tp: tuple[int, int] | None = None) -> None:
        self.model_config = mc = model_config or ModelRunConfig()
        self.cache_config = cc = cache_config or CacheConfig()
        self.ranks: RankGroup | None = None
        if parallel is not None and parallel.tensor_parallel_size > 1:
            shape = load_model_config(mc.model)  # a size the model cannot take is refused before any rank starts
            check_tensor_parallel(shape.num_attention_heads, shape.num_kv_heads, shape.intermediate_size,
                                  parallel.tensor_parallel_size, shape.name)
            self.ranks = RankGroup(parallel, (mc, cc))
            tp = (0, parallel.tensor_parallel_size)
            try:
                self._build(mc, cc, tp)
            except BaseException as e:
                try:  # tell the other ranks (they stop), then the caller, with rank 0's own error
                    self.ranks.ready({"error": f"{type(e).__name__}: {e}"})
                except Exception:
                    pass
                finally:
                    self.ranks.fail()
                raise e
            self.ranks.ready({"blocks": self.num_blocks})
        else:
            self._build(mc, cc, tp)
        logger.info("%s", self.describe())

    def _build(self, mc: ModelRunConfig, cc: CacheConfig, tp: tuple[int, int] | None) -> None:
        # The kernel configuration, resolved once here and handed down to the model, backend and kernels.
        self.kernel_config = mc.kernels or kernel_config()
        self.tp = tp if tp is not None and tp[1] > 1 else None
        self.lm = load_model(mc.model, resolve_dtype(mc.dtype), mc.attention_backend, fast=fast_path(mc.dtype),
                             kernel_config=self.kernel_config, tp=self.tp)
        self.comm = CommStats()  # the all-reduces' and the logits gather's count, bytes and time (tensor parallelism)
        self.vocab_head: VocabParallelHead | None = None
        if self.tp is not None:
            make_row_parallel(self.lm.model, self.comm)
            if self.kernel_config.tp_vocab_head:
                model = self.lm.model
                weight = model.embed_tokens.weight if getattr(model, "lm_head", None) is None else model.lm_head.weight
                # its slice multiplied as the loader chose for the whole head (row buckets where oneDNN runs it)
                self.vocab_head = VocabParallelHead(weight, self.tp[0], self.tp[1], self.comm, model.lm_product)
                model.lm_product = self.vocab_head
        cfg = self.lm.config
        limit = cfg.max_position_embeddings or mc.max_model_len
        if not limit:
            raise ValueError(f"{cfg.name} does not state its context length: pass max_model_len")
        self.max_model_len = mc.max_model_len or limit
        if self.max_model_len > limit:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds {cfg.name}'s context length {limit}")
        self.kv_dtype = self.lm.dtype if cc.kv_cache_dtype == "auto" else kv_torch_dtype(cc.kv_cache_dtype)
        # int8 pages with keys per channel (KVPAGE_INT8_KEYS=channel, attention/kv_channel.py)
        self.channel_keys = self.kv_dtype == torch.int8 and self.kernel_config.int8_keys == "channel"
        # quantized pages: each layer's exact key/value transform, before any block is written
        self.kv_transform = None
        if is_quantized(self.kv_dtype):
            identity = {"kernels": build_tag(), "kernel_config": repr(self.kernel_config), "tp": self.tp,
                        "backend": mc.attention_backend, "fast": self.lm.model.fast is not None}
            self.kv_transform = calibrate_kv_transforms(self.lm, self.kv_dtype, self.channel_keys,
                                                        default_dir(str(read("KVPAGE_CACHE_DIR"))), identity,
                                                        feedback=self.kernel_config.key_feedback)
        self.layout = model_layout(cfg, self.channel_keys)
        self.bytes_per_block = kv_bytes_per_block(cfg, cc.block_size, self.kv_dtype, self.layout, self.channel_keys)
        self.num_blocks = int(cc.kv_cache_memory) // self.bytes_per_block
        # a sequence of max_model_len tokens, in every group (a sliding-window group holds its window's blocks)
        per_seq = sum(g.spec.max_blocks(cc.block_size, self.max_model_len) for g in self.layout.groups)
        if self.num_blocks < per_seq:
            raise ValueError(
                f"a KV cache of {format_bytes(int(cc.kv_cache_memory))} holds {self.num_blocks} blocks "
                f"({self.num_blocks * cc.block_size} tokens), less than one sequence of max_model_len="
                f"{self.max_model_len}: raise kv_cache_memory or lower max_model_len"
            )
        # one host tier: swapped blocks and offloaded prefix blocks share its slots
        self.num_offload_blocks = int(cc.kv_offload_memory) // self.bytes_per_block
        self.num_swap_blocks = int(cc.swap_space) // self.bytes_per_block + self.num_offload_blocks
        if cc.offload:
            self._check_offload(cc)
        self.kv_cache = KVCache(cfg, self.num_blocks, cc.block_size, self.kv_dtype, self.num_swap_blocks, self.layout,
                                huge_pages=cc.huge_pages, channel_keys=self.channel_keys)
        if cc.kv_prefault:
            self.kv_cache.prefault()
        self.runner = ModelRunner(self.lm.model, self.kv_cache)
        if self.tp is not None:
            self.runner.shards = BlockShards(*self.tp, self.kv_cache.block_nbytes)
        self.eos_ids = tuple(self.lm.tokenizer.eos_token_ids)
        self.kv: KVCacheManager | None = None  # set by make_kv_manager
        self._blocked: dict[str, tuple[int, ...]] = {}  # the current step's blocked ids per sampling sequence
        self._requests: dict[str, SampleRequest] = {}  # the current step's requests whose uniforms are drawn
        # the steps' float32 logits, in one buffer kept from step to step (sampled before the next step runs)
        self._logits_buffer = LogitsBuffer()

    def describe(self) -> str:
        cc = self.cache_config
        per_seq = sum(g.spec.max_blocks(cc.block_size, self.max_model_len) for g in self.layout.groups)
        groups = f"; KV groups: {self.layout.describe()}" if self.layout.hybrid or self.layout.groups[0].spec.window \
            else ""
        advised = self.kv_cache.huge_page_bytes
        huge = f"; 2 MiB pages advised for {format_bytes(advised)}" if advised else ""
        cfg = self.lm.config
        tp = (f"; tensor-parallel rank {self.tp[0]} of {self.tp[1]}: {cfg.num_attention_heads} query / "
              f"{cfg.num_kv_heads} KV heads and the KV budget per rank") if self.tp else ""
        return (
            f"KV cache: {self.num_blocks} blocks x {cc.block_size} tokens = {self.num_blocks * cc.block_size} tokens "
            f"in "
            f"{format_bytes(self.num_blocks * self.bytes_per_block)} ({kv_dtype_name(self.kv_dtype)}"
            f"{', keys per channel' if self.channel_keys else ''}, "
            f"{format_bytes(self.bytes_per_block)}/block){groups}; max concurrency at max_model_len "
            f"{self.max_model_len}: {self.num_blocks / per_seq:.2f}x; swap space: {self.num_swap_blocks} blocks"
            f"{huge}{tp}"
        )

    def _check_offload(self, cc: CacheConfig) -> None:
        """Both tiers work on any number of ranks: the host tier's stores and loads are block copies every rank
        applies to its own shard, as swaps are; a disk-tier file holds every rank's shard (kv_shards.py)."""
        if cc.kv_offload_memory and not self.num_offload_blocks:
            raise ValueError(f"kv_offload_memory={format_bytes(int(cc.kv_offload_memory))} holds no block "
                             f"({format_bytes(self.bytes_per_block)} each)")

    def make_kv_manager(self, policy: str = "paged") -> KVCacheManager:
        """``paged`` (the engine) or ``static`` (contiguous max-length reservations: the baseline); the worker
        reads its block tables from it."""
        cc = self.cache_config
        tiers = None
        if cc.offload:
            if policy != "paged":
                raise ValueError("KV offload tiers keep prefix-cache blocks: they need the paged KV policy")
            tiers = self._make_tiers(cc)
        self.kv = KVPoolConfig(self.num_blocks, cc.block_size, policy, num_swap_blocks=self.num_swap_blocks,
                               enable_prefix_caching=cc.enable_prefix_caching, watermark=cc.watermark,
                               model_id=str(self.lm.path)).build(self.max_model_len, self.layout, tiers)
        return self.kv

    def _make_tiers(self, cc: CacheConfig) -> PrefixTiers:
        host = HostTier(self.num_swap_blocks, offload=self.num_offload_blocks > 0)
        disk = None
        if cc.kv_offload_dir is not None:
            cfg, t = self.lm.config, self.kv_cache.tensors[0]
            identity = {"model": str(self.lm.path), "kv_dtype": kv_dtype_name(self.kv_dtype),
                        "block_size": cc.block_size, "tensors": len(self.kv_cache.tensors),
                        "kv_heads": cfg.num_kv_heads, "row": int(t.shape[-1]),
                        "packed": any(getattr(b, "packed", False) for b in self.runner.builders),
                        "kv_transform": self.kv_transform}
            if self.tp is not None:  # a file holds every rank's shard, in rank order
                identity["tensor_parallel_size"] = self.tp[1]
            disk = DiskTier(Path(cc.kv_offload_dir).expanduser(), identity, int(cc.kv_offload_disk))
            self.runner.persist = disk.put
        return PrefixTiers(host, disk, cc.block_size, self.runner.shards.block_bytes)

    # ------------------------------------------------------------ StepWorker
    def execute_model(self, out: SchedulerOutput) -> StepLogits | None:
        """The step's block operations, then its forward pass: logits for every sequence that samples. When
        every one of them is plain greedy without logprobs, only each row's argmax is computed."""
        ops = BlockOps(out.swap_out, out.swap_in, out.copies, out.persists, out.disk_loads)
        if not out.work:
            self._apply_ops(ops)
            return None
        if self.layout.hybrid:
            tables = self.kv.block_tables
            batch = []
            for w in out.work:
                per_group = tables(w.seq.seq_id)
                batch.append(ScheduledSeq(w.seq.seq_id, w.token_ids, w.start_pos, per_group[0],
                                          need_logits=w.completes_prompt, block_tables=per_group,
                                          scores=_scores(w)))
        else:
            table = self.kv.block_table
            batch = [ScheduledSeq(w.seq.seq_id, w.token_ids, w.start_pos, table(w.seq.seq_id),
                                  need_logits=w.completes_prompt, scores=_scores(w)) for w in out.work]
        # what each sampling sequence may not draw yet, for this step's argmax decision and its draw
        self._blocked = {w.seq.seq_id: blocked_ids(w.seq, self.eos_ids) for w in out.work if w.completes_prompt}
        argmax_only = all(w.seq.request.beam is None and argmax_suffices(w.seq.request.params,
                                                                         self._blocked[w.seq.seq_id])
                          for w in out.work if w.completes_prompt)
        self._requests = {}
        draws = None if argmax_only else self._plan_draws(out)
        if self.ranks is None:
            return self.runner.execute(batch, ops, argmax_only, self._logits_buffer, draws)
        self.ranks.send(StepPlan("step", batch, ops))
        try:
            return self.runner.execute(batch, ops, argmax_only, self._logits_buffer, draws)
        except Exception as e:
            if self.ranks.alive and not isinstance(e, RankFailure):
                raise self.ranks.guard(e) from e
            raise

    def trim_heap(self) -> None:
        """The engine has run out of work: every rank hands its freed heap back to the OS (worker/heap.py)."""
        if self.ranks is not None and self.ranks.alive:
            self.ranks.send(StepPlan("trim"))
        trim_heap()

    def lost_rank(self) -> str | None:
        """Why the tensor-parallel group is gone while no step ran (a rank exited); the group is then shut down."""
        why = None if self.ranks is None else self.ranks.lost()
        if why is not None:
            self.ranks.fail()
        return why

    def prompt_scores(self, step: StepLogits | None) -> dict[str, list[PromptScore]]:
        return {} if step is None else step.prompt_scores

    def _plan_draws(self, out: SchedulerOutput) -> dict[str, DrawSetting] | None:
        """The step's draws for the logits pass to make itself, when no request needs its logits (greedy or
        plain sampling, one sample from each row, no logprobs): 128 sampled rows of SmolLM2 then skip writing
        and reading back 25 MB of float32 logits; rows that only mask tokens draw there too (pass_draws)."""
        seqs = [w.seq for w in out.work if w.completes_prompt]
        if any(s.request.beam is not None or (s.request.params.n > 1 and not s.request.forked) for s in seqs):
            return None
        reqs = [self._sample_request(s, [s]) for s in seqs]
        settings = logits_pass_draws(reqs, self.runner.vocab_size)
        if settings is None:
            return None
        self._requests = {s.seq_id: r for s, r in zip(seqs, reqs, strict=True)}
        return {s.seq_id: d for s, d in zip(seqs, settings, strict=True)}

    def _sample_request(self, seq: Sequence, targets: Seq[Sequence]) -> SampleRequest:
        """What ``seq``'s row draws for ``targets`` (itself, and at the end of an n > 1 prompt its forks)."""
        params = seq.request.params
        if params.seed is None:
            gens = [None] * len(targets)
        else:
            for s in targets:
                if s.rng is None:
                    s.rng = seeded_generator(params.seed, s.index)
            gens = [s.rng for s in targets]
        return SampleRequest(params, seq.request.prompt_token_ids, seq.output_token_ids, gens, self._blocked_for(seq),
                             seq.guide)

    def follow(self, plan: StepPlan) -> None:
        """A tensor-parallel follower runs rank 0's plan on its own shard and KV tensors."""
        if plan.kind == "step":
            parts = self.runner.forward_only(plan.batch, plan.ops)
            if self.vocab_head is not None:  # this rank's slice of the logits, to rank 0, for each head call
                for rows in parts:
                    self.vocab_head(rows.to(self.lm.dtype))
        elif plan.kind == "ops":
            self.runner.apply_block_ops(plan.ops)
        elif plan.kind == "trim":
            trim_heap()
        else:
            raise ValueError(f"unknown step plan {plan.kind!r}")

    def _apply_ops(self, ops: BlockOps) -> None:
        """Block operations alone (no forward pass), on every rank."""
        if self.ranks is None:
            self.runner.apply_block_ops(ops)
            return
        self.ranks.send(StepPlan("ops", ops=ops))
        try:
            self.runner.apply_block_ops(ops)
        except Exception as e:
            if self.ranks.alive and not isinstance(e, RankFailure):
                raise self.ranks.guard(e) from e
            raise

    def shutdown(self) -> None:
        """Write the pool's cached blocks that the disk tier lacks (every rank's shard of them), stop the other
        tensor-parallel ranks and finish the disk tier's writes; idempotent."""
        tiers = getattr(self.kv, "tiers", None)
        if tiers is not None:
            todo = tiers.unpersisted(list(self.kv.pool.cached.values()))
            # in slices of ~64 MiB: a whole pool read (and gathered from every rank) at once would hold several
            # copies of it
            per = max(1, (64 << 20) // max(1, tiers.payload_bytes))
            try:
                for i in range(0, len(todo), per):
                    self._apply_ops(BlockOps(persists=todo[i : i + per]))
            except RankFailure as e:  # the group is down: the other shards of those blocks are gone
                logger.warning("the disk tier's last writes were skipped: %s", e)
        if self.ranks is not None:
            self.ranks.shutdown()
        if tiers is not None:
            tiers.close()

    def sample(self, logits: StepLogits, tasks: Seq[SampleTask]) -> list[list[Sample] | BaseException]:
        """One batched draw for the whole step; a request whose settings fail gets its exception alone."""
        reqs, rows = [], []
        for t in tasks:
            seq = t.seq
            rows.append(logits.row(seq.seq_id))
            # a request whose uniforms execute_model drew keeps them (the same tokens, drawn in the pass or not)
            pre = self._requests.get(seq.seq_id) if len(t.targets) == 1 else None
            reqs.append(pre if pre is not None else self._sample_request(seq, t.targets))
        if logits.tokens is not None and any(self._requests.get(t.seq.seq_id) is not r
                                             for t, r in zip(tasks, reqs, strict=True)):
            raise RuntimeError("the logits pass drew tokens for a step whose tasks it did not plan")
        return self.sample_requests(logits, reqs, rows)

    def sample_requests(self, logits: StepLogits, reqs: list[SampleRequest], rows: list[int],
                        ) -> list[list[Sample] | BaseException]:
        if logits.tokens is not None:  # drawn in the logits pass (execute_model's plan)
            return drawn_samples(logits.tokens, reqs, rows)
        return sample_isolated(logits.logits, reqs, logits.argmax_rows, logits.lse_rows, rows)

    def beam_candidates(self, logits: StepLogits, tasks: Seq[SampleTask]) -> list[Candidates | BaseException]:
        """Each beam's best continuations from its row: float32 log-softmax (at the request's temperature),
        the ids it may not draw yet left out."""
        rows, temps, banned, keep = [], [], [], []
        for t in tasks:
            seq = t.seq
            rows.append(logits.row(seq.seq_id))
            temps.append(seq.request.params.temperature)
            banned.append(self._blocked_for(seq))
            keep.append(seq.request.beam.keep)
        return beam_candidates(logits.logits, rows, temps, banned, keep)

    def _blocked_for(self, seq: Sequence) -> tuple[int, ...]:
        """What ``seq`` may not draw this step (decided in execute_model; recomputed for a task it did not see)."""
        bl = self._blocked.get(seq.seq_id)
        return blocked_ids(seq, self.eos_ids) if bl is None else bl
