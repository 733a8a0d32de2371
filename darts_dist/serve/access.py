"""Who may use a server: the API key (from a file, the environment or a flag) and the warnings about exposure."""

from __future__ import annotations

import ipaddress
import logging
import os
from pathlib import Path

from darts_dist.errors import DartsError

logger = logging.getLogger(__name__)
API_KEY_ENV = "DARTS_DIST_API_KEY"
LOOPBACK = "127.0.0.1"


def resolve_api_key(
    flag: str | None = None, file: Path | None = None, configured_file: Path | None = None
) -> str | None:
    """The key clients must send: `--api-key-file` (its first line), else `--api-key` (which every user of the
    machine can read in `ps`: it works, with a warning), else `DARTS_DIST_API_KEY`, else the file the config names
    (`serve.api_key_file`); None: no key. A key given but blank (an empty or whitespace flag, variable or first line)
    is refused: it would otherwise mean "no key" without anyone having said so."""
    if file is not None and flag is not None:
        raise DartsError("both --api-key and --api-key-file are given", "give one: --api-key-file keeps it out of ps")
    if file is not None:
        return _key_from_file(file, "--api-key-file")
    if flag is not None:
        key = _non_blank(flag, "--api-key")
        logger.warning("--api-key shows the key to every user of this machine (ps, /proc); prefer --api-key-file "
                       "or %s", API_KEY_ENV)
        return key
    if API_KEY_ENV in os.environ:
        return _non_blank(os.environ[API_KEY_ENV], API_KEY_ENV)
    if configured_file is not None:
        return _key_from_file(configured_file, "serve.api_key_file")
    return None


def _key_from_file(file: Path, source: str) -> str:
    try:
        lines = Path(file).expanduser().read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise DartsError(f"cannot read the API key file {file} ({source}): {error}",
                         "pass a readable text file holding the key on its first line") from None
    if not lines or not lines[0].strip():
        raise DartsError(f"the API key file {file} ({source}) is empty", "write the key on its first line")
    return lines[0].strip()


def _non_blank(key: str, source: str) -> str:
    if not key.strip():
        raise DartsError(f"{source} is set but blank: an empty key would serve without one",
                         f"give the key, or unset {source} to serve without a key (on 127.0.0.1)")
    return key.strip()


def warn_if_exposed(host: str, api_key: str | None) -> None:
    """One warning when the server listens beyond this machine and anyone may use it."""
    if api_key is None and not is_loopback(host):
        logger.warning("serving on %s without an API key: anyone who can reach this address can use the model; "
                       "set --api-key-file or %s", host, API_KEY_ENV)


def bound_host(configured: str, from_command_line: str | None) -> str:
    """The address to bind: the command line's `--host`, else the configured `serve.host` if it is a loopback address,
    else 127.0.0.1 (with a warning saying why). A host from the model's registered config or a --config YAML never
    opens the server to the network on its own: whoever can write the registry or the file would decide who can
    reach the model; only the person starting the server does."""
    if from_command_line is not None or is_loopback(configured):
        return from_command_line or configured
    logger.warning("serve.host %s comes from a config, not the command line: binding %s instead; pass --host %s to "
                   "serve beyond this machine (with an API key)", configured, LOOPBACK, configured)
    return LOOPBACK


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False
