"""The MoE's health in any training or inference loop: per layer and step the load per expert, its
balance, dead experts, drops, the router's entropy, the balancing bias, the plan that ran, the
bytes sent and the all-to-all's share of the step; sinks that write it (JSONL, CSV, TensorBoard)
and alerts that say what went wrong and which setting helps.

``monitor = MoEMonitor(model)``, then ``monitor.step()`` once per step on every rank.
"""

from moeflow.metrics.alerts import Alert, HealthRules
from moeflow.metrics.health import LayerHealth, StepHealth
from moeflow.metrics.monitor import MoEMonitor
from moeflow.metrics.sinks import CsvSink, JsonlSink, MetricsSink, TensorBoardSink

__all__ = ["Alert", "CsvSink", "HealthRules", "JsonlSink", "LayerHealth", "MetricsSink", "MoEMonitor", "StepHealth",
           "TensorBoardSink"]
