"""The MNIST sampling protocol end to end at the tiny size: parts, pooled uint8 images, the table,
the figures, resuming; the deadline-aware GPU command's dry run on the CPU and its ≤ 8-file pack.

Needs the MNIST files and the MNIST-12 classifier (etweedie.data.mnist / etweedie.evaluation.image_metrics);
skips with the reason when they are missing.
"""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _need_mnist():
    try:
        from etweedie.data import load_mnist

        load_mnist("test")
    except (ImportError, FileNotFoundError) as exc:
        pytest.skip(f"MNIST data or reader unavailable: {exc}")


def test_tiny_cpu_protocol_writes_images_table_and_figures_and_resumes(tmp_path):
    _need_mnist()
    pytest.importorskip("onnxruntime", reason="the MNIST-12 classifier needs onnxruntime (extra 'mnist')")
    from experiments.mnist import cpu_protocol, sampling

    out = tmp_path / "cpu"
    paths = ("mnist_gaussian_isotropic", "mnist_joint")  # two of the five: the scoring costs seconds per path
    args = ["--posterior", "untrained:16", "--protocol", "tiny", "--out", str(out), "--n-boot", "20",
            "--null-draws", "10", "--paths", *paths]
    assert cpu_protocol.main(args) == 0
    tiny = sampling.TINY
    for path in paths:
        pooled = np.load(out / f"{path}.npy")
        assert pooled.dtype == np.uint8 and pooled.shape == (len(tiny.seeds) * tiny.images_per_seed, 28, 28)
        parts = [np.load(out / "parts" / f"{path}_seed{s}.npy") for s in tiny.seeds]
        assert np.array_equal(pooled, np.concatenate(parts))
        progress = np.load(out / "parts" / f"{path}_seed{tiny.seeds[0]}_progress.npy")
        assert progress.shape == (len(tiny.progress_levels()) + 1, tiny.images_per_seed, 784)
    # different seeds, different images
    first = np.load(out / "parts" / f"{paths[0]}_seed{tiny.seeds[0]}.npy")
    second = np.load(out / "parts" / f"{paths[0]}_seed{tiny.seeds[1]}.npy")
    assert not np.array_equal(first, second)
    result = json.loads((out / "table.json").read_text())
    assert set(result["rows"]) == {*paths, "real"}
    assert all(np.isfinite(r["feature_ed"]) for r in result["rows"].values())
    table = (out / "table.md").read_text()
    assert "Joint five-parameter path" in table and "(0.303)" in table
    for name in ("samples", "paths", "progress", "seeds", "nearest_train"):
        assert (out / f"mnist_{name}.png").stat().st_size > 1000
    # a rerun skips every finished part (their logs stay untouched)
    log = out / "parts" / f"mnist_joint_seed{tiny.seeds[0]}.json"
    before = log.stat().st_mtime_ns
    assert cpu_protocol.main([*args, "--no-table", "--no-figures"]) == 0
    assert log.stat().st_mtime_ns == before


def test_tiny_cpu_protocol_antithetic_variant(tmp_path, capsys):
    """--antithetic --n-posterior N: the parts record the variant, differ from the independent
    draws' images from the same seeds, and a folder of the other variant is refused."""
    _need_mnist()
    from experiments.mnist import cpu_protocol

    out = tmp_path / "anti"
    base = ["--posterior", "untrained:16", "--protocol", "tiny", "--paths", "mnist_joint", "--no-table", "--no-figures"]
    assert cpu_protocol.main([*base, "--out", str(out), "--antithetic", "--n-posterior", "4"]) == 0
    log = json.loads((out / "parts" / "mnist_joint_seed2718.json").read_text())
    assert log["protocol"]["antithetic"] is True and log["protocol"]["n_posterior"] == 4
    plain = tmp_path / "plain"
    assert cpu_protocol.main([*base, "--out", str(plain), "--n-posterior", "4"]) == 0
    assert not np.array_equal(np.load(out / "parts" / "mnist_joint_seed2718.npy"),
                              np.load(plain / "parts" / "mnist_joint_seed2718.npy"))
    assert cpu_protocol.main([*base, "--out", str(out), "--n-posterior", "4"]) == 2  # the variant is part of a folder
    assert cpu_protocol.main([*base, "--out", str(out), "--n-posterior", "0"]) == 2
    assert "--n-posterior must be >= 1" in capsys.readouterr().err


def test_tiny_cpu_protocol_final_mean_variant(tmp_path, capsys):
    """--final-average K: recorded in the parts, images differ from the single final draw's, a
    folder of the other variant is refused, and K < 1 is a one-line error."""
    _need_mnist()
    from experiments.mnist import cpu_protocol

    base = ["--posterior", "untrained:16", "--protocol", "tiny", "--paths", "mnist_joint", "--no-table", "--no-figures"]
    mean, plain = tmp_path / "mean", tmp_path / "plain"
    assert cpu_protocol.main([*base, "--out", str(mean), "--final-average", "8"]) == 0
    assert json.loads((mean / "parts" / "mnist_joint_seed2718.json").read_text())["protocol"]["final_average"] == 8
    assert cpu_protocol.main([*base, "--out", str(plain)]) == 0
    assert not np.array_equal(np.load(mean / "parts" / "mnist_joint_seed2718.npy"),
                              np.load(plain / "parts" / "mnist_joint_seed2718.npy"))
    assert cpu_protocol.main([*base, "--out", str(mean)]) == 2  # the variant is part of a folder
    assert cpu_protocol.main([*base, "--out", str(mean), "--final-average", "0"]) == 2
    assert "--final-average must be >= 1" in capsys.readouterr().err


