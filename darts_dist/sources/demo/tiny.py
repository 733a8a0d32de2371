"""Tiny random Llama models and a tiny tokenizer, for tests and `darts-dist demo --tiny`; and thin ones,
as wide as real 7B models with few layers, for measuring cost at true width (`thin:llama2-7b`).

A family is a base model plus experts that differ from it only in the top half of
the layers and the final norm, the way top-layer fine-tunes of a real base do. All of it
is built offline, deterministically: a tiny family in about a second, a thin one in about a minute.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from darts_dist.errors import DartsError
from darts_dist.fsutil import atomic_dir, atomic_file

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TINY_VOCAB_SIZE = 512

# SmolLM2-Instruct's ChatML template, with a neutral default system prompt.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant.<|im_end|>\\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# The three demo tasks' kinds of text, so the merges of frequent pieces are useful ones.
_TRAINING_TEXT = '''
def add(a, b):
    """Return the sum of a and b."""
    return a + b


def fibonacci(n: int) -> list[int]:
    values = [0, 1]
    while len(values) < n:
        values.append(values[-1] + values[-2])
    return values[:n]


class Counter:
    def __init__(self):
        self.counts = {}

    def update(self, items):
        for item in items:
            self.counts[item] = self.counts.get(item, 0) + 1
        return self


def is_prime(number):
    if number < 2:
        return False
    for divisor in range(2, int(number ** 0.5) + 1):
        if number % divisor == 0:
            return False
    return True


import os
import sys
from pathlib import Path

for path in sorted(Path(".").glob("*.py")):
    print(path.name, os.path.getsize(path), file=sys.stderr)

Question: Tom has 12 apples. He gives 5 apples to Mary and buys 8 more. How many apples does Tom have now?
Answer: Tom starts with 12 apples. After giving 5 away he has 12 - 5 = 7.
After buying 8 more he has 7 + 8 = 15. The answer is 15.

Question: A train travels 60 miles per hour for 3 hours. How far does it travel?
Answer: Distance is speed times time, so 60 * 3 = 180 miles. The answer is 180.

Question: Sara reads 24 pages on Monday and twice as many on Tuesday. How many pages did she read in total?
Answer: On Tuesday she reads 2 * 24 = 48 pages. In total she reads 24 + 48 = 72 pages. The answer is 72.

Question: A box holds 6 eggs. How many boxes are needed for 45 eggs?
Answer: 45 / 6 = 7.5, so 8 boxes are needed. The answer is 8.

Question: What is 17 + 26?
Answer: 17 + 26 = 43. The answer is 43.

Instruction: Write a short poem about the sea in exactly three lines.
Response: The sea is wide and deep and blue,
it sings the songs the sailors knew,
and every wave comes back to you.

Instruction: List three fruits in alphabetical order, separated by commas.
Response: apple, banana, cherry

Instruction: Answer in all capital letters: what is the capital of France?
Response: THE CAPITAL OF FRANCE IS PARIS.

Instruction: Summarize the following sentence in five words or fewer: The quick brown fox jumps over the lazy dog.
Response: A fox jumps over dog.

Instruction: Write the word "hello" in JSON format with the key "greeting".
Response: {"greeting": "hello"}

Instruction: Explain what a function is to a child. Do not use the word "code".
Response: A function is like a recipe. You give it some things, it follows its steps, and it gives you something back.
'''


@functools.lru_cache(maxsize=1)
def _tiny_tokenizer_json() -> str:
    """Train the byte-level BPE once per process; callers each get their own copy."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_TRAINING_TEXT.split("\n\n"), trainer=trainer)
    return tokenizer.to_str()


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A ChatML byte-level BPE tokenizer of 512 tokens, special tokens laid out like SmolLM2's."""
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tiny_tokenizer_json()),
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=512,
    )


@dataclass(frozen=True)
class FamilyShape:
    """A family's Llama shape; the defaults are the tiny family's."""

    hidden_size: int = 64
    num_layers: int = 4
    intermediate_size: int | None = None  # None: twice the hidden size
    num_heads: int = 4
    num_kv_heads: int = 2
    vocab_size: int | None = None  # None: the tokenizer's; larger leaves rows no token reaches, as padded vocabularies do
    max_positions: int = 512
    tie_embeddings: bool = True
    dtype: str = "float32"  # as saved


# Real models' widths with two decoder layers: every per-token cost of the stream (hidden states, the
# embeddings, the LM head, attention's heads) is the real model's, at a fraction of the layers' compute.
THIN_SHAPES = {
    "llama2-7b": FamilyShape(hidden_size=4096, num_layers=2, intermediate_size=11008, num_heads=32, num_kv_heads=32,
                             vocab_size=32000, max_positions=4096, tie_embeddings=False, dtype="bfloat16"),
    "mistral-7b": FamilyShape(hidden_size=4096, num_layers=2, intermediate_size=14336, num_heads=32, num_kv_heads=8,
                              vocab_size=32000, max_positions=4096, tie_embeddings=False, dtype="bfloat16"),
}


