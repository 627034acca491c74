"""MNIST image metrics and `etweedie mnist-eval` on the real data.

The classifier tests need onnx and onnxruntime (``pip install etweedie[mnist]``) and the MNIST
files (the repository's ``data/mnist`` or ``../shared/data/mnist``); they skip with the reason
when either is absent.  The small-tensor tests of the metric functions always run.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import etweedie
from etweedie.cli import main
from etweedie.evaluation.image_metrics import (
    FEATURE_TENSOR,
    LOGITS_TENSOR,
    MnistClassifier,
    MnistEvaluator,
    as_unit_images,
    bootstrap_feature_energy_distance,
    class_tv,
    classes_present,
    classifier_path,
    feature_energy_distance,
    mean_confidence,
    nearest_train,
    null_feature_energy_distance,
)
from etweedie.evaluation import stratified_bootstrap_energy_distance
from etweedie.data import MNIST_FILES

ROOT = Path(__file__).resolve().parent.parent
_NAMES = [name for pair in MNIST_FILES.values() for name in pair]


def _mnist_dir():
    for folder in (ROOT / "data" / "mnist", ROOT.parent / "shared" / "data" / "mnist"):
        if all((folder / f"{n}.gz").is_file() or (folder / n).is_file() for n in _NAMES):
            return folder
    return None


def _has_onnx() -> bool:
    try:
        import onnx  # noqa: F401
        import onnxruntime  # noqa: F401
    except ImportError:
        return False
    return True


DATA = _mnist_dir()
needs_onnx = pytest.mark.skipif(not _has_onnx(), reason="onnx/onnxruntime not installed (pip install etweedie[mnist])")
needs_data = pytest.mark.skipif(
    DATA is None, reason="MNIST IDX files absent (looked in <repo>/data/mnist and ../shared/data/mnist)"
)


@pytest.fixture(scope="module")
def evaluator():
    return MnistEvaluator(DATA)


@pytest.fixture(scope="module")
def real_row(evaluator):
    """The real-vs-real row at the paper's n = 768 (1,000 replicates; a 100-draw null keeps the test short)."""
    return evaluator.evaluate(evaluator.real_images(768), n_boot=1000, null_draws=100)


# ---------------------------------------------------------------------------- classifier
@needs_onnx
def test_packaged_model_is_the_zoo_file():
    import hashlib

    data = classifier_path().read_bytes()
    assert len(data) == 26143
    assert hashlib.sha256(data).hexdigest() == "5c688690f8bacf667d4c2074af5ad0646ca328d7ab03eccf944a65b320171bdd"


@needs_onnx
@pytest.mark.parametrize("flushing", [False, True])
def test_the_classifier_leaves_the_callers_subnormal_mode(flushing):
    """onnxruntime's flush-to-zero (set for the classifier's own speed) must not leak into the
    calling thread: a subnormal float32 still reads as itself after building and running it, and
    a caller who flushes on purpose keeps flushing."""
    torch.set_flush_denormal(flushing)
    try:
        clf = MnistClassifier()
        assert (float(torch.tensor(1e-40)) == 0.0) is flushing
        clf(torch.rand(3, 28, 28, generator=torch.Generator().manual_seed(0)))
        assert (float(torch.tensor(1e-40)) == 0.0) is flushing
    finally:
        torch.set_flush_denormal(False)


