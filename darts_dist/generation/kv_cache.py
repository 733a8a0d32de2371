"""The running batch's KV cache in slots that sequences join and leave between decoding steps, the attention that
reads it, and a cache of prompt prefixes.

Each sequence holds a slot of its own for its whole life: a row of a band, the slots of one width (the next power
of two at or above its prompt + max_tokens, at least SLOT_MIN_WIDTH, at most the batch's token budget), per layer
keys and values [rows, kv heads, width, head dim] allocated once. A decoding step writes one column per sequence
(its next position) and attention reads each band's rows up to their longest, under a mask of each row's own
length: nothing is concatenated or copied per step. A joining sequence's prompt is copied into a free row of its
band; a leaving one's row is refilled by its band's last (one row's copy). A band doubles its rows when full
(within the budget), so joins copy its rows now and then, never another band's. Bands keep long prompts from
widening short ones: a 2,000-token prompt beside 31 short streams costs its own slot, not 32 rows of 2,000.

Attention over the slots runs through transformers' AttentionInterface (`use_slot_attention`): in a decoding
step, transformers' own SDPA attention once per band; every other forward (prefills, which compute in a
transformers DynamicCache of their own) goes to the model's implementation as before. Only full-attention layers
are taken (`check_full_attention`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import AttentionInterface, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from darts_dist.errors import DartsError

LayerKV = list[tuple[Tensor, Tensor]]  # per layer: keys, values [heads, tokens, head_dim]
SLOT_MIN_WIDTH = 16
# A band opens with rows for this many tokens (at least one row; a 2,048-wide band, one), and doubles them when full.
BAND_FIRST_TOKENS = 2048


def _layers(cache: DynamicCache) -> list[DynamicLayer]:
    layers = list(cache.layers)
    if any(type(layer) is not DynamicLayer for layer in layers):
        kinds = sorted({type(layer).__name__ for layer in layers})
        raise DartsError(f"continuous batching needs a KV cache of full-attention layers, this model's has {kinds}",
                         "serve a model without sliding-window or static cache layers")
    return layers


def check_full_attention(config: PretrainedConfig) -> None:
    """A DartsError now, for a model whose KV cache the slots cannot hold."""
    _layers(DynamicCache(config=config))


def slot_width(tokens: int, budget: int | None) -> int:
    """The width of the slot a sequence of at most `tokens` tokens holds: the next power of two, at least
    SLOT_MIN_WIDTH, at most `budget` (the batch's token budget; None: none)."""
    width = max(SLOT_MIN_WIDTH, 1 << (tokens - 1).bit_length())
    return width if budget is None else max(tokens, min(width, budget))


@dataclass(frozen=True)
class _BandStep:
    """A decoding step's view of one band: its rows r0:r1 of the batch, each row's write column (its length so
    far), and the mask of each row's own tokens over the columns attention reads."""

    band: _Band
    r0: int
    r1: int
    rows: Tensor
    columns: Tensor
    mask: Tensor  # [rows, 1, 1, read] bool


@dataclass(frozen=True)
class SlotKV:
    """What a slot layer hands attention in a decoding step: per band, its keys and values up to its longest row."""

    parts: list[tuple[_BandStep, Tensor, Tensor]]


class _Band:
    """The slots of one width: per layer, keys and values [capacity, kv heads, width, head dim]; `owners[i]` is the
    sequence in row i (rows 0..len(owners)-1 are used)."""

    def __init__(self, width: int) -> None:
        self.width = width
        self.keys: list[Tensor] = []
        self.values: list[Tensor] = []
        self.owners: list[object] = []

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[0] if self.keys else 0

    def resize(self, rows: int, like: LayerKV) -> None:
        """Reallocate to `rows` rows, keeping the used ones; `like` (per layer keys and values [kv heads, tokens,
        head dim]) gives the heads, head size, dtype and device."""
        used = len(self.owners)
        keys, values = [], []
        for layer, (k, v) in enumerate(like):
            new_k = k.new_zeros(rows, k.shape[0], self.width, k.shape[-1])
            new_v = v.new_zeros(rows, v.shape[0], self.width, v.shape[-1])
            if used:
                new_k[:used], new_v[:used] = self.keys[layer][:used], self.values[layer][:used]
            keys.append(new_k)
            values.append(new_v)
        self.keys, self.values = keys, values


class SlotCache(Cache):
    """The running sequences' KV cache: a slot per sequence, in bands by width, within `budget` tokens (None: no
    limit) of allocated slots. `order()` is the batch's row order (band by band), which a decoding step's inputs
    follow."""

    def __init__(self, config: PretrainedConfig, budget: int | None) -> None:
        super().__init__(layers=[_SlotLayer(self, index) for index in range(len(_layers(DynamicCache(config=config))))])
        self.budget = budget
        self.bands: dict[int, _Band] = {}
        self.band_of: dict[object, _Band] = {}
        self.step: list[_BandStep] = []

    def allocated(self) -> int:
        """Tokens' worth of slots allocated, used or not."""
        return sum(band.capacity * band.width for band in self.bands.values())

    def order(self) -> list:
        return [owner for width in sorted(self.bands) for owner in self.bands[width].owners]

    def add(self, owner: object, kv: LayerKV, width: int) -> None:
        """`owner`'s tokens so far (`kv`: per layer keys and values [kv heads, tokens, head dim]) into a free row of
        the band of `width`."""
        band = self.bands.get(width) or _Band(width)
        row = len(band.owners)
        if row == band.capacity:
            self._grow(band, kv)
        self.bands[width] = band
        length = kv[0][0].shape[1]
        for layer, (keys, values) in enumerate(kv):
            band.keys[layer][row, :, :length] = keys
            band.values[layer][row, :, :length] = values
        band.owners.append(owner)
        self.band_of[owner] = band

    def remove(self, owner: object) -> None:
        """Free `owner`'s row: its band's last row moves into it; an empty band is freed."""
        band = self.band_of.pop(owner)
        row, last = band.owners.index(owner), len(band.owners) - 1
        if row != last:
            for keys, values in zip(band.keys, band.values):
                keys[row], values[row] = keys[last], values[last]
            band.owners[row] = band.owners[last]
        band.owners.pop()
        if not band.owners:
            del self.bands[band.width]

    def _grow(self, band: _Band, kv: LayerKV) -> None:
        """Room for one more row: double the band's rows, within the budget (other bands' unused rows given back
        first when the budget is short)."""
        needed = band.capacity + 1
        rows = max(needed, 2 * band.capacity, BAND_FIRST_TOKENS // band.width)
        if self.budget is not None:
            if (self.budget - self.allocated() + band.capacity * band.width) // band.width < needed:
                for other in self.bands.values():
                    if other is not band and other.capacity > len(other.owners):
                        other.resize(len(other.owners), kv)
            room = (self.budget - self.allocated() + band.capacity * band.width) // band.width
            if room < needed:  # the engine admits sequences by the same budget: a bug, not an input
                raise RuntimeError(f"no room in the KV cache's budget of {self.budget} tokens for a slot of "
                                   f"{band.width}")
            rows = min(rows, room)
        band.resize(rows, kv)

    def begin_decode(self, lengths: list[int], device: torch.device) -> Tensor:
        """Set up a decoding step: `lengths[i]`, the tokens row i of `order()` holds (its new token goes there).
        Returns the attention mask to pass the forward (a placeholder: attention reads each band's own)."""
        self.step, start = [], 0
        for width in sorted(self.bands):
            band = self.bands[width]
            end = start + len(band.owners)
            columns = torch.tensor(lengths[start:end], device=device)
            read = int(max(lengths[start:end])) + 1
            mask = (torch.arange(read, device=device) <= columns[:, None])[:, None, None, :]
            self.step.append(_BandStep(band, start, end, torch.arange(end - start, device=device), columns, mask))
            start = end
        return torch.ones(len(lengths), 1, 1, 1, dtype=torch.bool, device=device)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # the engine gives every forward its position ids


class _SlotLayer(CacheLayerMixin):
    """One decoder layer's view of the slot cache, as transformers' attention calls it."""

    is_sliding = False

    def __init__(self, cache: SlotCache, index: int) -> None:
        super().__init__()
        self.cache, self.index = cache, index

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        pass

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[SlotKV, SlotKV]:
        """Write each row's new key and value [B, kv heads, 1, head dim] at its column; hand attention the bands."""
        parts = []
        for step in self.cache.step:
            keys, values = step.band.keys[self.index], step.band.values[self.index]
            keys[step.rows, :, step.columns] = key_states[step.r0:step.r1, :, 0]
            values[step.rows, :, step.columns] = value_states[step.r0:step.r1, :, 0]
            read = step.mask.shape[-1]
            parts.append((step, keys[:len(step.rows), :, :read], values[:len(step.rows), :, :read]))
        view = SlotKV(parts)
        return view, view

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0

    def get_seq_length(self) -> int:
        return 0

    def get_max_length(self) -> int:
        return -1


def _slot_attention(original: str):
    """An attention function: a decoding step's slots band by band with transformers' SDPA attention; any other
    forward with the model's own implementation (`original`; eager's math is SDPA's)."""
    fallback = ALL_ATTENTION_FUNCTIONS[original] if original in ALL_ATTENTION_FUNCTIONS else sdpa_attention_forward

    def attention(module, query: Tensor, key, value, attention_mask, **kwargs):
        if not isinstance(key, SlotKV):
            return fallback(module, query, key, value, attention_mask, **kwargs)
        outputs = [sdpa_attention_forward(module, query[step.r0:step.r1], keys, values, step.mask, **kwargs)[0]
                   for step, keys, values in key.parts]
        return torch.cat(outputs), None

    return attention


def use_slot_attention(model: PreTrainedModel) -> None:
    """Make `model`'s attention read a SlotCache (transformers' AttentionInterface, registered per original
    implementation, whose masks it keeps)."""
    original = model.config._attn_implementation
    if original.startswith("darts_slots_"):
        return
    name = f"darts_slots_{original}"
    AttentionInterface.register(name, _slot_attention(original))
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[original if original in
                                                                        ALL_MASK_ATTENTION_FUNCTIONS else "sdpa"])
    model.set_attn_implementation(name)


# Prompt prefixes are cached in blocks of this many tokens: smaller blocks hit more of a shared prefix.
PREFIX_BLOCK = 8
# What a block is kept for: the client's salt (None: shared) and the correction weights its keys and values were
# computed under (None: none).
CacheScope = tuple[str | None, tuple[float, ...] | None]
# The key of a block: its scope, and every prompt token up to the block's end, since a block's keys and values
# depend on all of them.
BlockKey = tuple[CacheScope, tuple[int, ...]]


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
