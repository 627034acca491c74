"""Safe, portable checkpoints: safetensors weights (sharded), weights_only resume state, no code
execution from a crafted file, named errors for corrupted files, legacy posterior.pt, the run lock."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from etweedie.training.checkpoint import (
    CheckpointError,
    RunLock,
    RunLockedError,
    load_weights,
    safe_torch_load,
    save_weights,
)
from etweedie.posteriors import EngressionPosterior
from etweedie.training import load_config, load_posterior, save_posterior, train

from conftest import gen

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "eight_gaussians_tiny.toml"


class _Payload:
    """Unpickling this object runs ``open(marker, 'w')``: what a hostile checkpoint would do."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _states_equal(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "run"
    config = load_config(TINY)
    import dataclasses

    config = dataclasses.replace(config, steps=20, checkpoint_every=20, log_every=10)
    return config, train(config, out, progress=False)


def test_posterior_directory_is_safetensors_and_json(tiny_run):
    _, summary = tiny_run
    post = Path(summary["posterior"])
    assert sorted(p.name for p in post.iterdir()) == ["config.json", "model.safetensors"]
    meta = json.loads((post / "config.json").read_text())
    assert meta["format"] == "etweedie.posterior/2" and meta["class"] == "EngressionPosterior"
    assert meta["step"] == 20 and meta["train_config"]["batch_size"] == 64
    from safetensors.torch import load_file

    ckpt = safe_torch_load(summary["checkpoint"])
    assert _states_equal(load_file(str(post / "model.safetensors")), ckpt["ema"])
    model = load_posterior(post)
    assert not model.training and _states_equal(model.state_dict(), ckpt["ema"])


def test_sharded_weights_round_trip_and_split_tensors(tmp_path):
    """Shards of at most max_shard_bytes; a tensor larger than a shard is split and re-joined."""
    model = EngressionPosterior(784, width=256, depth=2, noise_dim=8, init_seed=3)
    limit = 200_000  # the 256×784 float32 matrices (802,816 bytes) must be split
    save_posterior(model, tmp_path / "post", dtype="float32", shard_mb=limit / 2**20)
    files = sorted(p.name for p in (tmp_path / "post").iterdir())
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) > 4 and "model.safetensors.index.json" in files
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert all((tmp_path / "post" / f).stat().st_size <= limit + 4096 for f in shards)  # + the JSON header
    index = json.loads((tmp_path / "post" / "model.safetensors.index.json").read_text())
    assert "input_y.weight" in index["parts"] or "out.weight" in index["parts"]
    loaded = load_posterior(tmp_path / "post")
    assert _states_equal(loaded.state_dict(), model.state_dict())
    y, eta = torch.zeros(2, 784), torch.tensor([1.5, 0.3, -1.0, 0.1, 0.2])
    torch.testing.assert_close(loaded.sample(y, eta, 3, generator=gen(0)), model.eval().sample(y, eta, 3, generator=gen(0)))
    # half precision halves the files and loads back into a float32 model
    save_posterior(model, tmp_path / "half", dtype="float16", shard_mb=None)
    half = load_posterior(tmp_path / "half")
    assert half.out.weight.dtype == torch.float32
    torch.testing.assert_close(half.out.weight, model.out.weight, rtol=1e-3, atol=1e-4)
    # a missing shard or a truncated one is a named error
    (tmp_path / "post" / shards[1]).write_bytes((tmp_path / "post" / shards[1]).read_bytes()[:100])
    with pytest.raises(CheckpointError, match="corrupted or truncated"):
        load_posterior(tmp_path / "post")
    os.remove(tmp_path / "post" / shards[1])
    with pytest.raises(CheckpointError, match="is missing"):
        load_posterior(tmp_path / "post")


