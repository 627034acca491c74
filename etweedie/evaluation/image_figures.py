"""Figures for MNIST-scale image samples (paper Figs. mnist_samples and mnist_nearest_train); needs matplotlib.

* :func:`image_grid` — a grid of images (white digits on black, as stored);
* :func:`nearest_train_figure` — generated images (upper rows) above their nearest training
  images in pixel RMSE (lower rows), each pair labelled with its RMSE.

Both take images as :func:`etweedie.evaluation.image_metrics.as_unit_images` accepts them and write a PNG.
matplotlib is imported on first use (with the non-interactive Agg backend).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import torch

from .._checks import check_int
from .image_metrics import as_unit_images, nearest_train

__all__ = ["image_grid", "nearest_train_figure", "tile"]


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError(f"figures need matplotlib ({exc}); install it with `pip install etweedie[plot]`") from exc
    return plt


def tile(images: torch.Tensor, columns: int, gap: int = 2) -> torch.Tensor:
    """``(n, h, w)`` images → one ``(rows·(h+gap)−gap, columns·(w+gap)−gap)`` canvas, row-major; gaps are 0.5 (grey)."""
    columns = check_int(columns, "columns", 1)
    n, h, w = images.shape
    rows = max(1, math.ceil(n / columns))
    canvas = torch.full((rows * (h + gap) - gap, columns * (w + gap) - gap), 0.5)
    for k in range(n):
        r, c = divmod(k, columns)
        canvas[r * (h + gap):r * (h + gap) + h, c * (w + gap):c * (w + gap) + w] = images[k]
    return canvas


def image_grid(images, path, *, columns: int = 16, max_images: int = 256, title: Optional[str] = None) -> Path:
    """Write the first ``max_images`` images as a grid of ``columns`` columns to ``path`` (PNG).

    Returns:
        the written path.
    """
    x = as_unit_images(images)[: check_int(max_images, "max_images", 1)]
    columns = min(check_int(columns, "columns", 1), x.shape[0])
    canvas = tile(x, columns)
    plt = _pyplot()
    height, width = canvas.shape
    fig, ax = plt.subplots(figsize=(width / 40, height / 40 + (0.4 if title else 0)), dpi=100)
    ax.imshow(canvas.numpy(), cmap="gray", vmin=0.0, vmax=1.0, interpolation="nearest")
    ax.set_axis_off()
    if title:
        ax.set_title(title, fontsize=9)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, bbox_inches="tight", pad_inches=0.05)
    plt.close(fig)
    return path


def nearest_train_figure(
    images,
    train,
    path,
    *,
    count: int = 12,
    columns: int = 12,
    title: Optional[str] = None,
) -> Path:
    """Write the first ``count`` images above their nearest training images (pixel RMSE) to ``path``.

    Blocks of ``columns`` images: a row of generated images, below it the row of their nearest
    training images (:func:`etweedie.evaluation.image_metrics.nearest_train`, exact), each column titled
    with the pair's RMSE (pixels in [0, 1]).

    Args:
        images: generated images (``(n, 28, 28)`` / ``(n, 784)``, uint8 or float in [0, 1]).
        train: training images ``(N, 28, 28)`` uint8 or float in [0, 1].

    Returns:
        the written path.
    """
    x = as_unit_images(images)[: check_int(count, "count", 1)]
    columns = min(check_int(columns, "columns", 1), x.shape[0])
    rmse, index = nearest_train(x, train)
    nearest = as_unit_images(train[index], "train")
    blocks = math.ceil(x.shape[0] / columns)
    plt = _pyplot()
    fig, axes = plt.subplots(2 * blocks, columns, figsize=(columns * 0.75, blocks * 1.6 + 0.4), squeeze=False)
    fig.subplots_adjust(wspace=0.08, hspace=0.25)
    for ax in axes.flat:
        ax.set_axis_off()
    for k in range(x.shape[0]):
        block, c = divmod(k, columns)
        top, bottom = axes[2 * block, c], axes[2 * block + 1, c]
        top.imshow(x[k].numpy(), cmap="gray", vmin=0.0, vmax=1.0, interpolation="nearest")
        bottom.imshow(nearest[k].numpy(), cmap="gray", vmin=0.0, vmax=1.0, interpolation="nearest")
        bottom.set_title(f"{float(rmse[k]):.3f}", fontsize=6, pad=1)
    caption = "upper: sample, lower: nearest training image (pixel RMSE)"
    fig.suptitle(f"{title}\n{caption}" if title else caption, fontsize=8)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, bbox_inches="tight", pad_inches=0.05, dpi=120)
    plt.close(fig)
    return path
