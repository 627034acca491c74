"""Clean-data sources for training: anything that draws a batch of examples ``(batch, d)`` from a generator.

The trainer (:mod:`etweedie.training`) never knows which data it trains on; it asks a source for
``draw(batch_size, generator) -> (batch_size, d)`` and reads ``source.dim``.  Three kinds:

* :class:`TensorSource` — a fixed set of examples ``(n, d)``, drawn uniformly with replacement;
* :class:`CallableSource` — any function ``draw(batch_size, generator)`` (e.g. a simulator);
* :class:`EightGaussiansSource` and :class:`MnistSource` — the two data sets the paper trains on,
  built from a config by :func:`etweedie.training.build_data_source`.

:func:`as_data_source` turns a tensor or a callable into a source.  Every random number comes from
the generator passed to ``draw`` (on the device the batch is drawn on), so a run is reproducible
from its seed.

Example::

    >>> src = as_data_source(torch.arange(12.0).reshape(6, 2))
    >>> src.dim, tuple(src.draw(4, torch.Generator().manual_seed(0)).shape)
    (2, (4, 2))
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Tuple, Union

import torch

from .._checks import check_generator
from .ring import EightGaussians

__all__ = [
    "CallableSource",
    "DataSource",
    "EightGaussiansSource",
    "MnistSource",
    "TensorSource",
    "as_data_source",
]


class DataSource:
    """Protocol of a clean-data source: ``dim`` (d) and ``draw(batch_size, generator) -> (batch_size, d)``.

    ``to(device)`` returns a source whose draws land on ``device`` (the generator passed to
    ``draw`` lives there too); sources holding data move it once.
    """

    dim: int

    def draw(self, batch_size: int, generator: torch.Generator) -> torch.Tensor:  # pragma: no cover - protocol
        raise NotImplementedError

    def to(self, device) -> "DataSource":
        return self


def _check_batch(batch_size) -> int:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int):
        raise TypeError(f"batch_size must be an int, got {type(batch_size).__name__}")
    if batch_size < 0:
        raise ValueError(f"batch_size must be >= 0, got {batch_size}")
    return batch_size


class TensorSource(DataSource):
    """A fixed set of examples ``(n, d)`` drawn uniformly with replacement.

    Args:
        examples: ``(n, d)`` floating-point tensor (n ≥ 1, d ≥ 1), or uint8/int pixels together
            with ``transform``.
        transform: optional function mapping a gathered batch ``(b, d)`` and the generator to
            floating-point examples (e.g. pixel scaling with dequantization); it may draw from
            the generator.

    ``draw(b, g)`` draws the b indices with ``torch.randint(n, (b,), generator=g)`` on g's
    device, then gathers; ``to(device)`` moves the examples once (data on the GPU for GPU runs).
    """

    def __init__(self, examples: torch.Tensor, transform: Optional[Callable] = None):
        if not isinstance(examples, torch.Tensor):
            raise TypeError(f"examples must be a torch.Tensor (n, d), got {type(examples).__name__}")
        if examples.dim() != 2 or examples.shape[0] < 1 or examples.shape[1] < 1:
            raise ValueError(f"examples must have shape (n, d) with n, d >= 1, got {tuple(examples.shape)}")
        if examples.device.type == "meta":
            raise ValueError("examples must hold data (a tensor on the meta device has none)")
        if transform is None and not examples.is_floating_point():
            raise TypeError(f"examples must be floating point (or pass a transform), got {examples.dtype}")
        if transform is not None and not callable(transform):
            raise TypeError(f"transform must be callable, got {type(transform).__name__}")
        if examples.is_floating_point():  # (one pass, once: a NaN would surface steps later as a NaN loss)
            bad = ~torch.isfinite(examples).all(-1)
            if bool(bad.any()):
                raise ValueError(f"examples must be finite, got NaN or inf in {int(bad.sum())} of {len(bad)} rows "
                                 f"(the first: row {int(bad.nonzero()[0, 0])})")
        self.examples = examples
        self.transform = transform
        self.dim = int(examples.shape[1])

    def __len__(self) -> int:
        return int(self.examples.shape[0])

    def draw(self, batch_size: int, generator: torch.Generator) -> torch.Tensor:
        batch_size = _check_batch(batch_size)
        generator = check_generator(generator)
        idx = torch.randint(len(self), (batch_size,), generator=generator, device=generator.device)
        batch = self.examples[idx.to(self.examples.device)]
        return batch if self.transform is None else self.transform(batch, generator)

    def to(self, device) -> "TensorSource":
        return TensorSource(self.examples.to(device), self.transform)


class CallableSource(DataSource):
    """A function ``draw(batch_size, generator) -> (batch_size, d)``; ``dim`` is d.

    The function must take every random number from ``generator`` (and put its batch on the
    generator's device) for runs to be reproducible.
    """

    def __init__(self, draw: Callable[[int, torch.Generator], torch.Tensor], dim: int):
        if not callable(draw):
            raise TypeError(f"draw must be callable as draw(batch_size, generator), got {type(draw).__name__}")
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
            raise ValueError(f"dim must be an int >= 1, got {dim!r}")
        self._draw = draw
        self.dim = dim

    def draw(self, batch_size: int, generator: torch.Generator) -> torch.Tensor:
        batch_size = _check_batch(batch_size)
        x = self._draw(batch_size, check_generator(generator))
        if not isinstance(x, torch.Tensor) or not x.is_floating_point() or tuple(x.shape) != (batch_size, self.dim):
            got = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"the data source's draw({batch_size}, generator) must return a floating-point "
                             f"({batch_size}, {self.dim}) tensor, got {got}")
        return x


class EightGaussiansSource(DataSource):
    """Clean points of :class:`etweedie.data.EightGaussians` (d = 2): ``draw`` = ``ring.sample(b, g)[0]``."""

    def __init__(self, ring: Optional[EightGaussians] = None):
        if ring is not None and not isinstance(ring, EightGaussians):
            raise TypeError(f"ring must be an etweedie.data.EightGaussians or None, got {type(ring).__name__}")
        self.ring = ring if ring is not None else EightGaussians()
        self.dim = self.ring.dim

    def draw(self, batch_size: int, generator: torch.Generator) -> torch.Tensor:
        generator = check_generator(generator)
        return self.ring.sample(_check_batch(batch_size), generator, device=generator.device)[0]


class MnistSource(TensorSource):
    """MNIST digits as flat 784-vectors, pixels scaled to ``pixel_range``, optionally dequantized.

    A pixel p ∈ {0, …, 255} becomes ``low + (high − low) · q`` with q = p / 255, or, with
    ``dequantize=True``, q = (p + U) / 256 with U ~ U[0, 1) drawn from the generator afresh at every
    draw (uniform dequantization: the discrete pixel law becomes a continuous density, so the
    posterior is not asked to put mass on 256 atoms).

    Args:
        images: ``(n, 784)`` or ``(n, 28, 28)`` uint8 pixels (the reader's output).
        pixel_range: ``(low, high)`` with low < high; default (−1, 1).
        dequantize: add uniform noise before scaling (default True).
    """

    def __init__(self, images: torch.Tensor, pixel_range: Tuple[float, float] = (-1.0, 1.0), dequantize: bool = True):
        if not isinstance(images, torch.Tensor) or images.dtype != torch.uint8 or images.dim() not in (2, 3):
            got = f"{images.dtype} {tuple(images.shape)}" if isinstance(images, torch.Tensor) else type(images).__name__
            raise TypeError(f"images must be a uint8 tensor (n, 784) or (n, 28, 28), got {got}")
        try:
            low, high = (float(t) for t in pixel_range)
        except (TypeError, ValueError):
            raise ValueError(f"pixel_range must be two numbers (low, high), got {pixel_range!r}") from None
        if not (math.isfinite(low) and math.isfinite(high) and low < high):
            raise ValueError(f"pixel_range must be (low, high), finite, with low < high, got {tuple(pixel_range)!r}")
        if images.numel() == 0:
            raise ValueError(f"images must hold at least one image with at least one pixel, got shape {tuple(images.shape)}")
        if not isinstance(dequantize, bool):
            raise TypeError(f"dequantize must be a bool, got {type(dequantize).__name__}")
        self.pixel_range, self.dequantize = (low, high), dequantize
        super().__init__(images.reshape(images.shape[0], -1), self._scale)

    def _scale(self, pixels: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        low, high = self.pixel_range
        q = pixels.to(torch.float32)
        if self.dequantize:
            q = (q + torch.rand(q.shape, generator=generator, device=q.device)) / 256.0
        else:
            q = q / 255.0
        return low + (high - low) * q

    def to(self, device) -> "MnistSource":
        return MnistSource(self.examples.to(device), self.pixel_range, self.dequantize)


def as_data_source(data: Union[DataSource, torch.Tensor, Callable], dim: Optional[int] = None, *,
                   dim_name: str = "dim") -> DataSource:
    """A :class:`DataSource` from a source, a tensor of examples ``(n, d)``, or a callable ``draw(b, g)``.

    For a callable, ``dim`` is required unless the callable has a ``dim`` attribute; ``dim_name``
    is the caller's name for it in the error (``train`` calls it ``data_dim``).  Given with a
    source or a tensor, ``dim`` must equal its d (a ValueError otherwise, never silently ignored).
    """
    if isinstance(data, (DataSource, torch.Tensor)):
        source = data if isinstance(data, DataSource) else TensorSource(data)
        d = getattr(source, "dim", None)
        if isinstance(d, bool) or not isinstance(d, int) or d < 1:
            raise TypeError(f"the data source's dim must be an int >= 1, got {type(d).__name__} {d!r}")
        if dim is not None and dim != d:
            raise ValueError(f"{dim_name}={dim!r} disagrees with the data's dimension d = {d} "
                             f"(pass {dim_name} only for a callable, or the data's own d)")
        return source
    if callable(data):
        dim = getattr(data, "dim", None) if dim is None else dim
        if dim is None:
            raise ValueError(f"a callable data source needs its dimension: pass {dim_name}= (the d of its (batch, d) draws)")
        return CallableSource(data, dim)
    raise TypeError(f"data must be a DataSource, a (n, d) tensor or a callable draw(batch_size, generator), "
                    f"got {type(data).__name__}")
