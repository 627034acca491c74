"""Which pixel scale the paper fed MNIST-12: t10k accuracy and mean confidence per candidate scale.

    python experiments/mnist/pixel_scale.py [--data-dir DIR]

The paper's real-vs-real row has mean confidence 0.993 and the classifier's test accuracy 0.989;
the scale that gives both is the one etweedie.evaluation.image_metrics uses ([0, 1]).  Also prints the spread
of the mean confidence over random 768-image draws of t10k (the real row is one such draw).
"""

from __future__ import annotations


import onnx
import onnxruntime as ort
import torch

from etweedie.evaluation import FEATURE_TENSOR, LOGITS_TENSOR, classifier_path, dynamic_batch_model
from etweedie.data import load_mnist
from experiments import _cli

SCALES = {
    "[0, 1] (x / 255)": lambda x: x / 255,
    "0..255 (raw)": lambda x: x,
    "standardized ((x/255 - 0.1307) / 0.3081)": lambda x: (x / 255 - 0.1307) / 0.3081,
    "[-1, 1] (x / 127.5 - 1)": lambda x: x / 127.5 - 1,
}


def main(argv=None) -> None:
    parser = _cli.OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir")
    args = parser.parse_args(argv)
    _cli.nonempty("--data-dir", args.data_dir, "an MNIST folder")
    images, labels = load_mnist("test", args.data_dir)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(dynamic_batch_model(onnx.load(str(classifier_path()))).SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    x = images.float()[:, None]
    print("| pixel scale | t10k accuracy | mean confidence (max softmax) |")
    print("|---|---|---|")
    for name, scale in SCALES.items():
        _, logits = session.run([FEATURE_TENSOR, LOGITS_TENSOR], {"Input3": scale(x).numpy()})
        prob = torch.softmax(torch.from_numpy(logits).double(), 1)
        conf = prob.max(1).values
        print(f"| {name} | {float((prob.argmax(1) == labels).double().mean()):.4f} | {float(conf.mean()):.4f} |")
        if name.startswith("[0, 1]"):
            unit_conf = conf
    g = torch.Generator().manual_seed(1)
    draws = torch.stack([unit_conf[torch.randperm(10000, generator=g)[:768]].mean() for _ in range(2000)])
    print(f"[0, 1]: mean confidence over 2,000 random 768-image draws: mean {float(draws.mean()):.4f}, "
          f"sd {float(draws.std()):.4f}, 2.5-97.5 % [{float(draws.quantile(0.025)):.4f}, {float(draws.quantile(0.975)):.4f}]")


if __name__ == "__main__":
    raise SystemExit(_cli.guarded("python -m experiments.mnist.pixel_scale", main))
