"""A scripted support model: a `FunctionModel` that plays a realistic support conversation, no API key needed.

Every decision is a pure function of the messages it receives (the latest customer prompt and the
tool calls, returns and retries after it, plus which capabilities the history loaded), never of a
counter, so a run that is resumed from a stored history or replayed by a durable engine gets the
same next step. Tool call ids are derived from the history too.

What it does, per customer prompt:

- suspicious logins / account takeover (`acct-42`): load `account-security`, `revoke_sessions`, answer;
  if the approval hook blocks the call, answer that it escalated.
- a refund (`ABC-123`, `$40`): call `issue_refund` straight away; when `RunbookRequired` bounces the
  call, load the capability its retry message names, then (within the policy it just read: over
  $500 needs a manager) call `issue_refund` again, answer with the result.
- returns, shipping delays, warranty claims: load the matching skill, answer quoting its first rule.
- an order id (`ABC-123`): load `orders`, `order_status`, answer quoting the result.
- anything else: a plain answer asking for details.

It records each request it saw (tools offered, instructions, model settings, capability
instructions delivered so far) in `SupportScript.requests`.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    RetryPromptPart,
    SystemPromptPart,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_ai.models.function import AgentInfo, DeltaToolCall, DeltaToolCalls, FunctionModel

__all__ = ['SCRIPTED_MODEL_NAME', 'SeenRequest', 'SupportScript', 'capability_context']

SCRIPTED_MODEL_NAME = 'scripted-support'
LOAD = 'load_capability'

_CONTEXT_RE = re.compile(r'<pyai:context id="capability:([^"]+)">\n?(.*?)\n?</pyai:context>', re.S)
_ORDER_RE = re.compile(r'\b[A-Z]{3}-\d{3}\b')
_ACCOUNT_RE = re.compile(r'\bacct-[A-Za-z0-9-]+\b')
_AMOUNT_RE = re.compile(r'\$\s?(\d+(?:\.\d+)?)')
_RETRY_ID_RE = re.compile(r"`load_capability`[^`]*`id='([^']+)'`")

_INTENTS: list[tuple[str, tuple[str, ...]]] = [
    ('security', ('log in', 'login', 'logged in', 'log into', 'suspicious', 'hacked', 'takeover', 'sessions')),
    ('refund', ('refund',)),
    ('returns', ('return', 'exchange', 'send back', 'send it back')),
    ('shipping-delays', ('late', 'delay', 'stuck', "hasn't arrived", 'not arrived', 'not received')),
    ('warranty', ('broken', 'defect', 'warranty', 'stopped working')),
]


@dataclass(frozen=True)
class SeenRequest:
    """What one model request showed the model.

    Attributes:
        prompt: The customer prompt the request answers.
        tools: Names of the function tools offered, in order (`load_capability` included).
        instructions: The system instructions (base + the catalog of deferred capabilities).
        model_settings: The merged model settings of the request, as a dict.
        context: `{capability id: instructions}` delivered so far in the messages (loaded capabilities).
        response: What the script answered: `load_capability(orders)`, `order_status(...)`, `text: ...`.
    """

    prompt: str
    tools: list[str]
    instructions: str | None
    model_settings: dict[str, Any] | None
    context: dict[str, str]
    response: str


def capability_context(messages: list[ModelMessage], instructions: str | None = None) -> dict[str, str]:
    """`{capability id: text}` of every `<pyai:context id="capability:...">` block in `messages` (latest wins).

    pydantic-ai 2.68 delivers a loaded capability's instructions in the request after the
    `load_capability` return as such a block (a system note; for models without inline system
    prompts, `<system>`-tagged user text).
    """
    found: dict[str, str] = {}
    texts: list[str] = [instructions] if instructions else []
    for message in messages:
        if isinstance(message, ModelRequest):
            for part in message.parts:
                if isinstance(part, (UserPromptPart, SystemPromptPart)) and isinstance(part.content, str):
                    texts.append(part.content)
    for text in texts:
        for cap_id, body in _CONTEXT_RE.findall(text):
            if cap_id != 'deferred_capabilities':
                found[cap_id] = body.strip()
    return found


def _is_retry(part: object) -> bool:
    """A call sent back to the model: in 2.68 a `ToolReturnPart` whose outcome is not `'success'`
    (`ModelRetry` from a tool or hook gives `'retried'`); older histories hold a `RetryPromptPart`."""
    if isinstance(part, ToolReturnPart):
        return part.outcome != 'success'
    return isinstance(part, RetryPromptPart)


def _is_note(part: UserPromptPart) -> bool:
    return isinstance(part.content, str) and part.content.lstrip().startswith('<system>')


@dataclass
class _Turn:
    """The latest customer prompt and what happened since, read from the messages."""

    prompt: str
    since: list[ModelMessage]  # messages after the prompt's request
    loaded: set[str]  # capabilities the whole history loaded
    context: dict[str, str]
    step: int  # number of responses in the history: makes tool call ids deterministic

    def returns(self, tool: str) -> list[ToolReturnPart]:
        """Successful returns of `tool` since the prompt."""
        return [
            p for m in self.since if isinstance(m, ModelRequest) for p in m.parts
            if isinstance(p, ToolReturnPart) and p.tool_name == tool and p.outcome == 'success'
        ]

    def retries(self, tool: str) -> list[ToolReturnPart | RetryPromptPart]:
        """Calls of `tool` since the prompt that were sent back (`ModelRetry`, a hook, bad arguments)."""
        return [
            p for m in self.since if isinstance(m, ModelRequest) for p in m.parts
            if _is_retry(p) and p.tool_name == tool  # type: ignore[union-attr]
        ]

    def load_failed(self, cap_id: str) -> RetryPromptPart | None:
        for retry in self.retries(LOAD):
            text = retry.content if isinstance(retry.content, str) else json.dumps(retry.content, default=str)
            if repr(cap_id) in text and 'already' not in text:
                return retry
        return None


def _read_turn(messages: list[ModelMessage], instructions: str | None) -> _Turn:
    prompt, start = '', 0
    for index, message in enumerate(messages):
        if isinstance(message, ModelRequest):
            for part in message.parts:
                if isinstance(part, UserPromptPart) and not _is_note(part):
                    prompt = part.content if isinstance(part.content, str) else str(part.content)
                    start = index + 1
    calls: dict[str, str] = {}  # load_capability tool_call_id -> capability id
    loaded: set[str] = set()
    for message in messages:
        for part in message.parts:
            if isinstance(part, ToolCallPart) and part.tool_name == LOAD:
                cap_id = part.args_as_dict().get('id')
                if isinstance(cap_id, str):
                    calls[part.tool_call_id] = cap_id
            elif _is_retry(part) and part.tool_name == LOAD and part.tool_call_id in calls:  # type: ignore[union-attr]
                if 'already active' in str(part.content):  # type: ignore[union-attr]
                    loaded.add(calls[part.tool_call_id])  # type: ignore[union-attr]
            elif isinstance(part, ToolReturnPart) and part.tool_name == LOAD and part.tool_call_id in calls:
                loaded.add(calls[part.tool_call_id])
    context = capability_context(messages, instructions)
    loaded |= set(context)
    step = sum(isinstance(m, ModelResponse) for m in messages)
    return _Turn(prompt, messages[start:], loaded, context, step)


def _intent(prompt: str) -> str:
    lowered = prompt.lower()
    for name, words in _INTENTS:
        if any(word in lowered for word in words):
            return name
    return 'orders' if _ORDER_RE.search(prompt) else 'chat'


def _first_rule(text: str) -> str:
    return text.strip().splitlines()[0].strip()


@dataclass
class SupportScript:
    """The scripted support model and a log of what it saw.

    Use `script.model` (a `FunctionModel` named `scripted-support`, streaming supported) wherever a
    model goes; `script.requests` lists a `SeenRequest` per model request, in order.
    """

    requests: list[SeenRequest] = field(default_factory=list)
    model: FunctionModel = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.model = FunctionModel(self.respond, stream_function=self.stream, model_name=SCRIPTED_MODEL_NAME)

    # ---- FunctionModel entry points ----------------------------------------------------------

    def respond(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        turn = _read_turn(messages, info.instructions)
        parts = self._decide(turn, [t.name for t in info.function_tools])
        self.requests.append(
            SeenRequest(
                prompt=turn.prompt,
                tools=[t.name for t in info.function_tools],
                instructions=info.instructions,
                model_settings=dict(info.model_settings) if info.model_settings else None,
                context=turn.context,
                response=_summary(parts),
            )
        )
        return ModelResponse(parts=parts, model_name=SCRIPTED_MODEL_NAME)

    async def stream(self, messages: list[ModelMessage], info: AgentInfo) -> AsyncIterator[str | DeltaToolCalls]:
        response = self.respond(messages, info)
        for index, part in enumerate(response.parts):
            if isinstance(part, TextPart):
                yield part.content
            elif isinstance(part, ToolCallPart):
                yield {index: DeltaToolCall(part.tool_name, part.args_as_json_str(), tool_call_id=part.tool_call_id)}

    # ---- the script --------------------------------------------------------------------------

    def _decide(self, turn: _Turn, tools: list[str]) -> list[TextPart | ToolCallPart]:
        def call(tool: str, **args: Any) -> list[TextPart | ToolCallPart]:
            return [ToolCallPart(tool, args, tool_call_id=f'scripted-{turn.step}-{tool}')]

        def say(text: str) -> list[TextPart | ToolCallPart]:
            return [TextPart(text)]

        def ensure_loaded(cap_id: str) -> list[TextPart | ToolCallPart] | None:
            """A `load_capability` call when `cap_id` is not loaded yet; a text answer when loading failed."""
            if cap_id in turn.loaded:
                return None
            if (failed := turn.load_failed(cap_id)) is not None:
                return say(f'Sorry, I cannot open the {cap_id} workflow right now ({failed.content}).')
            return call(LOAD, id=cap_id)

        prompt = turn.prompt
        intent = _intent(prompt)
        order_id = next(iter(_ORDER_RE.findall(prompt)), None)

        if intent == 'security':
            account = next(iter(_ACCOUNT_RE.findall(prompt)), None)
            if account is None:
                return say('I can help secure your account. What is your account id (it starts with acct-)?')
            if turn.retries('revoke_sessions'):
                return say(
                    f'I could not revoke the sessions for {account} myself; I have escalated your account '
                    'to our security team, who will contact you within the hour.'
                )
            if done := turn.returns('revoke_sessions'):
                return say(f'{done[-1].content} Please change your password and turn on two-factor authentication.')
            if (step := ensure_loaded('account-security')) is not None:
                return step
            return call('revoke_sessions', account_id=account)

        if intent == 'refund':
            if order_id is None:
                return say('I can help with a refund. Which order is it (the id looks like ABC-123)?')
            amount_match = _AMOUNT_RE.search(prompt)
            amount = float(amount_match.group(1)) if amount_match else 0.0
            if done := turn.returns('issue_refund'):
                return say(f'{done[-1].content} It will reach your original payment method in 5-7 business days.')
            policy = turn.context.get('refund-policy', '')
            if amount > 500 and 'manager approval' in policy:
                return say(
                    f'A refund of ${amount:.2f} for {order_id} needs manager approval under our refund policy; '
                    'I have asked a manager to review it and we will email you within one business day.'
                )
            bounced = turn.retries('issue_refund')
            if len(bounced) >= 2:
                return say(f'Sorry, I could not issue the refund: {bounced[-1].content}')
            if bounced and (named := _RETRY_ID_RE.search(str(bounced[-1].content))):
                if (step := ensure_loaded(named.group(1))) is not None:
                    return step
            if 'issue_refund' not in tools:
                return say('Sorry, I cannot issue refunds in this chat.')
            return call('issue_refund', order_id=order_id, amount=amount)

        if intent in ('returns', 'shipping-delays', 'warranty'):
            if (step := ensure_loaded(intent)) is not None:
                return step
            guidance = turn.context.get(intent)
            if guidance is None:
                return say(f'Sorry, I could not find our {intent} guidance.')
            about = f' about {order_id}' if order_id else ''
            return say(f'Thanks for reaching out{about}. {_first_rule(guidance)}')

        if intent == 'orders' and order_id is not None:
            if done := turn.returns('order_status'):
                return say(f'Order {order_id}: {done[-1].content}')
            if (step := ensure_loaded('orders')) is not None:
                return step
            return call('order_status', order_id=order_id)

        return say('Happy to help! Could you tell me your order id or what happened?')


def _summary(parts: list[TextPart | ToolCallPart]) -> str:
    out = []
    for part in parts:
        if isinstance(part, TextPart):
            out.append(f'text: {part.content}')
        elif part.tool_name == LOAD:
            out.append(f'{LOAD}({part.args_as_dict().get("id")})')
        else:
            args = ', '.join(f'{k}={v!r}' for k, v in part.args_as_dict().items())
            out.append(f'{part.tool_name}({args})')
    return '; '.join(out)
