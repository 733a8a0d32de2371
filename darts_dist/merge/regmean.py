"""merge.method regmean: the decoder layers' linears merged by RegMean (core.regmean) from each expert's inputs
on its own task's calibration rows; every other tensor by the mergekit method of `merge.others`. merge.method
regmean_plus: RegMean++ (Nguyen et al. 2025, arXiv 2508.03121), the same solution layer by layer, each expert's
layer fed the states the merge's own layers below it give (its embeddings included), not its own layers': a
layer's merge then answers for what the layers merged below it actually hand on.

Each expert runs once over its calibration rows (the rows the stream trains on) in a `GramCollector`: on Ray an
actor with an expert's resources, so the Gram matrices stay where they were made and reach the driver one
linear at a time (at 7B width an expert's Grams are ~22 GB, more than the driver should hold); in-process the
same class in this process. The driver writes mergekit's merge of the other tensors into a temporary folder,
replaces each linear's weight with the RegMean solution shard by shard, writes the record of what was done
(`regmean_config.yml`) and renames the folder into place: an interrupted merge leaves nothing behind. For
RegMean++ each collector keeps its task's states between layers and takes each merged layer in place of its
expert's once the driver has solved it (the layer's tensors travel to it: on a cluster it may sit on another node).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import ray
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from darts_dist.config import REGMEAN_RECORD, RunConfig, compute_dtype_name
from darts_dist.core import TokenizedSet, decoder_layers, layer_output
from darts_dist.core.regmean import GramRecorder, solve
from darts_dist.core.regmean import contribution as linear_contribution
from darts_dist.errors import DartsError
from darts_dist.fsutil import atomic_dir, atomic_file
from darts_dist.logs import progress_bar, show_progress_logs
from darts_dist.memory import PeakMemory
from darts_dist.merge.mergekit import REGMEAN_PLUS, build_mergekit_config, merge_device, merge_into
from darts_dist.ray_cluster.remote import expert_group, get_or_raise
from darts_dist.sources.data import calibration_sets
from darts_dist.sources.models import load_causal_lm, load_tokenizer, model_compute, model_dtype, resolve_device
from darts_dist.sources.references import ResolvedSources

logger = logging.getLogger(__name__)


class GramCollector:
    """One expert: loaded once, run over its task's calibration rows with a GramRecorder, then asked for each
    linear's share of RegMean's normal equations (fp32 on the CPU: the driver sums them in float64)."""

    def __init__(self, model_path: str, dtype: str, device: str) -> None:
        show_progress_logs()  # on Ray this actor's own process: its lines reach the driver's console
        self.device = resolve_device(device)
        self.memory = PeakMemory(self.device)
        self.model = load_causal_lm(Path(model_path), dtype=model_dtype(dtype, self.device), device=self.device)
        self.recorder = GramRecorder()
        self.linears = GramRecorder.linears(self.model)

    def accumulate(self, data: TokenizedSet, batch_size: int, progress: bool = True) -> dict[str, object]:
        """Every row of `data` through the expert; its token count, this collector's peak memory so far and where
        and in what dtype it computed (sources.models.compute_label)."""
        batches = list(data.batches(batch_size))
        marks = {len(batches) * quarter // 4 for quarter in (1, 2, 3)}  # a line at each quarter: Ray shows no bars
        with self.recorder.recording(self.model):
            for done, batch in enumerate(progress_bar(batches, desc=f"regmean grams {data.task}", unit="batch",
                                              disable=not progress), 1):
                self.recorder.run(self.model, batch["input_ids"].to(self.device),
                                  batch["attention_mask"].to(self.device))
                if done in marks:
                    logger.info("regmean grams %s: %d/%d batches", data.task, done, len(batches))
        logger.info("regmean grams %s: %d rows, %d tokens", data.task, len(data), self.recorder.tokens)
        return {"tokens": self.recorder.tokens, "peak_memory": self.memory.peak(), "compute": model_compute(self.model)}

    def shapes(self) -> dict[str, tuple[int, int]]:
        return {name: tuple(linear.weight.shape) for name, linear in self.linears.items()}

    def layers(self) -> list[tuple[str, list[str]]]:
        """Each decoder layer's parameter prefix (`model.layers.3.`) and its linears, bottom up."""
        names = {id(module): name for name, module in self.model.named_modules()}
        return [(names[id(layer)] + ".", list(GramRecorder.linears(self.model, index)))
                for index, layer in enumerate(decoder_layers(self.model))]

    def embedding_names(self) -> list[str]:
        """The input embeddings' parameter names: what RegMean++ replaces before the first layer."""
        embeddings = self.model.get_input_embeddings()
        prefix = next(name for name, module in self.model.named_modules() if module is embeddings)
        return [f"{prefix}.{name}" for name, _ in embeddings.named_parameters()]

    def start_layers(self, data: TokenizedSet, batch_size: int, embeddings: dict[str, torch.Tensor]) -> None:
        """RegMean++: the merge's input embeddings in place of the expert's, and the task's rows kept, to be carried
        up through the merge's layers one at a time (`layer_statistics`, then `advance`)."""
        self._load(embeddings)
        self.batches = [(batch["input_ids"].to(self.device), batch["attention_mask"].to(self.device))
                        for batch in data.batches(batch_size)]
        self.entering: list[torch.Tensor | None] = [None] * len(self.batches)  # None: the embeddings' output
        self.task = data.task

    def layer_statistics(self, index: int) -> dict[str, object]:
        """The Grams of decoder layer `index`'s linears (the expert's layer) on the states the merge's layers below
        hand it; as `accumulate`."""
        self.recorder = GramRecorder()
        with self.recorder.recording(self.model, index):
            for (input_ids, mask), entering in zip(self.batches, self.entering, strict=True):
                with self.recorder.observing(mask):
                    layer_output(self.model, index, input_ids, mask, entering)
        return {"tokens": self.recorder.tokens, "peak_memory": self.memory.peak(), "compute": model_compute(self.model)}

    def advance(self, index: int, tensors: dict[str, torch.Tensor]) -> None:
        """The merge's decoder layer `index` (`tensors`: all of its parameters) in place of the expert's, and the
        task's states carried through it."""
        self._load(tensors)
        self.entering = [layer_output(self.model, index, input_ids, mask, entering)
                         for (input_ids, mask), entering in zip(self.batches, self.entering, strict=True)]
        if index == len(decoder_layers(self.model)) - 1:
            self.batches, self.entering = [], []  # the last layer: nothing more to carry
        logger.info("regmean_plus %s: layer %d merged and carried", self.task, index)

    def _load(self, tensors: dict[str, torch.Tensor]) -> None:
        unexpected = self.model.load_state_dict(tensors, strict=False).unexpected_keys
        if unexpected:
            raise DartsError(f"the merged weights name tensors the expert does not have: {unexpected[:3]}",
                             "merge experts of one architecture (Hugging Face names)")

    def contribution(self, name: str, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
        gram, product = linear_contribution(self.recorder.gram(name), self.linears[name].weight, alpha)
        return gram.float().cpu(), product.float().cpu()


class Collectors:
    """The experts' collectors, local objects or Ray actors, asked the same questions: `submit` starts a call on
    each (Ray refs, or the values themselves outside Ray), `fetch` waits for the answers."""

    def __init__(self, members: Sequence[object], on_ray: bool) -> None:
        self.members, self.on_ray = list(members), on_ray

    def submit(self, method: str, calls: Sequence[tuple]) -> list:
        """`method(*calls[i])` on the i-th collector."""
        if self.on_ray:
            return [getattr(m, method).remote(*call) for m, call in zip(self.members, calls, strict=True)]
        return [getattr(m, method)(*call) for m, call in zip(self.members, calls, strict=True)]

    def fetch(self, submitted: list) -> list:
        return get_or_raise(submitted) if self.on_ray else submitted

    def ask(self, method: str, *args: object) -> list:
        """`method(*args)` on every collector, answered."""
        return self.fetch(self.submit(method, [args] * len(self.members)))


@contextmanager
def collectors(config: RunConfig, sources: ResolvedSources) -> Iterator[Collectors]:
    """A collector per task's expert: Ray actors with expert resources (cluster.executor ray) or local objects."""
    settings = config.calibration
    args = [(str(sources.experts[task]), settings.dtype, settings.device) for task in config.tasks]
    if not config.cluster.on_ray:
        yield Collectors([GramCollector(*a) for a in args], on_ray=False)
        return
    with expert_group(config.cluster, len(args), "RegMean's Gram actors") as options:
        actor = ray.remote(GramCollector)
        members = [actor.options(max_restarts=0, **options[i]).remote(*a) for i, a in enumerate(args)]
        try:
            yield Collectors(members, on_ray=True)
        finally:
            for member in members:
                ray.kill(member)


def _data_digest(data: TokenizedSet) -> str:
    """The rows' tokens, hashed: the Grams' provenance (same digest, same Grams for the same expert)."""
    digest = hashlib.sha256()
    for row, mask in zip(data.input_ids, data.attention_mask, strict=True):
        digest.update(row[mask.bool()].numpy().tobytes())
    return digest.hexdigest()[:16]


COMPUTED_ON = "computed_on"  # in a record's grams.tasks: where each expert's Grams were computed, once they were


def _without_computed_on(record: object) -> object:
    """A written record as `regmean_record` makes it: less where its Grams were computed (known only after)."""
    if isinstance(record, dict) and isinstance(record.get("grams"), dict):
        tasks = record["grams"].get("tasks", {})
        record["grams"]["tasks"] = {task: {k: v for k, v in seen.items() if k != COMPUTED_ON}
                                    for task, seen in tasks.items()} if isinstance(tasks, dict) else tasks
    return record


def regmean_record(config: RunConfig, sources: ResolvedSources, others: Mapping[str, object],
                   sets: Mapping[str, TokenizedSet]) -> dict[str, object]:
    """The mergekit-style YAML of a RegMean merge: inputs, alpha, the other tensors' mergekit config, and where
    each expert's Gram statistics came from. Equal records mean the same merge (an earlier one is reused)."""
    settings = config.calibration
    return {
        "merge_method": config.merge.method,
        "base_model": str(sources.base),
        "models": [{"model": str(sources.experts[task]), "task": task} for task in config.tasks],
        "parameters": {"alpha": config.merge.alpha},
        "linears": "every nn.Linear of the decoder layers (weights; their biases go with the other tensors)",
        "others": dict(others),
        "dtype": config.merge.dtype,
        "grams": {
            "statistic": "mean over real tokens of x xᵀ, x a linear's input (fp32), off-diagonals scaled by alpha"
                         + ("; a layer's inputs from the merge's own layers below it (RegMean++)"
                            if config.merge.method == REGMEAN_PLUS else ""),
            "compute_dtype": compute_dtype_name(settings.dtype, config.models_on_gpus or (
                not config.cluster.on_ray and resolve_device(settings.device).type == "cuda")),
            "tasks": {task: {"calibration": str(sources.data[task].calibration), "rows": len(data),
                             "max_length": settings.max_length, "validation_fraction": settings.validation_fraction,
                             "seed": settings.seed, "tokens": int(data.attention_mask.sum()),
                             "tokens_sha256": _data_digest(data)} for task, data in sets.items()},
        },
    }


class _Shards:
    """The merge's shards under `folder`, each rewritten (atomically) once every linear in it has its solution:
    solutions wait in memory only until their shard is complete."""

    def __init__(self, folder: Path, linears: Sequence[str]) -> None:
        self.files = sorted(folder.glob("*.safetensors"))
        self.waiting: dict[Path, set[str]] = {}  # per shard, the linears still unsolved
        self.order: list[str] = []  # the linears in the shards' order
        wanted = set(linears)
        for file in self.files:
            with safe_open(str(file), framework="pt") as weights:
                names = [name.removesuffix(".weight") for name in weights.keys()
                         if name.endswith(".weight") and name.removesuffix(".weight") in wanted]
            if names:
                self.waiting[file] = set(names)
                self.order += names
        missing = sorted(wanted - set(self.order))
        if missing:
            raise DartsError(f"the merged weights have no tensor for the linears {missing[:3]} (of {len(missing)})",
                             "merge experts whose weight files name every linear of the model (Hugging Face names)")
        self.solved: dict[str, torch.Tensor] = {}

    def put(self, module: str, weight: torch.Tensor) -> None:
        """A linear's solution; its shard is written once it is the shard's last."""
        self.solved[module] = weight
        for file, names in self.waiting.items():
            if module in names:
                names.discard(module)
                if not names:
                    tensors = load_file(file)
                    for name in [n for n in self.solved if n + ".weight" in tensors]:
                        tensors[name + ".weight"] = self.solved.pop(name).to(tensors[name + ".weight"].dtype)
                    with atomic_file(file) as tmp:
                        save_file(tensors, str(tmp), metadata={"format": "pt"})
                return

    def tensors(self, wanted: Callable[[str], bool], solved: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The tensors of the shards whose names are `wanted`, the linears' weights as `solved` gives them."""
        found = {}
        for file in self.files:
            with safe_open(str(file), framework="pt") as weights:
                found |= {name: weights.get_tensor(name) for name in weights.keys()
                          if wanted(name) and name.removesuffix(".weight") not in solved}
        return found | {name + ".weight": weight for name, weight in solved.items()}


def _solutions(pool: Collectors, modules: Sequence[str], alpha: float, device: torch.device,
               progress: bool, desc: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Each linear's RegMean solution [out, in], solved in float64 on `device`, returned on the CPU in fp32 (one
    linear's sums held at a time; the next linear's shares already on their way)."""
    def shares(index: int) -> list | None:
        return pool.submit("contribution", [(modules[index], alpha)] * len(pool.members)) \
            if index < len(modules) else None

    pending = shares(0)
    for index, module in enumerate(progress_bar(modules, desc=desc, unit="linear", disable=not progress)):
        answered, pending = pool.fetch(pending), shares(index + 1)
        merged = solve(sum(g.to(device, torch.float64) for g, _ in answered),
                       sum(p.to(device, torch.float64) for _, p in answered))
        yield module, merged.to("cpu", torch.float32).contiguous()


def _merge_linears(folder: Path, pool: Collectors, shapes: Mapping[str, tuple[int, int]], alpha: float,
                   device: torch.device, progress: bool) -> None:
    """RegMean: each linear's weight in the shards under `folder` replaced with its solution, shard by shard."""
    shards = _Shards(folder, list(shapes))
    for module, weight in _solutions(pool, shards.order, alpha, device, progress, "regmean solve"):
        shards.put(module, weight)


def _merge_layer_by_layer(folder: Path, pool: Collectors, config: RunConfig, sets: Mapping[str, TokenizedSet],
                          device: torch.device, progress: bool) -> list[dict[str, object]]:
    """RegMean++: decoder layer by decoder layer, each expert's Grams on the states the merged layers below give
    (first the merge's embeddings'), the layer's linears solved and written, then the merged layer handed to every
    collector to carry its states through. Returns each collector's statistics (as `accumulate`'s) of the last
    layer's pass (every layer's counts the same tokens)."""
    layers = pool.ask("layers")[0]
    shards = _Shards(folder, [module for _, modules in layers for module in modules])
    embeddings = shards.tensors(set(pool.ask("embedding_names")[0]).__contains__, {})
    pool.fetch(pool.submit("start_layers", [(sets[task], config.calibration.batch_size, embeddings)
                                            for task in config.tasks]))
    statistics: list[dict[str, object]] = []
    for index, (prefix, modules) in enumerate(progress_bar(layers, desc="regmean_plus layers", unit="layer",
                                                           disable=not progress)):
        statistics = pool.ask("layer_statistics", index)
        solved = dict(_solutions(pool, modules, config.merge.alpha, device, False, "regmean_plus solve"))
        layer = shards.tensors(lambda name: name.startswith(prefix), solved)  # norms and biases: mergekit's
        for module, weight in solved.items():
            shards.put(module, weight)
        pool.ask("advance", index, layer)
    return statistics


def regmean_merge(config: RunConfig, sources: ResolvedSources, out_dir: Path | None = None,
                  progress: bool = True) -> tuple[Path, bool]:
    """Merge by RegMean into `out_dir` (config.merged_dir); an identical earlier merge (same record) is reused.
    Returns the folder and whether it was merged now (False: reused)."""
    out_dir = Path(out_dir or config.merged_dir).absolute()
    others_settings = config.merge.others_merge
    # The other tensors' mergekit config is built (and so checked) before any expert runs.
    others = build_mergekit_config(
        base=sources.base, experts=sources.experts, method=others_settings.method,
        parameters=others_settings.parameters,
        expert_parameters={e.task: e.merge_parameters for e in config.sources.experts if e.merge_parameters},
        dtype=config.merge.dtype)
    sets = calibration_sets(config, sources.data, load_tokenizer(sources.base))
    record = regmean_record(config, sources, others, sets)
    written = out_dir / REGMEAN_RECORD
    if written.is_file() and _without_computed_on(yaml.safe_load(written.read_text())) == record:
        logger.info("merge: reusing %s (same RegMean record)", out_dir)
        return out_dir, False
    started = time.perf_counter()
    with atomic_dir(out_dir, overwrite=True) as tmp:
        merge_into(others, tmp, named=out_dir, device=config.merge.device)
        with collectors(config, sources) as pool:
            shapes = pool.ask("shapes")[0]
            device = merge_device(config.merge.device)
            if config.merge.method == REGMEAN_PLUS:
                statistics = _merge_layer_by_layer(tmp, pool, config, sets, device, progress)
            else:
                statistics = pool.fetch(pool.submit("accumulate", [(sets[task], config.calibration.batch_size,
                                                                    progress) for task in config.tasks]))
                _merge_linears(tmp, pool, shapes, config.merge.alpha, device, progress)
        for task, seen in zip(config.tasks, statistics, strict=True):
            record["grams"]["tasks"][task][COMPUTED_ON] = seen["compute"]
        (tmp / REGMEAN_RECORD).write_text(yaml.safe_dump(record, sort_keys=False, allow_unicode=True))
    logger.info("merge: %s of %d linears from %s tokens in %.1f s (collectors' peak memory %s)", config.merge.method,
                len(shapes),
                [s["tokens"] for s in statistics], time.perf_counter() - started,
                [f"{s['peak_memory'] / 2**20:.0f} MiB" for s in statistics])
    return out_dir, True
