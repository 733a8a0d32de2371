"""`darts-dist export`: a Hugging Face folder that transformers alone loads and that generates, scores and routes as
darts-dist does; the correction alone, put on a merged model; lm-eval's own `hf` model on the folder answering as
`--model darts-dist`; bad input refused with nothing written."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from isolation import requirements_environment
from lm_eval.models.huggingface import HFLM
from safetensors.torch import load_file
from test_lm_eval import CODE, MATH, QUESTIONS, make_run, requests_of
from transformers import AutoModelForCausalLM
from transformers.dynamic_module_utils import get_class_from_dynamic_module

from darts_dist.cli import main
from darts_dist.core import ROUTED, ROUTER_FILE, token_batch
from darts_dist.evaluate.lm_eval_model import DartsLM
from darts_dist.export.weights import INDEX_FILE, copy_weights
from darts_dist.generation import CorrectedLM

MAX_NEW_TOKENS = 8
# The exported model's task names and darts-dist's: a task, "merged" (None: no correction), "routed" (ROUTED).
TASK_NAMES = {"code": "code", "math": "math", "merged": None, "routed": ROUTED}

# Runs with only torch, transformers, safetensors and what they require on its path (darts_dist not importable):
# greedy batched generation (left-padded) and right-padded logits under each task, and a pipeline's answer.
ISOLATED = """
import importlib.util, json, sys
assert importlib.util.find_spec("darts_dist") is None, "darts_dist is importable"
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline
folder, logits_file, prompts, tasks = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4].split(",")
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
generated, logits = {}, {}
for task in tasks:
    tokenizer.padding_side = "left"
    batch = tokenizer.pad({"input_ids": prompts}, return_tensors="pt")
    out = model.generate(**batch, max_new_tokens=%d, do_sample=False, darts_task=task)
    generated[task] = out[:, batch["input_ids"].shape[1]:].tolist()
    tokenizer.padding_side = "right"
    batch = tokenizer.pad({"input_ids": prompts}, return_tensors="pt")
    with torch.no_grad():
        logits[task] = model(**batch, darts_task=task).logits.contiguous()
save_file(logits, logits_file)
answer = pipeline("text-generation", model=folder, trust_remote_code=True)("def add(a, b):", max_new_tokens=4,
                                                                           do_sample=False)
print(json.dumps({"generated": generated, "pipeline": answer[0]["generated_text"],
                  "class": [c.__module__ + "." + c.__name__ for c in type(model).__mro__[:3]]}))
""" % MAX_NEW_TOKENS


@pytest.fixture(scope="module")
def run_dir(tiny_family, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Corrections at a decoder layer (which changes the KV cache) and at the final norm, and a router."""
    return make_run(tmp_path_factory.mktemp("export_run"), tiny_family.base, layers=(1, "final"))