@needs_onnx
@needs_data
def test_rewritten_graph_matches_batch_one_original(evaluator):
    """Logits of the unmodified batch-1 graph, one image at a time, equal the rewritten graph's at batch 1,000."""
    import onnxruntime as ort

    images = evaluator.test_images[:1000]
    feats, logits = evaluator.classifier(images)
    assert feats.shape == (1000, 256) and logits.shape == (1000, 10)
    assert bool((feats >= 0).all())  # post-ReLU max-pool
    original = ort.InferenceSession(str(classifier_path()), providers=["CPUExecutionProvider"])
    x = as_unit_images(images).numpy()[:, None]
    for k in (0, 1, 517, 999):
        (one,) = original.run([LOGITS_TENSOR], {"Input3": x[k:k + 1]})
        torch.testing.assert_close(logits[k:k + 1], torch.from_numpy(one), rtol=1e-5, atol=1e-4)
        f1, z1 = evaluator.classifier(images[k:k + 1])  # the rewritten graph at batch 1
        torch.testing.assert_close(f1[0], feats[k], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(z1[0], logits[k], rtol=1e-5, atol=1e-4)
    # the exposed features are the ones the logits are computed from
    import onnx
    from onnx import numpy_helper

    init = {i.name: numpy_helper.to_array(i) for i in onnx.load(str(classifier_path())).graph.initializer}
    weight = torch.from_numpy(init["Parameter193"].reshape(256, 10))
    bias = torch.from_numpy(init["Parameter194"]).reshape(10)
    torch.testing.assert_close(feats.double() @ weight.double() + bias.double(), logits.double(), rtol=1e-4, atol=1e-3)
    assert FEATURE_TENSOR == "Pooling160_Output_0_reshape0"


@needs_onnx
@needs_data
def test_t10k_accuracy(evaluator):
    assert abs(evaluator.test_accuracy - 0.989) <= 0.001


@needs_onnx
@needs_data
def test_uint8_and_unit_float_inputs_agree(evaluator):
    images = evaluator.test_images[:64]
    f8, z8 = evaluator.classifier(images)
    ff, zf = evaluator.classifier(images.double() / 255)
    fn, zn = evaluator.classifier(images.reshape(64, 784).numpy())
    torch.testing.assert_close(f8, ff)
    torch.testing.assert_close(z8, zn)


# ---------------------------------------------------------------------------- the real-vs-real row
@needs_onnx
@needs_data
def test_real_vs_real_row_reproduces_paper_confidence_and_null(evaluator, real_row):
    assert real_row["n"] == 768 and real_row["classes_present"] == 10
    assert abs(real_row["mean_confidence"] - 0.993) <= 0.002, real_row
    lo, hi = real_row["mean_confidence_ci"]
    assert lo < real_row["mean_confidence"] < hi
    # the pixel scale, independent of which 768 images form the row: the whole held-out pool
    pool_conf = mean_confidence(evaluator.test_logits[evaluator.pool_index])
    assert abs(pool_conf - 0.993) <= 0.002
    assert 0.010 <= real_row["null_p95"] <= 0.030, real_row
    assert abs(real_row["null_mean"]) < 0.005  # unbiased estimator: the null is centred at 0
    # the row is a draw from its own null: below the null's far tail
    assert real_row["feature_ed"] < 2 * real_row["null_p95"]
    assert real_row["class_tv"] < 0.12 and 0.13 < real_row["nearest_train_rmse"] < 0.17


@needs_onnx
@needs_data
def test_held_out_images_are_disjoint_from_the_bank(evaluator):
    bank, pool = set(evaluator.bank_index.tolist()), set(evaluator.pool_index.tolist())
    assert len(bank) == 2048 and len(pool) == 7952 and not bank & pool


@needs_onnx
@needs_data
def test_null_draws_equal_the_energy_distance_op(evaluator):
    n, draws, pool = 300, 2, evaluator.pool[:1500]
    null = null_feature_energy_distance(pool, evaluator.bank, n, draws=draws, generator=torch.Generator().manual_seed(7))
    g = torch.Generator().manual_seed(7)
    for k in range(draws):
        idx = torch.randperm(pool.shape[0], generator=g)[:n]
        op = float(etweedie.energy_distance(pool[idx].double(), evaluator.bank.double(), 1.0, unbiased=True))
        assert abs(float(null[k]) - op) <= 1e-9 * max(1.0, abs(op)), (k, float(null[k]), op)


@needs_onnx
@needs_data
def test_feature_ed_float32_matches_float64_op(evaluator):
    feats, bank = evaluator.pool[:300], evaluator.bank[:600]
    ed32 = feature_energy_distance(feats, bank)
    ed64 = float(etweedie.energy_distance(feats.double(), bank.double(), backend="reference"))
    assert abs(ed32 - ed64) < 1e-6


@needs_onnx
@needs_data
def test_feature_ed_of_copies_is_nonpositive_and_grows_with_blur_and_shift(evaluator, real_row):
    feats = evaluator.classifier.features(evaluator.real_images(768))
    assert feature_energy_distance(feats, feats) <= 1e-9
    images = evaluator.real_images(768).float() / 255
    blurred = torch.nn.functional.avg_pool2d(images[:, None], 3, stride=1, padding=1, count_include_pad=False)[:, 0]
    ed = {}
    for name, x in (
        ("blur", blurred),
        ("shift1", torch.roll(images, 1, dims=2)),
        ("shift3", torch.roll(images, 3, dims=2)),
    ):
        ed[name] = feature_energy_distance(evaluator.classifier.features(x), evaluator.bank)
    p95 = real_row["null_p95"]
    assert ed["blur"] > 3 * p95 and ed["shift1"] > 3 * p95, (ed, p95)
    assert ed["shift3"] > ed["shift1"], ed


@needs_onnx
@needs_data
def test_nearest_train_of_a_training_image_is_zero(evaluator):
    train = evaluator.train_images
    rmse, index = nearest_train(train[[0, 123, 59999]], train)
    assert rmse.tolist() == [0.0, 0.0, 0.0]
    assert torch.equal(train[index], train[[0, 123, 59999]])


@needs_onnx
@needs_data
def test_nearest_train_equals_brute_force(evaluator):
    train = evaluator.train_images[:3000]
    queries = evaluator.test_images[:40]
    rmse, index = nearest_train(queries, train, chunk=700)
    d = torch.cdist(queries.reshape(40, -1).double() / 255, train.reshape(3000, -1).double() / 255, compute_mode="donot_use_mm_for_euclid_dist")
    best, best_index = d.min(1)
    torch.testing.assert_close(rmse, best / 28.0, rtol=1e-12, atol=1e-12)
    assert torch.equal(index, best_index)


# ---------------------------------------------------------------------------- metric functions (no data needed)
def test_null_batched_and_one_draw_paths_agree(monkeypatch):
    import etweedie.evaluation.image_metrics as image_metrics

    g = torch.Generator().manual_seed(3)
    pool, bank = torch.rand(200, 16, generator=g), torch.rand(60, 16, generator=g)
    batched = null_feature_energy_distance(pool, bank, 40, draws=7, generator=torch.Generator().manual_seed(1))
    monkeypatch.setattr(image_metrics, "_NULL_BLOCK_ELEMENTS", 40 * 40)  # forces one draw at a time
    single = null_feature_energy_distance(pool, bank, 40, draws=7, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(batched, single, rtol=0, atol=1e-12)
    idx = torch.randperm(200, generator=torch.Generator().manual_seed(1))[:40]  # the first draw, by the op
    assert float(single[0]) == pytest.approx(float(etweedie.energy_distance(pool[idx].double(), bank.double())), abs=1e-12)


def test_bootstrap_matches_the_metrics_bootstrap():
    g = torch.Generator().manual_seed(0)
    bank = torch.randn(50, 8, generator=g, dtype=torch.float64)
    groups = [torch.randn(20, 8, generator=g, dtype=torch.float64) + 0.3 for _ in range(3)]
    ours = bootstrap_feature_energy_distance(groups, bank, n_boot=70, generator=torch.Generator().manual_seed(5))
    _, lo, hi = stratified_bootstrap_energy_distance(groups, bank, n_boot=70, generator=torch.Generator().manual_seed(5))
    assert ours[0] == pytest.approx(lo, abs=1e-10) and ours[1] == pytest.approx(hi, abs=1e-10)


def test_class_metrics_small_examples():
    prior = torch.full((10,), 0.1)
    assert class_tv(torch.arange(10), prior) == pytest.approx(0.0)
    assert class_tv(torch.tensor([0, 0, 1, 1]), prior) == pytest.approx(0.8)
    assert classes_present(torch.tensor([0] * 99 + [1])) == 1  # class 1 holds exactly 1 %: not above it
    assert classes_present(torch.tensor([0] * 98 + [1, 1])) == 2
    logits = torch.tensor([[0.0] * 10, [100.0] + [0.0] * 9])
    assert mean_confidence(logits) == pytest.approx((0.1 + 1.0) / 2)


def test_bad_inputs_give_named_errors():
    with pytest.raises(TypeError, match="images must be a dense tensor"):
        as_unit_images(torch.zeros(2, 784).to_sparse())
    with pytest.raises(ValueError, match=r"shape \(n, 28, 28\) or \(n, 784\)"):
        as_unit_images(torch.zeros(4, 27, 28))
    with pytest.raises(ValueError, match="NaN"):
        as_unit_images(torch.full((2, 784), float("nan")))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        as_unit_images(torch.full((2, 28, 28), 1.5))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        as_unit_images(np.full((2, 28, 28), 255.0))  # float 0..255 is not a valid scale
    with pytest.raises(TypeError, match="uint8"):
        as_unit_images(torch.zeros(2, 28, 28, dtype=torch.int32))
    with pytest.raises(ValueError, match="at least one image"):
        as_unit_images(torch.zeros(0, 784))
    with pytest.raises(ValueError, match="labels in 0..9"):
        class_tv(torch.tensor([3, 11]), torch.full((10,), 0.1))
    for prior in (torch.zeros(10), torch.full((10,), math.inf), torch.ones(10, dtype=torch.int64)):
        with pytest.raises(ValueError, match="prior must be a finite, non-negative float"):
            class_tv(torch.tensor([0, 1]), prior)
    for train in (torch.full((3, 784), 255.0), torch.full((3, 28, 28), float("nan"))):  # float train on the 0..255 scale, NaN
        with pytest.raises(ValueError, match=r"train must hold float images in \[0, 1\]"):
            nearest_train(torch.zeros(2, 784), train)
    with pytest.raises(ValueError, match="shape"):
        feature_energy_distance(torch.zeros(1, 4), torch.zeros(3, 4))


@needs_onnx
def test_an_unreadable_onnx_file_is_a_named_error(tmp_path):
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"\x08\x07 not a model")
    with pytest.raises(ValueError, match="junk.onnx is not a readable MNIST-12 ONNX model"):
        MnistClassifier(path=junk)


def test_missing_onnx_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    with pytest.raises(ImportError, match=r"etweedie\[mnist\]"):
        MnistClassifier()


@needs_onnx
def test_missing_data_dir_is_a_named_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="t10k-images-idx3-ubyte"):
        MnistEvaluator(tmp_path / "absent")


