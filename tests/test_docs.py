"""The docs stay in step with the code: a short README whose links resolve, reference pages that list every
config key and every flag (and are committed as generated), a site navigation that lists every page, and a strict
MkDocs build."""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
import types
import typing
from pathlib import Path

import yaml
from pydantic import BaseModel

from darts_dist.cli import build_parser
from darts_dist.config import RunConfig

ROOT = Path(__file__).absolute().parent.parent
DOCS = ROOT / "docs"
README_MAX_LINES = 200
REFRESH = "run `python docs/gen_reference.py` and commit docs/reference/"


def _load_generator() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("docs_gen_reference", DOCS / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen = _load_generator()


def test_readme_is_a_short_front_door() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, (f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): move "
                                            f"detail into docs/ and link to it")


# ---------------------------------------------------------------- configuration reference
# The expected keys are found here by a walk of our own over the pydantic models, not by the generator's, so a
# generator that skips a key (a nested section, a list of sections, a union member) fails these tests.


def _models(annotation: typing.Any) -> list[tuple[str, type[BaseModel]]]:
    """(path suffix, model) for each model inside an annotation: '[]' for a list's items, '.<*>' for a
    mapping's values."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [("", annotation)]
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is list:
        return [("[]" + suffix, model) for suffix, model in _models(args[0])]
    if origin is dict:
        return [(".<*>" + suffix, model) for suffix, model in _models(args[1])]
    return [found for arg in args for found in _models(arg)]  # unions, Annotated, Optional


def _expected_keys(model: type[BaseModel] = RunConfig, prefix: str = "") -> list[str]:
    keys = []
    for name, field in model.model_fields.items():
        keys.append(prefix + name)
        for suffix, nested in _models(field.annotation):
            keys += _expected_keys(nested, f"{prefix}{name}{suffix}.")
    return keys


def _key_pattern(path: str) -> re.Pattern[str]:
    # A mapping's key is a placeholder of the generator's choosing (`<task>`), any word in angle brackets.
    return re.compile("`" + re.escape(path).replace(re.escape("<*>"), "<[A-Za-z_]+>") + "`")


def test_the_key_walk_sees_nested_lists_mappings_and_unions() -> None:
    keys = _expected_keys()
    for key in ("name", "sources.experts[].task", "sources.experts[].data.calibration",
                "calibration.tasks.<*>.beta", "calibration.coefficients.logit_weight", "serve.capture.flush_s"):
        assert key in keys
    assert len(keys) > 100


def test_configuration_reference_lists_every_key() -> None:
    page = gen.configuration_markdown()
    missing = [key for key in _expected_keys() if not _key_pattern(key).search(page)]
    assert not missing, f"the configuration reference lacks {missing}"


def test_configuration_reference_is_committed_as_generated() -> None:
    committed = DOCS / "reference" / "configuration.md"
    assert committed.is_file(), f"docs/reference/configuration.md is missing: {REFRESH}"
    assert committed.read_text(encoding="utf-8") == gen.configuration_markdown(), (
        f"docs/reference/configuration.md is not what the code generates: {REFRESH}")


# ---------------------------------------------------------------- command-line reference


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(actions[0].choices) if actions else {}


def _sections(page: str) -> dict[str, str]:
    """The CLI page's sections by heading: `darts-dist demo` -> its text."""
    parts = re.split(r"^## `([^`]+)`$", page, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2]))


def _arguments(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))]


def test_cli_reference_lists_every_command_and_flag() -> None:
    parser = build_parser()
    sections = _sections(gen.cli_markdown())
    commands = {f"darts-dist {name}": sub for name, sub in _subparsers(parser).items()}
    assert len(commands) >= 10
    missing = []
    for heading, command_parser in [("darts-dist", parser), *commands.items()]:
        if heading not in sections:
            missing.append(f"the section {heading}")
            continue
        for action in _arguments(command_parser):
            names = action.option_strings or [action.metavar or action.dest.upper()]
            missing += [f"{heading} {name}" for name in names if f"`{name}" not in sections[heading]]
        if command_parser.description and " ".join(command_parser.description.split()) not in sections[heading]:
            missing.append(f"the description of {heading}")
    assert not missing, f"the command-line reference lacks {missing}"


def test_cli_reference_is_committed_as_generated() -> None:
    committed = DOCS / "reference" / "cli.md"
    assert committed.is_file(), f"docs/reference/cli.md is missing: {REFRESH}"
    assert committed.read_text(encoding="utf-8") == gen.cli_markdown(), (
        f"docs/reference/cli.md is not what the code generates: {REFRESH}")


# ---------------------------------------------------------------- the site and the README


def _nav_pages(nav: typing.Any) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [page for item in nav for page in _nav_pages(item)]
    if isinstance(nav, dict):
        return [page for value in nav.values() for page in _nav_pages(value)]
    return []


def test_every_page_is_in_the_nav_and_every_nav_entry_exists() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    nav = [page for page in _nav_pages(config["nav"]) if not re.match(r"^[a-z]+://", page)]
    pages = sorted(path.relative_to(DOCS).as_posix() for path in DOCS.rglob("*.md"))
    assert not [page for page in nav if not (DOCS / page).is_file()], "mkdocs.yml's nav names pages docs/ lacks"
    assert sorted(set(pages) - set(nav)) == [], "pages in docs/ that mkdocs.yml's nav does not list"
    assert len(nav) == len(set(nav)), "a page listed twice in mkdocs.yml's nav"


def test_readme_links_resolve() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    assert targets, "the README links into docs/"
    broken = [target for target in targets
              if not re.match(r"^[a-z]+:", target) and not target.startswith("#")
              and not (ROOT / target.split("#")[0]).exists()]
    assert not broken, f"README.md links to files that do not exist: {broken}"


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    missing = [name for name in ("mkdocs", "material") if importlib.util.find_spec(name) is None]
    assert not missing, f"{missing} not installed: they are the test extra's (pip install -e '.[test]')"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    assert (tmp_path / "site" / "reference" / "configuration" / "index.html").is_file()
