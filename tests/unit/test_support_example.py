"""The seed's support agent (examples/support) end to end, in-process, on the local engine.

Model: every run here uses the scripted `FunctionModel` `SupportScript` (model name
`scripted-support`, examples/support/scripted.py); no provider is called. The script decides each
step from the messages it receives, so the assertions below are about what pydantic-ai really
showed it (tools offered, instructions, model settings, capability instructions delivered) and what
really happened (tool side effects counted in the `Store` deps).
"""

from __future__ import annotations

import asyncio
import importlib.util
from typing import Any

import pytest
from pydantic_ai import Agent
from pydantic_ai.messages import (
    InstructionDeltaPart,
    ModelMessage,
    ModelMessagesTypeAdapter,
    ModelRequest,
    ModelResponse,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.function import FunctionModel

from durable_capabilities import DurableAgent, validate_together
from examples.support import agent as support_module
from examples.support.agent import (
    SKILLS_DIR,
    AccountSecurity,
    Store,
    make_store,
    make_support,
    security_tools,
    support,
)
from examples.support.scripted import SCRIPTED_MODEL_NAME, SupportScript
from tests._helpers import ROOT

CATALOG = {
    'orders': 'Use for order tracking, delivery status, or questions involving an order ID.',
    'account-security': 'Use for suspicious logins, account takeover, or session revocation.',
    'refund-policy': 'Read before issuing refunds. Eligibility rules and approval limits.',
    'returns': 'Use for returning or exchanging an item, return labels, or the return window.',
    'shipping-delays': 'Use when a package is late, stuck in transit, or marked delivered but not received.',
    'warranty': 'Use for defective or broken items and warranty claims within the first year.',
}


def run(agent: DurableAgent[Any, Any], prompt: str, store: Store, history: list[ModelMessage] | None = None) -> Any:
    return asyncio.run(agent.run(prompt, deps=store, message_history=history))


def tool_returns(messages: list[ModelMessage], tool: str) -> list[ToolReturnPart]:
    return [
        p for m in messages if isinstance(m, ModelRequest) for p in m.parts
        if isinstance(p, ToolReturnPart) and p.tool_name == tool
    ]


def tool_calls(messages: list[ModelMessage], tool: str) -> list[ToolCallPart]:
    return [
        p for m in messages if isinstance(m, ModelResponse) for p in m.parts
        if isinstance(p, ToolCallPart) and p.tool_name == tool
    ]


def skill_body(name: str) -> str:
    return (SKILLS_DIR / f'{name}.md').read_text().split('---', 2)[2].strip()


def model_names(messages: list[ModelMessage]) -> set[str | None]:
    return {m.model_name for m in messages if isinstance(m, ModelResponse)}


# ---- the definition ---------------------------------------------------------------------------


def test_leaf_ids_and_report_of_the_support_definition() -> None:
    """Model: scripted FunctionModel. Every leaf has its capability's id, nothing to report."""
    assert support.leaf_ids() == {
        'orders': ['orders'],
        'account-security': ['account-security'],
        'refund-policy': ['refund-policy'],
        'returns': ['returns'],
        'shipping-delays': ['shipping-delays'],
        'warranty': ['warranty'],
    }
    report = support.report()
    assert report.errors == [], report.to_text()
    assert report.problems == [], report.to_text()
    assert support.name == 'support'
    assert support.capability_ids() == list(CATALOG)  # RunbookRequired is always on and has no id
    # The module-level toolset is still the user's object, id-less and untouched.
    assert security_tools.id is None
    assert list(security_tools.tools) == ['revoke_sessions']
    assert isinstance(support.model, FunctionModel)
    assert support.model.model_name == SCRIPTED_MODEL_NAME


def test_make_support_takes_a_provider_model_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """Model: none is called; only the definition's model is checked."""
    assert make_support('openai-responses:gpt-5.4').model == 'openai-responses:gpt-5.4'
    monkeypatch.setenv('SUPPORT_MODEL', 'anthropic:claude-sonnet-4-6')
    assert make_support().model == 'anthropic:claude-sonnet-4-6'
    monkeypatch.delenv('SUPPORT_MODEL')
    assert isinstance(make_support().model, FunctionModel)


def test_agent_module_loads_from_its_path() -> None:
    """Model: scripted FunctionModel. `durcap check examples/support/agent.py:support` imports it by path."""
    spec = importlib.util.spec_from_file_location('support_by_path', ROOT / 'examples' / 'support' / 'agent.py')
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert isinstance(module.support, DurableAgent)
    assert module.support.leaf_ids() == support.leaf_ids()
    assert module.support.report().ok


# ---- "Where is my order?": orders only --------------------------------------------------------


def test_order_question_loads_orders_only() -> None:
    """Model: scripted FunctionModel. Turn 1 sees the catalog and `load_capability`, then `order_status`."""
    script = SupportScript()
    store = make_store()
    result = run(make_support(script), 'Where is order ABC-123?', store)

    assert result.output == (
        'Order ABC-123: Blue denim jacket (size M): shipped 2026-04-28 via UPS, arriving 2026-05-02.'
    )
    first, second, third = script.requests
    # Request 1: only the framework's loader and the always-on agent tool; the catalog in the instructions.
    assert sorted(first.tools) == ['issue_refund', 'load_capability']
    assert first.instructions is not None
    assert first.instructions.startswith('You are a customer-support agent for an e-commerce store.')
    for cap_id, description in CATALOG.items():
        assert f'- {cap_id}: {description}' in first.instructions
    assert 'Quote the order ID' not in first.instructions
    assert first.context == {}
    assert first.response == 'load_capability(orders)'
    # Request 2: the loaded capability's tool and instructions, nothing of the other workflows.
    assert sorted(second.tools) == ['issue_refund', 'load_capability', 'order_status']
    assert second.context == {'orders': 'Quote the order ID and item name when discussing an order.'}
    assert second.response == "order_status(order_id='ABC-123')"
    assert third.response.startswith('text: Order ABC-123')
    # No account-security: no raised reasoning effort, the approval hook never ran.
    assert all(r.model_settings is None or 'extra_body' not in r.model_settings for r in script.requests)
    assert store.approvals == [] and store.revoked == [] and store.refunds == []
    assert model_names(result.all_messages()) == {SCRIPTED_MODEL_NAME}


# ---- "Someone is logging into my account": account-security ------------------------------------


def test_account_security_gate_is_on_by_default() -> None:
    """Model: scripted FunctionModel. The support example's `revoke_sessions` needs a person's approval by default:
    the run ends with the call in `DeferredToolRequests` (nothing revoked); continued with the approval
    (`DeferredToolResults`), the call runs once through the hook."""
    from pydantic_ai import DeferredToolRequests, DeferredToolResults

    assert AccountSecurity().require_approval
    agent, store = make_support(SupportScript()), make_store()
    prompt = 'Someone keeps trying to log into my account acct-42 from abroad.'
    first = asyncio.run(agent.run(prompt, deps=store, output_type=[str, DeferredToolRequests]))
    assert isinstance(first.output, DeferredToolRequests)
    [call] = first.output.approvals
    assert (call.tool_name, call.args_as_dict()) == ('revoke_sessions', {'account_id': 'acct-42'})
    assert store.revoked == [] and store.approvals == []
    done = asyncio.run(agent.run(deps=store, message_history=first.all_messages(), output_type=[str, DeferredToolRequests],
                                 deferred_tool_results=DeferredToolResults(approvals={call.tool_call_id: True})))
    assert isinstance(done.output, str) and done.output.startswith('Revoked sessions for acct-42.')
    assert store.revoked == ['acct-42']
    assert store.approvals == [('revoke_sessions', {'account_id': 'acct-42'})]


def test_only_the_security_tools_wait_for_a_person_after_account_security_is_loaded() -> None:
    """Model: scripted FunctionModel. The gate asks a person about `revoke_sessions` only: once `account-security` is
    loaded (and the revocation approved), a later turn's read-only calls (`load_capability`, `order_status`) run
    without an approval request (before the fix every tool call of the conversation asked, and a local run looped on
    denied `load_capability` calls forever)."""
    from pydantic_ai import DeferredToolRequests, DeferredToolResults

    agent, store = make_support(SupportScript()), make_store()
    first = asyncio.run(agent.run('Someone keeps trying to log into my account acct-42 from abroad.', deps=store,
                                  output_type=[str, DeferredToolRequests]))
    assert isinstance(first.output, DeferredToolRequests)
    [call] = first.output.approvals
    done = asyncio.run(agent.run(deps=store, message_history=first.all_messages(), output_type=[str, DeferredToolRequests],
                                 deferred_tool_results=DeferredToolResults(approvals={call.tool_call_id: True})))
    assert store.revoked == ['acct-42']

    second = asyncio.run(agent.run('Where is order ABC-123?', deps=store, message_history=done.all_messages(),
                                   output_type=[str, DeferredToolRequests]))
    assert isinstance(second.output, str), second.output
    assert second.output.startswith('Order ABC-123: Blue denim jacket')
    # the hook still saw (and recorded) the later calls: they passed it without a person
    assert store.approvals == [
        ('revoke_sessions', {'account_id': 'acct-42'}),
        ('load_capability', {'id': 'orders'}),
        ('order_status', {'order_id': 'ABC-123'}),
    ]


def test_a_local_run_denies_the_gated_call_at_once() -> None:
    """Model: scripted FunctionModel. On the local engine (`durcap run --engine local`) nothing can wait for a person:
    the gated `revoke_sessions` is denied at once with a reason the model sees, the user is told in one line, and the
    run completes without revoking anything."""
    from durable_capabilities import runner
    from durable_capabilities.engines.local import LOCAL_DENIAL

    store, lines = make_store(), []
    report = asyncio.run(runner.run(make_support(SupportScript()), 'Someone keeps trying to log into my account acct-42 '
                                    'from abroad.', engine='local', deps=store, notify=lines.append))
    assert store.revoked == [] and store.approvals == []
    assert lines == ['local run: revoke_sessions needs approval, which only a durable engine waits for: denied (run it '
                     'with --engine dbos, temporal or prefect, then `durcap approve`)']
    [denied] = tool_returns(report.new_messages, 'revoke_sessions')
    assert denied.content == LOCAL_DENIAL
    assert 'escalated your account to our security team' in report.output


# The tests below exercise the hook's own record-and-block path: the person's gate is turned off
# (`require_approval=False`); the durable gate is tested in tests/engines/test_approvals.py.


def test_suspicious_login_loads_account_security_bundle() -> None:
    """Model: scripted FunctionModel. Loading account-security brings its tool, settings and hook together."""
    script = SupportScript()
    store = make_store()
    result = run(make_support(script, require_approval=False), 'Someone keeps trying to log into my account acct-42 from abroad.', store)

    assert result.output.startswith('Revoked sessions for acct-42.')
    first, second, third = script.requests
    assert 'revoke_sessions' not in first.tools
    assert first.model_settings is None or 'extra_body' not in first.model_settings
    assert first.response == 'load_capability(account-security)'
    assert 'revoke_sessions' in second.tools
    assert second.context['account-security'] == 'Confirm the customer identity before revoking sessions.'
    # Model settings of the deferred capability apply only from the request after the load.
    assert second.model_settings is not None
    assert second.model_settings['extra_body'] == {'reasoning_effort': 'high'}
    assert third.model_settings is not None and third.model_settings['extra_body'] == {'reasoning_effort': 'high'}
    # The tool ran once, through the approval hook.
    assert store.revoked == ['acct-42']
    assert store.approvals == [('revoke_sessions', {'account_id': 'acct-42'})]
    assert len(tool_returns(result.all_messages(), 'revoke_sessions')) == 1


def test_approval_hook_blocks_a_denied_tool() -> None:
    """Model: scripted FunctionModel. The hook raises for a denied tool: it runs, the tool does not."""
    script = SupportScript()
    store = make_store()
    store.denied_tools.add('revoke_sessions')
    result = run(make_support(script, require_approval=False), 'My account acct-7 was hacked, please log everyone out.', store)

    assert store.approvals == [('revoke_sessions', {'account_id': 'acct-7'})]
    assert store.revoked == []
    [bounced] = tool_returns(result.all_messages(), 'revoke_sessions')
    assert bounced.outcome == 'retried'
    assert 'operator denied' in str(bounced.content)
    assert 'escalated' in result.output


# ---- read-before-act: RunbookRequired -----------------------------------------------------------


def test_refund_is_bounced_until_the_refund_policy_is_loaded() -> None:
    """Model: scripted FunctionModel. The first `issue_refund` is sent back; the refund happens once, after the load."""
    script = SupportScript()
    store = make_store()
    result = run(make_support(script), 'Please refund $40 for order ABC-123, the jacket arrived torn.', store)
    messages = result.all_messages()

    assert [r.response for r in script.requests] == [
        "issue_refund(order_id='ABC-123', amount=40.0)",
        'load_capability(refund-policy)',
        "issue_refund(order_id='ABC-123', amount=40.0)",
        'text: Refund of $40.00 issued for ABC-123. It will reach your original payment method in 5-7 business days.',
    ]
    # `issue_refund` is offered from turn 1 (agent-level tool).
    assert 'issue_refund' in script.requests[0].tools
    bounced, issued = tool_returns(messages, 'issue_refund')
    assert bounced.outcome == 'retried'  # pydantic-ai 2.68: ModelRetry from a hook is a retried ToolReturnPart
    assert bounced.content == (
        "Call the `load_capability` tool with `id='refund-policy'` and follow its guidance before calling `issue_refund`."
    )
    assert issued.outcome == 'success'
    assert issued.content == 'Refund of $40.00 issued for ABC-123.'
    assert store.refunds == [('ABC-123', 40.0)]
    assert script.requests[2].context['refund-policy'].startswith('Refunds over $500 require manager approval.')


def test_refund_over_the_limit_follows_the_policy_it_read() -> None:
    """Model: scripted FunctionModel. After reading the policy the model escalates instead of refunding."""
    script = SupportScript()
    store = make_store()
    result = run(make_support(script), 'I want a refund of $800 for order GHI-789.', store)

    assert store.refunds == []
    assert 'needs manager approval' in result.output
    assert [r.response.split('(')[0] for r in script.requests[:2]] == ['issue_refund', 'load_capability']
    assert len(tool_calls(result.all_messages(), 'issue_refund')) == 1


# ---- skills -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ('prompt', 'skill'),
    [
        ('I would like to return the jacket from DEF-456, it does not fit.', 'returns'),
        ('My package is late and looks stuck in transit.', 'shipping-delays'),
        ('The espresso machine is broken after two weeks.', 'warranty'),
    ],
)
def test_skill_body_is_delivered_when_loaded(prompt: str, skill: str) -> None:
    """Model: scripted FunctionModel. A skill's body reaches the model only after `load_capability`."""
    script = SupportScript()
    store = make_store()
    result = run(make_support(script), prompt, store)
    messages = result.all_messages()
    body = skill_body(skill)

    first, second = script.requests
    assert first.response == f'load_capability({skill})'
    assert body not in (first.instructions or '')
    assert first.context == {}
    # pydantic-ai 2.68 answers the call with a confirmation and delivers the instructions on the
    # next request, recorded in history as an InstructionDeltaPart for `capability:<id>`.
    [loaded] = tool_returns(messages, 'load_capability')
    assert loaded.outcome == 'success'
    assert loaded.content == {'message': f"Capability '{skill}' loaded. Its instructions, if any, follow."}
    deltas = [
        p for m in messages if isinstance(m, ModelRequest) for p in m.parts if isinstance(p, InstructionDeltaPart)
    ]
    assert [(str(d.id), d.content) for d in deltas] == [(f'capability:{skill}', body)]
    assert second.context == {skill: body}
    assert result.output.endswith(body.splitlines()[0])


