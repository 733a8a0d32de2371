"""Who may use a server: the API keys (from a file, the environment or a flag), each naming its client, and the
warnings about exposure."""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from darts_dist.errors import DartsError

logger = logging.getLogger(__name__)
API_KEY_ENV = "DARTS_DIST_API_KEY"
LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class ApiKeys:
    """The keys a server takes, each with its client's name: what traffic capture records of a request (never the
    key), so that one client's share of a recalibration can be capped."""

    clients: tuple[tuple[str, str], ...] = field(repr=False)  # (name, key); the keys stay out of any repr

    def __repr__(self) -> str:
        return f"ApiKeys(clients={[name for name, _ in self.clients]})"

    def client(self, token: str) -> str | None:
        """The name of the client whose key `token` is, else None. Every key is compared, in constant time each: how
        long it takes says nothing about which key came close."""
        found = None
        for name, key in self.clients:
            if hmac.compare_digest(token.encode(), key.encode()) and found is None:
                found = name
        return found


def resolve_api_key(
    flag: str | None = None, file: Path | None = None, configured_file: Path | None = None
) -> ApiKeys | None:
    """The keys clients must send one of: `--api-key-file` (a key per line, `KEY` or `NAME KEY`), else `--api-key`
    (which every user of the machine can read in `ps`: it works, with a warning), else `DARTS_DIST_API_KEY`, else the
    file the config names (`serve.api_key_file`); None: no key. A key given but blank (an empty or whitespace flag,
    variable or file) is refused: it would otherwise mean "no key" without anyone having said so."""
    if file is not None and flag is not None:
        raise DartsError("both --api-key and --api-key-file are given", "give one: --api-key-file keeps it out of ps")
    if file is not None:
        return _keys_from_file(file, "--api-key-file")
    if flag is not None:
        key = _non_blank(flag, "--api-key")
        logger.warning("--api-key shows the key to every user of this machine (ps, /proc); prefer --api-key-file "
                       "or %s", API_KEY_ENV)
        return ApiKeys(((_unnamed(1), key),))
    if API_KEY_ENV in os.environ:
        return ApiKeys(((_unnamed(1), _non_blank(os.environ[API_KEY_ENV], API_KEY_ENV)),))
    if configured_file is not None:
        return _keys_from_file(configured_file, "serve.api_key_file")
    return None


def _unnamed(number: int) -> str:
    return f"key-{number}"


def _keys_from_file(file: Path, source: str) -> ApiKeys:
    """A key per line: `KEY`, or `NAME KEY` to name its client (else key-N, N its place among the keys); blank
    lines and lines starting with # are skipped."""
    try:
        lines = Path(file).expanduser().read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise DartsError(f"cannot read the API key file {file} ({source}): {error}",
                         "pass a readable text file holding a key per line (KEY, or NAME KEY)") from None
    clients: list[tuple[str, str]] = []
    for number, line in enumerate(lines, 1):
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        if len(fields) > 2:
            raise DartsError(f"{file}, line {number}, has {len(fields)} words ({source})",
                             "write a key per line: KEY, or NAME KEY (a key has no spaces)")
        name, key = fields if len(fields) == 2 else (_unnamed(len(clients) + 1), fields[0])
        if any(name == other for other, _ in clients) or any(key == other for _, other in clients):
            raise DartsError(f"{file}, line {number}, repeats a client name or a key ({source})",
                             "give each client a key and a name of its own")
        clients.append((name, key))
    if not clients:
        raise DartsError(f"the API key file {file} ({source}) holds no key", "write a key per line: KEY, or NAME KEY")
    return ApiKeys(tuple(clients))


def _non_blank(key: str, source: str) -> str:
    if not key.strip():
        raise DartsError(f"{source} is set but blank: an empty key would serve without one",
                         f"give the key, or unset {source} to serve without a key (on 127.0.0.1)")
    return key.strip()


def warn_if_exposed(host: str, api_key: ApiKeys | None) -> None:
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
