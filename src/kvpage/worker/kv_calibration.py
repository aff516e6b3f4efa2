"""The constants of a quantized cache's transforms (attention/kv_transform.py), from the model's own queries,
keys and values over a fixed text.

The text is kvpage's own, mixed on purpose (prose, a dialogue, numbers, a table, code, a list) and never the
text the accuracy benchmark scores. The pass runs the model through a small float cache of its own dtype, so
its tensors are the model's as they are; it is deterministic for one model, dtype and kernel configuration, and
its digest goes into the disk tier's identity, so blocks written under other constants are never served.
"""

from __future__ import annotations

import logging
import time

import torch

from kvpage.attention.kv_transform import KVTransform, LayerAttend, transforms_fingerprint
from kvpage.worker.scoring import chunked_forward

logger = logging.getLogger(__name__)

CALIBRATION_TOKENS = 512

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


def calibrate_kv_transforms(lm) -> str | None:
    """Give every attention layer of loaded model ``lm`` its transform (once: a model already calibrated is
    left as it is); returns the transforms' digest. Rank-local under tensor parallelism: every rank runs the
    same pass at the same point of its start-up, so the collectives inside the forward pair up."""
    attends: list[LayerAttend] = [layer.self_attn.attend for layer in lm.model.layers]
    if all(a.transform is not None for a in attends):
        return transforms_fingerprint(attends)
    t0 = time.perf_counter()
    ids = lm.tokenizer.encode(CALIBRATION_TEXT)[:CALIBRATION_TOKENS]
    for a in attends:
        a.capture = []
    try:
        chunked_forward(lm, ids, lm.dtype, chunk=256)
        samples = [a.capture for a in attends]
    finally:
        for a in attends:
            a.capture = None
    for a, rows in zip(attends, samples, strict=True):
        q, k, v = (torch.cat([r[i] for r in rows]) for i in range(3))
        a.transform = KVTransform.from_samples(q, k, v)
    digest = transforms_fingerprint(attends)
    logger.info("quantized KV: transforms of %d layers from %d tokens in %.2f s (digest %s)", len(attends),
                len(ids), time.perf_counter() - t0, digest)
    return digest

