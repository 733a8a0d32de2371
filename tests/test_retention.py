"""Retention (evaluate.retention): the shipped set is what its manifest says, every model's score on it equals a
direct computation, the routed correction's is the router's pick, and an evaluation reports it for every model."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
import torch.nn.functional as F
from test_generation import TASKS, strong_corrections

from darts_dist.config import parse_config
from darts_dist.core import Envelope, ROUTED, TaskRouter
from darts_dist.evaluate import retention
from darts_dist.evaluate.retention import (
    MAX_PROMPT_TOKENS,
    MAX_REPLY_TOKENS,
    made_rows,
    retention_fields,
    score,
    shipped_rows,
)
from darts_dist.evaluate.evaluator import BaseSide, Evaluator
from darts_dist.evaluate.stage import evaluate_stage
from darts_dist.evaluate.tables import evaluation_tables, retention_line
from darts_dist.generation import CorrectedLM
from darts_dist.sources.models import BUNDLED_MODEL, BUNDLED_TOKENIZER, chat_prompt, encode_prompt, load_tokenizer
from darts_dist.sources.output_cache import OutputCache
from darts_dist.sources.references import resolve_sources
from darts_dist.tracking.runs import evaluation_metrics


def test_the_shipped_replies_are_the_manifests_and_the_bundled_tokenizers() -> None:
    manifest = json.loads(retention.MANIFEST.read_text())
    replies = retention.SET_FOLDER / manifest["replies"]
    assert manifest["base"] == BUNDLED_MODEL
    assert hashlib.sha256(replies.read_bytes()).hexdigest() == manifest["replies_sha256"]
    assert hashlib.sha256(retention.INSTRUCTIONS.read_bytes()).hexdigest() == manifest["instructions_sha256"]
    rows = [json.loads(line) for line in replies.read_text().splitlines()]
    assert [row["instruction"] for row in rows] == retention.instructions() and len(rows) == manifest["rows"] >= 40
    tokenizer = load_tokenizer(BUNDLED_TOKENIZER)  # the bundled base's (its weights are a download)
    for row in rows:
        # The base's chat rendering of the instruction (as CorrectedLM.encode_chat), its reply's text from its tokens.
        rendered = chat_prompt(tokenizer, [{"role": "user", "content": row["instruction"]}])
        assert row["prompt_ids"] == encode_prompt(tokenizer, rendered, rendered=True)
        assert len(row["prompt_ids"]) <= MAX_PROMPT_TOKENS and 0 < len(row["reply_ids"]) <= MAX_REPLY_TOKENS
        assert tokenizer.decode(row["reply_ids"], skip_special_tokens=True) == row["reply"]


@pytest.fixture(scope="module")
def base_lm(tiny_family) -> CorrectedLM:
    return CorrectedLM.load(tiny_family.base)


@pytest.fixture(scope="module")
def rows(base_lm, tiny_family, tmp_path_factory):
    assert shipped_rows(tiny_family.base) is None  # another base than the shipped replies'
    cache = OutputCache(tmp_path_factory.mktemp("outputs"))
    made = made_rows(base_lm, "tiny base", cache, batch_size=16)
    again = made_rows(base_lm, "tiny base", cache, batch_size=16)  # read back
    assert again == made and cache.hits == 1
    return made


def by_hand(model: torch.nn.Module, rows, task_weights=None) -> tuple[float, float]:
    """NLL per reply token and token agreement, row by row, with one forward per row."""
    nll = tokens = agreeing = 0.0
    for row in rows:
        ids = torch.tensor([[*row.prompt_ids, *row.reply_ids]])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0]
        start = len(row.prompt_ids)
        predicted = logits[start - 1:-1]
        targets = ids[0, start:]
        nll += float(F.cross_entropy(predicted.float(), targets, reduction="sum"))
        agreeing += float((predicted.argmax(-1) == targets).sum())
        tokens += len(targets)
    return nll / tokens, agreeing / tokens


def test_a_models_retention_equals_a_direct_computation(rows, base_lm, tiny_family) -> None:
    assert len(rows) == len(retention.instructions()) and all(row.reply_ids for row in rows)
    # The base on its own greedy replies: every token its own choice, in the dtype that made them.
    own = score(base_lm, rows, batch_size=16).summary()
    assert own["agreement"] == 1.0 and own["exact"] == 1.0
    expert = CorrectedLM.load(tiny_family.experts["math"])
    summary = score(expert, rows, batch_size=7).summary()  # batches of another size: right padding
    nll, agreement = by_hand(expert.model, rows)
    assert summary["nll"] == pytest.approx(nll, rel=1e-5) and summary["agreement"] == pytest.approx(agreement)
    low, high = summary["nll_ci"]
    assert low < summary["nll"] < high and summary["n"] == len(rows)


def test_the_routed_correction_is_scored_under_the_routers_pick(rows, base_lm) -> None:
    d = base_lm.model.config.hidden_size
    generator = torch.Generator().manual_seed(3)
    router = TaskRouter(TASKS, "final", torch.zeros(d), torch.ones(d), torch.randn(len(TASKS), d, generator=generator),
                        torch.zeros(len(TASKS)), threshold=0.0)
    with CorrectedLM(base_lm.model, base_lm.tokenizer, strong_corrections(d), router) as lm:
        routed = score(lm, rows, batch_size=16)
        picks = lm.routes([row.prompt_ids for row in rows])
        assert set(picks) <= set(TASKS) and None not in picks  # threshold 0: every row corrected
        named = lm.continuation_scores([r.prompt_ids for r in rows], [r.reply_ids for r in rows], picks)
        plain = lm.continuation_scores([r.prompt_ids for r in rows], [r.reply_ids for r in rows])
    assert list(routed.nll) == pytest.approx([-s.logprob for s in named], rel=1e-5)
    assert list(routed.nll) != pytest.approx([-s.logprob for s in plain], rel=1e-3)
    assert ROUTED == "auto"


def test_a_router_abstaining_outside_its_tasks_keeps_the_merges_retention(rows, base_lm, tiny_family) -> None:
    """What a request without a task gets, as the evaluator scores it: under a router sure of one task but whose
    envelopes hold none of the instructions, the uncorrected model's scores exactly, all counted as no correction;
    the same router routing outside gives them the task's correction. The field and the console line say so."""
    d = base_lm.model.config.hidden_size
    envelope = Envelope(torch.zeros(len(TASKS), d), torch.ones(len(TASKS), d), torch.zeros(len(TASKS)))
    router = TaskRouter(TASKS, "final", torch.zeros(d), torch.ones(d), torch.zeros(len(TASKS), d),
                        torch.tensor([0.9, 0.1]).log(), threshold=0.5, envelope=envelope)
    corrections, served = strong_corrections(d), {}
    for abstain in (True, False):  # the run's serve setting, as the server would route
        config = parse_config({"sources": {"base": str(tiny_family.base), "experts": [
            {"task": t, "path": str(tiny_family.experts[t])} for t in TASKS]},
            "evaluation": {"generation_batch_size": 16}, "serve": {"router_abstain_outside": abstain}})
        evaluator = Evaluator(config, {}, base_lm.tokenizer, progress=False, cache=None)
        evaluator.use_base(BaseSide({}, rows, None))
        merged = evaluator._retention(base_lm)
        served[abstain] = evaluator._served_retention(base_lm.model, base_lm.model, corrections, router, merged)
    assert served[True]["routes"] == {"merged": len(rows)}
    assert {k: v for k, v in served[True].items() if k != "routes"} == merged
    assert served[False]["routes"] == {"merged": 0, TASKS[0]: len(rows)} and served[False]["nll"] != merged["nll"]
    served = served[True]
    retained = {"base": merged, "experts": {}, "merged": merged, "corrected": served}
    assert retention_fields(retained)["retention_uncorrected_share"] == 1.0
    assert retention_line({"retention": retained}).endswith(f"(no correction on {len(rows)} of {len(rows)})")


