"""Credentials out of everything darts-dist writes for people to read: an MLflow server's basic auth written into
its URI (`http://user:password@host`) never reaches a report, a log line, an error or the tracking store's params
and artifacts. MLflow takes the same credentials from MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD, which
nothing here writes anywhere."""

from __future__ import annotations

import logging
import re
from typing import Any

HIDDEN = "***"
# scheme://userinfo@ (RFC 3986: userinfo holds no '/', '@' or whitespace); the scheme stays, so a reader still sees
# which server it was.
_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)[^/@\s\"']+@")


def redacted(text: str) -> str:
    """`text` with every URL's user:password replaced by HIDDEN."""
    return _USERINFO.sub(rf"\g<scheme>{HIDDEN}@", text)


def redacted_json(data: Any) -> Any:
    """`data` (a report, a config) with every string redacted, keys included."""
    if isinstance(data, str):
        return redacted(data)
    if isinstance(data, dict):
        return {redacted_json(key): redacted_json(value) for key, value in data.items()}
    if isinstance(data, (list, tuple)):
        return [redacted_json(value) for value in data]
    return data


class RedactingFilter(logging.Filter):
    """A handler's filter that redacts each record's message (its arguments merged in) before it is written."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = redacted(message)
        if clean != message:
            record.msg, record.args = clean, ()
        return True
