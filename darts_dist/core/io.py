"""Corrections (and the task router) on disk: a safetensors file whose JSON header says what it holds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from darts_dist.core.correction import CorrectionSpec, DartsCorrections
from darts_dist.errors import DartsError
from darts_dist.fsutil import atomic_file

FORMAT = "darts-dist-corrections"
FORMAT_VERSION = 1
HEADER_KEY = "darts_dist"


def _tensors(corrections: DartsCorrections) -> dict[str, torch.Tensor]:
    """Tensor names "{layer}.{param}", e.g. "final.down", "12.position"."""
    return {
        f"{layer}.{name}": p
        for layer in corrections.layer_keys
        for name, p in corrections[layer].named_parameters()
    }


def write_tagged(path: Path, tensors: dict[str, torch.Tensor], header: dict[str, Any], kind: str) -> Path:
    """Write fp32 CPU tensors with `header` as JSON under the darts-dist metadata key, atomically."""
    path = Path(path)
    tensors = {name: t.detach().to("cpu", torch.float32).contiguous() for name, t in tensors.items()}
    try:
        header_json = json.dumps(header)
    except TypeError as e:
        raise DartsError(
            f"cannot save the {kind} to {path}: the metadata is not JSON-serialisable ({e})",
            fix="pass metadata made of strings, numbers, lists and dicts",
        ) from e
    with atomic_file(path) as tmp:
        save_file(tensors, str(tmp), metadata={HEADER_KEY: header_json})
    return path


def read_tagged_header(path: Path, fmt: str, version: int | tuple[int, ...], keys: tuple[str, ...],
                       kind: str) -> dict[str, Any]:
    """The darts-dist header of a `fmt` file, checked for format, version (one, or those readable) and `keys`,
    without loading tensors.

    `kind` names the file's content in errors ("corrections", "router").
    """
    path = Path(path)
    resave = f"re-save the {kind}"
    if not path.is_file():
        raise DartsError(f"{kind} file {path} does not exist", fix="check the path, or calibrate first")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except (SafetensorError, OSError, ValueError) as e:
        raise DartsError(f"{path} is not a readable safetensors file ({e})", fix=resave) from e
    if HEADER_KEY not in meta:
        raise DartsError(
            f"{path} has no darts-dist header: it is a safetensors file, but not darts-dist {kind}",
            fix=f"pass a {kind} file written by darts-dist",
        )
    try:
        header = json.loads(meta[HEADER_KEY])
    except json.JSONDecodeError as e:
        raise DartsError(f"{path}: the darts-dist header is not valid JSON ({e})", fix=resave) from e
    if not isinstance(header, dict) or header.get("format") != fmt:
        found = header.get("format") if isinstance(header, dict) else type(header).__name__
        raise DartsError(f"{path}: header format is {found!r}, expected {fmt!r}", fix=resave)
    readable = version if isinstance(version, tuple) else (version,)
    if header.get("version") not in readable:
        raise DartsError(
            f"{path}: {kind} format version {header.get('version')!r}, this darts-dist reads "
            f"{' or '.join(map(str, readable))}",
            fix="use the darts-dist version that wrote the file, or re-calibrate",
        )
    for key in keys:
        if key not in header:
            raise DartsError(f"{path}: the darts-dist header lacks {key!r}", fix=resave)
    return header


def read_tagged_tensors(path: Path, expected: dict[str, list[int]], kind: str) -> dict[str, torch.Tensor]:
    """The file's tensors, refused unless their names and shapes are exactly `expected`."""
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise DartsError(f"{path}: cannot read the tensors ({e})", fix=f"re-save the {kind}") from e
    actual = {name: list(t.shape) for name, t in tensors.items()}
    if actual != expected:
        raise DartsError(
            f"{path}: the stored tensors {actual} do not match the header, which needs {expected}",
            fix=f"re-save the {kind}",
        )
    return tensors


def save_corrections(path: Path, corrections: DartsCorrections, metadata: dict[str, Any] | None = None) -> Path:
    """Write the corrections (fp32) and a JSON header to `path`, atomically; returns the path."""
    tensors = _tensors(corrections)
    header = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "spec": corrections.spec.to_dict(),
        "layers": list(corrections.layer_keys),
        "shapes": {name: list(t.shape) for name, t in tensors.items()},
        "metadata": metadata or {},
    }
    return write_tagged(path, tensors, header, "corrections")


def read_header(path: Path) -> dict[str, Any]:
    """The corrections file's darts-dist header, checked for format and version, without loading any tensor."""
    return read_tagged_header(path, FORMAT, FORMAT_VERSION, ("spec", "layers", "shapes", "metadata"), "corrections")


def load_corrections(path: Path) -> tuple[DartsCorrections, dict[str, Any]]:
    """Rebuild the corrections from `path`; returns them with the metadata they were saved with."""
    path = Path(path)
    header = read_header(path)
    try:
        spec = CorrectionSpec.from_dict(header["spec"])
        corrections = DartsCorrections(spec, header["layers"])
    except (TypeError, ValueError) as e:
        raise DartsError(f"{path}: invalid spec or layers in the header ({e})", fix="re-save the corrections") from e
    params = _tensors(corrections)
    expected = {name: list(p.shape) for name, p in params.items()}
    if header["shapes"] != expected:
        raise DartsError(
            f"{path}: the header's tensor shapes {header['shapes']} do not match its spec, which needs {expected}",
            fix="re-save the corrections",
        )
    tensors = read_tagged_tensors(path, expected, "corrections")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(tensors[name])
    return corrections, header["metadata"]
