"""The demo experts: top-layer fine-tunes of a base model, one per task, cached on disk.

A full fine-tune step of SmolLM2-135M takes ~25 s on two CPU cores, so an expert trains
only its top `top_layers` decoder layers and the final norm; the embeddings (tied to the
lm_head) and the bottom layers stay frozen. The bottom's outputs therefore never change
during training: they are computed once per batch (`frozen_bottom_features`) and every
step runs only the top layers, the norm and the lm_head (`run_top`), the latter on the
tokens that carry loss only. Where the CPU multiplies bf16 natively, both run under bf16
autocast (`ExpertTraining.precision`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers import PreTrainedModel
from transformers.masking_utils import create_causal_mask

from darts_dist.core import mask_positions
from darts_dist.errors import DartsError
from darts_dist.fsutil import atomic_dir, cache_root
from darts_dist.sources.data import load_rows, tokenize_rows
from darts_dist.sources.models import content_hash, load_causal_lm, load_tokenizer

IGNORE_INDEX = -100
# Bump when the training code changes what an expert is, so cached experts are rebuilt.
_RECIPE_VERSION = 1
_MARKER = "darts_expert.json"
_TOKENIZER_SUFFIXES = (".json", ".jinja", ".txt", ".model")


@dataclass(frozen=True)
class ExpertTraining:
    """How a demo expert is fine-tuned from the base."""

    # 8 top layers for 200 steps at 1e-3: the demo experts should be specialists as real fine-tunes are, far
    # from the base. At 3e-4 for 150 steps (math 40%, instruct 30% on 200 held-out problems) the task vectors
    # were so small that task arithmetic at weight 1 kept every expert's score within 1-5 points.
    top_layers: int = 8  # decoder layers trained (plus the final norm); embeddings / lm_head (tied) stay frozen
    steps: int = 200
    batch_size: int = 8
    # 192: the demo rows with SmolLM2's system prompt stay well within it, answers included.
    max_length: int = 192
    learning_rate: float = 1e-3
    num_samples: int = 512  # training rows per task, the first ones of its training file
    seed: int = 0
    # "bf16" runs the matmuls under bf16 autocast (weights and optimizer stay fp32): 2-4x faster
    # where the CPU multiplies bf16 natively (AMX, AVX512-BF16), slower elsewhere; "auto" picks
    # it only there. The bottom's features are then computed under autocast too.
    precision: Literal["auto", "bf16", "fp32"] = "auto"

    def __post_init__(self) -> None:
        counts = (self.top_layers, self.steps, self.batch_size, self.num_samples)
        if min(counts) < 1 or self.max_length < 2 or not self.learning_rate > 0:
            raise DartsError(
                f"expert training settings out of range: {self}",
                "top_layers, steps, batch_size and num_samples must be >= 1, max_length >= 2, learning_rate > 0",
            )
        resolved_precision(self.precision)


@dataclass(frozen=True)
class TopInputs:
    """One batch as the trainable top sees it: all the frozen bottom contributes, computed once."""

    start_layer: int  # index of the first decoder layer the top runs
    hidden_states: torch.Tensor  # [B, L, d], the input of layer `start_layer`
    causal_mask: torch.Tensor | None  # as create_causal_mask built it; None means plainly causal
    position_ids: torch.Tensor  # [B, L]
    position_embeddings: tuple[torch.Tensor, torch.Tensor]  # RoPE (cos, sin), [B, L, head_dim] each
    targets: torch.Tensor  # [B, L]: the next token where the loss counts, IGNORE_INDEX elsewhere


def batch_targets(batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Targets for the logits at each position: token t+1 if the loss counts it, else IGNORE_INDEX.

    The loss counts `response_mask` tokens when the batch has one (the assistant's turns
    of chat data), otherwise every real token.
    """
    input_ids, attention_mask = batch["input_ids"], batch["attention_mask"].bool()
    counted = batch["response_mask"].bool() & attention_mask if "response_mask" in batch else attention_mask
    targets = torch.full_like(input_ids, IGNORE_INDEX)
    targets[:, :-1] = torch.where(counted[:, 1:], input_ids[:, 1:], IGNORE_INDEX)
    return targets