# ---- resume and replay --------------------------------------------------------------------------


def test_resumed_conversation_keeps_loaded_capabilities() -> None:
    """Model: scripted FunctionModel. Turn 2 in a new agent object, from a JSON round-tripped history."""
    store = make_store()
    first = run(make_support(SupportScript()), 'Where is order ABC-123?', store)
    stored = ModelMessagesTypeAdapter.dump_json(first.all_messages())

    script = SupportScript()  # another "process": a fresh definition and model
    history = ModelMessagesTypeAdapter.validate_json(stored)
    second = run(make_support(script), 'Thanks! And where is order DEF-456?', store, history)

    assert second.output == 'Order DEF-456: Trail running shoes (EU 42): delivered 2026-04-20, signed for by J. Park.'
    # orders stays loaded from history: its tool is offered on the very first request of turn 2 and
    # the model never reloads it.
    assert 'order_status' in script.requests[0].tools
    assert script.requests[0].response == "order_status(order_id='DEF-456')"
    assert len(tool_calls(second.all_messages(), 'load_capability')) == 1  # the one from turn 1
    assert [r.response for r in script.requests][-1].startswith('text: Order DEF-456')


def test_account_security_stays_active_in_the_resumed_conversation() -> None:
    """Model: scripted FunctionModel. Once loaded, the hook gates every later tool call and the settings stay on."""
    store = make_store()
    first = run(make_support(SupportScript(), require_approval=False), 'Suspicious login on acct-9, please revoke sessions.', store)
    assert store.approvals == [('revoke_sessions', {'account_id': 'acct-9'})]

    script = SupportScript()
    run(make_support(script, require_approval=False), 'Where is order ABC-123?', store, first.all_messages())
    assert store.approvals == [
        ('revoke_sessions', {'account_id': 'acct-9'}),
        ('load_capability', {'id': 'orders'}),
        ('order_status', {'order_id': 'ABC-123'}),
    ]
    assert all(r.model_settings and r.model_settings['extra_body'] == {'reasoning_effort': 'high'} for r in script.requests)
    assert 'revoke_sessions' in script.requests[0].tools


