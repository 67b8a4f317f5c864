"""A regime map as heat maps: per API-time scale a row, mean and p99 ratio side by side;
x = arrival rate, y = KV capacity scale, colour centred at 1.0 (blue: MARS faster)."""

from __future__ import annotations

import os

from marsched.atomic import write_atomically
from marsched.regime.table import Cell, Regime, Thresholds

# Blue where MARS wins, red where it loses; white at a tie. The colour range is at least
# 0.5–1.5 so that small differences do not look large on a map that is all ties.
_LOW, _HIGH = 0.5, 1.5


def plot_regime(cells: list[Cell], path: str | os.PathLike[str], title: str,
                thresholds: Thresholds = Thresholds(), duration_s: float | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import TwoSlopeNorm
    from matplotlib.patches import Rectangle

    qps_values = sorted({c.qps for c in cells})
    kv_values = sorted({c.kv_scale for c in cells})
    api_values = sorted({c.api_time_scale for c in cells})
    ratios = [r for c in cells for r in (c.mean_ratio, c.p99_ratio)]
    norm = TwoSlopeNorm(vmin=min(_LOW, *ratios), vcenter=1.0, vmax=max(_HIGH, *ratios))
    width = 2 * (0.95 * len(qps_values) + 1.3) + 1.2
    height = len(api_values) * (0.62 * len(kv_values) + 0.9) + 1.5
    figure, axes = plt.subplots(len(api_values), 2, figsize=(width, height), squeeze=False)
    image = None
    for row, api in enumerate(api_values):
        for column, (field, label) in enumerate((("mean_ratio", "mean e2e"), ("p99_ratio", "p99 e2e"))):
            axis = axes[row][column]
            grid = [[float("nan")] * len(qps_values) for _ in kv_values]
            for cell in cells:
                if cell.api_time_scale == api:
                    grid[kv_values.index(cell.kv_scale)][qps_values.index(cell.qps)] = getattr(cell, field)
            image = axis.imshow(grid, cmap="RdBu_r", norm=norm, origin="lower", aspect="auto")
            for cell in cells:
                if cell.api_time_scale != api:
                    continue
                x, y = qps_values.index(cell.qps), kv_values.index(cell.kv_scale)
                value = getattr(cell, field)
                strong = abs(norm(value) - 0.5) > 0.33  # dark background: white text
                colour = "white" if strong else "black"
                axis.text(x, y, f"{value:.2f}", ha="center", va="center", fontsize=10, color=colour,
                          fontweight="bold" if cell.regime is not Regime.LIGHT else "normal")
                axis.text(x - 0.45, y + 0.42, cell.regime.letter, ha="left", va="top", fontsize=8, color=colour,
                          fontweight="bold")
                if cell.regime is Regime.OVERLOADED:
                    axis.add_patch(Rectangle((x - 0.5, y - 0.5), 1, 1, fill=False, hatch="//", edgecolor="0.35",
                                             linewidth=0))
                elif cell.regime is Regime.LIGHT:
                    axis.add_patch(Rectangle((x - 0.5, y - 0.5), 1, 1, facecolor="0.85", edgecolor="none",
                                             alpha=0.45))
            axis.set_xticks(range(len(qps_values)), [f"{q:g}" for q in qps_values])
            axis.set_yticks(range(len(kv_values)), [f"×{k:g}" for k in kv_values])
            axis.set_xlabel("requests per second")
            axis.set_ylabel("KV capacity")
            axis.set_title(f"{label}, API time ×{api:g}", fontsize=10)
    window = f"{duration_s:g} s window" if duration_s else "the arrival window"
    figure.suptitle(f"MARS / INFERCEPT end-to-end latency · {title}", fontsize=11)
    figure.text(0.5, 0.01,
                f"below 1 (blue): MARS faster.  L light (grey): both means within {thresholds.light_excess:.0%} "
                f"of the isolated floor.  S saturated.  O overloaded (hatched): INFERCEPT's longest queue wait "
                f"> {thresholds.overload_wait_fraction:.0%} of {window}.",
                ha="center", va="bottom", fontsize=8, wrap=True)
    top, bottom = 1 - 0.7 / height, 0.95 / height
    figure.subplots_adjust(left=0.09, right=0.86, top=top, bottom=bottom, hspace=0.55, wspace=0.3)
    # Its own axis, right of the panels: a colour bar placed by `ax=` would cover them after the adjust.
    bar = figure.add_axes((0.89, bottom + 0.1 * (top - bottom), 0.02, 0.8 * (top - bottom)))
    figure.colorbar(image, cax=bar, label="MARS / INFERCEPT")
    write_atomically(path, lambda f: figure.savefig(f, format="png", dpi=110))
    plt.close(figure)
