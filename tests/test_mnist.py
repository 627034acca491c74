"""MNIST IDX reader: canonical checksums, shapes and labels, gz/raw and torchvision layouts, named errors.

Real-data tests read the repository's ``data/mnist`` (or ``../shared/data/mnist`` beside the
checkout) and skip with the reason when neither holds the four files.
"""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest
import torch

from etweedie.data import ENV_VAR, MNIST_FILES, MnistChecksumError, default_data_dir, find_mnist_files, load_mnist

ROOT = Path(__file__).resolve().parent.parent
_NAMES = [name for pair in MNIST_FILES.values() for name in pair]


def _mnist_dir():
    for folder in (ROOT / "data" / "mnist", ROOT.parent / "shared" / "data" / "mnist"):
        if all((folder / f"{n}.gz").is_file() or (folder / n).is_file() for n in _NAMES):
            return folder
    return None


DATA = _mnist_dir()
needs_data = pytest.mark.skipif(
    DATA is None, reason="MNIST IDX files absent (looked in <repo>/data/mnist and ../shared/data/mnist)"
)

# Class counts of the 10,000 t10k labels (a published property of the test set).
T10K_COUNTS = [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]


@needs_data
def test_train_and_test_splits_load_with_canonical_content():
    images, labels = load_mnist("train", DATA)
    assert images.shape == (60000, 28, 28) and images.dtype == torch.uint8
    assert labels.shape == (60000,) and labels.dtype == torch.int64
    assert labels[:8].tolist() == [5, 0, 4, 1, 9, 2, 1, 3]
    test_images, test_labels = load_mnist("test", DATA)
    assert test_images.shape == (10000, 28, 28) and test_labels[:5].tolist() == [7, 2, 1, 0, 4]
    assert torch.bincount(test_labels, minlength=10).tolist() == T10K_COUNTS
    # digits are bright on a dark background: corners are empty, the centre holds ink
    assert int(test_images[:, 0, 0].max()) == 0 and float(test_images[:, 10:18, 10:18].float().mean()) > 60


@needs_data
def test_returned_tensors_are_fresh_copies():
    a, _ = load_mnist("test", DATA)
    a[0].fill_(255)
    b, _ = load_mnist("test", DATA)
    assert int(b[0, 0, 0]) == 0


@needs_data
def test_torchvision_raw_layout_with_mixed_raw_and_gz(tmp_path):
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for name in MNIST_FILES["test"]:  # uncompressed
        src = DATA / name
        data = src.read_bytes() if src.is_file() else gzip.open(DATA / f"{name}.gz").read()
        (raw / name).write_bytes(data)
    for name in MNIST_FILES["train"]:  # gzipped, as distributed
        (raw / f"{name}.gz").symlink_to(DATA / f"{name}.gz")
    assert default_data_dir(tmp_path) == raw
    assert find_mnist_files("test", tmp_path)[0].name == "t10k-images-idx3-ubyte"
    images, labels = load_mnist("test", tmp_path)
    ref_images, ref_labels = load_mnist("test", DATA)
    assert torch.equal(images, ref_images) and torch.equal(labels, ref_labels)


@needs_data
def test_environment_variable_is_used(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_VAR, str(DATA))
    assert default_data_dir() == DATA
    monkeypatch.setenv(ENV_VAR, str(tmp_path))
    with pytest.raises(FileNotFoundError, match=ENV_VAR):
        default_data_dir()


@needs_data
def test_altered_file_fails_the_checksum(tmp_path):
    for name in _NAMES:
        (tmp_path / f"{name}.gz").symlink_to(DATA / f"{name}.gz")
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    data = bytearray(gzip.open(DATA / "t10k-labels-idx1-ubyte.gz").read())
    data[100] = (data[100] + 1) % 10  # a plausible but wrong label
    (tmp_path / "t10k-labels-idx1-ubyte").write_bytes(bytes(data))
    with pytest.raises(MnistChecksumError, match="t10k-labels-idx1-ubyte"):
        load_mnist("test", tmp_path)
    _, labels = load_mnist("test", tmp_path, verify=False)  # opting out reads the altered bytes
    assert int(labels[100 - 8]) == data[100]  # 8-byte IDX label header
    (tmp_path / "t10k-labels-idx1-ubyte").write_bytes(bytes(data[:5000]))  # truncated
    with pytest.raises(MnistChecksumError):
        load_mnist("test", tmp_path)
    with pytest.raises(ValueError, match="dimensions|data bytes"):
        load_mnist("test", tmp_path, verify=False)


