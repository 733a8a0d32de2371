"""Serving: what is served (`model`), the OpenAI wire format (`openai_api`), the checks before the model
(`limits`, `access`), the HTTP ingress, the deployment, its metrics, the app (`builder`) and running it (`runner`).

`darts_dist.serve:app_builder` is the import path Serve's config files name (jobs/serve.yaml).
"""

from darts_dist.serve.builder import app_builder

__all__ = ["app_builder"]
