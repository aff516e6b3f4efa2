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
