"""The seed's multi-workflow support agent as one `DurableAgent` definition.

Workflows, each deferred until the model loads it:

- `orders`: instructions + a function tool (`order_status`), defined inline with `Capability`.
- `account-security`: instructions + a module-level, id-less `FunctionToolset` (`revoke_sessions`) +
  raised reasoning effort + an approval hook, bundled in one `AbstractCapability` subclass written
  exactly as the seed writes it (upstream alone fails on Temporal and Prefect here; `DurableAgent`
  gives the toolset the stable id `account-security` without touching the module-level object).
- `refund-policy`: a runbook the model must read before calling the always-on `issue_refund` tool,
  enforced by `RunbookRequired`.
- skills from `skills/*.md` (YAML front matter `id`, `description`; body = instructions).

The model is the scripted `SupportScript` (a `FunctionModel`, see `scripted.py`) unless
`SUPPORT_MODEL` names a provider model (`SUPPORT_MODEL=openai-responses:gpt-5.4`) or
`make_support(model=...)` is given one.

    $ durcap check examples/support/agent.py:support
"""

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic_ai import ApprovalRequired, ModelRetry, ModelSettings, RunContext
from pydantic_ai.capabilities import AbstractCapability, Capability
from pydantic_ai.models import Model
from pydantic_ai.toolsets import AgentToolset, FunctionToolset

from durable_capabilities import DurableAgent, RunbookRequired, load_skills

if __package__:
    from .scripted import SupportScript
else:  # loaded from its path (`durcap check examples/support/agent.py:support`): no parent package
    import importlib.util
    import sys

    _spec = importlib.util.spec_from_file_location('_support_scripted', Path(__file__).with_name('scripted.py'))
    assert _spec is not None and _spec.loader is not None
    _scripted = importlib.util.module_from_spec(_spec)
    sys.modules[_spec.name] = _scripted
    _spec.loader.exec_module(_scripted)
    SupportScript = _scripted.SupportScript

__all__ = [
    'SKILLS_DIR',
    'AccountSecurity',
    'Store',
    'issue_refund',
    'make_store',
    'make_support',
    'order_status',
    'orders',
    'refund_policy',
    'revoke_sessions',
    'script',
    'security_tools',
    'support',
]

SKILLS_DIR = Path(__file__).with_name('skills')


@dataclass
class Store:
    """Run dependencies: the shop's data plus a ledger of every side effect, so tests can count them.

    Attributes:
        orders: `{order id: status line}`, read by `order_status`.
        refunds: `(order id, amount)` per refund issued by `issue_refund`.
        revoked: Account ids whose sessions `revoke_sessions` revoked.
        approvals: `(tool name, args)` per tool call that reached the `account-security` approval hook.
        denied_tools: Tool names the approval hook blocks (an operator said no).
    """

    orders: dict[str, str]
    refunds: list[tuple[str, float]] = field(default_factory=list)
    revoked: list[str] = field(default_factory=list)
    approvals: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    denied_tools: set[str] = field(default_factory=set)


def make_store() -> Store:
    """Fresh deps with three orders and an empty ledger."""
    return Store(
        orders={
            'ABC-123': 'Blue denim jacket (size M): shipped 2026-04-28 via UPS, arriving 2026-05-02.',
            'DEF-456': 'Trail running shoes (EU 42): delivered 2026-04-20, signed for by J. Park.',
            'GHI-789': 'Espresso machine: awaiting stock, expected to ship 2026-05-10.',
        }
    )


# Workflow 1: instructions + function tool, defined inline.
orders = Capability[Store](
    id='orders',
    description='Use for order tracking, delivery status, or questions involving an order ID.',
    instructions='Quote the order ID and item name when discussing an order.',
    defer_loading=True,
)


@orders.tool
def order_status(ctx: RunContext[Store], order_id: str) -> str:
    """Look up shipping or delivery status for an order."""
    return ctx.deps.orders.get(order_id, f'No order found with id {order_id}.')


# Workflow 2: instructions + tool + per-step model settings + approval hook,
# all hidden until the model loads `account-security`.
security_tools = FunctionToolset[Store]()


@security_tools.tool
def revoke_sessions(ctx: RunContext[Store], account_id: str) -> str:
    """Revoke all active sessions for an account."""
    ctx.deps.revoked.append(account_id)
    return f'Revoked sessions for {account_id}.'


