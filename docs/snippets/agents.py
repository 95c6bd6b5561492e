"""agents.py: one agent definition for every engine. The model is scripted, so no API key is needed."""

from pydantic_ai import ModelResponse, TextPart, ToolCallPart
from pydantic_ai.capabilities import Capability
from pydantic_ai.messages import ModelMessage, ToolReturnPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from durable_capabilities import DurableAgent

ORDERS = {'ABC-123': 'shipped on 2026-04-28 via UPS', 'DEF-456': 'delivered on 2026-04-20'}

orders = Capability(
    id='orders',
    description='Use for order tracking or any question with an order id.',
    instructions='Quote the order id when you answer.',
    defer_loading=True,
)


@orders.tool_plain
def order_status(order_id: str) -> str:
    """Look up the shipping status of an order."""
    return ORDERS.get(order_id, f'no order {order_id}')


def scripted(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    """Stands in for an LLM: load `orders`, call `order_status`, then answer."""
    returned = {p.tool_name: p.content for m in messages for p in m.parts if isinstance(p, ToolReturnPart)}
    if 'load_capability' not in returned:
        return ModelResponse(parts=[ToolCallPart('load_capability', {'id': 'orders'})])
    if 'order_status' not in returned:
        return ModelResponse(parts=[ToolCallPart('order_status', {'order_id': 'ABC-123'})])
    return ModelResponse(parts=[TextPart(f"Order ABC-123 was {returned['order_status']}.")])


assistant = DurableAgent(
    'assistant',
    FunctionModel(scripted),  # or a model name, such as 'openai-responses:gpt-5.4'
    instructions='You are a customer-support agent.',
    capabilities=[orders],
)
