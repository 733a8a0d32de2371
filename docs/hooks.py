"""MkDocs hooks: the site's reference pages are built from the code, not from the committed copies.

`on_pre_build` runs the generator (docs/gen_reference.py); `on_files` serves its pages in place of the committed
docs/reference/*.md, so `mkdocs build --strict` always documents the code it is built with. The working tree is
never written: a committed page that differs from the code is a warning (an error under --strict) that names the
command which refreshes it.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

from mkdocs.structure.files import File, Files

log = logging.getLogger("mkdocs.hooks.gen_reference")
_GENERATOR = Path(__file__).resolve().parent / "gen_reference.py"
_pages: dict[str, str] = {}


def _generator():
    spec = importlib.util.spec_from_file_location("darts_dist_docs_gen_reference", _GENERATOR)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def on_pre_build(config) -> None:
    gen = _generator()
    _pages.clear()
    _pages["reference/configuration.md"] = gen.configuration_markdown()
    _pages["reference/cli.md"] = gen.cli_markdown()
    docs = Path(config["docs_dir"])
    for uri, text in _pages.items():
        committed = docs / uri
        if not committed.is_file() or committed.read_text(encoding="utf-8") != text:
            log.warning("docs/%s is not what the code generates; run `%s` and commit it", uri, gen.COMMAND)


def on_files(files: Files, config) -> Files:
    for uri, text in _pages.items():
        existing = files.get_file_from_path(uri)
        if existing is not None:
            files.remove(existing)
        files.append(File.generated(config, uri, content=text))
    return files