def test_int8_weights_quarter_the_bytes_and_round_trip_within_a_row_step(tmp_path):
    """int8 posteriors: matrices per-row int8 (+ a float32 scale per row), small tensors float16;
    every loaded weight within half a quantization step of the original, also when sharded."""
    model = EngressionPosterior(784, width=256, depth=2, noise_dim=8, init_seed=4)
    with torch.no_grad():
        model.out.weight[3].zero_()  # an all-zero row stays exactly zero
    save_posterior(model, tmp_path / "q", dtype="int8", shard_mb=None)
    save_posterior(model, tmp_path / "f32", dtype="float32", shard_mb=None)
    size = lambda d: sum(p.stat().st_size for p in d.glob("*.safetensors"))  # noqa: E731
    assert size(tmp_path / "q") < 0.27 * size(tmp_path / "f32")
    from safetensors.torch import load_file

    raw = load_file(str(tmp_path / "q" / "model.safetensors"))
    assert raw["out.weight"].dtype == torch.int8 and raw["out.weight::scale"].dtype == torch.float32
    small = [k for k, v in model.state_dict().items() if v.dim() < 2]
    assert small and all(raw[k].dtype == torch.float16 for k in small)
    meta = json.loads((tmp_path / "q" / "config.json").read_text())
    assert meta["weights"]["dtype"] == "int8" and "per-row int8" in meta["weights"]["int8"]
    loaded = load_posterior(tmp_path / "q")
    for name, w in model.state_dict().items():
        got = loaded.state_dict()[name]
        assert got.dtype == torch.float32 and got.shape == w.shape
        if name in raw and raw[name].dtype == torch.int8:
            step = w.reshape(w.shape[0], -1).abs().amax(1) / 127
            err = (got - w).reshape(w.shape[0], -1).abs().amax(1)
            assert bool((err <= step / 2 * (1 + 1e-5) + 1e-12).all()), name
    assert torch.equal(loaded.out.weight[3], torch.zeros_like(loaded.out.weight[3]))
    # sharded: an int8 matrix larger than a shard is split and re-joined before dequantization
    save_posterior(model, tmp_path / "qs", dtype="int8", shard_mb=100_000 / 2**20)
    assert len(list((tmp_path / "qs").glob("*.safetensors"))) > 2
    assert _states_equal(load_posterior(tmp_path / "qs").state_dict(), loaded.state_dict())
    # a scale without its matrix is a named error; NaN weights cannot be quantized
    from safetensors.torch import save_file

    raw.pop("out.weight")
    save_file(raw, str(tmp_path / "q" / "model.safetensors"))
    with pytest.raises(CheckpointError):
        load_weights(tmp_path / "q", verify=False)
    with torch.no_grad():
        model.out.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="finite"):
        save_posterior(model, tmp_path / "bad", dtype="int8")
    with pytest.raises(ValueError, match="dtype"):
        save_weights({"w": torch.ones(2, 2)}, tmp_path / "i32", {}, dtype=torch.int32)


def test_legacy_posterior_pt_loads_without_unpickling_code(tmp_path):
    model = EngressionPosterior(2, width=16, depth=1, init_seed=1)
    legacy = {"format": "etweedie.posterior/1", "model_config": model.config, "state_dict": model.state_dict(),
              "step": 5, "train_config": {"seed": 0}}
    torch.save(legacy, tmp_path / "posterior.pt")
    loaded = load_posterior(tmp_path / "posterior.pt")
    assert _states_equal(loaded.state_dict(), model.state_dict())
    assert _states_equal(load_posterior(tmp_path).state_dict(), model.state_dict())  # run dir with only posterior.pt
    save_posterior(loaded, tmp_path / "converted")  # conversion to the portable format
    assert _states_equal(load_posterior(tmp_path / "converted").state_dict(), model.state_dict())


@pytest.mark.parametrize("where", ["posterior", "checkpoint"])
def test_crafted_pickle_is_not_executed(tmp_path, where):
    """A checkpoint whose unpickling would write a marker file: refused with CheckpointError, the
    marker never appears (load_posterior on a .pt, and train resuming from OUT/checkpoint.pt)."""
    marker = tmp_path / "pwned"
    blob = {"format": "etweedie.checkpoint/1", "model_config": {}, "payload": _Payload(str(marker))}
    if where == "posterior":
        torch.save(blob, tmp_path / "evil.pt")
        with pytest.raises(CheckpointError, match="cannot be loaded safely"):
            load_posterior(tmp_path / "evil.pt")
    else:
        out = tmp_path / "run"
        out.mkdir()
        torch.save(blob, out / "checkpoint.pt")
        with pytest.raises(CheckpointError, match="cannot be loaded safely"):
            train(load_config(TINY), out, progress=False)
    assert not marker.exists()


