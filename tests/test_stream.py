"""The stream's pieces without a cluster: expert rows, the wire format, and the workers' feature store."""

from __future__ import annotations

import concurrent.futures
import itertools
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from darts_dist.calibrate.features import expert_targets
from darts_dist.calibrate.ray.feature_store import FeatureStore, wire_tensor
from darts_dist.calibrate.ray.stream import (
    ExpertStream,
    source_rows,
    target_column,
    to_wire,
    token_column,
)
from darts_dist.calibrate.ray.window import StreamWindow, window_tokens
from darts_dist.sources.data import load_rows, tokenize_rows
from darts_dist.sources.models import load_causal_lm
from darts_dist.sources.references import demo_data


@pytest.fixture(scope="module")
def code_set():
    from darts_dist.sources.demo.tiny import build_tiny_tokenizer

    return tokenize_rows(load_rows(demo_data()["code"]["calibration"]), build_tiny_tokenizer(), "code",
                         max_length=24, max_samples=7)


def test_source_rows_are_the_samples_cut_to_their_length(code_set) -> None:
    rows = source_rows(code_set)
    assert [row["row"] for row in rows] == list(range(7)) and {row["task"] for row in rows} == {"code"}
    lengths = code_set.attention_mask.sum(dim=1).tolist()
    assert [len(row["input_ids"]) for row in rows] == lengths
    for name in ("input_ids", "attention_mask", "response_mask"):
        assert rows[0][name].itemsize == (4 if name == "input_ids" else 1)  # compact on the wire
        padded = token_column([row[name] for row in rows])
        assert torch.equal(padded, getattr(code_set, name)[:, : max(lengths)])


def _column(values: list) -> np.ndarray:
    """A batch column as Ray Data hands it over: per-row arrays in a 1-D object array."""
    column = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        column[i] = value
    return column


def test_expert_actor_rows_are_the_experts_targets_on_real_tokens(tiny_family, code_set) -> None:
    layers = [1, "final"]
    actor = ExpertStream(str(tiny_family.experts["code"]), layers, "float32", "cpu")
    rows = source_rows(code_set)
    batch = {name: _column([row[name] for row in rows]) for name in rows[0]}
    out = actor(batch)
    expert = load_causal_lm(tiny_family.experts["code"])
    hidden, entropy, _ = expert_targets(expert, code_set.input_ids, code_set.attention_mask, layers)
    assert list(out["row"]) == list(range(7))
    for i, length in enumerate(code_set.attention_mask.sum(dim=1).tolist()):
        assert out["entropy"][i].shape == (length,)
        torch.testing.assert_close(torch.from_numpy(out["entropy"][i]), entropy[i, :length], atol=1e-5, rtol=1e-5)
        for layer in layers:
            sent = out[target_column(layer)][i]
            assert sent.dtype == np.float32 and sent.shape == (length, expert.config.hidden_size)
            torch.testing.assert_close(torch.from_numpy(sent), hidden[layer][i, :length], atol=1e-5, rtol=1e-5)


def test_an_expert_actor_loads_and_runs_its_model_on_one_thread_of_its_own(tiny_family, code_set, monkeypatch) -> None:
    """Ray calls an actor's constructor and its batches from different threads; the model's load, thread count and
    forwards all run on the actor's torch thread (darts_dist.torch_thread: libgomp's teams)."""
    from darts_dist.calibrate import features
    from darts_dist.sources import models

    threads = []
    for module, name in ((models, "load_causal_lm"), (features, "expert_targets"), (torch, "set_num_threads")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, real=real, **k: (threads.append(threading.current_thread()),
                                                                        real(*a, **k))[1])
    actor = ExpertStream(str(tiny_family.experts["code"]), [1], "float32", "cpu", cpu=("concurrent", 1))
    rows = source_rows(code_set)
    batch = {name: _column([row[name] for row in rows]) for name in rows[0]}
    with concurrent.futures.ThreadPoolExecutor(1) as caller:  # as Ray Data's map worker calls it
        caller.submit(actor, batch).result()
    assert len(threads) == 3 and len(set(threads)) == 1 and threads[0] is not threading.current_thread()


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_hidden_states_travel_exactly_in_their_compute_dtype(dtype) -> None:
    values = torch.randn(5, 16).to(getattr(torch, dtype))  # what expert_targets hands over on a GPU
    sent = to_wire(values, dtype)
    assert sent.itemsize == {"float32": 4, "float16": 2, "bfloat16": 2}[dtype]
    assert wire_tensor(sent).dtype == values.dtype and torch.equal(wire_tensor(sent), values)


def test_fp32_states_on_a_bf16_wire_are_rounded_to_nearest() -> None:
    """A CPU expert computes fp32 and sends bf16 (wide models): each value is the nearest bf16, so it is off by at
    most half a bf16 unit in the last place (2^-8 of its magnitude), not a truncation's whole unit."""
    values = torch.randn(64, 256)
    received = wire_tensor(to_wire(values, "bfloat16")).float()
    assert torch.equal(received, values.bfloat16().float())
    assert ((received - values).abs() <= values.abs() * 2.0 ** -8).all()