def test_refund_policy_loaded_earlier_lets_the_refund_through_at_once() -> None:
    """Model: scripted FunctionModel. RunbookRequired reads the loaded set rebuilt from history."""
    store = make_store()
    first = run(make_support(SupportScript()), 'Please refund $25 for order DEF-456.', store)
    assert store.refunds == [('DEF-456', 25.0)]

    script = SupportScript()
    second = run(make_support(script), 'And refund $15 for order ABC-123 too.', store, first.all_messages())
    assert [r.response for r in script.requests] == [
        "issue_refund(order_id='ABC-123', amount=15.0)",
        'text: Refund of $15.00 issued for ABC-123. It will reach your original payment method in 5-7 business days.',
    ]
    assert 'refund-policy' in script.requests[0].context  # the policy read in turn 1, still in context
    assert store.refunds == [('DEF-456', 25.0), ('ABC-123', 15.0)]
    new = second.new_messages()
    assert [p.outcome for p in tool_returns(new, 'issue_refund')] == ['success']


def test_script_is_a_function_of_the_messages() -> None:
    """Model: scripted FunctionModel. Two independent runs produce identical responses, call ids included."""

    def responses(prompt: str) -> list[Any]:
        result = run(make_support(SupportScript()), prompt, make_store())
        return [
            [(type(p).__name__, getattr(p, 'tool_name', None), getattr(p, 'args', None), getattr(p, 'tool_call_id', None), getattr(p, 'content', None)) for p in m.parts]
            for m in result.all_messages()
            if isinstance(m, ModelResponse)
        ]

    prompt = 'Please refund $40 for order ABC-123.'
    assert responses(prompt) == responses(prompt)

    # Replaying a recorded history to the script gives the same next step as the live run did.
    script = SupportScript()
    result = run(make_support(script), prompt, make_store())
    live = [r.response for r in script.requests]
    messages = result.all_messages()
    replay = SupportScript()
    agent = make_support(replay).build('local')
    for cut in range(1, len(messages)):
        if isinstance(messages[cut], ModelResponse):
            asyncio.run(_one_request(agent, messages[:cut]))
    assert [r.response for r in replay.requests] == live