def test_bf16_scores_stay_near_fp32(rows, tiny_family) -> None:
    fp32 = score(CorrectedLM.load(tiny_family.experts["code"]), rows, batch_size=16).summary()
    bf16 = score(CorrectedLM.load(tiny_family.experts["code"], dtype=torch.bfloat16), rows, batch_size=16).summary()
    assert bf16["nll"] == pytest.approx(fp32["nll"], rel=0.05) and abs(bf16["agreement"] - fp32["agreement"]) < 0.1


def test_an_uncorrected_models_scores_are_read_back_from_the_output_cache(rows, tiny_family, tmp_path) -> None:
    config = parse_config({"sources": {"base": str(tiny_family.base), "experts": [
        {"task": "code", "path": str(tiny_family.experts["code"])}]}, "evaluation": {"generation_batch_size": 16}})
    evaluator = Evaluator(config, {}, load_tokenizer(tiny_family.base), progress=False,
                          cache=OutputCache(tmp_path / "outputs"))
    evaluator.use_base(BaseSide({}, rows, None))
    expert = CorrectedLM.load(tiny_family.experts["code"])
    first = evaluator._retention(expert, "the code expert")
    calls = []
    expert.model.register_forward_hook(lambda *args: calls.append(1))
    assert evaluator._retention(expert, "the code expert") == first and calls == []  # read back: no forward
    assert evaluator.cache.hits == 1 and evaluator._retention(expert) == first and calls  # no identity: computed


