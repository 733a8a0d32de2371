"""darts-dist: merge fine-tuned decoder LLMs and repair the merge with DARTS, on Ray."""

__version__ = "0.2.0"