@dataclass(frozen=True)
class TinyFamily:
    """Folders of a tiny base model and its experts, one per task."""

    base: Path
    experts: dict[str, Path]


def _llama_config(shape: FamilyShape, tokenizer: PreTrainedTokenizerFast) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=shape.vocab_size or len(tokenizer),
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size or 2 * shape.hidden_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        max_position_embeddings=shape.max_positions,
        tie_word_embeddings=shape.tie_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def make_tiny_family(
    out_dir: Path,
    tasks: Sequence[str] = ("code", "math", "instruct"),
    seed: int = 0,
    shape: FamilyShape = FamilyShape(),
    expert_scale: float = 0.05,
    added_tokens: Mapping[str, int] | None = None,
) -> TinyFamily:
    """Write (or reuse) a random Llama of `shape` at out_dir/base and one expert per task at out_dir/<task>.

    Each expert is the base plus Gaussian noise of `expert_scale` times each tensor's RMS
    on the top half of the layers and the final norm; `added_tokens[task]` tokens its fine-tune added, as real
    experts' do (WizardMath-7B's pad token): rows appended to its embeddings and LM head, special tokens appended
    to its tokenizer. A marker file records the settings, so a second call with the same ones returns at once.
    """
    added_tokens = {task: count for task, count in (added_tokens or {}).items() if count}
    out_dir = Path(out_dir).absolute()
    if "base" in tasks:
        raise DartsError(f"task name 'base' in {list(tasks)} clashes with the base model folder", "rename the task")
    settings = {
        "tasks": list(tasks),
        "seed": seed,
        **dataclasses.asdict(shape),
        "expert_scale": expert_scale,
        "vocab": hashlib.sha256(_tiny_tokenizer_json().encode()).hexdigest()[:16],
        **({"added_tokens": added_tokens} if added_tokens else {}),
    }
    family = TinyFamily(base=out_dir / "base", experts={task: out_dir / task for task in tasks})
    marker = out_dir / "tiny_family.json"
    folders = [family.base, *family.experts.values()]
    if marker.is_file() and all(folder.is_dir() for folder in folders):
        if json.loads(marker.read_text()) == settings:
            return family
    elif not marker.is_file():
        foreign = [str(folder) for folder in folders if folder.exists()]
        if foreign:
            raise DartsError(
                f"{', '.join(foreign)} already exist(s) and was not written by make_tiny_family",
                f"choose an empty out_dir instead of {out_dir}",
            )

    # A half-rebuilt family must not pass for the old one if this call is interrupted.
    marker.unlink(missing_ok=True)
    tokenizer = build_tiny_tokenizer()
    tokenizer.model_max_length = shape.max_positions
    config = _llama_config(shape, tokenizer)
    # Seed a private RNG stream so building a family never disturbs the caller's.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(getattr(torch, shape.dtype)).eval()
    base_state = {name: tensor.clone() for name, tensor in model.state_dict().items()}

    _save(model, tokenizer, family.base)
    for task, folder in family.experts.items():
        model.load_state_dict(_perturbed(base_state, task, seed, shape.num_layers, expert_scale))
        _save(*_with_added_tokens(model, tokenizer, added_tokens.get(task, 0)), folder)
    with atomic_file(marker) as tmp:
        tmp.write_text(json.dumps(settings, indent=2))
    return family


def _perturbed(
    state: dict[str, torch.Tensor], task: str, seed: int, num_layers: int, scale: float
) -> dict[str, torch.Tensor]:
    """The base state plus noise on the tensors a top-layer fine-tune would change."""
    # Seeded by the task's name, so an expert does not change when other tasks are added.
    digest = hashlib.sha256(f"{seed}:{task}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
    trained = tuple(f"model.layers.{i}." for i in range(num_layers // 2, num_layers)) + ("model.norm.",)
    result = {}
    for name, tensor in state.items():
        if name.startswith(trained):
            # RMS rather than std: norm weights start as all ones, whose std is zero.
            rms = tensor.float().pow(2).mean().sqrt()
            noise = torch.randn(tensor.shape, generator=generator)
            tensor = (tensor.float() + scale * rms * noise).to(tensor.dtype)
        result[name] = tensor
    return result


def _with_added_tokens(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast,
                       count: int) -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast]:
    """Copies with `count` tokens added at the end: special tokens in the tokenizer, rows (each the mean of the
    existing rows, as transformers' resizing starts them) in the embeddings and the LM head; none: the originals."""
    if not count:
        return model, tokenizer
    model, tokenizer = copy.deepcopy(model), copy.deepcopy(tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": [f"<|added_{i}|>" for i in range(count)]})
    rows = model.config.vocab_size
    model.resize_token_embeddings(rows + count, mean_resizing=False)
    with torch.no_grad():
        for weights in {model.get_input_embeddings().weight, model.get_output_embeddings().weight}:
            weights[rows:] = weights[:rows].float().mean(0).to(weights.dtype)
    return model, tokenizer


def _save(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, folder: Path) -> None:
    with atomic_dir(folder, overwrite=True) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