async def _one_request(agent: Agent[Any, Any], history: list[ModelMessage]) -> None:
    """Resume `history` (which ends in a request) for one model request, then stop."""
    async with agent.iter(None, deps=make_store(), message_history=history) as run_:
        async for node in run_:
            if Agent.is_call_tools_node(node):
                break


def test_streaming_requests_follow_the_same_script() -> None:
    """Model: scripted FunctionModel (its stream function). An event handler makes every request streamed."""
    script = SupportScript()
    store = make_store()
    events: list[Any] = []

    async def handler(ctx: Any, stream: Any) -> None:
        async for event in stream:
            events.append(event)

    result = asyncio.run(make_support(script).run('Where is order GHI-789?', deps=store, event_stream_handler=handler))
    assert result.output == 'Order GHI-789: Espresso machine: awaiting stock, expected to ship 2026-05-10.'
    assert [r.response.split('(')[0] for r in script.requests] == [
        'load_capability', 'order_status', 'text: Order GHI-789: Espresso machine: awaiting stock, expected to ship 2026-05-10.'
    ]
    assert events


def test_module_level_support_runs() -> None:
    """Model: the module's scripted FunctionModel (`examples.support.agent.script`)."""
    before = len(support_module.script.requests)
    store = make_store()
    result = asyncio.run(support.run('Where is order ABC-123?', deps=store))
    assert result.output.startswith('Order ABC-123: Blue denim jacket')
    assert len(support_module.script.requests) == before + 3


