"""The DARTS math in plain torch: correction, loss, hooks into a causal LM, metrics, file format."""

from darts_dist.core.correction import (
    Correction,
    CorrectionSpec,
    DartsCorrections,
    expected_parameter_count,
    one_hot_tasks,
    parse_layer,
)
from darts_dist.core.hooks import (
    CorrectionHandle,
    attach_corrections,
    capture_hidden,
    surgery_module,
    token_positions,
)
from darts_dist.core.io import FORMAT_VERSION, load_corrections, read_header, save_corrections
from darts_dist.core.loss import entropy_weights, next_token_entropy, weighted_l1_loss
from darts_dist.core.metrics import (
    BUCKET_LABELS,
    POSITION_BUCKETS,
    BucketMeans,
    token_bias,
    token_nll,
)

__all__ = [
    "BUCKET_LABELS",
    "FORMAT_VERSION",
    "POSITION_BUCKETS",
    "BucketMeans",
    "Correction",
    "CorrectionHandle",
    "CorrectionSpec",
    "DartsCorrections",
    "attach_corrections",
    "capture_hidden",
    "entropy_weights",
    "expected_parameter_count",
    "load_corrections",
    "next_token_entropy",
    "one_hot_tasks",
    "parse_layer",
    "read_header",
    "save_corrections",
    "surgery_module",
    "token_bias",
    "token_nll",
    "token_positions",
    "weighted_l1_loss",
]
