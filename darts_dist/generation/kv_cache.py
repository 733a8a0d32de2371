"""A left-aligned batch KV cache that sequences join and leave between decoding steps.

Every row's tokens end at the last column and padding sits at the left, as in a left-padded
batch, so one forward decodes every row's next token. A joining batch is padded on the left to
the longer of the two lengths and stacked under the running rows; leaving rows are dropped, and
columns that are padding in every row left are cut. Only transformers' DynamicCache of full-attention
layers is taken: its per-layer key and value tensors are [B, heads, S, head_dim].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers.cache_utils import DynamicCache, DynamicLayer

from darts_dist.errors import DartsError


def _layers(cache: DynamicCache) -> list[DynamicLayer]:
    layers = list(cache.layers)
    if any(type(layer) is not DynamicLayer for layer in layers):
        kinds = sorted({type(layer).__name__ for layer in layers})
        raise DartsError(f"continuous batching needs a KV cache of full-attention layers, this model's has {kinds}",
                         "serve a model without sliding-window or static cache layers")
    return layers


def _pad_left(tensor: Tensor, length: int, dim: int) -> Tensor:
    missing = length - tensor.shape[dim]
    if missing == 0:
        return tensor
    pad = [0, 0] * (tensor.ndim - 1 - dim % tensor.ndim) + [missing, 0]
    return F.pad(tensor, pad)


class BatchCache:
    """The running rows' KV cache and attention mask [B, S] (1 on real tokens)."""

    def __init__(self) -> None:
        self.cache: DynamicCache | None = None
        self.mask: Tensor | None = None

    @property
    def rows(self) -> int:
        return 0 if self.mask is None else self.mask.shape[0]

    def join(self, cache: DynamicCache, mask: Tensor) -> None:
        """Stack a prefilled batch's cache and mask under the running rows'."""
        if self.cache is None:
            self.cache, self.mask = cache, mask
            return
        length = max(self.mask.shape[1], mask.shape[1])
        for mine, theirs in zip(_layers(self.cache), _layers(cache), strict=True):
            mine.keys = torch.cat([_pad_left(mine.keys, length, -2), _pad_left(theirs.keys, length, -2)])
            mine.values = torch.cat([_pad_left(mine.values, length, -2), _pad_left(theirs.values, length, -2)])
        self.mask = torch.cat([_pad_left(self.mask, length, 1), _pad_left(mask.to(self.mask.device), length, 1)])

    def extend(self) -> Tensor:
        """The mask for one more token in every row (the step about to run), kept as the new mask."""
        self.mask = torch.cat([self.mask, self.mask.new_ones(self.rows, 1)], dim=1)
        return self.mask

    def keep(self, rows: list[int]) -> None:
        """Keep only these rows, in this order; cut the columns that are padding in all of them."""
        if not rows:
            self.cache = self.mask = None
            return
        index = torch.tensor(rows, device=self.mask.device)
        mask = self.mask.index_select(0, index)
        start = int(mask.any(0).long().argmax())  # the first column some kept row uses
        self.mask = mask[:, start:]
        for layer in _layers(self.cache):
            layer.keys = layer.keys.index_select(0, index.to(layer.keys.device))[..., start:, :]
            layer.values = layer.values.index_select(0, index.to(layer.values.device))[..., start:, :]