def test_gpu_command_dry_run_packs_at_most_eight_small_files_and_resumes(tmp_path, capsys):
    _need_mnist()
    from experiments.mnist import gpu_sample

    work, pack = tmp_path / "work", tmp_path / "pack"
    args = ["--dry-run", "--no-bench", "--work", str(work), "--pack-dir", str(pack), "--paths", "mnist_joint",
            "mnist_gaussian_nondiagonal"]
    assert gpu_sample.main(args) == 0
    files = sorted(pack.iterdir())
    assert len(files) <= 8 and all(f.stat().st_size <= 16 * 2**20 for f in files)
    assert {f.name for f in files} == {"mnist_joint.npy", "mnist_gaussian_nondiagonal.npy", "progress.npz",
                                       "sampling_log.json", "parts.tar.gz"}
    log = json.loads((pack / "sampling_log.json").read_text())
    assert log["missing"] == [] and len(log["parts"]) == 6
    capsys.readouterr()
    assert gpu_sample.main(args) == 0
    assert capsys.readouterr().out.count("done earlier, skipped") == 6
    # a folder holds one protocol: other settings are an error (exit 2), not a silent reuse
    assert gpu_sample.main([*args, "--n-posterior", "3"]) == 2
    assert "sampled with other settings" in capsys.readouterr().err
    # nor are images of another posterior pooled with the folder's: other weights are an error
    assert gpu_sample.main([*args, "--posterior", "untrained:16"]) == 2
    assert "sampled by another posterior" in capsys.readouterr().err
    saved = json.loads((work / "parts" / "mnist_joint_seed2718.json").read_text())
    assert saved["posterior"] == "untrained:32" and len(saved["posterior_sha256"]) == 16
    # a deadline already past: nothing new starts after the first part, and the pack says what is left
    assert gpu_sample.main(["--dry-run", "--no-bench", "--work", str(tmp_path / "w2"), "--pack-dir",
                            str(tmp_path / "p2"), "--paths", "mnist_joint", "--deadline", "0", "--pack-reserve", "0"]) == 0
    late = json.loads((tmp_path / "p2" / "sampling_log.json").read_text())
    assert len(late["parts"]) == 1 and len(late["missing"]) == 2


def test_gpu_sample_rerun_without_bench_keeps_the_earlier_benchmark(tmp_path, capsys):
    """A lease that continues the paths with --no-bench packs the benchmark of the first lease."""
    from experiments.mnist import gpu_sample

    work, base = tmp_path / "work", ["--dry-run", "--paths", "mnist_joint", "--deadline", "0", "--pack-reserve", "0"]
    assert gpu_sample.main([*base, "--work", str(work), "--pack-dir", str(tmp_path / "p1")]) == 0
    first = json.loads((tmp_path / "p1" / "sampling_log.json").read_text())["benchmark"]
    assert first and "error" not in first and first["speedup"] > 0
    capsys.readouterr()
    assert gpu_sample.main([*base, "--no-bench", "--work", str(work), "--pack-dir", str(tmp_path / "p2")]) == 0
    assert "the one measured earlier" in capsys.readouterr().out
    assert json.loads((tmp_path / "p2" / "sampling_log.json").read_text())["benchmark"] == first
    # a fresh folder without a benchmark packs none
    assert gpu_sample.main([*base, "--no-bench", "--work", str(tmp_path / "w3"), "--pack-dir", str(tmp_path / "p3")]) == 0
    assert json.loads((tmp_path / "p3" / "sampling_log.json").read_text())["benchmark"] is None


def test_a_damaged_or_foreign_part_log_is_a_named_error(tmp_path):
    from experiments.mnist import sampling

    for text in ("[]", '{"posterior": "x"}', '{"protocol": {"name": "ti'):
        (tmp_path / "mnist_joint_seed3141.json").write_text(text)
        with pytest.raises(ValueError, match=r"mnist_joint_seed3141\.json is not a (readable )?part log"):
            sampling._finished_part(tmp_path, "mnist_joint_seed3141", sampling.TINY)


def test_sampling_table_errors_are_one_line(tmp_path, capsys):
    from experiments.mnist import sampling_table

    (tmp_path / "mnist_joint.npy").write_bytes(b"not an npy file")
    capsys.readouterr()
    assert sampling_table.main([str(tmp_path), "--seeds", "0"]) == 2
    assert sampling_table.main([str(tmp_path), "--n-boot", "1"]) == 2
    assert sampling_table.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("sampling_table: error:") for line in err)