def _check_top_layers(model: PreTrainedModel, top_layers: int) -> int:
    num_layers = model.config.num_hidden_layers
    if not 1 <= top_layers <= num_layers:
        raise DartsError(
            f"top_layers={top_layers} is outside 1..{num_layers}, the decoder layers of this model",
            f"train between 1 and {num_layers} top layers",
        )
    return num_layers - top_layers


@torch.no_grad()
def frozen_bottom_features(
    model: PreTrainedModel, batches: Iterable[Mapping[str, torch.Tensor]], top_layers: int
) -> list[TopInputs]:
    """Run the frozen bottom (embeddings and the first L - top_layers layers) over every batch once.

    Each batch holds `input_ids` and `attention_mask` [B, L], and optionally `response_mask`,
    the tokens the loss counts (all real tokens without it). Returned tensors are detached,
    so they can feed any number of training steps.
    """
    start_layer = _check_top_layers(model, top_layers)
    decoder = model.model
    features = []
    for batch in batches:
        input_ids, attention_mask = batch["input_ids"], batch["attention_mask"]
        position_ids = mask_positions(attention_mask)
        hidden = decoder.embed_tokens(input_ids)
        causal_mask = create_causal_mask(
            config=model.config,
            inputs_embeds=hidden,
            attention_mask=attention_mask,
            cache=None,
            position_ids=position_ids,
        )
        position_embeddings = decoder.rotary_emb(hidden, position_ids=position_ids)
        for layer in decoder.layers[:start_layer]:
            hidden = layer(
                hidden,
                attention_mask=causal_mask,
                position_ids=position_ids,
                position_embeddings=position_embeddings,
            )
        features.append(
            TopInputs(
                start_layer=start_layer,
                hidden_states=hidden,
                causal_mask=causal_mask,
                position_ids=position_ids,
                position_embeddings=position_embeddings,
                targets=batch_targets(batch),
            )
        )
    return features


def run_top(model: PreTrainedModel, inputs: TopInputs) -> torch.Tensor:
    """The top layers and the final norm on cached bottom features: the lm_head's input, [B, L, d]."""
    hidden = inputs.hidden_states
    for layer in model.model.layers[inputs.start_layer :]:
        hidden = layer(
            hidden,
            attention_mask=inputs.causal_mask,
            position_ids=inputs.position_ids,
            position_embeddings=inputs.position_embeddings,
        )
    return model.model.norm(hidden)


