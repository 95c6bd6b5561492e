"""`Budget`: spend limits of a `DurableAgent` that survive durability, and `BudgetExceededError` (DC060).

Core: a definition and its error, importing nothing of the package above `errors`. What enforces it is
`budgets.BudgetModel`, the agent's model inside each engine's model request unit (see docs/budgets.md):

- before every model request, the spend recorded in the conversation store for the budget's key is checked against
  the limits (plus what an operator raised them by); under them, the request is reserved and sent; at or over one,
  `BudgetExceededError` is raised before the request (or, with `on_exceed='approval'`, the run waits for a person);
- when the request completes, its reservation is settled with the usage the provider reported (tokens, and cost
  from the user's price table, else pydantic-ai's / genai-prices' price of the response).

The check and the settle run inside the durable unit (a Temporal activity, a DBOS step, a Prefect task, a plain call
locally), so a crash, a resume elsewhere or another engine sees the same ledger; a retried unit settles the same
reservation (keyed by run and request), so a request is counted once. Requests admitted while the spend was under
the limit may pass it: concurrent runs of one key overspend together by at most one request each.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, Literal

from pydantic_ai.exceptions import ModelQuotaExceededError
from pydantic_ai.messages import ModelMessage, ModelRequest, ModelResponse, ToolCallPart, ToolReturnPart

from .errors import DurcapError

__all__ = ['BUDGET_SETTING', 'RAISE_TOOL', 'Budget', 'BudgetExceededError', 'conversation_key', 'granted_raises']

BUDGET_SETTING = 'durcap_budget'
"""The key of the run's `model_settings` that carries the budget's key and run into the model request unit (it
crosses every engine's boundary with the request's other arguments); `BudgetModel` removes it before the provider
sees the settings."""

LIMIT_FIELDS = ('input_tokens', 'output_tokens', 'total_tokens', 'cost')

RAISE_TOOL = 'durcap_raise_budget'
"""The tool a run over its budget with `on_exceed='approval'` calls (it needs approval): approved, it raises the limit.
Its calls are stored in the conversation (a tool of the definition, so resuming it is no drift, DC019); the model is
never sent them."""


def conversation_key(conversation_id: str) -> str:
    """The budget key of a conversation-scoped budget: `conversation:{id}`."""
    return f'conversation:{conversation_id}'


def granted_raises(messages: Sequence[ModelMessage]) -> dict[str, float]:
    """What the approved `RAISE_TOOL` calls of a history raised conversation-scoped limits by: `{limit: amount}`, summed
    over the calls whose key is a `conversation:` key and whose result says they ran (`outcome == 'success'`: an
    operator approved them); denied or undecided calls raise nothing. A fork inherits these with the spend of the
    turns it keeps (`SQLConversationStore.fork`)."""
    calls: dict[str, dict[str, Any]] = {}
    raised: dict[str, float] = {}
    for message in messages:
        for part in message.parts:
            if isinstance(message, ModelResponse) and isinstance(part, ToolCallPart) and part.tool_name == RAISE_TOOL:
                calls[part.tool_call_id] = part.args_as_dict()
            elif (isinstance(message, ModelRequest) and isinstance(part, ToolReturnPart) and part.tool_name == RAISE_TOOL
                  and part.outcome == 'success' and part.tool_call_id in calls):
                args = calls[part.tool_call_id]
                name, by = args.get('budget'), args.get('by')
                if (name in LIMIT_FIELDS and str(args.get('key', '')).startswith('conversation:')
                        and isinstance(by, int | float) and not isinstance(by, bool)):
                    raised[name] = raised.get(name, 0) + by
    return raised


class BudgetExceededError(ModelQuotaExceededError, DurcapError, code='DC060'):
    """A model request was refused before it was sent: its budget's key already spent a limit (problem DC060).

    A pydantic-ai `ModelQuotaExceededError`, so no engine retries the model request unit (Temporal's
    `non_retryable_model_errors` default, DBOS's and Prefect's retry conditions): the run fails at once.

    Attributes:
        budget: The limit reached (`'total_tokens'`, `'input_tokens'`, `'output_tokens'`, `'cost'`).
        key: The budget key (`conversation:{id}`, `run:{id}`, or the key computed from the deps).
        spent: What the key's completed requests spent of it (tokens, or USD).
        limit: The limit (plus what operators raised it by).
        decided: Refused right after an operator's decision on raising it (`on_exceed='approval'`): what happened
            to the raise, as a clause of the message (`'the raise by 51 was denied by alice (enough for today)'`);
            `True` when not known; `False` when no raise was asked for.
    """

    def __init__(self, budget: str, key: str, spent: float, limit: float, model_name: str = 'budget',
                 decided: bool | str = False):
        self.budget, self.key, self.spent, self.limit, self.decided = budget, key, spent, limit, decided
        unit = ' USD' if budget == 'cost' else ' tokens'
        if decided:
            outcome = decided if isinstance(decided, str) else \
                'the raise was denied, too small, or not decided in time'
            message = (f'DC060 budget {budget} for key {key!r}: spent {_num(spent)}{unit} of limit {_num(limit)}{unit}; '
                       f'{outcome}; the model request was not sent. Fix: approve a raise when the next run asks for one, '
                       f'raise the limit (Budget({budget}=...)), or reset the key (`durcap budgets reset {key}`)')
        else:
            message = (f'DC060 budget {budget} of key {key!r} is spent: {_num(spent)}{unit} of the limit '
                       f'{_num(limit)}{unit}; the model request was not sent. Fix: raise the limit (Budget({budget}=...)), '
                       f"reset the key (`durcap budgets reset {key}`), or use Budget(on_exceed='approval') to let an "
                       'operator raise it')
        super().__init__(model_name, message)

    def __reduce__(self) -> Any:  # DBOS and Prefect pickle a failed unit's error
        return (type(self), (self.budget, self.key, self.spent, self.limit, self.model_name, self.decided))


def _num(value: float) -> str:
    return f'{value:g}' if isinstance(value, float) else str(value)


Scope = Literal['run', 'conversation'] | Callable[[Any], str]


@dataclass(frozen=True)
class Budget:
    """Spend limits of a `DurableAgent`, checked before every model request on every engine.

    Args:
        total_tokens / input_tokens / output_tokens: Token limits (the provider's reported usage), `None`: none.
        cost: A cost limit in USD (`None`: none).
        scope: Whose spend is counted: `'conversation'` (the default: every turn of a conversation; a run without
            a conversation counts per run), `'run'` (one run: one workflow, flow run or local run), or a callable
            `deps -> key` (a tenant: every run whose deps give the same key, concurrently too).
        on_exceed: `'error'` (the default: `BudgetExceededError`, DC060) or `'approval'` (the run waits as a
            durable approval, "raise the budget by `raise_by`?", decided with `durcap approve` / `deny`; approved, the
            limit is raised and the request sent; denied, the run fails with DC060). Durable engines only (a local
            run denies it at once, as it does every approval; a request sent streamed, with an `event_stream_handler`,
            fails with DC060 instead).
        raise_by: What an approval raises the reached limit by (default: the limit itself, doubling it).
        prices: `{model name: (USD per million input tokens, USD per million output tokens)}` (`'*'` for any model);
            a model not in it is priced by pydantic-ai (genai-prices), else counted at 0 USD.
        store: The store of the ledger (default: the agent's conversation store).

    Raises:
        ValueError: no limit given, a negative limit, an unknown `scope` / `on_exceed`, a `raise_by` that is not above
            0, or a price that is not two numbers >= 0.
    """

    total_tokens: int | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None
    cost: float | None = None
    scope: Scope = 'conversation'
    on_exceed: Literal['error', 'approval'] = 'error'
    raise_by: float | None = None
    prices: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    store: str | None = None

    def __post_init__(self) -> None:
        given = self.limits()
        if not given:
            raise ValueError('Budget(): give at least one limit (total_tokens=, input_tokens=, output_tokens=, cost=)')
        for name, value in given.items():
            if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
                raise ValueError(f'Budget({name}=...): a limit is a number >= 0, not {value!r}')
        if not callable(self.scope) and self.scope not in ('run', 'conversation'):
            raise ValueError(f"Budget(scope=...): 'run', 'conversation' or a callable deps -> key, not {self.scope!r}")
        if self.on_exceed not in ('error', 'approval'):
            raise ValueError(f"Budget(on_exceed=...): 'error' or 'approval', not {self.on_exceed!r}")
        if self.raise_by is not None and (not isinstance(self.raise_by, int | float) or isinstance(self.raise_by, bool)
                                          or self.raise_by <= 0):
            raise ValueError(f'Budget(raise_by=...): what an approval adds is a number > 0, not {self.raise_by!r}')
        for model, price in dict(self.prices).items():
            if (not isinstance(price, tuple | list) or len(price) != 2
                    or any(not isinstance(p, int | float) or isinstance(p, bool) or p < 0 for p in price)):
                raise ValueError(f'Budget(prices={{{model!r}: ...}}): a price is (USD per million input tokens, USD per '
                                 f'million output tokens), two numbers >= 0, not {price!r}')

    def limits(self) -> dict[str, float]:
        """`{field: limit}` of the limits set (`'input_tokens'`, `'output_tokens'`, `'total_tokens'`, `'cost'`)."""
        return {name: getattr(self, name) for name in LIMIT_FIELDS if getattr(self, name) is not None}

    def key(self, *, run_id: str, conversation_id: str | None, deps: Any) -> str:
        """The budget key of a turn: `conversation:{id}` (a run without one: `run:{run_id}`), `run:{run_id}`, or
        `str(scope(deps))` (run in the engine's container code: on Temporal, workflow code, so it must be
        deterministic).

        Raises:
            ValueError: the scope callable returned an empty key.
        """
        if callable(self.scope):
            key = str(self.scope(deps))
            if not key:
                raise ValueError('Budget(scope=...): the callable returned an empty key')
            return key
        if self.scope == 'conversation' and conversation_id is not None:
            return conversation_key(conversation_id)
        return f'run:{run_id}'

    def price(self, response: Any) -> float:
        """The cost in USD of a `ModelResponse`: the user's price table, else pydantic-ai's price of it (genai-prices,
        `ModelResponse.cost()` or its usage's `cost`), else 0."""
        usage = response.usage
        model = response.model_name or ''
        table = self.prices.get(model) or self.prices.get('*')
        if table is not None:
            return (usage.input_tokens * table[0] + usage.output_tokens * table[1]) / 1_000_000
        known = getattr(usage, 'cost', None)
        if isinstance(known, Decimal | int | float):
            return float(known)
        try:
            return float(response.cost().total_price)
        except Exception:  # noqa: BLE001 - a model genai-prices does not know costs nothing we can tell
            return 0.0
