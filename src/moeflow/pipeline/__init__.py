"""Pipeline parallelism: a model in stages over the ``pp`` dimension of a mesh, run by
``torch.distributed.pipelining``'s schedules, with the MoE parts moeflow adds (the stages' aux
losses in the backward, the tied embedding across stages). Its names load on first use: settings
read :mod:`moeflow.pipeline.layout` without importing torch's pipeline runtime."""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "Pipeline": "moeflow.pipeline.build", "pipeline_stages": "moeflow.pipeline.build",
    "SCHEDULES": "moeflow.pipeline.layout", "schedule_named": "moeflow.pipeline.layout",
    "StageSplit": "moeflow.pipeline.split", "TransformerStage": "moeflow.pipeline.stage",
}

__all__ = ["SCHEDULES", "Pipeline", "StageSplit", "TransformerStage", "pipeline_stages", "schedule_named"]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'moeflow.pipeline' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
