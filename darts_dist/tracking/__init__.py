"""Tracking: MLflow runs and step metrics (`runs`), the model registry (`registry`), the pyfunc model."""
