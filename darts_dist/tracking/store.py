"""What every talk with an MLflow store shares: its settings for a block, and the errors of a store that is down."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import requests
import sqlalchemy.exc
from mlflow.exceptions import MlflowException

# A store that stops answering mid-run costs each request seconds, not MLflow's default minutes of back-off.
QUICK_REQUESTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
# What a tracking store that is down or refuses a request raises: MLflow's own errors, HTTP errors, SQL errors.
STORE_ERRORS = (MlflowException, requests.RequestException, sqlalchemy.exc.SQLAlchemyError, OSError)


@contextlib.contextmanager
def environment(**values: str) -> Iterator[None]:
    """Environment variables set for a block, then put back: MLflow reads its settings from them."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
