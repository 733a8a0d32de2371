"""The GPU's dtypes on a CPU: the evaluation's corrected head in bf16 (its numbers derived from bf16's epsilon), the
compute dtype's settings and refusals, and the registered model's device and dtype."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from darts_dist.cli import main
from darts_dist.config import ServeSection, compute_dtype_name, parse_config
from darts_dist.core import CorrectionSpec, DartsCorrections, attach_corrections, token_nll
from darts_dist.evaluate.passes import corrected_outputs, merged_outputs, reference
from darts_dist.sources.data import TaskFiles, tokenized
from darts_dist.sources.demo.tiny import build_tiny_tokenizer
from darts_dist.sources.models import missing_kernel, model_compute, model_dtype
from darts_dist.sources.references import demo_data

U = torch.finfo(torch.bfloat16).eps / 2  # bf16's unit roundoff: a value rounded to bf16 is within U of it, relatively


@pytest.fixture(scope="module")
def heldout(tiny_family):
    """Eight held-out math rows, and strong random corrections (the identity would hide every dtype boundary)."""
    config = parse_config({"sources": {"base": str(tiny_family.base), "experts": [
        {"task": "math", "path": str(tiny_family.experts["math"])}]}, "calibration": {"max_length": 96}})
    files = TaskFiles(calibration=demo_data()["math"]["heldout"], heldout=demo_data()["math"]["heldout"])
    data = tokenized(files, "math", "heldout", config.calibration, build_tiny_tokenizer())
    batch = {name: getattr(data, name)[:8] for name in ("input_ids", "attention_mask", "response_mask")}
    torch.manual_seed(3)
    corrections = DartsCorrections(CorrectionSpec(("code", "math"), 64, rank=4, max_positions=96), ["final"])
    with torch.no_grad():
        for parameter in corrections.parameters():
            parameter.add_(torch.randn_like(parameter))
    return batch, corrections


def _model(path: Path, dtype: torch.dtype):
    from darts_dist.sources.models import load_causal_lm

    return load_causal_lm(path, dtype=dtype)


def test_the_corrected_nll_in_bf16_is_the_hooked_models_and_within_bf16_rounding_of_fp32(tiny_family, heldout) -> None:
    """A bf16 model's corrected NLL (final-layer corrections, the 7B examples' `layers: [final]`): the evaluation's
    shortcut (correct the plain pass's h, then lm_head) gives what the model with the corrections hooked in gives,
    and what fp32 arithmetic gives on the same weights and the same h.

    The bounds come from bf16's epsilon. Hooked and shortcut round the same ĥ and differ only in how the head's
    matrix product is blocked, so a logit differs by at most one bf16 unit in the last place (2U of it): the NLL, a
    log-softmax, moves by at most twice the largest logit change. Against fp32 arithmetic the bf16 path rounds ĥ
    (within U, relatively) and each logit (within U): |Δz_v| ≤ U·Σ_i |W_vi|·|ĥ_i| + U·|z_v| per token, and
    |ΔNLL| ≤ 2·max_v |Δz_v|."""
    batch, corrections = heldout
    merged = _model(tiny_family.base, torch.bfloat16)
    expert = _model(tiny_family.experts["math"], torch.bfloat16)
    ref = reference(expert, batch, "final")
    plain = merged_outputs(merged, batch, "final")
    shortcut = corrected_outputs(merged, ref, plain, corrections, 1, "final")
    assert plain.hidden.dtype == torch.bfloat16 and plain.hidden.device.type == "cpu"  # kept as the model made it
    counted = ref.nll_mask

    weights = torch.zeros(8, 2)
    weights[:, 1] = 1.0
    with attach_corrections(merged, corrections) as handle, torch.no_grad():
        handle.set_task_weights(weights)
        logits = merged(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    hooked, hooked_counted = token_nll(logits, batch["input_ids"], batch["attention_mask"], batch["response_mask"])
    assert torch.equal(counted, hooked_counted) and counted.any()
    one_ulp = 2 * (2 * U) * logits.float().abs().amax(-1)[:, :-1]
    assert ((shortcut.nll - hooked).abs() <= one_ulp)[counted].all()

    # fp32 arithmetic on the same weights (the bf16 model's, exactly) and the same h^m.
    head = merged.get_output_embeddings().weight.float()
    with torch.no_grad():
        corrected = corrections["final"](plain.hidden.float(), ref.positions, weights)
        exact_logits = corrected[:, :-1] @ head.T
    exact = torch.nn.functional.cross_entropy(exact_logits[counted], batch["input_ids"][:, 1:][counted],
                                              reduction="none")
    bound = 2 * (U * (corrected[:, :-1].abs() @ head.abs().T) + U * exact_logits.abs()).amax(-1)[counted]
    assert ((shortcut.nll[counted] - exact).abs() <= bound).all()
    # Not vacuous: the correction moves the NLL by far more than bf16's rounding may.
    assert (plain.nll[counted] - shortcut.nll[counted]).abs().mean() > 5 * bound.mean()


def test_auto_is_bf16_on_gpus_and_fp32_on_cpus_and_a_named_dtype_holds_everywhere() -> None:
    assert [compute_dtype_name("auto", on_gpu) for on_gpu in (True, False)] == ["bfloat16", "float32"]
    assert [compute_dtype_name("bfloat16", on_gpu) for on_gpu in (True, False)] == ["bfloat16", "bfloat16"]
    assert model_dtype("auto", torch.device("cpu")) == torch.float32
    assert model_dtype("float16", torch.device("cpu")) == torch.float16
    config = parse_config({"sources": {"base": "b", "experts": [{"task": "t", "path": "p"}]},
                           "calibration": {"dtype": "bfloat16"}})
    # The replicas compute as the run evaluated the model, unless serve.dtype says otherwise.
    assert config.serving.dtype == "bfloat16"
    assert parse_config({**config.model_dump(), "serve": {"dtype": "float32"}}).serving.dtype == "float32"
    # A wide model's fp32 CPU experts send bf16; bf16 experts send what they compute, at any width.
    assert config.calibration.wire_dtype_for(64, on_gpu=False) == "bfloat16"
    assert parse_config({**config.model_dump(), "calibration": {"dtype": "float32"}}).calibration.wire_dtype_for(
        64, on_gpu=False) == "float32"
    assert ServeSection().dtype == "auto"
    assert (ServeSection().prefill_chunk_for(on_gpu=True), ServeSection().prefill_chunk_for(on_gpu=False)) == (512, 64)
    assert ServeSection(prefill_chunk_tokens=100).prefill_chunk_for(on_gpu=True) == 100


def test_a_dtype_the_device_has_no_kernels_for_is_named_and_refused_before_any_work(tmp_path: Path, capsys,
                                                                                      monkeypatch) -> None:
    assert missing_kernel(torch.bfloat16, "cpu") is None and missing_kernel(torch.float32, "cpu") is None
    assert "Float8_e4m3fn" in missing_kernel(torch.float8_e4m3fn, "cpu")  # a dtype torch's CPU cannot compute in
    # A CPU without float16 kernels (torch has them here): the command stops before the run folder exists.
    monkeypatch.setattr("darts_dist.sources.models.missing_kernel",
                        lambda dtype, device: "no kernel" if dtype == torch.float16 else None)
    code = main(["demo", "--tiny", "--in-process", "--dtype", "float16", "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and "cannot compute a model in float16: no kernel" in err and "fix:" in err, err
    assert not (tmp_path / "out").exists()
    assert main(["demo", "--tiny", "--dtype", "float8", "--output-dir", str(tmp_path / "out")]) == 2
    assert "--dtype (calibration.dtype)" in capsys.readouterr().err


def test_the_registered_model_computes_where_its_model_config_says(tiny_family, tmp_path: Path) -> None:
    """The pyfunc's device and dtype come from its model_config: as logged (the run's dtype), or as load_model
    overrides it."""
    import mlflow
    from darts_dist.tracking.registry import log_pyfunc_model
    from darts_dist.tracking.runs import TRACKING_URI_ENV, connect, experiment_id
    from darts_dist.tracking.store import environment

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = connect(uri)
    run_id = client.create_run(experiment_id(client, uri, "dtypes")).info.run_id
    logged = log_pyfunc_model(uri, run_id, tiny_family.base, None, None, dtype="bfloat16")
    with environment(**{TRACKING_URI_ENV: uri}):
        as_logged = mlflow.pyfunc.load_model(logged)
        overridden = mlflow.pyfunc.load_model(logged, model_config={"dtype": "auto"})
    for model, dtype in ((as_logged, "bfloat16"), (overridden, "float32")):
        lm = model.unwrap_python_model().lm
        assert model_compute(lm.model) == f"cpu {dtype}"
    import pandas as pd

    answer = as_logged.predict(pd.DataFrame({"prompt": ["Question: 2 + 3?\nAnswer:"]}), params={"max_new_tokens": 3})
    assert answer["completion_tokens"].tolist()[0] >= 1 and answer["prompt_tokens"].tolist()[0] > 1


@pytest.mark.slow
def test_the_in_process_demo_runs_in_bf16(tmp_path: Path) -> None:
    """mergekit's merge, calibration and evaluation in-process (`demo --tiny --in-process`) in bf16, every role saying
    so in the report. The Ray path's roles in bf16 (Gram actors, ZeRO-3 ranks, router, evaluation actors, the
    registered model) are test_fake_gpus's calibration; ZeRO-0, a Ray Serve replica and the export at width 4096,
    test_gpu_check's."""
    in_process = tmp_path / "in-process.json"
    assert main(["demo", "--tiny", "--in-process", "--dtype", "bfloat16", "--steps", "10", "--score-limit", "1",
                 "--output-dir", str(tmp_path / "demo"), "--report", str(in_process)]) == 0
    compute = json.loads(in_process.read_text())["compute"]
    assert set(compute) == {"calibration (in-process)", "router", "evaluation (in-process)", "registration check"}
    assert set(compute.values()) == {"cpu bfloat16"}, compute


