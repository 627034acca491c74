"""Accuracy of the learned (Hyvärinen) conditional score against the oracle noisy score.

For one data replicate of an estimate config this draws exactly what
``experiments.eight_gaussians.estimation`` draws — the clean reference bank, the estimation/held-out
observations of each level and the score network's fresh noisy training observations (same
generator streams) — trains the score network with the config's ``[score_net]`` settings
(optionally overridden by ``--set key=value``), and reports per-level and pooled NMSE and mean
cosine against the oracle score (``is_score`` on the reference bank, as the experiment does) on
the held-out and estimation points.  The oracle's own Monte-Carlo floor is reported too: the
same IS score on the independent posterior bank, against the reference-bank oracle.

    OMP_NUM_THREADS=1 nice -n 5 .venv/bin/python -m experiments.estimation_diagnostics.score_net_accuracy \
        --config configs/estimate_spd.toml --rep 0 --set ema=0.999 --json out.json

No oracle quantity enters training or model selection: the network sees the noisy training
observations and their known σ only.
"""

from __future__ import annotations

import json
import time

import torch

from etweedie.ops import is_score
from etweedie.score import mean_cosine, score_nmse
from experiments import _cli
from experiments.eight_gaussians.estimation import learned_score_for, load_config, replicate_observations, validate_config


def _parse_value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def light_replicate(config, rep):
    """make_replicate without the SIR posterior draws (the same observations, from the same streams)."""
    obs = replicate_observations(config, rep)
    levels = [
        dict(level,
             s_est=is_score(level["y_est"], obs["reference_bank"], level["law"])[0],
             s_hold=is_score(level["y_hold"], obs["reference_bank"], level["law"])[0],
             s_hold_indep=is_score(level["y_hold"], obs["posterior_bank"], level["law"])[0])
        for level in obs["levels"]
    ]
    return {"levels": levels, "ring": obs["ring"]}


def main(argv=None) -> int:
    p = _cli.OneLineParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/estimate_spd.toml")
    p.add_argument("--rep", type=int, default=0)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a [score_net] entry (JSON value)")
    p.add_argument("--level-scale", choices=("rms", "plain"), default=None, help="override truth.level_scale")
    p.add_argument("--label", default="")
    p.add_argument("--json", default=None, help="append one JSON line with the results here")
    p.add_argument("--progress", action="store_true")
    args = p.parse_args(argv)
    _cli.at_least("--rep", args.rep, 0)
    _cli.out_file("--json", args.json)
    torch.set_num_threads(1)
    config = _cli.read_config("--config", args.config, load_config)
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or key not in config["score_net"]:
            raise _cli.UsageError(f"--set must be KEY=VALUE with KEY one of {', '.join(config['score_net'])}, got {item!r}")
        config["score_net"][key] = _parse_value(value)
    if args.level_scale:
        config["truth"]["level_scale"] = args.level_scale
    try:
        config = validate_config(config)
    except (ValueError, TypeError) as exc:  # a --set value, or the config's
        raise _cli.UsageError(f"--config {args.config} with --set {' '.join(args.set) or '(none)'}: {exc}") from None
    rep = light_replicate(config, args.rep)
    t = time.perf_counter()
    _, diag = learned_score_for(config, rep, args.rep, progress=args.progress, return_model=True)
    seconds = time.perf_counter() - t
    learned = diag.pop("model")
    out = {"label": args.label, "rep": args.rep, "level_scale": config["truth"]["level_scale"], "settings": config["score_net"], "train_seconds": round(seconds, 1), "levels": []}
    hold_l, ref_l, est_l, eref_l = [], [], [], []
    for lv in rep["levels"]:
        s_hold = learned(lv["y_hold"], lv["sigma"])
        s_est = learned(lv["y_est"], lv["sigma"])
        out["levels"].append({
            "sigma": lv["sigma"],
            "nmse_heldout": score_nmse(s_hold, lv["s_hold"]), "cos_heldout": mean_cosine(s_hold, lv["s_hold"]),
            "nmse_estimation": score_nmse(s_est, lv["s_est"]),
            "oracle_floor_nmse": score_nmse(lv["s_hold_indep"], lv["s_hold"]),
        })
        hold_l.append(s_hold), ref_l.append(lv["s_hold"]), est_l.append(s_est), eref_l.append(lv["s_est"])
    out["nmse_heldout"] = score_nmse(torch.cat(hold_l), torch.cat(ref_l))
    out["cos_heldout"] = mean_cosine(torch.cat(hold_l), torch.cat(ref_l))
    out["nmse_estimation"] = score_nmse(torch.cat(est_l), torch.cat(eref_l))
    out["final_loss"] = diag.get("final_loss")
    for k in ("best_step", "val_loss"):
        if k in diag:
            out[k] = diag[k]
    per = " ".join(f"σ={lv['sigma']}: {lv['nmse_heldout']:.4f}" for lv in out["levels"])
    floor = " ".join(f"{lv['oracle_floor_nmse']:.4f}" for lv in out["levels"])
    print(f"[{args.label}] rep {args.rep} train {seconds:.1f}s | held-out NMSE {per} | pooled {out['nmse_heldout']:.4f} "
          f"cos {out['cos_heldout']:.4f} | est NMSE {out['nmse_estimation']:.4f} | oracle floor {floor}", flush=True)
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(out) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(_cli.guarded("python -m experiments.estimation_diagnostics.score_net_accuracy", main))