def test_gpu_command_refuses_bad_sizes_first_and_reports_a_failed_run(tmp_path, capsys, monkeypatch):
    _need_mnist()
    from experiments.mnist import gpu_sample, sampling

    base = ["--dry-run", "--no-bench", "--work", str(tmp_path / "w"), "--pack-dir", str(tmp_path / "p")]
    for flag, value in (("--levels", "0"), ("--n-posterior", "0"), ("--step-fraction", "nan"), ("--first-level-steps", "-1"),
                        ("--deadline", "-5")):
        assert gpu_sample.main([*base, flag, value]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"gpu_sample: error: {flag}")

    def broken(*args, **kwargs):
        raise RuntimeError("device lost")

    monkeypatch.setattr(sampling, "run_protocol", broken)
    assert gpu_sample.main([*base, "--paths", "mnist_joint"]) == 1
    assert "sampling stopped (RuntimeError: device lost)" in capsys.readouterr().err
    assert (tmp_path / "p" / "sampling_log.json").is_file()  # what was done is still packed


def test_cpu_protocol_checks_the_table_flags_and_out_before_sampling(tmp_path, capsys):
    from experiments.mnist import cpu_protocol

    base = ["--posterior", "untrained:16", "--protocol", "tiny", "--no-figures"]
    afile = tmp_path / "afile"
    afile.write_text("x")
    for extra in (["--n-boot", "1"], ["--null-draws", "-1"], ["--threads", "-1"]):
        assert cpu_protocol.main([*base, "--out", str(tmp_path / "o"), *extra]) == 2
    assert cpu_protocol.main([*base, "--out", str(afile)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 4 and all(line.startswith("cpu_protocol: error:") for line in err)
    assert not (tmp_path / "o" / "parts").exists()  # nothing was sampled


def test_tiny_transport_protocol_records_its_cost_and_counts_right(tmp_path, capsys):
    _need_mnist()
    pytest.importorskip("onnxruntime", reason="the MNIST-12 classifier needs onnxruntime (extra 'mnist')")
    import torch

    from etweedie.sample import DrawCounter, initial_states, sample_transport
    from experiments.mnist import cpu_protocol, sampling

    out = tmp_path / "transport"
    args = ["--posterior", "untrained:16", "--protocol", "tiny_transport", "--out", str(out), "--n-boot", "20",
            "--null-draws", "5", "--paths", "mnist_joint", "--no-figures"]
    assert cpu_protocol.main(args) == 0
    proto = sampling.TINY_TRANSPORT
    log = json.loads((out / "parts" / f"mnist_joint_seed{proto.seeds[0]}.json").read_text())
    assert log["draws_per_image"] == proto.draws_per_image and log["protocol"]["sampler"] == "transport"
    assert "| 7 |" in (out / "table.md").read_text()  # the cost column: 1 warm-up + (2 + 3 − 1) steps + 2 final draws
    # the protocol's count is what the sampler asks of the posterior
    counted = DrawCounter(sampling.load_posterior("untrained:16"))
    plan = proto.plan("mnist_joint")
    g = torch.Generator().manual_seed(0)
    y0 = initial_states(plan, None, 3, 784, generator=g)
    sample_transport(counted, y0, plan, None, generator=g, **{k: v for k, v in proto.sampler_kwargs("cpu").items()
                                                               if k != "sampler"}, disable=True)
    assert counted.draws_per_chain(3) == proto.draws_per_image == 7


@pytest.mark.parametrize("module,args,words", [
    ("demo", ["--images", "1"], "--images"),
    ("diagnostics", ["--out", "{tmp}", "--images", "1"], "--images"),
    ("sampler_ablation", ["--out", "{tmp}", "--seed", "-1"], "--seed"),
])
def test_mnist_sampling_commands_refuse_bad_flags_in_one_line(module, args, words, tmp_path, capsys):
    import importlib

    main = importlib.import_module(f"experiments.mnist.{module}").main
    assert main([a.replace("{tmp}", str(tmp_path / "o")) for a in args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err


def test_mnist_demo_and_diagnostics_run_at_a_tiny_size(tmp_path, capsys):
    _need_mnist()
    pytest.importorskip("onnxruntime", reason="the MNIST-12 classifier needs onnxruntime (extra 'mnist')")
    from experiments.mnist import demo, diagnostics

    assert demo.main(["--posterior", "untrained:16", "--images", "4", "--out", str(tmp_path / "demo")]) == 0
    assert (tmp_path / "demo" / "samples.png").stat().st_size > 1000
    assert np.load(tmp_path / "demo" / "samples.npy").shape == (4, 28, 28)
    row = json.loads((tmp_path / "demo" / "eval.json").read_text())
    assert row["draws_per_image"] == 95 and np.isfinite(row["feature_ed"])
    assert diagnostics.main(["--posterior", "untrained:16", "--images", "4", "--mean-of", "2", "--paths", "mnist_joint",
                             "--out", str(tmp_path / "diag")]) == 0
    result = json.loads((tmp_path / "diag" / "diagnostics.json").read_text())
    assert len(result["floor"]["mnist_joint"]) == len(diagnostics.FLOOR_RMS)
    assert set(next(iter(result["chains"]["mnist_joint"].values()))) == {"chains", "truly_noisy"}
