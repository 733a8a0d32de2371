"""The package's layout is its data's path: no import cycle, no layer importing a later one, and serving
(the Ray Serve app and the registered pyfunc model) free of the demo and of `datasets`."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).absolute().parent.parent / "darts_dist"
# Each module's layer, by its dotted prefix (the longest prefix wins): a module may import its own layer
# and earlier ones, never a later one (DESIGN.md §5).
LAYERS = {
    "darts_dist": 0, "darts_dist.core": 0, "darts_dist.config": 0, "darts_dist.errors": 0, "darts_dist.fsutil": 0,
    "darts_dist.logs": 0, "darts_dist.fanin": 0, "darts_dist.memory": 0, "darts_dist.options": 0, "darts_dist.run_folder": 0,
    "darts_dist.ray_cluster": 0,
    "darts_dist.sources": 1,
    "darts_dist.merge": 2,
    "darts_dist.calibrate": 3,
    "darts_dist.generation": 4,
    "darts_dist.evaluate": 5,
    "darts_dist.tracking": 6, "darts_dist.registry": 6,
    "darts_dist.serve": 7, "darts_dist.export": 7, "darts_dist.plan": 7,
    "darts_dist.pipeline": 8, "darts_dist.ablation": 8, "darts_dist.merge_sweep": 8, "darts_dist.recalibrate": 8,
    "darts_dist.tuning": 8,
    "darts_dist.cli": 9,
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports() -> dict[str, set[str]]:
    """Every darts_dist module and the darts_dist modules it imports, lazy imports inside functions included."""
    modules = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
        graph[name] = {t for t in targets if t in modules and t != name and modules[t].name != "__init__.py"}
    return graph


def layer(module: str) -> int:
    prefix = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return LAYERS[prefix]


def test_no_import_cycle() -> None:
    graph, state, stack = imports(), {}, []

    def visit(node: str) -> None:
        state[node] = "open"
        stack.append(node)
        for target in sorted(graph[node]):
            assert state.get(target) != "open", "import cycle: " + " -> ".join(stack[stack.index(target):] + [target])
            if target not in state:
                visit(target)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_no_layer_imports_a_later_one() -> None:
    upward = sorted(f"{source} -> {target}" for source, targets in imports().items() for target in targets
                    if layer(target) > layer(source))
    assert upward == []


# Rooms apart beyond the order of layers: serving (the Serve app, the corrected model it runs) needs nothing of
# calibration, and evaluation reaches the cluster through ray_cluster, not through calibration's Ray job.
FORBIDDEN = {"darts_dist.serve": "darts_dist.calibrate", "darts_dist.generation": "darts_dist.calibrate",
             "darts_dist.evaluate": "darts_dist.calibrate.ray"}


def within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def test_serving_and_evaluation_keep_out_of_calibrations_rooms() -> None:
    crossing = sorted(f"{source} -> {target}" for source, targets in imports().items() for target in targets
                      for room, kept_out in FORBIDDEN.items() if within(source, room) and within(target, kept_out))
    assert crossing == []


def test_only_sources_import_the_demo() -> None:
    outside = sorted(f"{source} -> {target}" for source, targets in imports().items() for target in targets
                     if target.startswith("darts_dist.sources.demo") and not source.startswith("darts_dist.sources"))
    assert outside == []


def test_the_import_paths_stored_artifacts_use_still_import() -> None:
    """jobs/serve.yaml names darts_dist.serve:app_builder; registered models of darts-dist 0.1 carry code that
    imports darts_dist.generation and darts_dist.registry."""
    from darts_dist.generation import CorrectedLM  # noqa: F401
    from darts_dist.registry import CORRECTIONS_ARTIFACT, MERGED_ARTIFACT, PARAM_DEFAULTS, ROUTER_ARTIFACT  # noqa: F401
    from darts_dist.serve import app_builder

    assert callable(app_builder)


def modules_a_fresh_process_loads(imports: str, selected: str) -> list[str]:
    """The modules in sys.modules for which `selected` (an expression of `m`) holds, after `imports` (a statement)
    in a fresh process."""
    probe = f"import json, sys\n{imports}\nprint(json.dumps(sorted(m for m in sys.modules if {selected})))\n"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_serving_imports_neither_the_demo_nor_datasets() -> None:
    """The Serve app's and the pyfunc model's modules, imported in a fresh process."""
    assert modules_a_fresh_process_loads(
        "import darts_dist.serve, darts_dist.tracking.pyfunc_model",
        "m.split('.')[0] == 'datasets' or m.startswith(('darts_dist.sources.demo', 'darts_dist.sources.data', "
        "'darts_dist.sources.references', 'darts_dist.pipeline', 'darts_dist.ablation'))") == []


def test_the_command_line_answers_help_and_validate_without_the_ml_stack() -> None:
    """`darts-dist --help`, `validate` and a job's bad arguments load no torch, transformers, Ray or MLflow (seconds of
    imports each): the commands import them when they run."""
    heavy = ("torch", "transformers", "ray", "mlflow", "datasets", "mergekit", "deepspeed", "scipy")
    assert modules_a_fresh_process_loads("import darts_dist.cli", f"m.split('.')[0] in {heavy!r}") == []