# ---------------------------------------------------------------------------- CLI
@needs_onnx
@needs_data
def test_cli_scores_files_and_writes_json_and_figures(tmp_path, capsys, evaluator, monkeypatch):
    import etweedie.evaluation.image_metrics as image_metrics

    # the module's evaluator (its set-up classifies t10k; the data-dir path has its own test below)
    monkeypatch.setattr(image_metrics, "MnistEvaluator", lambda data_dir, classifier=None: evaluator)
    images = evaluator.test_images[evaluator.pool_index[-96:]]
    np.save(tmp_path / "a.npy", images.numpy())
    torch.save({"images": images.float().reshape(96, 784) / 255}, tmp_path / "b.pt")
    out = tmp_path / "out.json"
    rc = main([
        "mnist-eval", str(tmp_path / "a.npy"), str(tmp_path / "b.pt"), "--data-dir", str(DATA), "--groups", "3",
        "--n-boot", "50", "--null-draws", "5", "--json", str(out), "--figures", str(tmp_path / "figs"),
    ])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert "a.npy" in printed and "b.pt" in printed
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [r["n"] for r in rows] == [96, 96]
    for key in ("feature_ed", "feature_ed_ci", "null_mean", "null_p95", "mean_confidence", "class_tv",
                "classes_present", "nearest_train_rmse"):
        assert key in rows[0], key
    assert rows[0]["feature_ed"] == pytest.approx(rows[1]["feature_ed"], abs=1e-6)  # same images, two formats
    assert sorted(p.name for p in (tmp_path / "figs").iterdir()) == [
        "a_grid.png", "a_nearest_train.png", "b_grid.png", "b_nearest_train.png"]


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda p: np.save(p / "s.npy", np.zeros((4, 27, 28), np.float32)), "shape"),
        (lambda p: np.save(p / "s.npy", np.full((4, 784), 2.0, np.float32)), "[0, 1]"),
        (lambda p: np.save(p / "s.npy", np.full((4, 784), np.nan, np.float32)), "NaN"),
        (lambda p: (p / "s.npy").write_bytes(b"junk"), "cannot read"),
    ],
)
def test_cli_bad_sample_files_exit_2_with_one_line(tmp_path, capsys, make, message):
    make(tmp_path)
    rc = main(["mnist-eval", str(tmp_path / "s.npy"), "--data-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("\n") == 1 and message in err and "s.npy" in err, err


def test_cli_usage_errors_exit_2(tmp_path, capsys):
    assert main(["mnist-eval"]) == 2
    assert "SAMPLES" in capsys.readouterr().err
    assert main(["mnist-eval", str(tmp_path / "missing.npy")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["mnist-eval", "--real", "768", "--n-boot", "1"]) == 2
    assert "--n-boot" in capsys.readouterr().err
    assert main(["mnist-eval", "--real", "768", "--seed", "9223372036854775"]) == 2
    assert "--seed must be in [0, " in capsys.readouterr().err
    # the outputs' paths, the threads and the grouping are checked before the (seconds-long) set-up
    np.save(tmp_path / "s.npy", np.random.default_rng(0).random((16, 784), dtype=np.float32))
    sample = str(tmp_path / "s.npy")
    (tmp_path / "file").write_text("x")
    for extra, message in [
        (["--json", ""], "--json must be a file path"),
        (["--json", str(tmp_path)], "is a folder"),
        (["--json", str(tmp_path / "file" / "out.json")], "--json"),
        (["--figures", str(tmp_path / "file")], "--figures"),
        (["--threads", "100000"], "--threads must be in [1, 1024]"),
        (["--groups", "3"], "--groups 3 must split its 16 images"),
    ]:
        assert main(["mnist-eval", sample, *extra]) == 2, extra
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, (extra, err)


@needs_onnx
def test_cli_missing_data_dir_exit_2(tmp_path, capsys):
    rc = main(["mnist-eval", "--real", "10", "--data-dir", str(tmp_path / "absent")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "train-images-idx3-ubyte" in err


def test_null_and_bootstrap_name_a_feature_width_mismatch_and_a_bad_chunk():
    g = torch.Generator().manual_seed(0)
    pool, bank = torch.randn(10, 4, generator=g), torch.randn(12, 3, generator=g)
    with pytest.raises(ValueError, match="pool has 4 features per image, bank has 3"):
        null_feature_energy_distance(pool, bank, 5, draws=3, generator=g)
    with pytest.raises(ValueError, match=r"groups\[0\] has 4 features per image, bank has 3"):
        bootstrap_feature_energy_distance([pool], bank, n_boot=4, generator=g)
    with pytest.raises(ValueError, match="chunk must be an int >= 1"):
        bootstrap_feature_energy_distance([pool], torch.randn(12, 4, generator=g), n_boot=4, generator=g, chunk=0)