def test_an_evaluation_reports_retention_for_every_model(tiny_family, tmp_path) -> None:
    """In-process evaluation, score_base off: the base still runs, for the retention set alone; the corrected
    model's retention (no router: a request without a task gets the merged model) is the merge's."""
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"text": f"def f_{i}(x):\n    return x + {i}\n"}) + "\n" for i in range(4)))
    config = parse_config({
        "output_dir": str(tmp_path), "sources": {"base": str(tiny_family.base), "experts": [
            {"task": t, "path": str(tiny_family.experts[t]), "data": {"calibration": str(data), "heldout": str(data)}}
            for t in ("code", "math")]},
        "calibration": {"max_length": 32, "batch_size": 4},
        "evaluation": {"score_limit": 0, "score_base": False, "cache": False},
    })
    result = evaluate_stage(config, resolve_sources(config), tiny_family.base, None, driver_holds_models=lambda: True)
    retained = result["retention"]
    assert set(retained["experts"]) == {"code", "math"}
    merged_by_hand, _ = by_hand(CorrectedLM.load(tiny_family.base).model, made_rows(
        CorrectedLM.load(tiny_family.base), None, None, batch_size=16))
    assert retained["merged"]["nll"] == pytest.approx(merged_by_hand, rel=1e-5)  # the "merge" here is the base
    assert retained["corrected"] == retained["merged"] and retained["base"]["agreement"] == 1.0
    overall = result["overall"]
    assert overall["retention_nll_merged"] == retained["merged"]["nll"]
    assert overall["retention_nll_experts"] == pytest.approx(
        sum(s["nll"] for s in retained["experts"].values()) / 2)
    metrics = evaluation_metrics(result)
    assert metrics["eval.overall.retention_agreement_corrected"] == retained["corrected"]["agreement"]
    assert (metrics["eval.overall.retention_nll_merged_ci.low"], metrics["eval.overall.retention_nll_merged_ci.high"]) \
        == pytest.approx(retained["merged"]["nll_ci"])
    title, headers, table = evaluation_tables("t", result)[-1]
    assert title.startswith("retention") and [row[0] for row in table] == [
        "base", "expert code", "expert math", "merged", "corrected"]
    line = retention_line(result)
    assert line.startswith(f"retention ({len(retention.instructions())} general instructions") and len(line) < 300
