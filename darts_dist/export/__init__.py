"""Export: the corrected model leaves darts-dist as a Hugging Face folder that transformers loads alone
(`--format hf`), or as its correction to put on the merged model (`--format correction`)."""

from darts_dist.export.folders import FORMATS, export_model
from darts_dist.export.source import ExportSource, read_source

__all__ = ["FORMATS", "ExportSource", "export_model", "read_source"]
