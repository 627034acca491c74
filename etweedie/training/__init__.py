"""Training: the energy-score training of an Engression posterior, score-matching training, the
one optimizer loop they (and noise estimation) share, and the files a run writes and reads.

* :mod:`etweedie.training.engression` — :func:`train` (``etweedie train``), the energy-score step,
  held-out checks;
* :mod:`etweedie.training.config` — the run's configs (TOML) and the noise prior;
* :mod:`etweedie.training.posterior_files` — :func:`save_posterior` / :func:`load_posterior`;
* :mod:`etweedie.training.scorematching` — score networks trained by (sliced) score matching;
* :mod:`etweedie.training.optim` — the optimizer loop, its learning-rate schedule and EMA;
* :mod:`etweedie.training.checkpoint` — safetensors weights, resume state, atomic writes, the run lock;
* :mod:`etweedie.training.pretrained` — the posteriors shipped with the repository, by name.
"""

from .engression import (
    build_data_source, build_posterior, gaussian_posterior_check, held_out_loss, learning_rate, train,
)
from .config import (
    config_from_dict, config_to_dict, DataConfig, dry_run_config, load_config, ModelConfig, noise_law,
    noise_metric, NoisePrior, PriorConfig, TrainConfig,
)
from .posterior_files import (
    load_posterior, save_posterior,
)
from .scorematching import (
    ConditionalScoreNet, fit_score, hyvarinen_loss, jacobian_trace, LearnedScore, ResidualMLP, ScoreNet,
    ScoreTrainResult, sliced_score_matching_vr_loss, train_score_net,
)
from .optim import (
    EMA, optimize, warmup_cosine,
)
from .checkpoint import (
    atomic_torch_save, atomic_write_text, CheckpointError, load_weights, MAX_SHARD_BYTES, RunLock,
    RunLockedError, safe_torch_load, save_weights, WEIGHTS_CONFIG,
)
from .pretrained import (
    PRETRAINED, pretrained_dir, resolve_pretrained,
)

__all__ = [
    "atomic_torch_save", "atomic_write_text", "build_data_source", "build_posterior", "CheckpointError",
    "ConditionalScoreNet", "config_from_dict", "config_to_dict", "DataConfig", "dry_run_config", "EMA",
    "fit_score", "gaussian_posterior_check", "held_out_loss", "hyvarinen_loss", "jacobian_trace",
    "LearnedScore", "learning_rate", "load_config", "load_posterior", "load_weights", "MAX_SHARD_BYTES",
    "ModelConfig", "noise_law", "noise_metric", "NoisePrior", "optimize", "PRETRAINED", "pretrained_dir",
    "PriorConfig", "ResidualMLP", "resolve_pretrained", "RunLock", "RunLockedError", "safe_torch_load",
    "save_posterior", "save_weights", "ScoreNet", "ScoreTrainResult", "sliced_score_matching_vr_loss",
    "train", "train_score_net", "TrainConfig", "warmup_cosine", "WEIGHTS_CONFIG"
]
