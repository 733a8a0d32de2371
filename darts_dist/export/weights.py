"""The merged weights in transformers' layout: one model.safetensors up to 5 GB, else shards of at most 5 GB
with model.safetensors.index.json, as `save_pretrained` writes them. One shard is in memory at a time."""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

MAX_SHARD_BYTES = 5 * 10**9  # transformers' "5GB"
_ITEMSIZE = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
             "C64": 8, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I8": 1, "U8": 1, "BOOL": 1}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def weight_files(model_dir: Path) -> list[Path]:
    """The folder's safetensors weight files, in the order its index (if any) names them."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        names = dict.fromkeys(json.loads(index.read_text())["weight_map"].values())
        return [model_dir / name for name in names]
    return sorted(model_dir.glob("*.safetensors"))


_FLOATS = ("F64", "F32", "F16", "BF16")  # the dtypes an export's --dtype casts (not integers, not float8)
_CAST = (torch.float64, torch.float32, torch.float16, torch.bfloat16)  # the same, as torch names them


def _tensors(files: list[Path], dtype: torch.dtype | None = None) -> Iterator[tuple[Path, str, int, int]]:
    """(file, tensor name, element count, bytes) of every tensor, read from the headers alone; the bytes once cast
    to `dtype` where it casts them."""
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                tensor_slice = f.get_slice(name)
                count = math.prod(tensor_slice.get_shape())
                saved = tensor_slice.get_dtype()
                itemsize = dtype.itemsize if dtype is not None and saved in _FLOATS else _ITEMSIZE[saved]
                yield path, name, count, count * itemsize


def parameter_count(model_dir: Path) -> int:
    return sum(count for _, _, count, _ in _tensors(weight_files(model_dir)))


def _plan(files: list[Path], max_shard_bytes: int, dtype: torch.dtype | None) -> list[list[tuple[Path, str, int]]]:
    """(file, tensor, bytes) grouped into shards of at most `max_shard_bytes` (a larger tensor alone in its own)."""
    shards: list[list[tuple[Path, str, int]]] = [[]]
    size = 0
    for path, name, _, nbytes in _tensors(files, dtype):
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((path, name, nbytes))
        size += nbytes
    return shards


def saved_dtypes(model_dir: Path) -> set[str]:
    """The safetensors dtypes (F32, BF16, ...) of the folder's floating-point weights."""
    found = set()
    for path in weight_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            found |= {f.get_slice(name).get_dtype() for name in f.keys()}
    return found & set(_FLOATS)


def copy_weights(model_dir: Path, out: Path, max_shard_bytes: int = MAX_SHARD_BYTES,
                 dtype: torch.dtype | None = None) -> list[str]:
    """Write `model_dir`'s weights into `out` in transformers' layout, their floating-point tensors cast to `dtype`
    when given (rounded to nearest); returns the file names written."""
    files = weight_files(model_dir)
    if not files:
        raise FileNotFoundError(f"{model_dir} holds no safetensors weights")
    shards = _plan(files, max_shard_bytes, dtype)
    if len(shards) == 1 and len(files) == 1 and dtype is None:  # already one file: its bytes as they are
        shutil.copyfile(files[0], out / SINGLE_FILE)
        return [SINGLE_FILE]
    names = [SINGLE_FILE] if len(shards) == 1 else [f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                                                    for i in range(1, len(shards) + 1)]
    weight_map = {}
    for shard, name in zip(shards, names):
        tensors = {}
        for path, tensor, _ in shard:
            with safe_open(str(path), framework="pt") as f:
                value = f.get_tensor(tensor)
            tensors[tensor] = value.to(dtype) if dtype is not None and value.dtype in _CAST else value
            weight_map[tensor] = name
        save_file(tensors, str(out / name), metadata={"format": "pt"})
    if len(names) > 1:
        total = sum(nbytes for shard in shards for _, _, nbytes in shard)
        (out / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                 indent=2, sort_keys=True) + "\n")
    return names
