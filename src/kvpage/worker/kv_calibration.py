"""The constants of a quantized cache's transforms (attention/kv_transform.py), and the choice of which parts a
model keeps, from the model itself over a fixed text.

The text is kvpage's own, mixed on purpose (prose, a dialogue, numbers, a table, code, a list) and never the
text the accuracy benchmark scores. One pass through a float cache of the model's dtype gives the queries,
keys and values the constants come from and the reference hidden states; five passes through the quantized
cache (no transform; then the keys' rounding feedback alone, with the key part, with the value part, with both)
give each choice's error against that reference, and the smallest wins: a choice that measured better per layer
can still lose end to end (SmolLM2 with fp8 pages). The feedback goes with every part because it lowered the
error wherever it was measured (SmolLM2 and Gemma 3, int8 and fp8) and the key part (a per-channel scale that
balances keys against queries) is a coarser answer to the same imbalance; pages with keys per channel have no
feedback (four passes).
About 1.3 s at start-up for either packaged model in bf16 on a 2-core Zen 5 EPYC; 10.5 s for SmolLM2 in float32
on the AVX2-only family-23 EPYC (five 512-token prompts' worth of forward passes at that CPU's float32 GEMM
rate), where it was most of an int8 engine's start before the result was kept on disk (worker/transform_cache.py:
later starts read it back). Deterministic for one
model, dtype and kernel configuration; the digest goes into the disk tier's identity, so blocks written under
other constants are never served.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from kvpage.attention.kv_quant import keys_feedback
from kvpage.attention.kv_transform import KVTransform, LayerAttend, transforms_fingerprint
from kvpage.worker import transform_cache
from kvpage.worker.scoring import chunked_hidden

logger = logging.getLogger(__name__)

CALIBRATION_TOKENS = 512
CHUNK = 64  # the passes feed the text in chunks that read their keys back from the pages
PARTS = ((False, False), (True, False), (False, True), (True, True))  # (keys, values): the parts measured

CALIBRATION_TEXT = """\
The harbour town woke slowly. Fishing boats rocked against the pier while gulls argued over the night's
catch, and the baker on Quay Street pulled the first trays of rye loaves from an oven that had been burning
since four. By seven the market square was full: cheese from the valley farms, apples in wooden crates,
knives sharpened while you waited, and a man who sold maps of places that no longer existed.

"Are you taking the morning ferry?" asked the ticket clerk.
"Only if the wind drops," Mara said. "Last week it turned back halfway across."
"Then take the eleven o'clock. The captain on that one has crossed in worse weather for thirty years."

Timetable (winter service):
| departure | arrival | vessel       | fare  |
|-----------|---------|--------------|-------|
| 07:15     | 08:40   | Northern Gull| 12.50 |
| 11:00     | 12:20   | Saint Brigid | 12.50 |
| 16:45     | 18:05   | Northern Gull| 14.00 |

In 1897 the population was 2,314; by 1951 it had fallen to 1,206, and the 2021 census counted 3,871
residents, 18.4% of them under sixteen. The average rainfall is 1,140 mm a year, with a wettest month of
October (163 mm) and a driest of May (61 mm).

def schedule(requests, capacity):
    \"\"\"Admit requests in arrival order while they fit; return the admitted and the waiting ones.\"\"\"
    admitted, waiting, used = [], [], 0
    for req in sorted(requests, key=lambda r: r.arrival):
        if used + req.size <= capacity:
            admitted.append(req)
            used += req.size
        else:
            waiting.append(req)
    return admitted, waiting

Things to pack for the crossing:
1. a waterproof jacket and a spare jumper;
2. the printed tickets (the office does not accept phones);
3. something to eat, because the kiosk closes in January;
4. patience.

