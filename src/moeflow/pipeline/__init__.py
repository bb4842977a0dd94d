"""Pipeline parallelism: a model in stages over the ``pp`` dimension of a mesh, run by
``torch.distributed.pipelining``'s schedules, with the MoE parts moeflow adds (the stages' aux
losses in the backward, the tied embedding across stages)."""

from moeflow.pipeline.build import Pipeline, pipeline_stages
from moeflow.pipeline.schedules import SCHEDULES, schedule_named
from moeflow.pipeline.split import StageSplit
from moeflow.pipeline.stage import TransformerStage

__all__ = ["SCHEDULES", "Pipeline", "StageSplit", "TransformerStage", "pipeline_stages", "schedule_named"]
