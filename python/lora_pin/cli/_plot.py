"""``lora-pin simulate --plot``: loads and hit rates against slots, host tier and replicas, one line per
router; or against device memory, slot pool beside page pool. Drawn with matplotlib (the ``plot``
extra)."""

from __future__ import annotations

from typing import Any

__all__ = ["MISSING", "draw", "draw_memory"]

MISSING = "--plot needs matplotlib: install the plot extra (pip install 'lora_pin[plot]')"

# Each axis: the row key and its label.
_AXES = (
    ("slots", "device slots"),
    ("max_loaded_loras", "host tier (adapters)"),
    ("replicas", "replicas"),
)


def draw(rows: list[dict[str, Any]], path: str) -> None:
    """Writes a 2 x 3 figure to ``path`` (format from its suffix, e.g. ``.png``, ``.svg``).

    Top row: loads (device misses over all replicas); bottom row: device hit rate. Columns: against
    slots, host tier and replicas; in each, one line per router, the other two settings held at the
    sweep's first value (and the first policy).

    Raises:
        ImportError: matplotlib is not installed (the caller reports :data:`MISSING`).
        OSError: ``path`` cannot be written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = rows[0]
    fig, axes = plt.subplots(2, 3, figsize=(14, 7), squeeze=False)
    routers = list(dict.fromkeys(r["router"] for r in rows))
    finite_hosts = [r["max_loaded_loras"] for r in rows if r["max_loaded_loras"] is not None]
    # An unbounded host tier is drawn right of the largest bounded one, at twice its size.
    unbounded_x = 2 * max(finite_hosts, default=1)
    for col, (key, label) in enumerate(_AXES):
        if key == "max_loaded_loras" and len(finite_hosts) < len(rows):
            label += f"; unbounded drawn at {unbounded_x}"
        fixed = [k for k, _ in _AXES if k != key] + ["policy"]
        for router in routers:
            points = sorted(
                (unbounded_x if r[key] is None else r[key], r["overall"]["loads"], r["overall"]["hit_rate"])
                for r in rows
                if r["router"] == router and all(r[k] == first[k] for k in fixed)
            )
            xs = [p[0] for p in points]
            axes[0][col].plot(xs, [p[1] for p in points], marker="o", label=router)
            axes[1][col].plot(xs, [100 * p[2] for p in points], marker="o", label=router)
        axes[1][col].set_xlabel(label)
        held = ", ".join(f"{k}={first[k] if first[k] is not None else 'unbounded'}" for k in fixed)
        axes[0][col].set_title(held, fontsize=9)
    axes[0][0].set_ylabel("loads (all replicas)")
    axes[1][0].set_ylabel("device hit rate (%)")
    axes[0][0].legend()
    fig.suptitle(f"lora-pin simulate: {first['policy']}, queue bound {first['queue_bound']}")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def draw_memory(rows: list[dict[str, Any]], path: str) -> None:
    """Writes a 1 x 2 figure to ``path``: device loads and device hit rate against device memory
    (GiB), one line per pool and policy (``--memory-gib`` rows).

    Raises:
        ImportError: matplotlib is not installed (the caller reports :data:`MISSING`).
        OSError: ``path`` cannot be written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), squeeze=False)
    for pool, policy in dict.fromkeys((r["pool"], r["policy"]) for r in rows):
        points = sorted(
            (r["memory_gib"], r["device"]["misses"], r["device"]["hit_rate"])
            for r in rows
            if (r["pool"], r["policy"]) == (pool, policy)
        )
        xs = [p[0] for p in points]
        label = f"{pool} pool, {policy}"
        axes[0][0].plot(xs, [p[1] for p in points], marker="o", label=label)
        axes[0][1].plot(xs, [100 * p[2] for p in points], marker="o", label=label)
    axes[0][0].set_ylabel("device loads")
    axes[0][1].set_ylabel("device hit rate (%)")
    for ax in axes[0]:
        ax.set_xlabel("device memory (GiB)")
    axes[0][0].legend()
    fig.suptitle("lora-pin simulate: slot pool vs page pool at equal bytes")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