@dataclass
class AccountSecurity(AbstractCapability[Store]):
    """Account security: `revoke_sessions`, high reasoning effort, and a hook on every later tool call.

    Attributes:
        require_approval: A person must approve each call of this capability's own tools (`revoke_sessions`;
            `ApprovalRequired`; on by default, the seed's gate made real): a durable run waits for `durcap approve` /
            `durcap deny` (see docs/approvals.md); a local run ends with the call in `DeferredToolRequests`. The
            other tools of a run that loaded `account-security` (`order_status`, `issue_refund`, `load_capability`)
            pass the hook without a person. Off: the hook only records each call and blocks the tools in
            `Store.denied_tools`.
    """

    id: str = 'account-security'
    description: str = 'Use for suspicious logins, account takeover, or session revocation.'
    defer_loading: bool = True
    require_approval: bool = True

    def get_instructions(self) -> str:
        return 'Confirm the customer identity before revoking sessions.'

    def get_toolset(self) -> AgentToolset[Store]:
        return security_tools

    def get_model_settings(self) -> ModelSettings:
        # Raise reasoning effort just for sensitive workflows.
        return ModelSettings(extra_body={'reasoning_effort': 'high'})

    async def before_tool_execute(self, ctx, *, call, tool_def, args):
        # Approval gate: inspect the call and raise to block, active once the model has loaded `account-security`.
        # A person approves only this capability's own tools (`revoke_sessions`, the side effect the docs gate): the
        # hook sees every later tool call of the run, and read-only ones (`order_status`, `load_capability`) must not
        # wait for a person (nor loop on a local run's denial).
        if self.require_approval and tool_def.name in security_tools.tools and not ctx.tool_call_approved:
            raise ApprovalRequired()  # a durable run waits for a person's decision, then runs the call once
        ctx.deps.approvals.append((tool_def.name, dict(args)))
        if tool_def.name in ctx.deps.denied_tools:
            raise ModelRetry(f'An operator denied `{tool_def.name}`; escalate to the security team instead.')
        return args


# Read-before-act: `issue_refund` is visible from turn 1, but bounced until `refund-policy` is loaded.
refund_policy = Capability(
    id='refund-policy',
    description='Read before issuing refunds. Eligibility rules and approval limits.',
    instructions=(
        'Refunds over $500 require manager approval. '
        'Refunds outside the 30-day window require a documented exception.'
    ),
    defer_loading=True,
)


def issue_refund(ctx: RunContext[Store], order_id: str, amount: float) -> str:
    """Issue a refund for an order."""
    ctx.deps.refunds.append((order_id, amount))
    return f'Refund of ${amount:.2f} issued for {order_id}.'


def make_support(
    model: 'str | Model | SupportScript | None' = None, *, name: str = 'support', require_approval: bool = True,
) -> DurableAgent[Store, str]:
    """A fresh support-agent definition.

    Args:
        model: A `SupportScript` (its `FunctionModel` is used), a pydantic-ai model name or `Model`.
            Default: the `SUPPORT_MODEL` environment variable if set, else a new `SupportScript`.
        name: The agent name (part of every durable unit name).
        require_approval: `revoke_sessions` (any `account-security` tool) waits for a person's approval
            (`AccountSecurity.require_approval`, on by default); `False` turns the gate off.
    """
    if model is None:
        model = os.environ.get('SUPPORT_MODEL') or SupportScript()
    if isinstance(model, SupportScript):
        model = model.model
    return DurableAgent(
        name,
        model,
        deps_type=Store,
        instructions='You are a customer-support agent for an e-commerce store.',
        capabilities=[
            orders,
            AccountSecurity(require_approval=require_approval),
            refund_policy,
            RunbookRequired(requirements={'issue_refund': 'refund-policy'}),
            *load_skills(SKILLS_DIR),
        ],
        tools=[issue_refund],
    )


script = SupportScript()
"""The scripted model `support` uses when `SUPPORT_MODEL` is unset; `script.requests` records what it saw."""

support = make_support(os.environ.get('SUPPORT_MODEL') or script)
"""The support agent: `await support.run('Where is order ABC-123?', deps=make_store())`."""
