"""The exported folder's README.md: Hub metadata, how to load it, the merge recipe, the calibration settings and
the run's held-out evaluation with its intervals."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import yaml

from darts_dist.core import read_header
from darts_dist.evaluate.tables import evaluation_tables
from darts_dist.export.source import ExportSource
from darts_dist.export.weights import parameter_count
from darts_dist.sources.models import BUNDLED_MODEL

# Hub ids of the models darts-dist bundles, for the card's `base_model`.
HUB_IDS = {BUNDLED_MODEL: "HuggingFaceTB/SmolLM2-135M-Instruct"}
TAGS = ["merge", "mergekit", "darts"]


def _markdown_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(str(cell).replace("|", "\\|") for cell in cells) + " |"

    return "\n".join([f"**{title}**", "", line(headers), line(["---"] * len(headers)), *map(line, rows), ""])


def _front_matter(source: ExportSource) -> str:
    meta: dict[str, Any] = {"library_name": "transformers", "tags": TAGS}
    if source.config is not None:
        meta["base_model"] = HUB_IDS.get(source.config.sources.base, source.config.sources.base)
    return "---\n" + yaml.safe_dump(meta, sort_keys=False) + "---\n"


def _share(source: ExportSource) -> str:
    header = read_header(source.files.corrections)
    corrections = sum(math.prod(shape) for shape in header["shapes"].values())
    model = parameter_count(source.files.merged_dir)
    return f"{corrections:,} correction parameters beside the model's {model:,} ({corrections / model:.3%})"


def _sections(source: ExportSource) -> list[str]:
    """Recipe, calibration settings and evaluation, as far as the source records them."""
    parts = []
    recipe = source.files.merged_dir / "mergekit_config.yml"
    if recipe.is_file():
        parts.append("## Merge recipe (mergekit)\n\n```yaml\n" + recipe.read_text().strip() + "\n```\n")
    if source.config is not None:
        calibration = source.config.calibration.model_dump(mode="json")
        parts.append("## Calibration settings\n\n```yaml\n" + yaml.safe_dump(calibration, sort_keys=False).strip()
                     + "\n```\n")
    if source.evaluation is not None:
        tables = evaluation_tables("held-out, merged vs. corrected", source.evaluation)
        parts.append("## Evaluation (the run's held-out data)\n\n" + "\n".join(_markdown_table(*t) for t in tables))
    else:
        parts.append("## Evaluation\n\nThe source recorded no held-out evaluation.\n")
    return parts


def model_card(source: ExportSource, settings: dict[str, Any], default_task: str, folder: str) -> str:
    """`folder`: the name the snippet loads the model by (on the Hub, its repository's)."""
    name = source.files.name
    tasks = ", ".join(f"`{task}`" for task in settings["tasks"])
    routed = " `routed` (the task router inside the model picks each sequence's correction from its prompt)," \
        if settings["router"] else ""
    usage = f"""# {name}

A merge of fine-tuned experts ({tasks}) of one base model, made with mergekit and repaired by **DARTS**:
a small per-task correction of the hidden states, ĥ = h − U·ReLU(D·h) + P[t], at layers {settings['layers']}
({_share(source)}). Exported by darts-dist from `{source.origin}`.

The correction is not linear, so it cannot be folded into the weights: this folder's own code applies it
(`trust_remote_code=True`; **without it, transformers loads the plain merge**). The tokenizer is the merged
model's own.

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained("{folder}", trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained("{folder}")
```

`darts_task` picks the correction: one of {tasks},{routed} or `merged` (no correction: the plain merge).
This folder applies `{default_task}` unless told otherwise: `model.generate(..., darts_task="math")` per call, or
`model.config.darts_task` for every call.
"""
    return "\n".join([_front_matter(source), usage, *_sections(source)])


def correction_card(source: ExportSource, settings: dict[str, Any], folder: str) -> str:
    return "\n".join([_front_matter(source), f"""# {source.files.name}: the DARTS correction alone

The corrections ({', '.join(settings['tasks'])}) and task router of a darts-dist calibration, {_share(source)}.
Put them on the merged model they were trained for:

```python
from transformers.dynamic_module_utils import get_class_from_dynamic_module
DartsCorrection = get_class_from_dynamic_module("modeling_darts.DartsCorrection", "{folder}")
model = DartsCorrection.from_pretrained("{folder}").apply(merged_model)
```
""", *_sections(source)])
