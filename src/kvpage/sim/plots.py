"""Pictures of the block pool (matplotlib, imported only when a picture is asked for)."""

from __future__ import annotations

from pathlib import Path

from kvpage.sim.trace import StepRecord

FREE = (1.0, 1.0, 1.0)
FREE_CACHED = (0.86, 0.86, 0.86)


def draw_pool_timeline(records: list[StepRecord], path: str | Path, title: str = "KV block pool over time") -> None:
    """One column per step, one row per physical block, coloured by the request that owns it.

    Shared blocks (ref count > 1) are hatched and labelled with all owners; free blocks that still hold a
    cached prefix are grey.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    if not records:
        raise ValueError("nothing to draw: the scenario has no steps")
    names: list[str] = []
    for rec in records:
        for view in rec.pool:
            for o in view.owners:
                if o not in names:
                    names.append(o)
    cmap = plt.get_cmap("tab10")
    colour = {n: cmap(i % 10) for i, n in enumerate(names)}
    n_blocks, n_steps = len(records[0].pool), len(records)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.0 + 0.9 * n_steps), max(3.0, 0.8 + 0.38 * n_blocks)))
    for x, rec in enumerate(records):
        for y, view in enumerate(rec.pool):
            if view.owners:
                face = colour[view.owners[0]]
            else:
                face = FREE_CACHED if view.cached else FREE
            shared = len(view.owners) > 1
            ax.add_patch(Rectangle((x, y), 1, 1, facecolor=face, edgecolor="black", linewidth=0.5,
                                   hatch="//" if shared else None))
            if view.owners:
                ax.text(x + 0.5, y + 0.5, ",".join(view.owners), ha="center", va="center", fontsize=7)
    ax.set_xlim(0, n_steps)
    ax.set_ylim(n_blocks, 0)
    ax.set_xticks([i + 0.5 for i in range(n_steps)])
    ax.set_xticklabels([f"{r.index}\n{r.op}" for r in records], fontsize=7)
    ax.set_yticks([i + 0.5 for i in range(n_blocks)])
    ax.set_yticklabels([str(i) for i in range(n_blocks)], fontsize=7)
    ax.set_xlabel("step")
    ax.set_ylabel("physical block")
    ax.set_title(title)
    handles = [Patch(facecolor=colour[n], edgecolor="black", label=n) for n in names]
    handles += [
        Patch(facecolor="white", edgecolor="black", hatch="//", label="shared (ref > 1)"),
        Patch(facecolor=FREE_CACHED, edgecolor="black", label="free, cached prefix"),
        Patch(facecolor=FREE, edgecolor="black", label="free"),
    ]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _save(plt, fig, path: str | Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def draw_memory_over_time(results: dict, path: str | Path, slot_bytes: float) -> None:
    """Allocated vs live KV memory over simulated time, one panel per allocator (``{name: SimResult}``)."""
    plt = _pyplot()
    fig, axes = plt.subplots(len(results), 1, figsize=(8, 2.6 * len(results)), sharey=True)
    axes = list(axes) if len(results) > 1 else [axes]
    gib = slot_bytes / 2**30
    for ax, (_name, res) in zip(axes, results.items(), strict=True):
        t = [s.time for s in res.steps]
        alloc = [s.allocated_slots * gib for s in res.steps]
        live = [s.live_slots * gib for s in res.steps]
        cap = res.config.num_blocks * res.config.block_size * gib
        summ = res.summary()
        ax.fill_between(t, live, alloc, step="post", color="tab:red", alpha=0.35, label="allocated, holding nothing")
        ax.fill_between(t, 0, live, step="post", color="tab:blue", alpha=0.6, label="live tokens")
        ax.axhline(cap, color="black", linewidth=0.8, linestyle="--", label="KV pool")
        ax.set_title(f"{summ['allocator']}: utilization {summ['utilization']:.1%}, mean "
                     f"{summ['mean_concurrency']:.1f} running, {summ['throughput_tok_s']:.0f} tok/s", fontsize=9)
        ax.set_ylabel("KV memory (GiB)")
        ax.legend(fontsize=7, loc="upper right")
    axes[-1].set_xlabel("simulated time (s)")
    _save(plt, fig, path)


def draw_waste_vs_block_size(series: list, path: str | Path) -> None:
    """Tail waste and concurrency against block size (``[(block_size, summary), ...]``)."""
    plt = _pyplot()
    sizes = [bs for bs, _ in series]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.plot(sizes, [100 * s["waste_tail"] for _, s in series], "o-", color="tab:red", label="tail waste (% of held)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes)
    ax.set_xticklabels([str(b) for b in sizes])
    ax.set_xlabel("block size (tokens)")
    ax.set_ylabel("last-block waste (%)", color="tab:red")
    ax2 = ax.twinx()
    ax2.plot(sizes, [s["mean_concurrency"] for _, s in series], "s--", color="tab:blue", label="mean running seqs")
    ax2.set_ylabel("mean running sequences", color="tab:blue")
    ax.set_title("paged allocation, same KV memory: waste vs block size", fontsize=9)
    _save(plt, fig, path)


def draw_hit_rate_vs_sharing(series: list, path: str | Path) -> None:
    """Prefix hit rate and prefix blocks saved against how many requests share each system prompt."""
    plt = _pyplot()
    ks = [k for k, _ in series]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.plot(ks, [100 * s["prefix_hit_rate"] for _, s in series], "o-", label="prefix hit rate (% of prompt tokens)")
    ax.plot(ks, [100 * s["prefix_blocks_saved_fraction"] for _, s in series], "s--",
            label="shared-prefix blocks saved (%)")
    ax.set_xscale("log")
    ax.set_xticks(ks)
    ax.set_xticklabels([str(k) for k in ks])
    ax.set_ylim(0, 102)
    ax.set_xlabel("requests sharing each system prompt")
    ax.set_ylabel("%")
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title("prefix caching: reuse vs sharing", fontsize=9)
    _save(plt, fig, path)