Die Fähre legt um elf Uhr ab. Le bateau part à onze heures. El barco sale a las once. 船は十一時に出ます。
Questions about lost luggage go to lost@harbour.example or to +44 1632 960 018, weekdays 9-17.
"""


def calibrate_kv_transforms(lm, dtype: torch.dtype, channel_keys: bool = False, cache_dir: Path | None = None,
                            identity: dict[str, Any] | None = None, feedback: bool = True) -> str | None:
    """Give every attention layer of loaded model ``lm`` its transform for pages of ``dtype`` (once per dtype: a model
    already calibrated for it is left as it is); returns the transforms' digest (None: the model does best
    without them). ``channel_keys``: int8 pages with keys per channel, whose tensors are bytes (uint8): their
    transforms are kept under that dtype, apart from int8 rows'. Rank-local under tensor parallelism: every rank
    runs the same passes at the same point of its start-up, so the collectives inside the forward pair up, and
    every rank ends each pass with the same hidden states, so all make the same choice. With ``cache_dir`` the
    result is kept there and read back by later starts (worker/transform_cache.py), ``identity`` naming what
    else it depends on (the kernels' build and configuration, the shard). ``feedback``: False measures the parts
    without the keys' rounding feedback only (KVPAGE_KEY_FEEDBACK=0)."""
    attends: list[LayerAttend] = [layer.self_attn.attend for layer in lm.model.layers]
    key = torch.uint8 if channel_keys else dtype  # the cache tensors' dtype, which LayerAttend looks up
    current = [a.transforms.get(key) for a in attends]  # a calibration with feedback is redone without if asked
    if all(key in a.transforms for a in attends) and (feedback or all(t is None or t.feedback is None
                                                                      for t in current)):
        return transforms_fingerprint(attends, key)
    t0 = time.perf_counter()
    entry = None
    if cache_dir is not None:
        entry = transform_cache.cache_key(lm.path, lm.dtype, dtype, channel_keys,
                                          {**(identity or {}), "key_feedback": feedback})
        kept = transform_cache.load(cache_dir, entry, len(attends))
        if kept is not None:
            for a, t in zip(attends, kept[0], strict=True):
                a.transforms[key] = t
            digest = transforms_fingerprint(attends, key)
            if digest == kept[1]:
                logger.info("%s pages: KV transforms from %s (digest %s)", dtype, cache_dir, digest)
                return digest
            for a in attends:  # not to be taken for a calibration by the passes below
                del a.transforms[key]
            logger.warning("calibrated KV transforms in %s give another digest: calibrating again", cache_dir)
    ids = lm.tokenizer.encode(CALIBRATION_TEXT)[:CALIBRATION_TOKENS]
    for a in attends:
        a.capture = []
    try:
        ref = chunked_hidden(lm, ids, lm.dtype, chunk=CHUNK)
        samples = [a.capture for a in attends]
    finally:
        for a in attends:
            a.capture = None
    full = [KVTransform.from_samples(*(torch.cat([r[i] for r in rows]) for i in range(3)))
            for rows in samples]
    # which parts help is measured end to end: the hidden states' error over the text, for no transform and
    # for each choice of parts with the keys' rounding feedback (without it where keys are rounded per channel,
    # or where the configuration says so); the feedback depends only on whether the key part scales the queries
    fed = feedback and not channel_keys
    feedbacks = {scaled: [layer_feedback(t, rows, scaled) for t, rows in zip(full, samples, strict=True)]
                 for scaled in ((False, True) if fed else ())}
    made: dict[tuple[bool, bool, bool], list[KVTransform | None]] = {}
    errors = {}
    for choice in dict.fromkeys([(False, False, False)] + [(*parts, fed) for parts in PARTS]):
        fbs = feedbacks[choice[0]] if choice[2] else [None] * len(full)
        made[choice] = [t.parts(*choice[:2], fb) for t, fb in zip(full, fbs, strict=True)]
        for a, t in zip(attends, made[choice], strict=True):
            a.transforms[key] = t
        hidden = chunked_hidden(lm, ids, dtype, chunk=CHUNK, channel_keys=channel_keys)
        errors[choice] = float((hidden - ref).pow(2).mean())
    best = min(errors, key=errors.__getitem__)
    for a, t in zip(attends, made[best], strict=True):
        a.transforms[key] = t
    digest = transforms_fingerprint(attends, key)
    if entry is not None:
        transform_cache.save(cache_dir, entry, [a.transforms[key] for a in attends], digest)
    logger.info("%s pages%s: key transform %s, value transform %s, key rounding feedback %s (hidden-state error "
                "%s), from %d tokens in %.2f s (digest %s)", dtype, " (keys per channel)" if channel_keys else "",
                *("on" if b else "off" for b in best),
                ", ".join(f"{k}: {e:.3g}" for k, e in errors.items()), len(ids), time.perf_counter() - t0, digest)
    return digest


def layer_feedback(t: KVTransform, rows: list, scaled: bool) -> torch.Tensor:
    """One layer's keys' rounding feedback from its captured rows, for the queries as they reach the pages: times
    the key part's query scale where ``scaled``."""
    q = torch.cat([r[0] for r in rows]).float()
    if scaled and t.keys is not None:
        q = q * t.keys.query_scale
    return keys_feedback(q, rows[0][1].shape[1])
