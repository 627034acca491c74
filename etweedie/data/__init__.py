"""Clean data: the eight-Gaussians ring with its analytic scores and exact posteriors, MNIST read
from its IDX files, and the data sources the trainer draws batches from.

The first stage of the data path (**data** → noise → posterior → score → sampler → metrics).

* :mod:`etweedie.data.ring` — :class:`EightGaussians` and its SIR posterior sampler;
* :mod:`etweedie.data.mnist` — the checksum-verified MNIST reader (never downloads);
* :mod:`etweedie.data.sources` — anything that draws a ``(batch, d)`` batch from a generator.
"""

from .ring import (
    EightGaussians, posterior_sample_sir,
)
from .mnist import (
    default_data_dir, ENV_VAR, find_mnist_files, load_mnist, MNIST_FILES, MnistChecksumError,
)
from .sources import (
    as_data_source, CallableSource, DataSource, EightGaussiansSource, MnistSource, TensorSource,
)

__all__ = [
    "as_data_source", "CallableSource", "DataSource", "default_data_dir", "EightGaussians",
    "EightGaussiansSource", "ENV_VAR", "find_mnist_files", "load_mnist", "MNIST_FILES",
    "MnistChecksumError", "MnistSource", "posterior_sample_sir", "TensorSource"
]