def test_missing_directory_names_folders_and_files(tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        load_mnist("train", tmp_path / "nowhere")
    message = str(info.value)
    assert str(tmp_path / "nowhere") in message and "MNIST/raw" in message
    for name in _NAMES:
        assert name in message
    (tmp_path / "train-images-idx3-ubyte.gz").write_bytes(b"")  # one of four is not enough
    with pytest.raises(FileNotFoundError, match="t10k-labels-idx1-ubyte"):
        default_data_dir(tmp_path)


def test_bad_arguments():
    with pytest.raises(ValueError, match="split must be 'train' or 'test'"):
        load_mnist("validation")
    with pytest.raises(ValueError, match="split must be 'train' or 'test'"):
        load_mnist(["test"])  # (not hashable: a TypeError from the lookup before)
    with pytest.raises(TypeError, match="data_dir"):
        load_mnist("test", data_dir=3)


def test_corrupt_gzip_is_a_named_error(tmp_path):
    for name in _NAMES:
        (tmp_path / f"{name}.gz").write_bytes(b"not gzip")
    with pytest.raises(MnistChecksumError, match="gzip"):
        load_mnist("test", tmp_path)
    # a valid gzip header with a corrupt deflate body: zlib's own error, named the same way
    raw = gzip.compress(bytes(range(256)) * 64)
    for name in _NAMES:
        (tmp_path / f"{name}.gz").write_bytes(raw[:10] + bytes([raw[10] ^ 0xFF]) + raw[11:])
    with pytest.raises(MnistChecksumError, match="gzip"):
        load_mnist("test", tmp_path)


def test_repository_carries_the_data_and_its_licence(monkeypatch):
    folder = ROOT / "data" / "mnist"
    if not folder.is_dir():
        pytest.skip("not a source checkout (no data/mnist folder)")
    readme = (folder / "README.md").read_text()
    assert "CC BY-SA 3.0" in readme
    for name in _NAMES:
        assert (folder / f"{name}.gz").is_file(), name
        assert name in readme
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert default_data_dir() == folder  # the default for a source checkout


# ---------------------------------------------------------------------------- audit regressions
def _fake_folder(folder):
    """Four placeholder files: enough for the folder look-up, not a valid IDX file among them."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in _NAMES:
        (folder / f"{name}.gz").write_bytes(b"")
    return folder


def test_an_empty_data_dir_is_refused_not_read_as_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(_fake_folder(tmp_path))  # Path("") is "." : it found these files
    for empty in ("", "  "):
        with pytest.raises(ValueError, match="data_dir must be a folder path"):
            default_data_dir(empty)
        with pytest.raises(ValueError, match="data_dir must be a folder path"):
            load_mnist("test", empty)


def test_verify_must_be_a_bool(tmp_path):
    folder = _fake_folder(tmp_path)
    for bad in (None, 0, "yes"):  # None switched the checksums off
        with pytest.raises(TypeError, match="verify must be True or False"):
            load_mnist("test", folder, verify=bad)


def test_pretrained_dir_expands_a_home_relative_environment_value(tmp_path, monkeypatch):
    from etweedie.training.pretrained import ENV_VAR as PRETRAINED_ENV
    from etweedie.training import pretrained_dir

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv(PRETRAINED_ENV, "~/weights")
    assert pretrained_dir() == tmp_path / "weights"


def test_mnist_eval_reads_a_big_endian_npy(tmp_path):
    import numpy as np

    from etweedie.commands.mnist_eval import load_samples

    native = np.random.default_rng(0).random((4, 784)).astype(np.float32)
    np.save(tmp_path / "be.npy", native.astype(">f4"))
    got = load_samples(tmp_path / "be.npy")
    assert got.dtype == torch.float32 and torch.equal(got, torch.from_numpy(native))


def test_mnist_eval_refuses_an_empty_data_dir_and_json_over_a_samples_file(tmp_path, capsys):
    import numpy as np

    from etweedie.cli import main

    sample = tmp_path / "s.npy"
    np.save(sample, np.zeros((4, 784), np.float32))
    before = sample.read_bytes()
    assert main(["mnist-eval", str(sample), "--data-dir", ""]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--data-dir must be a folder holding the MNIST files, got ''" in err, err
    # the JSON results would have replaced the samples they score (checked before any work)
    for alias in (str(sample), str(tmp_path / "." / "s.npy")):
        assert main(["mnist-eval", str(sample), "--json", alias, "--data-dir", str(tmp_path / "absent")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--json" in err and "SAMPLES file" in err, err
    assert sample.read_bytes() == before
