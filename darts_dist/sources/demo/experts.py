"""The demo experts: low-rank deltas of a base model's top layers, one per task, shipped with the package.

Each is made once, by `darts-dist demo --make-experts` (fp32, seeded): the linear layers of the base's top
`top_layers` decoder layers are fine-tuned at full rank, and each layer's change is truncated to its best
rank-`rank` approximation (SVD) and written as a PEFT LoRA adapter (fp16, a few MB, checksums in
`experts/manifest.json`). Every machine then loads the same experts, and the demo's numbers differ between
CPUs by float rounding only. The frozen bottom's outputs never change, so they are computed once per batch
(`frozen_bottom_features`) and every step runs only the top layers, the norm and the lm_head (`run_top`),
the latter on the tokens that carry loss only.
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
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.masking_utils import create_causal_mask

from darts_dist.core import mask_positions
from darts_dist.errors import DartsError
from darts_dist.fsutil import atomic_dir
from darts_dist.logs import progress_bar
from darts_dist.sources.data import load_rows, tokenize_rows
from darts_dist.sources.models import BUNDLED_MODEL, content_hash, load_causal_lm, load_tokenizer

if TYPE_CHECKING:
    from peft import PeftModel

IGNORE_INDEX = -100
SHIPPED_DIR = Path(__file__).parent / "experts"  # package data: one adapter folder per task, and the manifest
MANIFEST = "manifest.json"
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ExpertTraining:
    """How a demo expert is made from the base: every linear layer of its top decoder layers fine-tuned, each change
    kept at rank `rank`."""

    top_layers: int = 8  # decoder layers tuned; the bottom, embeddings, norms and lm_head (tied) stay frozen
    # The truncation's rank: 2.6 MB of fp16 per expert at 16. Full-rank changes truncated to it interfere more in a
    # merge than LoRA adapters trained at that rank (docs/notes/measurements.md, "The shipped demo experts").
    rank: int = 16
    steps: int = 200
    batch_size: int = 8
    # 192: the demo rows with SmolLM2's system prompt stay well within it, answers included.
    max_length: int = 192
    learning_rate: float = 1e-3
    num_samples: int = 512  # training rows per task, the first ones of its training file
    seed: int = 0
    # "bf16" runs the matmuls under bf16 autocast (weights and optimizer stay fp32), an opt-in: faster where the
    # CPU multiplies bf16 natively (AMX, AVX512-BF16), slower elsewhere, and its experts differ with the CPU.
    precision: Literal["bf16", "fp32"] = "fp32"

    def __post_init__(self) -> None:
        counts = (self.top_layers, self.rank, self.steps, self.batch_size, self.num_samples)
        if min(counts) < 1 or self.max_length < 2 or not self.learning_rate > 0:
            raise DartsError(
                f"expert training settings out of range: {self}",
                "top_layers, rank, steps, batch_size and num_samples must be >= 1, max_length >= 2, "
                "learning_rate > 0",
            )
        if self.precision not in ("bf16", "fp32"):
            raise DartsError(f"precision={self.precision!r} is not one of 'bf16', 'fp32'", "use one of those")


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
    model: PreTrainedModel, features: list[TopInputs], params: list[torch.nn.Parameter], settings: ExpertTraining,
    desc: str = "expert",
) -> list[float]:
    """Train `params` (of the top layers) on cached features with AdamW; returns each step's loss."""
    optimizer = torch.optim.AdamW(params, lr=settings.learning_rate, weight_decay=0.0)
    bf16 = settings.precision == "bf16"
    generator = torch.Generator().manual_seed(settings.seed)
    order: list[int] = []
    losses = []
    progress = progress_bar(range(settings.steps), desc=desc, unit="step")
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
    return losses


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


