"""`engines.loaded_capabilities_in`: which capabilities a run loaded, read from its messages in every form an engine
keeps them (message objects, message JSON, one JSON string, a lone model response)."""

from __future__ import annotations

from pydantic_ai.messages import (
    ModelMessagesTypeAdapter,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_core import to_json

from durable_capabilities.engines._adapter import loaded_capabilities_in


def _messages() -> list[object]:
    look_alike = {'part_kind': 'tool-call', 'tool_name': 'load_capability', 'args': {'id': 'not-loaded'}}
    return [
        ModelRequest(parts=[UserPromptPart('refund order 7')]),
        ModelResponse(parts=[ToolCallPart('load_capability', {'id': 'orders'}, tool_call_id='c1')]),
        ModelRequest(parts=[ToolReturnPart('load_capability', 'loaded', tool_call_id='c1')]),
        ModelResponse(parts=[TextPart('checking'), ToolCallPart('load_capability', '{"id": "refund-policy"}', tool_call_id='c2'),
                             ToolCallPart('order_status', {'order_id': '7'}, tool_call_id='c3')]),
        # A tool's result that merely holds something shaped like the call: not a load.
        ModelRequest(parts=[ToolReturnPart('order_status', {'history': [look_alike]}, tool_call_id='c3')]),
        ModelResponse(parts=[ToolCallPart('load_capability', {'id': 'orders'}, tool_call_id='c4')]),
    ]


def test_every_form_gives_the_loads_in_order_once_each_and_ignores_look_alikes_in_tool_results() -> None:
    messages = _messages()
    as_json = ModelMessagesTypeAdapter.dump_python(messages, mode='json')  # type: ignore[arg-type]
    expected = ['orders', 'refund-policy']
    assert loaded_capabilities_in(messages) == expected  # message objects (DBOS step outputs)
    assert loaded_capabilities_in([as_json]) == expected  # message JSON (Temporal's workflow result, the store)
    assert loaded_capabilities_in([to_json(as_json).decode()]) == expected  # one JSON string (the Prefect flow's result)
    assert loaded_capabilities_in([m for m in as_json if m['kind'] == 'response']) == expected  # activity results
    assert loaded_capabilities_in([messages[1].parts[0]]) == ['orders']  # a lone tool-call part
    assert loaded_capabilities_in([{'output': 'x', 'new_messages': as_json}]) == expected  # a container's payload
    assert loaded_capabilities_in([None, 'text', 3, []]) == []
