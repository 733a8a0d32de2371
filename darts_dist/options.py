"""The command-line flags that set config keys: one table, and every value validated by the config's models.

As in mergekit's options.py, a flag is another way to write a config key: applying flags builds an
update of the config and validates the whole config again with the same pydantic models as the
YAML, so a bad flag fails before any work with `error:` / `fix:` naming the flag, like a bad key.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from darts_dist.config import RunConfig, format_errors
from darts_dist.errors import DartsError


@dataclass(frozen=True)
class ConfigFlag:
    """A flag and the config key it sets (a dotted path); a flag without a value sets `const`."""

    flag: str
    key: str
    help: str
    metavar: str | None = None
    const: Any = None

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")

    def value(self, raw: Any) -> Any:
        """The value for the key, before validation: paths absolute; `all` is no limit."""
        if self.key == "output_dir":
            return Path(raw).absolute()
        if self.key == "evaluation.score_limit" and raw == "all":
            return None
        return raw


CONFIG_FLAGS = {flag.flag: flag for flag in (
    ConfigFlag("--steps", "calibration.steps", "calibration steps (calibration.steps)", "N"),
    ConfigFlag("--traffic-share", "calibration.traffic_share",
               "share of the calibration samples taken from the captured prompts (calibration.traffic_share)", "X"),
    ConfigFlag("--score-limit", "evaluation.score_limit",
               "task-score problems per task, or all (evaluation.score_limit; 0: no task scores)", "N|all"),
    ConfigFlag("--output-dir", "output_dir", "where run folders go (output_dir)", "DIR"),
    ConfigFlag("--address", "cluster.address", "an existing Ray cluster to calibrate on (cluster.address; default: "
               "RAY_ADDRESS, else a local cluster started for the job)", "ADDR"),
    ConfigFlag("--in-process", "cluster.executor", "calibrate with the one-process reference loop instead of Ray "
               "(cluster.executor: in-process)", const="in-process"),
)}


def add_config_flags(parser: argparse.ArgumentParser, *flags: str) -> None:
    """Add the named config flags to a command's parser; their values stay raw until `apply_config_flags`."""
    for name in flags:
        flag = CONFIG_FLAGS[name]
        if flag.const is not None:
            parser.add_argument(flag.flag, dest=flag.dest, action="store_const", const=flag.const, help=flag.help)
        else:
            parser.add_argument(flag.flag, dest=flag.dest, default=None, metavar=flag.metavar, help=flag.help)


def _nested(key: str, value: Any) -> dict[str, Any]:
    head, _, rest = key.partition(".")
    return {head: _nested(rest, value) if rest else value}


def _merge(base: Mapping[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in update.items():
        merged[key] = _merge(merged[key], value) if isinstance(value, Mapping) and key in merged else value
    return merged


def apply_config_flags(config: RunConfig, args: argparse.Namespace) -> RunConfig:
    """The config with every config flag the command line set, validated as a whole."""
    given = {flag: getattr(args, flag.dest) for flag in CONFIG_FLAGS.values()
             if getattr(args, flag.dest, None) is not None}
    if not given:
        return config
    data = config.model_dump()
    for flag, raw in given.items():
        data = _merge(data, _nested(flag.key, flag.value(raw)))
    try:
        return RunConfig.model_validate(data)
    except ValidationError as error:
        names = {flag.key: f"{flag.flag} ({flag.key})" for flag in given}
        raise DartsError(f"the command line sets invalid values:\n{format_errors(error, names)}",
                         "fix the flags above (`darts-dist COMMAND --help` lists them)") from None