def train_expert(
    base_dir: Path, train_file: Path, task: str, settings: ExpertTraining, tokenizer: PreTrainedTokenizerBase
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One task's expert: the top layers' linear weights fine-tuned from the base; their changes, and the losses."""
    tokenized = tokenize_rows(load_rows(train_file), tokenizer, task, settings.max_length,
                              max_samples=settings.num_samples)
    model = load_causal_lm(base_dir)
    batches = progress_bar(tokenized.batches(settings.batch_size), desc=f"{task}: frozen bottom", unit="batch",
                   total=math.ceil(len(tokenized) / settings.batch_size))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=settings.precision == "bf16"):
        features = frozen_bottom_features(model, batches, settings.top_layers)
    if not any(bool((inputs.targets != IGNORE_INDEX).any()) for inputs in features):
        raise DartsError(
            f"task {task!r}: no training row of {train_file} has a token to learn within "
            f"max_length={settings.max_length} (chat rows learn only the assistant's tokens)",
            "raise max_length, or give rows whose responses start earlier",
        )
    tuned = _tuned_weights(model, features[0].start_layer)
    base = {name: weight.detach().clone() for name, weight in tuned.items()}
    model.requires_grad_(False)
    for weight in tuned.values():
        weight.requires_grad_(True)
    losses = train_top(model, features, list(tuned.values()), settings, desc=f"{task}: top layers")
    return {name: weight.detach() - base[name] for name, weight in tuned.items()}, losses


def _tuned_weights(model: PreTrainedModel, start_layer: int) -> dict[str, torch.nn.Parameter]:
    """The weights of the LORA_MODULES linear layers in decoder layers start_layer.., by parameter name."""
    return {name: param for name, param in model.named_parameters()
            if name.endswith(".weight") and name.split(".")[-2] in LORA_MODULES
            and int(name.split(".")[2]) >= start_layer}


def low_rank_adapter(
    base_dir: Path, deltas: Mapping[str, torch.Tensor], settings: ExpertTraining
) -> tuple["PeftModel", float]:
    """A PEFT LoRA adapter whose B·A is each delta's best rank-`settings.rank` approximation (truncated SVD, float64),
    and the share of the deltas' squared Frobenius norm it keeps."""
    from peft import LoraConfig, get_peft_model  # heavy to import, and only making the experts needs it

    model = load_causal_lm(base_dir)
    start_layer = model.config.num_hidden_layers - settings.top_layers
    # lora_alpha = r: PEFT scales B·A by alpha / r, so 1 here and B·A is the delta itself.
    adapters = LoraConfig(r=settings.rank, lora_alpha=settings.rank, lora_dropout=0.0, target_modules=list(LORA_MODULES),
                          layers_to_transform=list(range(start_layer, model.config.num_hidden_layers)))
    peft_model = get_peft_model(model, adapters)
    modules = dict(peft_model.base_model.model.named_modules())
    kept = total = 0.0
    for name, delta in deltas.items():
        u, s, vh = torch.linalg.svd(delta.double(), full_matrices=False)
        keep = min(settings.rank, len(s))  # a layer narrower than the rank keeps all of it; the rest stays zero
        root = s[:keep].sqrt()
        module = modules[name.removesuffix(".weight")]
        lora_a, lora_b = module.lora_A["default"].weight.data, module.lora_B["default"].weight.data
        lora_a.zero_(), lora_b.zero_()
        lora_a[:keep] = root[:, None] * vh[:keep]
        lora_b[:, :keep] = u[:, :keep] * root
        kept, total = kept + float((s[: settings.rank] ** 2).sum()), total + float((s**2).sum())
    return peft_model, kept / total if total else 1.0


def make_experts(
    base_dir: Path, train_files: Mapping[str, Path], out_dir: Path, settings: ExpertTraining = ExpertTraining(),
    base_name: str = BUNDLED_MODEL,
) -> dict[str, Path]:
    """Train one expert per task of `train_files` and write them to `out_dir` as the package ships them: a PEFT
    adapter folder per task (weights in fp16) and `manifest.json` with each adapter's checksum and how it was made.
    `base_name`: how the adapters name their base, a reference every machine resolves (not this one's path).
    Written to a temporary folder first: an interrupted run leaves `out_dir` as it was."""
    base_dir = Path(base_dir).absolute()
    train_files = _check_files(train_files, "training")
    tokenizer = load_tokenizer(base_dir)
    manifest: dict[str, object] = {"base": content_hash(base_dir), "settings": dataclasses.asdict(settings),
                                   "experts": {}}
    with atomic_dir(Path(out_dir), overwrite=True) as tmp:
        for task, train_file in train_files.items():
            started = time.perf_counter()
            deltas, losses = train_expert(base_dir, train_file, task, settings, tokenizer)
            peft_model, kept = low_rank_adapter(base_dir, deltas, settings)
            peft_model.half()  # fp16 on disk: half the bytes; loading upcasts to the base's fp32
            peft_model.save_pretrained(tmp / task)
            (tmp / task / "README.md").unlink(missing_ok=True)  # PEFT's model card template: nothing of ours in it
            adapter_config = json.loads((tmp / task / "adapter_config.json").read_text())
            # Sorted: PEFT writes target_modules in a set's order, which changes from one process to the next.
            adapter_config |= {"base_model_name_or_path": base_name,
                               "target_modules": sorted(adapter_config["target_modules"])}
            (tmp / task / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2, sort_keys=True))
            manifest["experts"][task] = {
                "train_file": _file_hash(train_file),
                "first_loss": losses[0],
                "last_loss": losses[-1],
                "kept": kept,  # the share of the fine-tune's squared change the rank-`rank` adapter keeps
                "seconds": round(time.perf_counter() - started, 1),
                "files": {name: _file_hash(tmp / task / name) for name in ADAPTER_FILES},
            }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return {task: Path(out_dir) / task for task in train_files}


def shipped_experts(folder: Path = SHIPPED_DIR) -> dict[str, Path]:
    """The shipped expert adapters by task, each checked against the manifest's checksums."""
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        raise DartsError(f"no demo experts in {folder} (no {MANIFEST})",
                         "reinstall darts-dist, or make them: darts-dist demo --make-experts")
    experts = json.loads(manifest_path.read_text())["experts"]
    for task, record in experts.items():
        for name, expected in record["files"].items():
            path = folder / task / name
            if not path.is_file() or _file_hash(path) != expected:
                raise DartsError(f"the demo expert {task!r} in {folder} does not match its checksum ({name})",
                                 "reinstall darts-dist, or make the experts again: darts-dist demo --make-experts")
    return {task: folder / task for task in experts}


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