def _rows(seed: int, count: int, width: int = 3) -> list[tuple[int, dict[str, np.ndarray]]]:
    rng = np.random.default_rng(seed)
    rows = []
    for row in rng.permutation(count):  # arrival order is not row order
        length = int(rng.integers(1, 9))
        rows.append((int(row), {
            "input_ids": rng.integers(0, 100, length),
            "mask": np.ones(length, dtype=bool),
            "hidden": rng.standard_normal((length, width), dtype=np.float32),
            "bf16": to_wire(torch.randn(length, width), "bfloat16"),
        }))
    return rows


@pytest.mark.parametrize("budget", [1 << 30, 600])
def test_feature_store_hands_rows_back_sorted_and_unpadded(tmp_path: Path, budget: int) -> None:
    """Within the budget in memory; past it spilled to disk, each row at its own length, and read back
    memory-mapped in place; same values either way, padded only when a minibatch is taken (and kept in their wire's
    dtype: TaskFeatures.rows upcasts them on the training device)."""
    store = FeatureStore(["a", "b"], max_length=8, budget_bytes=budget, spill_dir=tmp_path)
    rows = {"a": _rows(0, 20), "b": _rows(1, 13)}
    held, peak, spilled = [], 0, 0  # by hand: the rows in memory, the most bytes they held, the bytes spilled
    for pair in itertools.zip_longest(rows["a"], rows["b"]):  # the tasks interleaved, each out of order
        for task, item in zip(("a", "b"), pair):
            if item is not None:
                store.add(task, *item)
                held.append(item[1])
                peak = max(peak, sum(x.nbytes for arrays in held for x in arrays.values()))
                if sum(x.nbytes for arrays in held for x in arrays.values()) > budget:  # all of them to disk
                    spilled += sum(x.nbytes for arrays in held for x in arrays.values())
                    held = []
    assert (store.peak_memory_bytes, store.spilled_bytes) == (peak, spilled)
    assert (spilled > 0) == (budget < 1 << 20)  # in memory, the peak is every row at once
    # No padding on disk: each spill file is exactly its rows' bytes.
    on_disk = sum(path.stat().st_size for path in tmp_path.glob("*.raw"))
    assert on_disk <= spilled and (on_disk > 0) == (spilled > 0)
    for task, expected in rows.items():
        assert store.row_ids(task) == list(range(len(expected)))
        arrays = store.arrays(task)
        assert isinstance(arrays["hidden"].values, np.memmap) == (budget < 1 << 20)
        for row, values in expected:
            for name, value in values.items():
                assert np.array_equal(arrays[name].row(row), value)
        by_row = dict(expected)
        index = torch.tensor([3, 0, 7])
        batch = arrays["bf16"][index]  # a minibatch: padded to its longest row, still in its wire's dtype
        longest = max(len(by_row[row]["mask"]) for row in index.tolist())
        assert batch.dtype == torch.bfloat16 and batch.shape == (3, longest, 3)
        for i, row in enumerate(index.tolist()):
            value = by_row[row]["bf16"]
            assert torch.equal(batch[i, : len(value)], wire_tensor(value))
            assert not batch[i, len(value):].any()  # zero padding
        assert np.array_equal(arrays["mask"].padded()[0, : len(by_row[0]["mask"])], by_row[0]["mask"])


def test_feature_store_refuses_rows_that_do_not_fit(tmp_path: Path) -> None:
    store = FeatureStore(["a"], max_length=4, budget_bytes=1 << 20, spill_dir=tmp_path)
    store.add("a", 0, {"x": np.zeros(3), "y": np.zeros((3, 2))})
    with pytest.raises(ValueError, match="share a length"):
        store.add("a", 1, {"x": np.zeros(5), "y": np.zeros((5, 2))})
    with pytest.raises(ValueError, match="earlier rows had"):
        store.add("a", 2, {"x": np.zeros(2), "y": np.zeros((2, 3))})
    with pytest.raises(ValueError, match="does not hold"):
        store.add("b", 3, {"x": np.zeros(2), "y": np.zeros((2, 2))})


@pytest.mark.slow  # the session's Ray cluster
def test_the_window_holds_an_expert_until_the_workers_received_its_rows(ray_cluster) -> None:
    """An expert waits while its task has `limit` tokens in flight, whatever the rows' count; a retried batch
    (same rows) is not counted twice; a batch larger than the window still enters an empty one; tasks have
    windows of their own."""
    import ray

    window = StreamWindow.remote(100)
    ray.get(window.enter.remote("code", list(range(8)), [10] * 8))  # 80 tokens
    blocked = window.enter.remote("code", [8, 9], [12, 12])
    assert not ray.wait([blocked], timeout=1.0)[0]  # 104 tokens would be in flight
    ray.get(window.enter.remote("code", [10, 11], [10, 10]))  # two shorter rows fit: 100 tokens
    ray.get(window.enter.remote("math", list(range(8)), [10] * 8))  # another task's window is its own
    ray.get(window.enter.remote("code", list(range(8)), [10] * 8))  # a retried batch: already in flight, enters at once
    assert ray.get(window.tokens_in_flight.remote()) == {"code": 100, "math": 80}
    window.leave.remote("code", list(range(8)))
    ray.get(blocked, timeout=30)
    assert ray.get(window.tokens_in_flight.remote()) == {"code": 44, "math": 80}
    window.leave.remote("code", [8, 9, 10, 11])
    ray.get(window.enter.remote("code", list(range(100, 120)), [24] * 20), timeout=30)  # larger than the window, empty
    # At least the batches Ray Data's split may hold back per worker (2) plus one, of any task's longest rows;
    # else the configured bytes.
    lengths = [[128] * 10 + [40] * 100, [100] * 50]
    assert window_tokens(2, 2308, lengths, 8, 1) == 24 * 100  # 10 rows of 128 and 14 of 40 < 24 of 100
    assert window_tokens(2, 2308, lengths, 8, 2) == 40 * 100
    assert window_tokens(256, 2308, lengths, 8, 1) == (256 << 20) // 2308