def test_a_record_of_an_earlier_run_serves_as_it_was_evaluated(tmp_path: Path) -> None:
    """Records written before the compute dtype said bfloat16 (then the default, meaning "on GPUs; CPUs compute
    fp32"): read back they mean auto. A record of now keeps an explicit bfloat16; serve --config takes the model's
    run's dtype, --dtype wins over both."""
    from darts_dist.config import parse_record
    from darts_dist.serve.model import serve_settings

    config = parse_config({"sources": {"base": "b", "experts": [{"task": "t", "path": "p"}]},
                           "calibration": {"dtype": "bfloat16"}})
    now = config.model_dump(mode="json")
    then = {**now, "merge": {k: v for k, v in now["merge"].items() if k != "device"},
            "serve": {**now["serve"], "dtype": "bfloat16"}}
    old = parse_record(then, "an earlier run's config.json")
    assert (old.calibration.dtype, old.serve.dtype, old.serving.dtype) == ("auto", "auto", "auto")
    assert parse_record(now, "this run's config.json").serving.dtype == "bfloat16"
    override = tmp_path / "serve.yaml"
    override.write_text(json.dumps({"sources": now["sources"], "serve": {"port": 9000}}))
    assert serve_settings(config, override).dtype == "bfloat16"  # the model's run's, not the YAML's auto
    assert serve_settings(config, override, dtype="float32").dtype == "float32"
