"""Temporal: the tool spans of `telemetry` from a worker interceptor (the tool activities are upstream's).

Each execution of a `..._call_tool` activity (every attempt, in whichever worker runs it) is one
`durcap.tool_call` (or `durcap.capability_load`) span with its attempt (`activity.info().attempt`), in the run's
trace (`telemetry.trace_id(workflow id)`). Activities run only when executed, never on replay, so a replayed workflow
task emits none. The model request and store spans come from inside the units themselves (`telemetry.TelemetryModel`,
the conversation units).
"""

from __future__ import annotations

from typing import Any

from temporalio import activity
from temporalio.worker import ActivityInboundInterceptor, ExecuteActivityInput, Interceptor

from ... import telemetry


class ToolSpans(Interceptor):
    """The worker interceptor that `make_worker` adds when telemetry is on (`telemetry.enabled()`)."""

    def intercept_activity(self, next: ActivityInboundInterceptor) -> ActivityInboundInterceptor:
        return _ToolSpanInbound(next)


class _ToolSpanInbound(ActivityInboundInterceptor):
    async def execute_activity(self, input: ExecuteActivityInput) -> Any:
        if not activity.info().activity_type.endswith('call_tool'):
            return await self.next.execute_activity(input)
        params = input.args[0] if input.args else None
        kind = activity.info().activity_type
        name = getattr(params, 'name', None) or kind
        args = getattr(params, 'tool_args', None)
        # `{agent}__toolset__{toolset id}__call_tool`: the toolset id of a capability's toolset is the capability's id
        capability = kind.split('__toolset__', 1)[1].rsplit('__call_tool', 1)[0] if '__toolset__' in kind else None
        with telemetry.tool_unit(name, args if isinstance(args, dict) else None,
                                 capability=capability if capability and capability != '<agent>' else None):
            return await self.next.execute_activity(input)
