"""The command-line flags that set config keys, generated from the config's fields that declare one (`config.Flag`),
every value validated by the config's models.

As in mergekit's options.py, a flag is another way to write a config key: applying flags builds an
update of the config and validates the whole config again with the same pydantic models as the
YAML, so a bad flag fails before any work with `error:` / `fix:` naming the flag, like a bad key.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from darts_dist.config import Flag, RunConfig, format_errors
from darts_dist.errors import DartsError


@dataclass(frozen=True)
class ConfigFlag:
    """A flag (declared on its config field with `config.Flag`) and the config key it sets (a dotted path)."""

    flag: Flag
    key: str

    @property
    def dest(self) -> str:
        return self.flag.name.removeprefix("--").replace("-", "_")

    @property
    def help(self) -> str:
        return f"{self.flag.help} ({self.key}{'' if self.flag.const is None else f': {self.flag.const}'})"

    def value(self, raw: Any) -> Any:
        """The value for the key, before validation."""
        return raw if self.flag.parse is None else self.flag.parse(raw)


def config_flags(model: type[BaseModel] = RunConfig, prefix: str = "") -> dict[str, ConfigFlag]:
    """Every flag declared on the fields of `model` and of its sections, by flag name."""
    flags = {}
    for name, field in model.model_fields.items():
        for flag in (m for m in field.metadata if isinstance(m, Flag)):
            flags[flag.name] = ConfigFlag(flag, prefix + name)
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            flags |= config_flags(field.annotation, f"{prefix}{name}.")
    return flags


CONFIG_FLAGS = config_flags()


def add_config_flags(parser: argparse.ArgumentParser, *flags: str) -> None:
    """Add the named config flags to a command's parser; their values stay raw until `apply_config_flags`."""
    for name in flags:
        flag = CONFIG_FLAGS[name]
        if flag.flag.const is not None:
            parser.add_argument(name, dest=flag.dest, action="store_const", const=flag.flag.const, help=flag.help)
        else:
            parser.add_argument(name, dest=flag.dest, default=None, metavar=flag.flag.metavar, help=flag.help)


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
        names = {flag.key: f"{flag.flag.name} ({flag.key})" for flag in given}
        raise DartsError(f"the command line sets invalid values:\n{format_errors(error, names)}",
                         "fix the flags above (`darts-dist COMMAND --help` lists them)") from None
