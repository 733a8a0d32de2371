"""The import path that registered models logged by darts-dist 0.1 run: their copied pyfunc code imports these
names from here. New code imports `darts_dist.tracking.registry`; models logged since carry their own code."""

from darts_dist.tracking.registry import CORRECTIONS_ARTIFACT, MERGED_ARTIFACT, PARAM_DEFAULTS, ROUTER_ARTIFACT

__all__ = ["CORRECTIONS_ARTIFACT", "MERGED_ARTIFACT", "PARAM_DEFAULTS", "ROUTER_ARTIFACT"]
