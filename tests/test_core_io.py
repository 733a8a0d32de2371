"""Corrections round-trip through safetensors bit-exactly; bad files raise DartsError naming the file."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from darts_dist.core.correction import CorrectionSpec, DartsCorrections
from darts_dist.core.io import FORMAT_VERSION, load_corrections, read_header, save_corrections
from darts_dist.errors import DartsError


def make(position_bias="per_task", position_rank=None) -> DartsCorrections:
    spec = CorrectionSpec(
        tasks=("math", "code"), hidden_size=8, rank=2, max_positions=6,
        position_bias=position_bias, position_rank=position_rank,
    )
    torch.manual_seed(0)
    corrections = DartsCorrections(spec, ["final", 3])
    with torch.no_grad():
        for p in corrections.parameters():
            p.normal_()
    return corrections


@pytest.mark.parametrize("kw", [{}, dict(position_bias="shared", position_rank=3), dict(position_bias="none")])
def test_roundtrip_bit_exact(tmp_path, kw):
    corrections = make(**kw)
    path = save_corrections(tmp_path / "sub" / "c.safetensors", corrections, {"beta": {"math": 0.5}, "step": 7})
    assert path.is_file() and list(path.parent.iterdir()) == [path]  # no temp file left behind
    loaded, metadata = load_corrections(path)
    assert metadata == {"beta": {"math": 0.5}, "step": 7}
    assert loaded.spec == corrections.spec and loaded.layer_keys == ("final", 3)
    a, b = corrections.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    header = read_header(path)
    assert header["version"] == FORMAT_VERSION and header["format"] == "darts-dist-corrections"
    assert header["shapes"]["final.down"] == [2, 2, 8]


def test_corrupt_and_foreign_files(tmp_path):
    path = save_corrections(tmp_path / "c.safetensors", make())
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(path.read_bytes()[:-50])
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"not a safetensors file at all")
    foreign = tmp_path / "foreign.safetensors"
    save_file({"w": torch.zeros(2)}, str(foreign))
    for bad in (truncated, garbage, foreign, tmp_path / "missing.safetensors"):
        with pytest.raises(DartsError, match=bad.name):
            load_corrections(bad)


def rewrite_header(src, dst, edit) -> None:
    from safetensors import safe_open

    with safe_open(str(src), framework="pt") as f:
        header = json.loads(f.metadata()["darts_dist"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    edit(header, tensors)
    save_file(tensors, str(dst), metadata={"darts_dist": json.dumps(header)})


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda h, t: h.update(format="something-else"), "format"),
        (lambda h, t: h.update(version=99), "version 99"),
        (lambda h, t: h.pop("spec"), "lacks 'spec'"),
        (lambda h, t: h["spec"].update(hidden_size=-1), "invalid spec"),
        (lambda h, t: h["shapes"].update({"final.down": [1, 1, 1]}), "shapes"),
        (lambda h, t: t.pop("3.up"), "stored tensors"),
        (lambda h, t: t.update({"3.up": torch.zeros(1)}), "stored tensors"),
    ],
)
def test_wrong_header(tmp_path, edit, message):
    path = save_corrections(tmp_path / "c.safetensors", make())
    bad = tmp_path / "bad.safetensors"
    rewrite_header(path, bad, edit)
    with pytest.raises(DartsError, match=message) as info:
        load_corrections(bad)
    assert "bad.safetensors" in str(info.value)


def test_unserialisable_metadata(tmp_path):
    with pytest.raises(DartsError, match="JSON"):
        save_corrections(tmp_path / "c.safetensors", make(), {"x": object()})
    assert not list(tmp_path.iterdir())