def _stored_features(features, wire: str, tmp_path: Path, settings):
    """`features` as a Ray worker holds them after a `wire`-dtype stream: rows through the feature store (spilled,
    so read back memory-mapped), hidden states in the wire's dtype, padded and upcast per minibatch."""
    from darts_dist.calibrate.ray.worker import merged_column, task_features

    store = FeatureStore([features.task], max_length=features.input_ids.shape[1], budget_bytes=0,
                         spill_dir=tmp_path / wire)
    for i, length in enumerate(features.attention_mask.sum(dim=1).tolist()):
        store.add(features.task, i, {
            "input_ids": features.input_ids[i, :length].numpy(),
            "attention_mask": features.attention_mask[i, :length].numpy(),
            "response_mask": features.response_mask[i, :length].numpy(),
            "entropy": features.entropy[i, :length].numpy(),
            target_column("final"): to_wire(features.targets["final"][i, :length], wire),
            merged_column("final"): to_wire(features.merged["final"][i, :length], wire),
        })
    return task_features(store, features.task, 0, settings)


def test_corrections_trained_from_a_bf16_wire_match_an_fp32_wire_within_bf16_rounding(tiny_family, tmp_path) -> None:
    """Every hidden state on a bf16 wire is within u = eps_bf16 / 2 of its fp32 value, relatively. The loss is a
    weighted mean of |h^m + c - h^k|, so for any corrections c the two wires' losses differ by at most
    delta = u * (the same weighted mean of |h^m| + |h^k|); hence corrections trained on the bf16 wire are, on the
    fp32 features, within 2 * delta of the ones trained on fp32 (each is at least as good as the other on its own
    wire). delta comes from bf16's epsilon and the data, not from a tolerance picked to pass."""
    from darts_dist.calibrate.features import collect_features
    from darts_dist.calibrate.loop import build_corrections, calibrate_in_process, calibration_loss
    from darts_dist.config import CalibrationSection
    from darts_dist.core import entropy_weights, weighted_l1_loss
    from darts_dist.sources.demo.tiny import build_tiny_tokenizer

    settings = CalibrationSection(layers=["final"], rank=4, max_positions=48, max_length=48, batch_size=8, steps=80,
                                  learning_rate=1e-2, beta=1.0)
    data = tokenize_rows(load_rows(demo_data()["code"]["calibration"]), build_tiny_tokenizer(), "code",
                         max_length=48, max_samples=32)
    features = collect_features("code", 0, data, load_causal_lm(tiny_family.experts["code"]),
                                load_causal_lm(tiny_family.base), ["final"], batch_size=8, progress=False)
    wires = {wire: _stored_features(features, wire, tmp_path, settings) for wire in ("float32", "bfloat16")}
    every = torch.arange(len(features))

    def loss(corrections, wire: str) -> float:
        with torch.no_grad():
            return float(calibration_loss(corrections, wires[wire].rows(every), 0, settings.beta, "all"))

    rows = wires["float32"].rows(every)
    weights = entropy_weights(rows["entropy"], rows["attention_mask"], settings.beta)
    magnitude = rows["merged"]["final"].abs() + rows["targets"]["final"].abs()
    delta = torch.finfo(torch.bfloat16).eps / 2 * float(
        weighted_l1_loss(magnitude, torch.zeros_like(magnitude), rows["attention_mask"], weights))
    trained = {}
    for wire in wires:
        torch.manual_seed(settings.seed)
        corrections = build_corrections(["code"], features.targets["final"].shape[-1], settings)
        trained[wire] = calibrate_in_process([wires[wire]], corrections, settings, progress=False).corrections
    torch.manual_seed(settings.seed)
    for corrections in (build_corrections(["code"], features.targets["final"].shape[-1], settings), *trained.values()):
        assert abs(loss(corrections, "bfloat16") - loss(corrections, "float32")) <= delta
    assert loss(trained["bfloat16"], "float32") <= loss(trained["float32"], "float32") + 2 * delta
    # Training did something, and the rounding's bound is small beside what it removed.
    before = loss(build_corrections(["code"], features.targets["final"].shape[-1], settings), "float32")
    assert loss(trained["float32"], "float32") < before - 10 * delta