@pytest.mark.parametrize("damage", ["empty", "truncated", "garbage"])
def test_damaged_checkpoints_are_named_errors(tmp_path, tiny_run, damage):
    config, summary = tiny_run
    data = Path(summary["checkpoint"]).read_bytes()
    out = tmp_path / "run"
    out.mkdir()
    ckpt = out / "checkpoint.pt"
    ckpt.write_bytes({"empty": b"", "truncated": data[: len(data) // 2], "garbage": os.urandom(4096)}[damage])
    with pytest.raises(CheckpointError, match=r"checkpoint\.pt"):
        train(config, out, progress=False)
    with pytest.raises(CheckpointError, match=r"checkpoint\.pt"):
        load_posterior(ckpt)


def test_weights_config_damage_is_named(tmp_path):
    save_weights({"w": torch.ones(3)}, tmp_path / "w", {"format": "x"})
    state, meta = load_weights(tmp_path / "w")
    assert torch.equal(state["w"], torch.ones(3)) and meta["format"] == "x"
    (tmp_path / "w" / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_weights(tmp_path / "w")
    with pytest.raises(ValueError, match="no posterior or checkpoint"):
        load_posterior(tmp_path / "nothing-here")


def test_run_lock_refuses_a_second_run(tmp_path):
    config = load_config(TINY)
    out = tmp_path / "run"
    out.mkdir()
    with RunLock(out):
        with pytest.raises(RunLockedError, match="another training run is using"):
            train(config, out, progress=False)
        assert not (out / "checkpoint.pt").exists()
    # released: the run goes ahead
    import dataclasses

    assert train(dataclasses.replace(config, steps=2), out, progress=False)["step"] == 2


def test_save_weights_checks_its_arguments(tmp_path):
    st = {"a": torch.ones(3)}
    with pytest.raises(TypeError, match="dtype must be a torch.dtype"):
        save_weights(st, tmp_path / "x", {}, dtype="float16")
    with pytest.raises(TypeError, match="names \\(str\\) to tensors"):
        save_weights({"a": [1, 2]}, tmp_path / "y", {})
    with pytest.raises(TypeError, match="JSON-serializable"):
        save_weights(st, tmp_path / "z", {"f": object()})
    assert not (tmp_path / "z").exists() and not (tmp_path / "z.tmp").exists()  # refused before any file


@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_weights_that_do_not_fit_the_dtype_are_refused(tmp_path, dtype):
    """A bias of 1e5 saved in float16 (int8 keeps small tensors in float16) became inf, and the
    file was then refused on load as damaged: refused when saving instead, naming the tensor."""
    m = EngressionPosterior(dim=2, width=8, depth=1)
    with torch.no_grad():
        m.out.bias.fill_(1e5)
    with pytest.raises(ValueError, match="'out.bias' does not fit torch.float16"):
        save_posterior(m, tmp_path / "p", dtype=dtype)


def test_load_weights_given_a_file_is_a_checkpoint_error(tmp_path):
    save_weights({"a": torch.ones(3)}, tmp_path / "w", {"x": 1})
    with pytest.raises(CheckpointError, match="is a file, not a weights directory"):
        load_weights(tmp_path / "w" / "config.json")


def test_save_weights_never_replaces_a_file(tmp_path):
    """A path naming an existing file was moved aside to '<name>.old' and the save then failed
    with NotADirectoryError; it is refused before anything moves."""
    precious = tmp_path / "weights"
    precious.write_text("someone's file")
    with pytest.raises(ValueError, match="is an existing file"):
        save_weights({"a": torch.ones(3)}, precious, {})
    assert precious.read_text() == "someone's file" and sorted(p.name for p in tmp_path.iterdir()) == ["weights"]
    with pytest.raises(TypeError, match="directory must be a str or os.PathLike, got int"):
        save_weights({"a": torch.ones(3)}, 5, {})
    # a stray file where the write keeps its temporary or old copy does not stop the save
    (tmp_path / "w.tmp").write_text("x")
    (tmp_path / "w.old").write_text("x")
    save_weights({"a": torch.ones(3)}, tmp_path / "w", {})
    save_weights({"a": torch.zeros(3)}, tmp_path / "w", {})
    assert torch.equal(load_weights(tmp_path / "w")[0]["a"], torch.zeros(3))
    assert not (tmp_path / "w.tmp").exists() and not (tmp_path / "w.old").exists()


# ---------------------------------------------------------------------------- hostile folders
def _sharded_int8(tmp_path: Path) -> Path:
    """A small posterior folder with int8 matrices, two shards or more and split tensors."""
    model = EngressionPosterior(64, width=128, depth=2, noise_dim=4)
    out = tmp_path / "post"
    save_posterior(model, out, dtype="int8", shard_mb=0.01)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["parts"] and len(json.loads((out / "config.json").read_text())["weights"]["files"]) > 1
    return out


def _rehash(folder: Path) -> None:
    """Make config.json's checksums match the files again (what a careful forger would do)."""
    from etweedie.training.checkpoint import _sha256

    meta = json.loads((folder / "config.json").read_text())
    for name in meta["weights"]["files"]:
        meta["weights"]["files"][name] = _sha256(folder / name)
    if "index" in meta["weights"]:
        meta["weights"]["index"] = _sha256(folder / "model.safetensors.index.json")
    (folder / "config.json").write_text(json.dumps(meta))


def _set_model_config(folder: Path, **changes) -> None:
    meta = json.loads((folder / "config.json").read_text())
    meta["model_config"].update(changes)
    (folder / "config.json").write_text(json.dumps(meta))


def _config_symlink(folder: Path, target: str) -> None:
    (folder / "config.json").unlink()
    os.symlink(target, folder / "config.json")


def _shard_symlink(folder: Path, _target=None) -> None:
    shard = sorted(folder.glob("model-*.safetensors"))[0]
    outside = folder.parent / "outside.safetensors"
    os.replace(shard, outside)
    os.symlink(outside, shard)


def _reorder_parts(folder: Path) -> None:
    path = folder / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    name = next(iter(index["parts"]))
    index["parts"][name] = list(reversed(index["parts"][name]))
    path.write_text(json.dumps(index))
    _rehash(folder)


def _retype_shard(folder: Path, dtype: torch.dtype) -> None:
    from safetensors.torch import load_file, save_file

    shard = sorted(folder.glob("model-*.safetensors"))[-1]
    tensors = load_file(str(shard))
    key = next(k for k, v in tensors.items() if v.is_floating_point() and "::" not in k)
    tensors[key] = tensors[key].to(dtype)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    _rehash(folder)


def _huge_scale(folder: Path) -> None:
    from safetensors.torch import load_file, save_file

    for shard in sorted(folder.glob("model-*.safetensors")):
        tensors = load_file(str(shard))
        scales = [k for k in tensors if k.endswith("::scale")]
        if scales:
            tensors[scales[0]] = torch.full_like(tensors[scales[0]], 1e30)
            save_file(tensors, str(shard), metadata={"format": "pt"})
            break
    _rehash(folder)


@pytest.mark.parametrize("damage,words", [
    (lambda f: _set_model_config(f, depth=10**7), "depth must be <= 1024"),
    (lambda f: _set_model_config(f, width=10**9), "width must be <= 65536"),
    (lambda f: _config_symlink(f, "/dev/zero"), "is a symbolic link"),
    (lambda f: (f / "config.json").write_text("[" * 100_000 + "]" * 100_000), "nested too deeply"),
    (lambda f: (f / "config.json").write_bytes(b" " * (9 * 1024 * 1024)), "more than the"),
    (_shard_symlink, "is a symbolic link"),
    (_reorder_parts, "must be the list"),
    (lambda f: _retype_shard(f, torch.int64), "where the network holds float32"),
    (lambda f: _retype_shard(f, torch.bool), "where the network holds float32"),
    (_huge_scale, "int8 scale"),
], ids=["depth-1e7", "width-1e9", "config-dev-zero", "config-nested", "config-9MiB", "shard-symlink",
        "parts-reordered", "int64-rehashed", "bool-rehashed", "int8-scale-1e30"])
def test_a_hostile_weights_folder_is_a_named_error_in_bounded_time(tmp_path, damage, words):
    """Each way a posterior folder from elsewhere was found to misbehave (minutes of layer building,
    reading /dev/zero, following a link out of the folder, permuted rows, garbage dtypes or scales)
    is now a CheckpointError naming the file or field, raised within seconds."""
    import time

    folder = _sharded_int8(tmp_path)
    load_posterior(folder)  # intact: loads
    damage(folder)
    start = time.perf_counter()
    with pytest.raises(CheckpointError, match=words.replace("(", r"\(")):
        load_posterior(folder)
    assert time.perf_counter() - start < 10


def test_the_index_is_covered_by_the_checksums(tmp_path):
    folder = _sharded_int8(tmp_path)
    path = folder / "model.safetensors.index.json"
    path.write_text(path.read_text() + " ")
    with pytest.raises(CheckpointError, match="index .* differs from the sha256"):
        load_weights(folder)
    load_weights(folder, verify=False)


def test_int8_refuses_weights_beyond_float16_range(tmp_path):
    w = torch.ones(64, 64)
    w[3, 5] = 1e6
    with pytest.raises(ValueError, match="float16's range"):
        save_weights({"w": w}, tmp_path / "q", {}, dtype=torch.int8)
    assert not (tmp_path / "q").exists()


def test_a_full_disk_while_saving_a_checkpoint_is_an_oserror(tmp_path):
    """torch.save writes through a Python file object, so the write failure surfaces as the
    OSError it is (here EFBIG from a file-size limit, as ENOSPC on a full disk), and the old
    file stays whole."""
    import subprocess
    import sys

    from etweedie.training import atomic_torch_save

    target = tmp_path / "ckpt.pt"
    atomic_torch_save({"a": torch.zeros(10)}, target)
    before = target.read_bytes()
    code = (
        "import resource, signal, sys, torch\n"
        "from etweedie.training.checkpoint import atomic_torch_save\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))\n"
        "try:\n"
        f"    atomic_torch_save({{'a': torch.zeros(1 << 20)}}, {str(target)!r})\n"
        "except OSError as exc:\n"
        "    print('OSError', exc.errno); sys.exit(0)\n"
        "sys.exit(1)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("OSError"), done.stdout + done.stderr
    assert target.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]