def summed_target_nll(model: PreTrainedModel, final_hidden: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Summed next-token NLL over the positions with a target, and how many there are.

    Only those positions go through the lm_head: with a 49152-token vocabulary it costs
    more than a decoder layer, and most of a chat batch is prompt or padding.
    """
    keep = targets != IGNORE_INDEX
    logits = model.lm_head(final_hidden[keep])
    return F.cross_entropy(logits.float(), targets[keep], reduction="sum"), int(keep.sum())


def train_top(
    model: PreTrainedModel, features: list[TopInputs], settings: ExpertTraining, desc: str = "expert"
) -> list[float]:
    """Fine-tune the top layers and final norm on cached features with AdamW; returns each step's loss."""
    start_layer = features[0].start_layer
    params = [p for layer in model.model.layers[start_layer:] for p in layer.parameters()]
    params += list(model.model.norm.parameters())
    for param in params:
        param.requires_grad_(True)
    optimizer = torch.optim.AdamW(params, lr=settings.learning_rate, weight_decay=0.0)
    bf16 = resolved_precision(settings.precision) == "bf16"
    generator = torch.Generator().manual_seed(settings.seed)
    order: list[int] = []
    losses = []
    progress = tqdm(range(settings.steps), desc=desc, unit="step")
    for _ in progress:
        if not order:
            # A fresh shuffle of the batches each epoch; batch contents stay as cached.
            order = torch.randperm(len(features), generator=generator).tolist()
        inputs = features[order.pop()]
        # A fresh autocast region per step: autocast caches its bf16 copies of the weights
        # until the region ends, so one region around the loop would never see an update.
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            nll, count = summed_target_nll(model, run_top(model, inputs), inputs.targets)
        loss = nll / max(count, 1)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        losses.append(loss.item())
        progress.set_postfix(loss=f"{losses[-1]:.3f}")
    for param in params:
        param.requires_grad_(False)
    return losses


def resolved_precision(precision: str) -> Literal["bf16", "fp32"]:
    """The precision "auto" stands for on this machine; "bf16" and "fp32" stand for themselves."""
    if precision in ("bf16", "fp32"):
        return precision
    if precision != "auto":
        raise DartsError(f"precision={precision!r} is not one of 'auto', 'bf16', 'fp32'", "use one of those")
    # Private torch helpers, hence the getattr: without them, assume no native bf16.
    checks = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    return "bf16" if any(getattr(torch.cpu, check, lambda: False)() for check in checks) else "fp32"


def _file_hash(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _check_files(files: Mapping[str, Path], role: str) -> dict[str, Path]:
    if not files:
        raise DartsError(f"no {role} files were given", f"pass one {role} file per task")
    missing = {task: str(path) for task, path in files.items() if not Path(path).is_file()}
    if missing:
        raise DartsError(f"{role} file(s) not found: {missing}", "check the paths, or regenerate the demo data")
    return {task: Path(path).absolute() for task, path in files.items()}


def _tokenizer_hash(folder: Path) -> str:
    """sha256 over a folder's tokenizer-kind files; content_hash covers only config and weights."""
    digest = hashlib.sha256()
    for path in sorted(Path(folder).iterdir()):
        if path.is_file() and path.suffix in _TOKENIZER_SUFFIXES:
            digest.update(path.name.encode() + b"\0" + _file_hash(path).encode())
    return digest.hexdigest()


def _experts_key(base_dir: Path, train_files: Mapping[str, Path], settings: ExpertTraining, tokenizer_dir: Path) -> str:
    """What an expert set depends on: the base, the tokenizer, each task's data, the settings, the recipe."""
    ingredients = {
        "recipe": _RECIPE_VERSION,
        "base": content_hash(base_dir),
        "tokenizer": _tokenizer_hash(tokenizer_dir),
        "data": {task: _file_hash(path) for task, path in sorted(train_files.items())},
        "settings": dataclasses.asdict(settings),
    }
    return hashlib.sha256(json.dumps(ingredients, sort_keys=True).encode()).hexdigest()


def _is_built(folder: Path, key: str) -> bool:
    marker = folder / _MARKER
    return marker.is_file() and json.loads(marker.read_text()).get("key") == key


def make_experts(
    base_dir: Path,
    train_files: Mapping[str, Path],
    out_root: Path | None = None,
    settings: ExpertTraining = ExpertTraining(),
    tokenizer_dir: Path | None = None,
) -> dict[str, Path]:
    """Fine-tune (or reuse) one expert per task of `train_files`; returns {task: expert folder}.

    The folders live under `out_root` (default: cache_root()/experts/<key>), where the key
    hashes the base's content, the tokenizer, each training file's bytes and the settings.
    A folder is reused only when its marker holds the same key, so changed data or
    settings rebuild it. Chat rows train on the assistant's tokens only, text rows on all.
    """
    base_dir = Path(base_dir).absolute()
    tokenizer_dir = Path(tokenizer_dir).absolute() if tokenizer_dir is not None else base_dir
    train_files = _check_files(train_files, "training")
    # Resolved before hashing: "auto" trains differently on different CPUs.
    settings = dataclasses.replace(settings, precision=resolved_precision(settings.precision))
    key = _experts_key(base_dir, train_files, settings, tokenizer_dir)
    out_root = Path(out_root).absolute() if out_root is not None else cache_root() / "experts" / key[:16]
    experts = {task: out_root / task for task in train_files}
    todo = [task for task, folder in experts.items() if not _is_built(folder, key)]
    if not todo:
        return experts

    tokenizer = load_tokenizer(tokenizer_dir)
    for task in todo:
        started = time.perf_counter()
        tokenized = tokenize_rows(
            load_rows(train_files[task]), tokenizer, task, settings.max_length, max_samples=settings.num_samples
        )
        model = load_causal_lm(base_dir)
        batches = tqdm(
            tokenized.batches(settings.batch_size),
            desc=f"{task}: frozen bottom",
            unit="batch",
            total=math.ceil(len(tokenized) / settings.batch_size),
        )
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=settings.precision == "bf16"):
            features = frozen_bottom_features(model, batches, settings.top_layers)
        if not any(bool((inputs.targets != IGNORE_INDEX).any()) for inputs in features):
            raise DartsError(
                f"task {task!r}: no training row of {train_files[task]} has a token to learn within "
                f"max_length={settings.max_length} (chat rows learn only the assistant's tokens)",
                "raise max_length, or give rows whose responses start earlier",
            )
        prepare_s = time.perf_counter() - started
        losses = train_top(model, features, settings, desc=f"{task}: top layers")
        marker = {
            "key": key,
            "task": task,
            "base": str(base_dir),
            "train_file": str(train_files[task]),
            "settings": dataclasses.asdict(settings),
            "first_loss": losses[0],
            "last_loss": losses[-1],
            "prepare_seconds": round(prepare_s, 1),
            "train_seconds": round(time.perf_counter() - started - prepare_s, 1),
        }
        with atomic_dir(experts[task], overwrite=True) as tmp:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            (tmp / _MARKER).write_text(json.dumps(marker, indent=2))
    return experts


@torch.no_grad()
def heldout_nll(model: PreTrainedModel, batches: Iterable[Mapping[str, torch.Tensor]]) -> float:
    """NLL per counted token of a model over batches (response tokens for chat, all real ones for text)."""
    total, count = 0.0, 0
    for batch in batches:
        attention_mask = batch["attention_mask"]
        final_hidden = model.model(
            input_ids=batch["input_ids"], attention_mask=attention_mask, position_ids=mask_positions(attention_mask)
        ).last_hidden_state
        nll, n = summed_target_nll(model, final_hidden, batch_targets(batch))
        total, count = total + nll.item(), count + n
    return total / count if count else math.nan


def expert_report(
    base_dir: Path,
    experts: Mapping[str, Path],
    heldout_files: Mapping[str, Path],
    max_length: int = ExpertTraining.max_length,
    batch_size: int = ExpertTraining.batch_size,
    max_samples: int | None = None,
    tokenizer_dir: Path | None = None,
) -> dict[str, dict[str, float]]:
    """Held-out NLL per token of each expert and of the base on that expert's task.

    Returns {task: {"base": nll, "expert": nll}}; an expert that learnt its task has the
    lower number. Tasks without a held-out file are an error, not silently skipped.
    """
    heldout_files = _check_files(heldout_files, "held-out")
    missing = sorted(set(experts) - set(heldout_files))
    if missing:
        raise DartsError(f"no held-out file for task(s) {missing}", "pass a held-out file for every expert's task")
    tokenizer = load_tokenizer(tokenizer_dir if tokenizer_dir is not None else base_dir)
    sets = {
        task: tokenize_rows(load_rows(heldout_files[task]), tokenizer, task, max_length, max_samples=max_samples)
        for task in experts
    }
    base = load_causal_lm(base_dir)
    report = {task: {"base": heldout_nll(base, sets[task].batches(batch_size))} for task in experts}
    del base
    for task, folder in experts.items():
        report[task]["expert"] = heldout_nll(load_causal_lm(folder), sets[task].batches(batch_size))
    return report
