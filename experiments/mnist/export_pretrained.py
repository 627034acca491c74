"""Ship a trained MNIST posterior in the repository: weights folder, held-out scores, model card.

Copies a run's ``posterior/`` (float16 safetensors shards ≤ 16 MiB + ``config.json`` with the
sha256 of every shard; :mod:`etweedie.training.checkpoint`) to ``--dest``, evaluates it on MNIST's test
split, and writes ``MODEL_CARD.md`` and ``model_card.json`` beside the weights:

* ``held_out_es``: :func:`etweedie.training.held_out_loss` — the matched energy score (the training
  loss) on 4,096 test images with tuples from the training prior (seed 12345);
* ``per_level``: the matched energy score (β = 1.4), the pixel-space energy score (β = 1) and the
  MSE of the mean of 16 draws on 512 test images at the sampler's realized-RMS levels with the
  generalized/non-diagonal tuple (:func:`posterior_ablation.evaluate`, the ablation's metric).

    PYTHONPATH=$PWD python experiments/mnist/export_pretrained.py --run runs/mnist_cpu \\
        --dest pretrained/mnist_cpu --command "etweedie train --config configs/mnist_cpu.toml --out runs/mnist_cpu"
"""

from __future__ import annotations

import datetime
import json
import platform
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from posterior_ablation import evaluate  # noqa: E402  (the ablation's per-level metric)

from etweedie.training import safe_torch_load
from etweedie.data import load_mnist
from etweedie.training import config_from_dict, held_out_loss, load_posterior, save_posterior
from experiments import _cli


