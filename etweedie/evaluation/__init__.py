"""Sample-quality metrics: the last stage of the data path (… → sampler → **metrics**).

* :mod:`etweedie.evaluation.metrics` — eight-Gaussians metrics, energy distances with stratified
  bootstrap intervals;
* :mod:`etweedie.evaluation.image_metrics` — the MNIST classifier-feature metrics (``etweedie mnist-eval``);
* :mod:`etweedie.evaluation.image_figures` — sample grids and nearest-training-image figures.
"""

from .metrics import (
    bootstrap_ed_replicates, eight_gaussians_metrics, forward_noised, MarginalTracker, mean_radial_error,
    METRIC_SUITES, min_mode_mass, mode_assignment, mode_weight_tv, mode_weights, modes_present,
    null_energy_distance, signed_energy_distance, stratified_bootstrap,
    stratified_bootstrap_energy_distance, stratified_subset,
)
from .image_metrics import (
    as_unit_images, BANK_SEED, BANK_SIZE, bootstrap_feature_energy_distance, class_histogram, class_tv,
    classes_present, classifier_path, confidences, dynamic_batch_model, feature_energy_distance,
    FEATURE_TENSOR, LOGITS_TENSOR, mean_confidence, MnistClassifier, MnistEvaluator, nearest_train,
    null_feature_energy_distance,
)
from .image_figures import (
    image_grid, nearest_train_figure, tile,
)

__all__ = [
    "as_unit_images", "BANK_SEED", "BANK_SIZE", "bootstrap_ed_replicates",
    "bootstrap_feature_energy_distance", "class_histogram", "class_tv", "classes_present",
    "classifier_path", "confidences", "dynamic_batch_model", "eight_gaussians_metrics",
    "feature_energy_distance", "FEATURE_TENSOR", "forward_noised", "image_grid", "LOGITS_TENSOR",
    "MarginalTracker", "mean_confidence", "mean_radial_error", "METRIC_SUITES", "min_mode_mass",
    "MnistClassifier", "MnistEvaluator", "mode_assignment", "mode_weight_tv", "mode_weights",
    "modes_present", "nearest_train", "nearest_train_figure", "null_energy_distance",
    "null_feature_energy_distance", "signed_energy_distance", "stratified_bootstrap",
    "stratified_bootstrap_energy_distance", "stratified_subset", "tile"
]
