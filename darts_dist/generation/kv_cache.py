"""A left-aligned batch KV cache that sequences join and leave between decoding steps, and a cache of
prompt prefixes.

Every row's tokens end at the last column and padding sits at the left (a prefill that reused a
cached prefix is left-aligned before it joins), so one forward decodes every row's next token and
the cache is the batch's rows × its longest row. A joining batch is padded on the left to
the longer of the two lengths and stacked under the running rows; leaving rows are dropped, and
columns that are padding in every row left are cut. Only transformers' DynamicCache of full-attention
layers is taken: its per-layer key and value tensors are [B, heads, S, head_dim].
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import PretrainedConfig
from transformers.cache_utils import DynamicCache, DynamicLayer

from darts_dist.errors import DartsError


def _layers(cache: DynamicCache) -> list[DynamicLayer]:
    layers = list(cache.layers)
    if any(type(layer) is not DynamicLayer for layer in layers):
        kinds = sorted({type(layer).__name__ for layer in layers})
        raise DartsError(f"continuous batching needs a KV cache of full-attention layers, this model's has {kinds}",
                         "serve a model without sliding-window or static cache layers")
    return layers


def check_full_attention(config: PretrainedConfig) -> None:
    """A DartsError now, for a model whose KV cache the batch cache cannot join and cut."""
    _layers(DynamicCache(config=config))


def left_align(cache: DynamicCache, mask: Tensor) -> Tensor:
    """Move each row's tokens to the right end of a cache whose mask has holes (a cached prefix, padding, the
    rest of the prompt), in order; returns the new mask. The columns freed on the left are padding."""
    width = int(mask.sum(1).max())
    # A stable sort puts each row's padding first and keeps its tokens in order: the last `width` columns.
    index = torch.sort(mask, dim=1, stable=True).indices[:, -width:]
    for layer in _layers(cache):
        gather = index.to(layer.keys.device)[:, None, :, None].expand(-1, layer.keys.shape[1], -1,
                                                                       layer.keys.shape[3])
        layer.keys, layer.values = layer.keys.gather(2, gather), layer.values.gather(2, gather)
    return torch.gather(mask, 1, index)


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


# Prompt prefixes are cached in blocks of this many tokens: smaller blocks hit more of a shared prefix.
PREFIX_BLOCK = 8
# What a block is kept for: the client's salt (None: shared) and the correction weights its keys and values were
# computed under (None: none).
CacheScope = tuple[str | None, tuple[float, ...] | None]
# The key of a block: its scope, and every prompt token up to the block's end, since a block's keys and values
# depend on all of them.
BlockKey = tuple[CacheScope, tuple[int, ...]]
LayerKV = list[tuple[Tensor, Tensor]]  # per layer: keys, values [heads, tokens, head_dim]


class PrefixCache:
    """The keys and values of prompt prefixes already prefilled (a shared system prompt, a chat template's
    opening), in blocks of PREFIX_BLOCK tokens, at most `max_tokens` of them, least recently used out first.

    A prompt's cached part is its longest run of cached blocks from its start, short of its last token (the
    prefill must compute the last token's logits). Blocks are kept per scope: per client salt, and per correction
    where the correction changes the keys and values (one at a decoder layer); a final-layer correction shares the
    uncorrected blocks.
    """

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.blocks: OrderedDict[BlockKey, LayerKV] = OrderedDict()

    def lookup(self, scope: CacheScope, ids: tuple[int, ...]) -> tuple[int, LayerKV | None]:
        """How many leading tokens of `ids` are cached, and their keys and values per layer (None if none)."""
        found: list[LayerKV] = []
        end = PREFIX_BLOCK
        while end < len(ids) and (block := self.blocks.get((scope, ids[:end]))) is not None:
            found.append(block)
            end += PREFIX_BLOCK
        if not found:
            return 0, None
        self._touch(scope, ids, len(found))
        return len(found) * PREFIX_BLOCK, [(torch.cat([b[layer][0] for b in found], dim=1),
                                            torch.cat([b[layer][1] for b in found], dim=1))
                                           for layer in range(len(found[0]))]

    def keeps(self, ids: tuple[int, ...]) -> bool:
        """Whether `store` would keep any block of this prompt."""
        return self.max_tokens >= PREFIX_BLOCK and len(ids) > PREFIX_BLOCK

    def store(self, scope: CacheScope, ids: tuple[int, ...], kv: LayerKV) -> None:
        """Keep the blocks of a prefilled prompt (`kv`: its tokens' keys and values per layer, in order)."""
        blocks = (len(ids) - 1) // PREFIX_BLOCK
        for index in range(blocks):
            key = (scope, ids[:(index + 1) * PREFIX_BLOCK])
            if key not in self.blocks:
                cut = slice(index * PREFIX_BLOCK, (index + 1) * PREFIX_BLOCK)
                # Copies: a view would keep the whole batch's cache alive.
                self.blocks[key] = [(keys[:, cut].clone(), values[:, cut].clone()) for keys, values in kv]
        self._touch(scope, ids, blocks)
        while len(self.blocks) * PREFIX_BLOCK > self.max_tokens:
            self.blocks.popitem(last=False)

    def _touch(self, scope: CacheScope, ids: tuple[int, ...], blocks: int) -> None:
        # The first block most recently: a chain is evicted from its end, never cut at its start.
        for index in reversed(range(blocks)):
            self.blocks.move_to_end((scope, ids[:(index + 1) * PREFIX_BLOCK]))


def cache_with_past(config: PretrainedConfig, past: LayerKV | None) -> DynamicCache:
    """A fresh DynamicCache for the model of `config`, holding `past` ([B, heads, P, head_dim] per layer) if given."""
    if past is None:
        return DynamicCache(config=config)
    return DynamicCache(ddp_cache_data=past, config=config)
