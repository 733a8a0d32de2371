"""Serving: the Ray Serve app (`app`), the OpenAI wire format (`openai_api`), and what is served (`model`).

`darts_dist.serve:app_builder` is the import path Serve's config files name (jobs/serve.yaml).
"""

from darts_dist.serve.app import app_builder

__all__ = ["app_builder"]