# ---- one module-level toolset, two agents --------------------------------------------------------


def test_shared_security_tools_work_for_two_agents() -> None:
    """Model: scripted FunctionModel (one per agent). Both agents share the module-level `security_tools`."""
    script_a, script_b = SupportScript(), SupportScript()
    agent_a = DurableAgent('security-desk', script_a.model, deps_type=Store,
                           capabilities=[AccountSecurity(require_approval=False)])
    agent_b = make_support(script_b, name='support-eu', require_approval=False)
    assert agent_a.leaf_ids() == {'account-security': ['account-security']}
    assert agent_b.leaf_ids()['account-security'] == ['account-security']
    assert validate_together([agent_a, agent_b]).ok

    store_a, store_b = make_store(), make_store()
    result_a = run(agent_a, 'Suspicious login on acct-1, please revoke sessions.', store_a)
    result_b = run(agent_b, 'Suspicious login on acct-2, please revoke sessions.', store_b)
    assert result_a.output.startswith('Revoked sessions for acct-1.')
    assert result_b.output.startswith('Revoked sessions for acct-2.')
    assert store_a.revoked == ['acct-1'] and store_b.revoked == ['acct-2']
    assert store_a.approvals == [('revoke_sessions', {'account_id': 'acct-1'})]
    assert store_b.approvals == [('revoke_sessions', {'account_id': 'acct-2'})]

    # Running the first agent again after the second was built still works, and the shared object
    # was never given an id.
    store_c = make_store()
    run(agent_a, 'Suspicious login on acct-3.', store_c)
    assert store_c.revoked == ['acct-3']
    assert security_tools.id is None


def test_shared_security_tools_build_for_temporal_where_upstream_alone_fails() -> None:
    """Model: scripted FunctionModel (not called). The seed's AccountSecurity on Temporal, two agents."""
    from pydantic_ai.durable_exec.temporal import TemporalDurability
    from pydantic_ai.exceptions import UserError

    with pytest.raises(UserError, match='unique `id`'):
        Agent(SupportScript().model, name='plain', deps_type=Store, capabilities=[AccountSecurity(), TemporalDurability()])

    for name in ('support-us', 'support-apac'):
        built = make_support(SupportScript(), name=name).build('temporal')
        assert built.name == name
    assert security_tools.id is None
