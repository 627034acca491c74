"""Figures of the MNIST sampling protocol (paper App. "Energy-Tweedie Diffusion on MNIST").

* ``mnist_samples.png`` — unselected samples per path (rows), the first images of the pooled set;
* ``mnist_nearest_train.png`` — 12 generated images per path (upper row) above their nearest
  training images in pixel RMSE (lower row); the 12 are drawn from the pooled set with a common
  figure seed, not selected;
* ``mnist_paths.png`` — the five parameter paths: σ_t, r_t, β_t, λ_t, u_t, v_t against path
  progress t, and the (u, v) trajectories inside the training disk ‖(u, v)‖ ≤ 0.7;
* ``mnist_progress.png`` — reverse-chain states, paths as columns, matched-RMS levels as rows
  (then the final posterior draw), the same nine chains (3×3) in every cell;
* ``mnist_seeds.png`` — endpoint samples, paths as rows and seeds as columns.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Optional, Sequence

import numpy as np
import torch

from etweedie.sample import MNIST_PATHS, level_times

FIGURE_SEED = 1234
TITLES = {name: p.description for name, p in MNIST_PATHS.items()}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def tile(images: np.ndarray, cols: int, pad: int = 1, fill: float = 1.0) -> np.ndarray:
    """``(n, 28, 28)`` images (values in [0, 1]) → one ``(rows·29 − 1, cols·29 − 1)`` mosaic, row-major."""
    n = images.shape[0]
    rows = max(1, -(-n // cols))
    h, w = images.shape[1:]
    out = np.full((rows * (h + pad) - pad, cols * (w + pad) - pad), fill, dtype=np.float32)
    for i in range(n):
        r, c = divmod(i, cols)
        out[r * (h + pad): r * (h + pad) + h, c * (w + pad): c * (w + pad) + w] = images[i]
    return out


def _unit(images: np.ndarray) -> np.ndarray:
    return images.astype(np.float32) / 255.0 if images.dtype == np.uint8 else np.clip(images.astype(np.float32), 0, 1)


def _show(ax, mosaic, title=None):
    ax.imshow(mosaic, cmap="gray", vmin=0, vmax=1, interpolation="nearest")
    ax.set_xticks([]), ax.set_yticks([])
    if title:
        ax.set_title(title, fontsize=8)


def samples_figure(pooled: Dict[str, np.ndarray], out: Path, per_path: int = 24) -> Path:
    plt = _plt()
    fig, axes = plt.subplots(len(pooled), 1, figsize=(per_path * 0.32, 0.55 * len(pooled) + 0.3), squeeze=False)
    for ax, (name, images) in zip(axes[:, 0], pooled.items()):
        _show(ax, tile(_unit(images[:per_path]), per_path))
        ax.set_ylabel(TITLES.get(name, name), rotation=0, ha="right", va="center", fontsize=7)
    fig.suptitle("Unselected samples per path (first images of the pooled set)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=150)
    plt.close(fig)
    return out


def nearest_train_figure(pooled: Dict[str, np.ndarray], train: torch.Tensor, out: Path, per_path: int = 12) -> Path:
    from etweedie.evaluation import nearest_train

    plt = _plt()
    g = torch.Generator().manual_seed(FIGURE_SEED)
    fig, axes = plt.subplots(len(pooled), 1, figsize=(per_path * 0.45, 1.05 * len(pooled) + 0.3), squeeze=False)
    for ax, (name, images) in zip(axes[:, 0], pooled.items()):
        pick = torch.randperm(images.shape[0], generator=g)[: min(per_path, images.shape[0])].numpy()
        gen = images[pick]
        rmse, index = nearest_train(torch.from_numpy(gen), train)
        pair = np.concatenate([_unit(gen), _unit(train[index].numpy())])
        _show(ax, tile(pair, len(pick)), f"{TITLES.get(name, name)}: mean nearest-train RMSE {float(rmse.mean()):.3f}")
    fig.suptitle("Generated (upper rows) and their nearest training images in pixel RMSE (lower rows)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=150)
    plt.close(fig)
    return out


def paths_figure(out: Path, levels: int = 64) -> Path:
    plt = _plt()
    t = level_times(200)
    fig, axes = plt.subplots(1, 7, figsize=(17, 2.6))
    labels = ("σ_t", "r_t", "β_t", "λ_t", "u_t", "v_t")
    for name, path in MNIST_PATHS.items():
        beta, lam, r, u, v = path.coordinates(t)
        sigma = path(t).sigma
        for ax, values in zip(axes[:6], (sigma, r, beta, lam, u, v)):
            ax.plot(t.numpy(), values.numpy(), label=TITLES[name], lw=1.2)
        axes[6].plot(u.numpy(), v.numpy(), lw=1.2)
        axes[6].plot(u[:1].numpy(), v[:1].numpy(), "o", ms=3, color=axes[6].lines[-1].get_color())
    for ax, label in zip(axes[:6], labels):
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("path progress t", fontsize=8)
    for ax in axes[:2]:
        ax.set_yscale("log")
    circle = np.linspace(0, 2 * np.pi, 200)
    axes[6].plot(0.7 * np.cos(circle), 0.7 * np.sin(circle), "k--", lw=0.8)
    axes[6].set_aspect("equal")
    axes[6].set_title("(u, v) inside the training disk", fontsize=9)
    axes[0].legend(fontsize=6, loc="lower left")
    fig.tight_layout()
    fig.savefig(out, dpi=150)
    plt.close(fig)
    return out


def progress_figure(progress: Dict[str, np.ndarray], rms: Sequence[float], out: Path) -> Path:
    """``progress[path]``: ``(rows + 1, 9, 784)`` states at the tracked levels, then the final draw."""
    plt = _plt()
    names = list(progress)
    n_rows = progress[names[0]].shape[0]
    fig, axes = plt.subplots(n_rows, len(names), figsize=(1.3 * len(names) + 0.6, 1.3 * n_rows), squeeze=False)
    for j, name in enumerate(names):
        for i in range(n_rows):
            states = np.clip(progress[name][i].astype(np.float32), 0, 1).reshape(-1, 28, 28)
            _show(axes[i, j], tile(states, 3), TITLES.get(name, name).replace(" / ", "\n") if i == 0 else None)
            if j == 0:
                label = f"r = {rms[i]:.3g}" if i < len(rms) else "final draw"
                axes[i, j].set_ylabel(label, fontsize=8)
    fig.suptitle("Reverse chains at matched realized RMS (states clipped to [0, 1]); same 9 chains per cell", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=150)
    plt.close(fig)
    return out


def seeds_figure(parts: Dict[str, Dict[int, np.ndarray]], out: Path, per_cell: int = 16) -> Path:
    plt = _plt()
    names = list(parts)
    seeds = list(parts[names[0]])
    cols = int(np.ceil(np.sqrt(per_cell)))
    fig, axes = plt.subplots(len(names), len(seeds), figsize=(1.6 * len(seeds) + 1.6, 1.6 * len(names)), squeeze=False)
    for i, name in enumerate(names):
        for j, seed in enumerate(seeds):
            _show(axes[i, j], tile(_unit(parts[name][seed][:per_cell]), cols), f"seed {seed}" if i == 0 else None)
        axes[i, 0].set_ylabel(TITLES.get(name, name), fontsize=7)
    fig.suptitle("Unselected endpoint samples per path (rows) and seed (columns)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=150)
    plt.close(fig)
    return out


def all_figures(out_dir, parts_dir, paths: Sequence[str], seeds: Sequence[int], train: Optional[torch.Tensor]) -> list:
    """Every figure from a protocol's part files in ``parts_dir``; written to ``out_dir``."""
    out_dir, parts_dir = Path(out_dir), Path(parts_dir)
    parts = {p: {s: np.load(parts_dir / f"{p}_seed{s}.npy") for s in seeds} for p in paths}
    pooled = {p: np.concatenate([parts[p][s] for s in seeds]) for p in paths}
    progress = {p: np.load(parts_dir / f"{p}_seed{seeds[0]}_progress.npy") for p in paths}
    rms = json.loads((parts_dir / f"{paths[0]}_seed{seeds[0]}.json").read_text())["progress_rms"]
    made = [
        samples_figure(pooled, out_dir / "mnist_samples.png"),
        paths_figure(out_dir / "mnist_paths.png"),
        progress_figure(progress, rms, out_dir / "mnist_progress.png"),
        seeds_figure(parts, out_dir / "mnist_seeds.png"),
    ]
    if train is not None:
        made.append(nearest_train_figure(pooled, train, out_dir / "mnist_nearest_train.png"))
    return made
