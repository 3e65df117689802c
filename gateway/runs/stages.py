"""The stages of a run's pipeline, chosen for each run from its request and its tenant's policy
(design §3). Order matters: tool calls are made whole first, so the safety window sees a
choice's text and knows where a call interrupts it.
"""

from __future__ import annotations

from gateway.metrics import GatewayMetrics
from gateway.runs.pipeline import Stage
from gateway.runs.spec import RunSpec
from gateway.runs.tool_calls import tool_call_stage
from safety.moderation import ModerationClient
from safety.window import SafetyWindow


def build_stages(
    spec: RunSpec, metrics: GatewayMetrics, moderation: ModerationClient | None = None
) -> list[Stage]:
    stages: list[Stage] = []
    if (tools := tool_call_stage(spec.chat)) is not None:
        stages.append(tools)
    if spec.safety is not None:
        stages.append(SafetyWindow(spec.safety, spec.chat.n, metrics.safety, moderation))
    return stages
