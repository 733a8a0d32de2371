"""Who may use a server: the API key (from a file, the environment or a flag) and the warnings about exposure."""

from __future__ import annotations

import ipaddress
import logging
import os
from pathlib import Path

from darts_dist.errors import DartsError

logger = logging.getLogger(__name__)
API_KEY_ENV = "DARTS_DIST_API_KEY"


def resolve_api_key(flag: str | None = None, file: Path | None = None) -> str | None:
    """The key clients must send: `--api-key-file` (its first line), else `--api-key` (which every user of the
    machine can read in `ps`: it works, with a warning), else `DARTS_DIST_API_KEY`; None: no key."""
    if file is not None and flag:
        raise DartsError("both --api-key and --api-key-file are given", "give one: --api-key-file keeps it out of ps")
    if file is not None:
        try:
            lines = Path(file).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as error:
            raise DartsError(f"cannot read the API key file {file}: {error}",
                             "pass a readable text file holding the key on its first line") from None
        if not lines or not lines[0].strip():
            raise DartsError(f"the API key file {file} is empty", "write the key on its first line")
        return lines[0].strip()
    if flag:
        logger.warning("--api-key shows the key to every user of this machine (ps, /proc); prefer --api-key-file "
                       "or %s", API_KEY_ENV)
        return flag
    return os.environ.get(API_KEY_ENV) or None


def warn_if_exposed(host: str, api_key: str | None) -> None:
    """One warning when the server listens beyond this machine and anyone may use it."""
    if api_key is None and not is_loopback(host):
        logger.warning("serving on %s without an API key: anyone who can reach this address can use the model; "
                       "set --api-key-file or %s", host, API_KEY_ENV)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False