def main(argv=None) -> int:
    ap = _cli.OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", required=True, help="training run directory (holds posterior/ and train_log.jsonl)")
    ap.add_argument("--dest", required=True, help="destination weights folder, e.g. pretrained/mnist_cpu")
    ap.add_argument("--command", required=True, help="the exact training command, for the card")
    ap.add_argument("--machine", default="2-core CPU VM (shared with other jobs while training)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=("as-trained", "float16", "int8"), default="as-trained",
                    help="store the weights in this dtype (int8: per-row int8 matrices, etweedie.training.checkpoint); "
                         "the card then also scores the as-trained weights, for the difference")
    ap.add_argument("--stage", action="append", default=[],
                    help="an earlier training stage this run was fine-tuned from (its config's init), in order: "
                         "one line for the card's 'Stages' list, e.g. \"17,694 steps on an H100 with configs/mnist_full.toml\"")
    ap.add_argument("--train-torch", default=None, help="torch version of the training run (default: this one's)")
    args = ap.parse_args(argv)
    _cli.threads("--threads", args.threads)
    _cli.nonempty("--run", args.run, "a training run directory")
    _cli.nonempty("--dest", args.dest, "a destination folder")
    _cli.nonempty("--command", args.command, "the training command")
    if not (Path(args.run) / "posterior" / "config.json").is_file():
        raise _cli.UsageError(f"--run {args.run}: no posterior/config.json there; expected a finished training run directory")
    torch.set_num_threads(args.threads)
    run, dest = Path(args.run), Path(args.dest)
    src = run / "posterior"
    meta = json.loads((src / "config.json").read_text())
    train_cfg = config_from_dict(meta["train_config"])
    log = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines() if line.strip()]

    if dest.exists():  # replaced only when it is an earlier export (never an arbitrary folder or file)
        try:
            earlier = json.loads((dest / "config.json").read_text()).get("format", "")
        except (OSError, ValueError, AttributeError):
            earlier = ""
        if dest.is_dir() and not any(dest.iterdir()):
            dest.rmdir()
        elif dest.is_dir() and isinstance(earlier, str) and earlier.startswith("etweedie.posterior"):
            shutil.rmtree(dest)
        else:
            print(f"export_pretrained: error: --dest {dest} exists and is not an exported posterior; "
                  "give a new or empty folder", file=sys.stderr)
            return 2
    test = load_mnist("test")[0][:512].reshape(512, 784).to(torch.float32) / 255.0
    as_trained = None
    if args.dtype == "as-trained":
        shutil.copytree(src, dest)
    else:  # re-stored: the as-trained weights are scored too, so the card shows what the dtype costs
        original = load_posterior(src).float()
        as_trained = dict(dtype=meta["weights"].get("dtype"), held_out_es=held_out_loss(original, train_cfg),
                          per_level=evaluate(original, test))
        extra = {k: v for k, v in meta.items() if k not in ("format", "class", "model_config", "step", "train_config", "weights")}
        save_posterior(original, dest, train_config=meta.get("train_config"), step=meta.get("step"), dtype=args.dtype,
                       shard_mb=train_cfg.shard_mb, extra=extra)
        meta = json.loads((dest / "config.json").read_text())
    posterior = load_posterior(dest).float()
    held = held_out_loss(posterior, train_cfg)
    per_level = evaluate(posterior, test)

    files = meta["weights"]["files"]
    sizes = {name: (dest / name).stat().st_size for name in files}
    last = log[-1]
    cpu_time = None
    if (run / "checkpoint.pt").is_file():  # the resume state records the process CPU time of the run
        cpu_time = float(safe_torch_load(run / "checkpoint.pt")["cpu_time"])
    card = dict(
        name=dest.name,
        load=f'etweedie.training.load_posterior("{dest.name}")  # or load_posterior("{dest}")',
        model_class=meta.get("class"),
        model_config=meta.get("model_config"),
        parameters=sum(t.numel() for t in posterior.parameters()),
        weights=dict(dtype=meta["weights"].get("dtype"), files={n: dict(sha256=files[n], bytes=sizes[n]) for n in files},
                     total_bytes=sum(sizes.values())),
        train_config=meta.get("train_config"),
        data="MNIST train split (60,000 images; data/mnist, checksum-verified), pixels in [0, 1], uniform dequantization",
        steps=last["step"],
        train_wall_time_s=last.get("wall_time"),
        train_steps_per_s=round(last["step"] / last["wall_time"], 3) if last.get("wall_time") else None,
        train_cpu_time_s=cpu_time,
        final_loss=last["loss"],
        held_out_es=held,
        per_level=per_level,
        as_trained=as_trained,
        machine=args.machine,
        torch=args.train_torch or torch.__version__,
        eval_torch=torch.__version__,
        python=platform.python_version(),
        command=args.command,
        stages=[*args.stage, f"this run: {args.command}"] if args.stage else None,
        date=datetime.date.today().isoformat(),
    )
    (dest / "model_card.json").write_text(json.dumps(card, indent=1) + "\n")
    rows = "\n".join(f"| {r} | {v['es']:.2f} | {v['es_pix']:.3f} | {v['mse']:.4f} |" for r, v in per_level.items())
    shards = "\n".join(f"| `{n}` | {sizes[n]:,} | `{files[n]}` |" for n in files)
    m = card["model_config"]
    config_path = _config_path(args.command)
    stored = meta["weights"].get("dtype")
    what = ("int8 (matrices per row, with a float32 scale per row; biases and small tensors float16)"
            if stored == "int8" else stored)
    compare = ""
    if as_trained is not None:
        lines = "\n".join(f"| {r} | {as_trained['per_level'][r]['es']:.2f} | {v['es']:.2f} | "
                          f"{as_trained['per_level'][r]['mse']:.4f} | {v['mse']:.4f} |" for r, v in per_level.items())
        compare = f"""
## Stored precision

Trained weights {as_trained['dtype']}, stored here as {stored}: held-out matched energy score
{as_trained['held_out_es']:.3f} as trained against {held:.3f} as stored.

| realized RMS r | es ({as_trained['dtype']}) | es ({stored}) | mse ({as_trained['dtype']}) | mse ({stored}) |
|---|---|---|---|---|
{lines}
"""
    stages = ""
    if args.stage:
        listed = "\n".join(f"{i}. {line}" for i, line in enumerate(card["stages"], 1))
        stages = f"""
## Stages

Fine-tuned in stages, each started from the weights of the one before (the config's `init`):

{listed}
"""
    text = f"""# MNIST posterior, width {m['width']} (`{dest.name}`)

The conditional Engression posterior x = g(y, η, ε) of the paper's MNIST appendix:
a residual SiLU MLP (width {m['width']}, depth {m['depth']}, noise {m['noise_dim']} per layer, η by
{m['conditioning']}) with the preconditioned output (c_in/c_skip/c_out in the realized noise RMS around
{"per-pixel learned centres and scales initialized at " if m.get('learn_data_scale') else ""}the MNIST pixel mean {m['data_center']} and std {m['data_std']}), {card['parameters']:,} parameters,
conditioned on η = (β, log λ, log σ, u, v) over β ∈ [1.3, 2], λ ∈ [1, 2.5], σ ∈ [0.025, 6],
‖(u, v)‖ ≤ 0.7 with Σ = (σ/c_{{β,784}})² I₃₉₂ ⊗ S(u, v).  Pixels in [0, 1].

    from etweedie.training import load_posterior
    posterior = load_posterior("{dest.name}")          # this folder; or load_posterior("{dest}")
    draws = posterior.sample(y, eta, n, generator=g)   # y (..., 784) in [0, 1] units, eta (..., 5)

## Training

- data: {card['data']}
- command: `{args.command}`
- config: `{config_path}` (copied in `config.json` → `train_config`)
- steps: {card['steps']:,} (batch {train_cfg.batch_size}, {train_cfg.draws} draws per example)
- wall time: {card['train_wall_time_s']:.0f} s ({card['train_steps_per_s']} steps/s) on {args.machine}{"" if cpu_time is None else f"; process CPU time {round(cpu_time)} s (the cost on an idle machine)"}
- final training loss (mean of the last log interval): {card['final_loss']:.3f}
- held-out matched energy score (4,096 test images, tuples from the training prior, seed 12345): {held:.3f}
- date: {card['date']}; torch {card['torch']} (scores below computed with torch {card['eval_torch']})
{stages}
## Held-out scores at the sampler's levels

Generalized/non-diagonal tuple (β, λ, u, v) = (1.4, 1.8, 0, 0.6), 512 test images, 16 draws each.
`es`: matched energy score (β = 1.4, noise metric); `es_pix`: energy score with β = 1 in pixels;
`mse`: per-pixel MSE of the mean of the draws.

| realized RMS r | es | es_pix | mse |
|---|---|---|---|
{rows}
{compare}
## Files

Weights are {what} safetensors (no pickle), at most 16 MiB per shard; `config.json` holds the
model and training configs and the sha256 that `load_posterior` verifies.

| file | bytes | sha256 |
|---|---|---|
{shards}
"""
    (dest / "MODEL_CARD.md").write_text(text)
    print(json.dumps(dict(dest=str(dest), held_out_es=held, steps=card["steps"], total_bytes=card["weights"]["total_bytes"])))
    return 0


def _config_path(command: str) -> str:
    """The ``--config`` of the training command, for the card."""
    words = command.split()
    return words[words.index("--config") + 1] if "--config" in words[:-1] else "the run's config (config.json)"


if __name__ == "__main__":
    raise SystemExit(_cli.guarded("python -m experiments.mnist.export_pretrained", main))
