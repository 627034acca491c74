"""Figures of the Eight-Gaussians diffusion experiments (paper App. diffusion_full5); needs matplotlib.

``write_figures(results, ring, out_dir)`` writes, per table (``paths``, ``isolation``):

* ``<table>_parameter_paths.png`` — (β_t, λ_t, r_t, u_t, v_t) against path progress t;
* ``<table>_endpoint_samples.png`` — final samples per path beside clean data;
* ``<table>_progress.png`` — reverse-chain states across levels (rows: paths; columns: levels);
* ``<table>_trajectories.png`` — trajectory ribbons colored by the final sample's nearest mode
  (start: circle, end: dot);
* ``<table>_marginal_tracking.png`` — signed ED between the chain and the exact noisy marginal
  per level (x: realized RMS, log scale; y: symmetric log scale, since the signed ED can be < 0);
  one panel per path, against the first path in grey, when there are more than four.

Panels wrap into rows of at most six.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List

import torch

from etweedie.data import EightGaussians
from etweedie.evaluation import mode_assignment
from etweedie.sample import GeometricRMS, get_path

__all__ = ["write_figures"]

MAX_COLUMNS = 6  # panels per row of the endpoint, trajectory and tracking grids
SINGLE_PANEL_CURVES = 4  # more tracking curves than this get one panel each (against the first in grey)
_COLORS = [f"C{i}" for i in range(10) if i != 7]  # C7 is grey, the grid's reference curve


def write_figures(results: Dict, ring: EightGaussians, out_dir) -> List[str]:
    """Write every figure of every table in ``results`` to ``out_dir``; returns the file names.

    Without matplotlib installed nothing is written and an empty list is returned.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # figures are optional: the metrics and samples do not need them
        print("note: matplotlib is not installed; no figures written (pip install 'etweedie[plot]')")
        return []
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for table, res in results["tables"].items():
        fig_data = res["_figure"]
        for stem, fn in (
            ("parameter_paths", _parameter_paths),
            ("endpoint_samples", _endpoint_samples),
            ("progress", _progress),
            ("trajectories", _trajectories),
            ("marginal_tracking", _tracking),
        ):
            fig = fn(plt, res, fig_data, ring)
            if fig is None:
                continue
            name = f"{table}_{stem}.png"
            fig.savefig(out / name, dpi=110, bbox_inches="tight")
            plt.close(fig)
            written.append(name)
    return written


def _lim(ring: EightGaussians) -> float:
    return ring.radius + 4 * ring.std + 0.6


def _grid(plt, n: int, size: float, max_cols: int = MAX_COLUMNS, **kwargs):
    """``n`` square panels in rows of at most ``max_cols`` (the isolation table has 12): the figure and
    its first ``n`` axes, the unused ones hidden."""
    cols = max(1, min(n, max_cols))
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(size * cols, size * rows), squeeze=False, **kwargs)
    flat = [ax for row in axes for ax in row]
    for ax in flat[n:]:
        ax.set_visible(False)
    return fig, flat[:n]


def _parameter_paths(plt, res, fig_data, ring):
    sched = res["schedule"]
    rms = GeometricRMS(sched["r_max"], sched["r_min"])
    t = torch.linspace(0, 1, 201, dtype=torch.float64)
    labels = ("β", "λ", "r (realized RMS)", "u", "v")
    fig, axes = plt.subplots(1, 5, figsize=(17, 3.0))
    styles = ("-", "--", ":", "-.")  # paths often share a coordinate (the rotating and joint u, v): keep each visible
    for i, name in enumerate(res["names"]):
        coords = get_path(name, rms=rms).coordinates(t)
        for ax, values in zip(axes, coords):
            ax.plot(t.numpy(), values.numpy(), label=name, color=f"C{i % 10}", ls=styles[i % len(styles)],
                    lw=max(1.0, 2.8 - 0.4 * i))  # earlier curves wider: one drawn over another still shows
    for ax, label in zip(axes, labels):
        ax.set_title(label)
        ax.set_xlabel("path progress t")
    axes[2].set_yscale("log")
    fig.tight_layout()
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8, frameon=False)
    return fig


def _endpoint_samples(plt, res, fig_data, ring):
    finals = fig_data["final"]
    panels = list(finals.items()) + [("clean data", fig_data.get("clean"))]
    fig, axes = _grid(plt, len(panels), 3.2)
    lim = _lim(ring)
    for ax, (name, x) in zip(axes, panels):
        if x is None:
            continue
        x = x[:4096]
        ax.scatter(x[:, 0], x[:, 1], s=1, alpha=0.4, color="k" if name == "clean data" else "C0")
        ax.set_title(name, fontsize=9)
        ax.set_xlim(-lim, lim), ax.set_ylim(-lim, lim)
        ax.set_aspect("equal")
        ax.set_xticks([]), ax.set_yticks([])
    fig.tight_layout()
    return fig