@pytest.fixture(scope="module")
def exported(run_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("exported") / "tiny-darts"
    assert main(["export", str(run_dir), "--out", str(out)]) == 0
    return out


def prompts(lm: CorrectedLM) -> list[list[int]]:
    """≥ 50 prompts of mixed lengths, code and word problems (the router picks both)."""
    texts = [*CODE, *MATH, *QUESTIONS]
    return [lm.encode(texts[i % len(texts)] + " x" * (i % 7)) for i in range(56)]


def generated_texts(lm: CorrectedLM, rows: list[list[int]]) -> list[str]:
    """What darts-dist's engine reports for HF's generated rows: the text before the end-of-sequence token, special
    tokens left out."""
    texts = []
    for row in rows:
        end = next((i for i, token in enumerate(row) if token in lm.eos_ids), len(row))
        texts.append(lm.tokenizer.decode(row[:end], skip_special_tokens=True))
    return texts


def corrected_logits(lm: CorrectedLM, encoded: list[list[int]], task: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """darts-dist's logits of right-padded prompts under `task` (routed: routed on the prompts), and the mask."""
    weights, _ = lm.task_weights([lm.task_index(task)] * len(encoded), encoded)
    ids = torch.full((len(encoded), max(map(len, encoded))), lm.pad_id)
    mask = torch.zeros_like(ids)
    for row, tokens in enumerate(encoded):
        ids[row, :len(tokens)], mask[row, :len(tokens)] = torch.tensor(tokens), 1
    with torch.no_grad(), lm.weighted(weights):
        return lm.model(input_ids=ids, attention_mask=mask).logits, mask


@pytest.mark.slow
def test_transformers_alone_loads_the_copied_folder_and_answers_as_darts_dist(run_dir: Path, exported: Path,
                                                                              tmp_path: Path) -> None:
    moved = tmp_path / "elsewhere" / "model"  # no absolute path inside: a copy loads, the original gone
    shutil.copytree(exported, moved)
    env = {"PYTHONPATH": str(requirements_environment(["torch", "transformers", "safetensors"], tmp_path)),
           "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    lm = CorrectedLM.load(run_dir / "merged", run_dir / "corrections.safetensors",
                          router_path=run_dir / ROUTER_FILE)
    encoded = prompts(lm)
    result = subprocess.run([sys.executable, "-S", "-c", ISOLATED, str(moved), str(tmp_path / "logits.safetensors"),
                             json.dumps(encoded), ",".join(TASK_NAMES)],
                            cwd=tmp_path, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = json.loads(result.stdout.strip().splitlines()[-1])
    # The base architecture's own class underneath, built from the folder's code.
    assert loaded["class"][2] == "transformers.models.llama.modeling_llama.LlamaForCausalLM"
    assert loaded["class"][0].endswith("modeling_darts.LlamaForCausalLM")
    assert loaded["pipeline"].startswith("def add(a, b):") and len(loaded["pipeline"]) > len("def add(a, b):")
    logits = load_file(str(tmp_path / "logits.safetensors"))
    assert len({len(ids) for ids in encoded}) > 3
    assert {"code", "math", None} <= set(lm.routes(encoded))  # both corrections and none (outside) in one batch
    texts = {}
    for name, task in TASK_NAMES.items():
        want = lm.generate_ids(encoded, [task] * len(encoded), max_new_tokens=MAX_NEW_TOKENS)
        texts[name] = generated_texts(lm, loaded["generated"][name])
        assert texts[name] == [completion.text for completion in want], name
        ours, mask = corrected_logits(lm, encoded, task)
        real = mask.bool()
        assert torch.allclose(logits[name][real], ours[real], atol=1e-5, rtol=0), name
    assert texts["code"] != texts["merged"] and texts["math"] != texts["code"]  # the corrections are in them
    lm.close()


def test_the_tokenizer_and_the_config_load_without_remote_code_a_question_or_a_warning(exported: Path,
                                                                                       tmp_path: Path) -> None:
    """config.json keeps the merged model's type: AutoTokenizer (which reads the config first) asks nothing and warns
    nothing, where only torch, transformers and safetensors are installed; without trust_remote_code,
    AutoModelForCausalLM is the plain merge (as the docs say)."""
    script = ("import importlib.util, sys\nassert importlib.util.find_spec('darts_dist') is None\n"
              "from transformers import AutoConfig, AutoTokenizer\n"
              "tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])\nconfig = AutoConfig.from_pretrained(sys.argv[1])\n"
              "print(type(tokenizer).__name__, config.model_type, config.architectures[0], config.darts['tasks'])")
    env = {"PYTHONPATH": str(requirements_environment(["torch", "transformers", "safetensors"], tmp_path)),
           "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-S", "-c", script, str(exported)], stdin=subprocess.DEVNULL,
                            cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert result.stdout.split()[1:3] == ["llama", "DartsForCausalLM"]


def test_routing_in_the_corrected_forward_equals_a_pass_of_its_own(tiny_family, tmp_path: Path) -> None:
    """Corrections at the final norm only, the router there too: the router reads the states the correction is
    about to change, in the same forward; the answers are those of a separate routing pass and darts-dist's."""
    run = make_run(tmp_path / "run", tiny_family.base)
    assert main(["export", str(run), "--out", str(tmp_path / "out")]) == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out", trust_remote_code=True)
    lm = CorrectedLM.load(run / "merged", run / "corrections.safetensors", router_path=run / ROUTER_FILE)
    encoded = prompts(lm)[:24]
    assert {"code", "math"} <= set(lm.routes(encoded))
    ids, mask = token_batch(encoded, lm.pad_id)
    assert model._darts_in_pass  # no correction before the router's layer
    lm.tokenizer.padding_side = "left"
    batch = lm.tokenizer.pad({"input_ids": encoded}, return_tensors="pt")
    answers = {}
    for in_pass in (True, False):
        model._darts_in_pass = in_pass
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask, darts_task="routed").logits
        out = model.generate(**batch, max_new_tokens=MAX_NEW_TOKENS, do_sample=False, darts_task="routed")
        answers[in_pass] = (logits, generated_texts(lm, out[:, batch["input_ids"].shape[1]:].tolist()))
    assert torch.allclose(answers[True][0], answers[False][0], atol=1e-5, rtol=0)
    want = lm.generate_ids(encoded, [ROUTED] * len(encoded), max_new_tokens=MAX_NEW_TOKENS)
    assert answers[True][1] == answers[False][1] == [completion.text for completion in want]
    lm.close()


def test_the_correction_alone_goes_onto_the_merged_model(run_dir: Path, exported: Path, tmp_path: Path) -> None:
    out = tmp_path / "correction"
    assert main(["export", str(run_dir), "--format", "correction", "--out", str(out), "--task", "math"]) == 0
    # No weights: the correction alone.
    assert {p.name for p in out.glob("*.safetensors")} == {"corrections.safetensors", ROUTER_FILE}
    correction = get_class_from_dynamic_module("modeling_darts.DartsCorrection", str(out))
    model = correction.from_pretrained(out).apply(AutoModelForCausalLM.from_pretrained(run_dir / "merged"))
    assert model.config.darts_task == "math"  # as --task said
    whole = AutoModelForCausalLM.from_pretrained(exported, trust_remote_code=True)
    ids = torch.tensor([[5, 9, 17, 33, 2, 40]])
    with torch.no_grad():
        for task in TASK_NAMES:
            assert torch.equal(model(ids, darts_task=task).logits, whole(ids, darts_task=task).logits), task
        # The folder's default: config.darts_task, as --task set it.
        assert torch.equal(model(ids).logits, whole(ids, darts_task="math").logits)
        assert not torch.equal(model(ids).logits, whole(ids, darts_task="merged").logits)
    with pytest.raises(ValueError, match="knows"):
        model(ids, darts_task="chemistry")
    # Saved again (as push_to_hub saves), it loads corrected, routed included.
    model.save_pretrained(tmp_path / "resaved")
    resaved = AutoModelForCausalLM.from_pretrained(tmp_path / "resaved", trust_remote_code=True)
    with torch.no_grad():
        for task in TASK_NAMES:
            assert torch.equal(resaved(ids, darts_task=task).logits, whole(ids, darts_task=task).logits), task


@pytest.mark.parametrize("task", ["math", "merged", "routed"])
def test_lm_evals_hf_model_on_the_folder_answers_as_darts_dist_lm_eval(run_dir: Path, exported: Path,
                                                                      task: str) -> None:
    theirs = HFLM(pretrained=str(exported), trust_remote_code=True, device="cpu", dtype="float32", batch_size=2,
                  darts_task=task)
    ours = DartsLM(run=str(run_dir), task=task, device="cpu", batch_size=2)
    likelihoods, generations = requests_of(QUESTIONS + CODE[:1])
    # Routed: generation routes on the prompt in both; a likelihood is routed on its context by darts-dist-lm-eval
    # but on context and continuation by a model that sees them in one forward, so they are compared pinned only.
    if task != "routed":
        got, want = theirs.loglikelihood(likelihoods, True), ours.loglikelihood(likelihoods, True)
        assert [g for _, g in got] == [g for _, g in want]
        assert [lp for lp, _ in got] == pytest.approx([lp for lp, _ in want], abs=1e-5)
    assert theirs.generate_until(generations, True) == ours.generate_until(generations, True)
    ours.lm.close()


def test_sharded_weights_load_as_the_single_file(tiny_family, tmp_path: Path) -> None:
    names = copy_weights(tiny_family.base, tmp_path, max_shard_bytes=200_000)
    assert len(names) > 1 and (tmp_path / INDEX_FILE).is_file()
    shutil.copyfile(tiny_family.base / "config.json", tmp_path / "config.json")
    sharded = AutoModelForCausalLM.from_pretrained(tmp_path).state_dict()
    whole = AutoModelForCausalLM.from_pretrained(tiny_family.base).state_dict()
    assert sharded.keys() == whole.keys() and all(torch.equal(sharded[k], whole[k]) for k in whole)


def test_a_model_dispatched_by_accelerate_is_corrected(run_dir: Path, exported: Path) -> None:
    """device_map splits and offloading wrap the forward (accelerate's hooks): the correction still applies, and
    generate() still takes darts_task, per row too, with several returned sequences each."""
    from accelerate import dispatch_model

    correction = get_class_from_dynamic_module("modeling_darts.DartsCorrection", str(exported))
    merged = dispatch_model(AutoModelForCausalLM.from_pretrained(run_dir / "merged"), {"": "cpu"}, force_hooks=True)
    model = correction.from_pretrained(exported).apply(merged)
    whole = AutoModelForCausalLM.from_pretrained(exported, trust_remote_code=True)
    ids = torch.tensor([[5, 9, 17, 33, 2, 40], [7, 7, 21, 30, 3, 11]])
    with torch.no_grad():
        assert torch.equal(model(ids, darts_task="math").logits, whole(ids, darts_task="math").logits)
        assert not torch.equal(model(ids, darts_task="math").logits, whole(ids, darts_task="merged").logits)
    tasks = ["math", "code"]
    beams = {"max_new_tokens": 4, "do_sample": False, "num_beams": 2, "num_return_sequences": 2}
    out = model.generate(ids, darts_task=tasks, **beams)
    alone = [whole.generate(ids[row:row + 1], darts_task=task, **beams) for row, task in enumerate(tasks)]
    assert out.tolist() == alone[0].tolist() + alone[1].tolist()
    assert alone[0].tolist() != whole.generate(ids[:1], darts_task="merged", **beams).tolist()


def _refused(capsys, tmp_path: Path, *args: str, expected: str) -> None:
    before = set(tmp_path.iterdir())
    assert main(["export", *args]) == 2
    err = capsys.readouterr().err
    assert expected in err and "fix:" in err, err
    assert set(tmp_path.iterdir()) == before  # nothing half-written, no temporary sibling


def test_bad_input_is_refused_with_nothing_written(run_dir: Path, tmp_path: Path, capsys) -> None:
    bare = tmp_path / "bare"
    shutil.copytree(run_dir / "merged", bare / "merged")
    _refused(capsys, tmp_path, str(bare), "--out", str(tmp_path / "out"), expected="has no corrections")
    alien = tmp_path / "alien"
    shutil.copytree(run_dir, alien)
    config = json.loads((alien / "merged" / "config.json").read_text())
    (alien / "merged" / "config.json").write_text(json.dumps({**config, "model_type": "nonesuch"}))
    _refused(capsys, tmp_path, str(alien), "--out", str(tmp_path / "out"), expected="'nonesuch'")
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    _refused(capsys, tmp_path, str(run_dir), "--out", str(taken), expected="exists")
    assert [p.name for p in taken.iterdir()] == ["keep.txt"]
    _refused(capsys, tmp_path, str(run_dir), "--out", str(tmp_path / "out"), "--task", "chemistry",
             expected="'chemistry' is not a task")
    _refused(capsys, tmp_path, str(run_dir), "--out", str(run_dir), "--overwrite", expected="holds the files")
    broken = tmp_path / "broken"  # refused while writing: the partial folder goes
    shutil.copytree(run_dir, broken)
    (broken / ROUTER_FILE).write_bytes(b"not safetensors")
    _refused(capsys, tmp_path, str(broken), "--out", str(tmp_path / "out"), expected="router")
    # --overwrite replaces an earlier export only: never a folder of the user's, nor a file.
    _refused(capsys, tmp_path, str(run_dir), "--out", str(taken), "--overwrite", expected="is not a darts-dist export")
    assert [p.name for p in taken.iterdir()] == ["keep.txt"]
    _refused(capsys, tmp_path, str(run_dir), "--out", str(taken / "keep.txt"), "--overwrite",
             expected="is not a darts-dist export")
    earlier = tmp_path / "earlier"
    assert main(["export", str(run_dir), "--out", str(earlier), "--format", "correction"]) == 0
    (earlier / "stale.txt").write_text("from before")
    assert main(["export", str(run_dir), "--out", str(earlier), "--overwrite"]) == 0
    assert (earlier / "config.json").is_file() and not (earlier / "stale.txt").exists()
    assert main(["export", str(run_dir), "--out", str(earlier), "--overwrite", "--format", "correction"]) == 0


def test_only_known_files_of_the_merged_folder_go_along(run_dir: Path, tmp_path: Path, caplog) -> None:
    """The folder is loaded with trust_remote_code=True: a Python file, a folder or a link that reached the merged
    folder stays out of it (named in a warning); tokenizer, template, generation and recipe files go along."""
    planted = tmp_path / "planted"
    shutil.copytree(run_dir, planted)
    merged = planted / "merged"
    (merged / "modeling_llama.py").write_text("import os; os.system('echo owned')\n")
    (merged / "extra").mkdir()
    (merged / "extra" / "notes.txt").write_text("x")
    (merged / "vocab.json").symlink_to("/etc/passwd")
    (merged / "mergekit_config.yml").write_text("merge_method: task_arithmetic\n")
    out = tmp_path / "out"
    with caplog.at_level(logging.WARNING, logger="darts_dist.export.folders"):
        logger = logging.getLogger("darts_dist")
        logger.addHandler(caplog.handler)  # directly: darts-dist's lines do not propagate to the root logger
        try:
            assert main(["export", str(planted), "--out", str(out)]) == 0
        finally:
            logger.removeHandler(caplog.handler)
    names = {path.name for path in out.iterdir()}
    assert not {"extra", "vocab.json", "modeling_llama.py"} & names
    assert {"mergekit_config.yml", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
            "generation_config.json", "modeling_darts.py", "config.json", "README.md"} <= names
    assert f"left out of {out}: extra/, modeling_llama.py, vocab.json" in caplog.text
