"""`darts-dist plan`: before any work starts, what each role of a run holds (from config.json files alone) and
whether a cluster has room for it. Sources → roles (`roles.py`) → fit (`cluster.py`)."""

from __future__ import annotations

from dataclasses import dataclass

from darts_dist.config import RunConfig
from darts_dist.plan.roles import (Role, calibration_roles, correction_parameters, driver_role, evaluation_roles,
                                   export_role, merge_roles, registration_roles, serving_role)
from darts_dist.plan.shapes import ModelShape, model_shape


@dataclass(frozen=True)
class Plan:
    merged: ModelShape
    experts: dict[str, ModelShape]
    roles: list[Role]
    correction_parameters: int

    @property
    def driver(self) -> Role:
        return next(role for role in self.roles if role.phase == "driver")

    @property
    def correction_share(self) -> float:
        """The correction's parameters as a share of the model's (the paper's "0.1%")."""
        return self.correction_parameters / self.merged.parameters


def build_plan(config: RunConfig) -> Plan:
    """Every role's memory for `config`; reads each model's config.json, no weights (the merge has the base's
    shape)."""
    merged = model_shape(config.sources.base)
    experts = {e.task: model_shape(e.path) for e in config.sources.experts}
    roles = [*merge_roles(config, experts), *calibration_roles(config, experts, merged),
             *evaluation_roles(config, experts, merged), *registration_roles(config, merged),
             serving_role(config.serving, merged, correction_parameters(config, merged)),
             driver_role(config, experts, merged), export_role(merged)]
    return Plan(merged, experts, roles, correction_parameters(config, merged))


__all__ = ["Plan", "Role", "build_plan"]
