"""The DARTS math in plain torch: correction, learned merge coefficients, loss, hooks into a causal LM, metrics, batching, router, file format."""

from darts_dist.core.batching import TokenizedSet, pad_rows, token_batch
from darts_dist.core.coefficients import LayerwiseMerge, TaskVectors, coefficient_table, layer_group, layer_prefix
from darts_dist.core.correction import (
    Correction,
    CorrectionSpec,
    DartsCorrections,
    LayerKey,
    expected_parameter_count,
    mask_positions,
    one_hot_tasks,
    parse_layer,
)
from darts_dist.core.hooks import (
    CorrectionHandle,
    attach_corrections,
    capture_hidden,
    decoder_layers,
    fed_inputs,
    run_from,
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
from darts_dist.core.router import ROUTED, ROUTER_FILE, Routing, TaskRouter, pool_prompts, prompt_mask

__all__ = [
    "BUCKET_LABELS",
    "FORMAT_VERSION",
    "POSITION_BUCKETS",
    "ROUTED",
    "ROUTER_FILE",
    "BucketMeans",
    "Correction",
    "CorrectionHandle",
    "CorrectionSpec",
    "DartsCorrections",
    "LayerKey",
    "LayerwiseMerge",
    "Routing",
    "TaskRouter",
    "TaskVectors",
    "TokenizedSet",
    "attach_corrections",
    "capture_hidden",
    "coefficient_table",
    "decoder_layers",
    "entropy_weights",
    "expected_parameter_count",
    "fed_inputs",
    "layer_group",
    "layer_prefix",
    "load_corrections",
    "mask_positions",
    "next_token_entropy",
    "one_hot_tasks",
    "pad_rows",
    "parse_layer",
    "pool_prompts",
    "prompt_mask",
    "read_header",
    "run_from",
    "save_corrections",
    "surgery_module",
    "token_batch",
    "token_bias",
    "token_nll",
    "token_positions",
    "weighted_l1_loss",
]