def _progress(plt, res, fig_data, ring):
    prog = fig_data["progress"]
    if not prog:
        return None
    names = list(prog)
    n_levels = len(next(iter(prog.values()))["r"])
    n_cols = min(6, n_levels)
    cols = sorted({round(i * (n_levels - 1) / max(n_cols - 1, 1)) for i in range(n_cols)})
    fig, axes = plt.subplots(len(names), len(cols), figsize=(2.3 * len(cols), 2.3 * len(names)), squeeze=False)
    lim = _lim(ring) + 1.0
    for i, name in enumerate(names):
        states, r = prog[name]["states"], prog[name]["r"]
        for j, k in enumerate(cols):
            ax = axes[i][j]
            ax.scatter(states[k][:, 0], states[k][:, 1], s=1, alpha=0.4)
            ax.set_xlim(-lim, lim), ax.set_ylim(-lim, lim)
            ax.set_aspect("equal")
            ax.set_xticks([]), ax.set_yticks([])
            if i == 0:
                ax.set_title(f"level {k}, r={r[k]:.3g}", fontsize=8)
            if j == 0:
                ax.set_ylabel(name, fontsize=8)
    fig.tight_layout()
    return fig


def _trajectories(plt, res, fig_data, ring):
    traj = fig_data["trajectories"]
    if not traj:
        return None
    means = ring.means(torch.float64)
    cmap = plt.get_cmap("tab10")
    fig, axes = _grid(plt, len(traj), 3.6)
    lim = _lim(ring) + 1.0
    for ax, (name, data) in zip(axes, traj.items()):
        states, final = data["states"], data["final"]  # (L, C, 2), (C, 2)
        labels = mode_assignment(final.double(), means)
        for c in range(states.shape[1]):
            color = cmap(int(labels[c]) % 10)
            path = torch.cat([states[:, c], final[c : c + 1]])
            ax.plot(path[:, 0], path[:, 1], color=color, lw=0.6, alpha=0.7)
            ax.scatter(path[0, 0], path[0, 1], s=12, facecolors="none", edgecolors=color, lw=0.6)
            ax.scatter(path[-1, 0], path[-1, 1], s=6, color=color)
        ax.set_title(name, fontsize=9)
        ax.set_xlim(-lim, lim), ax.set_ylim(-lim, lim)
        ax.set_aspect("equal")
        ax.set_xticks([]), ax.set_yticks([])
    fig.tight_layout()
    return fig


def _tracking(plt, res, fig_data, ring):
    """Mean ± sd over the models of each path's tracking curve: one panel for up to
    ``SINGLE_PANEL_CURVES`` paths; beyond that one panel per path, each with the first path (the
    reference arm of the isolation table) in grey, since a dozen overlapping bands cannot be read."""
    tracking = fig_data["tracking"]
    if not tracking:
        return None
    curves = {name: _mean_sd(c) for name, c in tracking.items()}
    single = len(curves) <= SINGLE_PANEL_CURVES
    if single:
        fig, ax = plt.subplots(figsize=(5.5, 3.6))
        axes = [ax] * len(curves)
    else:
        fig, axes = _grid(plt, len(curves), 2.8, sharex=True, sharey=True)
    first = next(iter(curves))
    for i, (ax, (name, (r, mean, sd))) in enumerate(zip(axes, curves.items())):
        color = _COLORS[i % len(_COLORS)]
        if not single:
            if name != first:
                ax.plot(curves[first][0], curves[first][1], color="0.6", lw=0.8, label=first)
            ax.set_title(name, fontsize=9)
        ax.plot(r, mean, label=name, lw=1, color=color)
        if sd is not None:
            ax.fill_between(r, mean - sd, mean + sd, alpha=0.2, color=color)
    for ax in set(axes):
        ax.set_xscale("log")
        ax.set_yscale("symlog", linthresh=1e-3)
        ax.axhline(0, color="k", lw=0.5)
    axes[min(1, len(axes) - 1)].legend(fontsize=7)  # the grid's second panel names its grey curve
    axes[0].invert_xaxis()  # shared x in the grid: once
    for ax in set(axes):  # the grid: x labels under the lowest panel of each column, y labels on the first
        if single or _below_is_empty(ax, len(axes)):
            ax.set_xlabel("realized RMS r (level)")
        if single or ax.get_subplotspec().is_first_col():
            ax.set_ylabel("signed ED to the noisy marginal")
    fig.tight_layout()
    return fig


def _mean_sd(curves):
    """(r, mean, sd or None) over the models' curves of one path."""
    r = torch.tensor([c["r"] for c in curves[0]])
    values = torch.tensor([[c["signed_ed"] for c in curve] for curve in curves])  # (models, L)
    return r, values.mean(0), values.std(0) if values.shape[0] > 1 else None


def _below_is_empty(ax, n: int) -> bool:
    """Whether the grid cell under ``ax`` holds no panel (the last row, or above a gap in a short last row)."""
    spec = ax.get_subplotspec()
    rows, cols = spec.get_gridspec().get_geometry()
    return (spec.rowspan.start + 1) * cols + spec.colspan.start >= n
