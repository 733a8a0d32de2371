"""The MLflow pyfunc model of a corrected merged model: prompts (and tasks) in, generated text out.

This file is the model's code in MLflow's models-from-code form: `registry.log_pyfunc_model`
hands its *path* to `mlflow.pyfunc.log_model`, MLflow stores a copy of it with the model, and
`mlflow.pyfunc.load_model` executes that copy, so loading a model unpickles nothing. darts-dist
itself never imports this module (running it registers the model with MLflow's `set_model`).
`load_context` reads only the model's own artifacts: the merged model folder (weights,
config, tokenizer), the corrections' safetensors file and the task router's. A row whose task
is "auto" is routed: the router picks its task, or no correction below its threshold.
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
from mlflow.pyfunc import PythonModel, PythonModelContext

import mlflow
from darts_dist.generation import CorrectedLM
from darts_dist.sources.models import model_dtype, resolve_device
from darts_dist.tracking.registry import CORRECTIONS_ARTIFACT, MERGED_ARTIFACT, PARAM_DEFAULTS, ROUTER_ARTIFACT


def _task(value: object) -> str | None:
    # A missing task arrives as None, NaN (pandas fills a column that way) or an empty string.
    if value is None or (isinstance(value, float) and math.isnan(value)) or value == "":
        return None
    return str(value)


class DartsPyfunc(PythonModel):
    """`predict` takes a DataFrame of `prompt` and optional `task`; params carry the generation settings (and the
    engine's max_batch_size)."""

    def load_context(self, context: PythonModelContext) -> None:
        corrections, router = (context.artifacts.get(name) for name in (CORRECTIONS_ARTIFACT, ROUTER_ARTIFACT))
        # Where it computes: the model_config it was logged with, or the one load_model passes (device auto: CUDA
        # where a GPU is visible; dtype auto: bfloat16 there, float32 on a CPU).
        settings = context.model_config or {}
        device = resolve_device(str(settings.get("device", "auto")))
        self.lm = CorrectedLM.load(
            Path(context.artifacts[MERGED_ARTIFACT]),
            None if corrections is None else Path(corrections),
            device=device,
            dtype=model_dtype(str(settings.get("dtype", "auto")), device),
            router_path=None if router is None else Path(router),
        )

    def predict(
        self, context: PythonModelContext, model_input: pd.DataFrame, params: dict | None = None
    ) -> pd.DataFrame:
        settings = {**PARAM_DEFAULTS, **(params or {})}
        prompts = [str(p) for p in model_input["prompt"]]
        tasks = [_task(t) for t in model_input["task"]] if "task" in model_input else None
        options = {
            "max_new_tokens": int(settings["max_new_tokens"]),
            "temperature": float(settings["temperature"]),
            "top_p": float(settings["top_p"]),
            "stop": list(settings["stop"]) or None,
            "seed": int(settings["seed"]),
            # Rows go through the continuous-batching engine, as the Serve app's requests do.
            "max_batch_size": int(settings["max_batch_size"]),
        }
        if settings["chat"]:
            completions = self.lm.chat([[{"role": "user", "content": p}] for p in prompts], tasks, **options)
        else:
            completions = self.lm.generate(prompts, tasks, **options)
        return pd.DataFrame({
            "text": [c.text for c in completions],
            "finish_reason": [c.finish_reason for c in completions],
            "prompt_tokens": [c.prompt_tokens for c in completions],
            "completion_tokens": [c.completion_tokens for c in completions],
        })


mlflow.models.set_model(DartsPyfunc())
