"""An agent for run-ownership and resume tests (`test_runs.py`). Model: a scripted `FunctionModel` (no provider).

The prompt names an order (`charge order A-1`); everything is logged under `$DURCAP_LEDGER_DIR`:
- `charges`: one line per execution of `charge` (the side effect that must happen once per run), the order id;
- `model-requests`: one line per model request, `{order}:{responses already in the history}` (a request that
  runs again shows up as a repeated line);
- `charge-started-{order}`: created when `charge` starts, holding its process id; `charge` then waits
  `$DURCAP_LEDGER_CHARGE_SECONDS` (default 3) before returning, so a test can start a second run while the first is
  in flight, or less: it returns as soon as the test creates `release` there (`(ledger / 'release').touch()`),
  once what needed the charges in flight has happened; `charge-parent-{order}`: its parent's process id, written
  first (readable after the process ended).
An order id starting with `BROKEN` makes the model raise `RuntimeError('card declined for order ...')` on the
request after the capability loaded: the run fails (for `runs show` of a failed run).
`$DURCAP_LEDGER_IMPORT_SECONDS` (default 0): importing this module takes that long (a slow target: a flow run whose
new process imports it stays PENDING meanwhile).
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from pathlib import Path

from pydantic_ai import ModelResponse, TextPart, ToolCallPart
from pydantic_ai.capabilities import Capability
from pydantic_ai.messages import ModelMessage, ToolReturnPart, UserPromptPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from durable_capabilities import DurableAgent


def _dir() -> Path:
    path = Path(os.environ['DURCAP_LEDGER_DIR'])
    path.mkdir(parents=True, exist_ok=True)
    return path


def _append(name: str, line: str) -> None:
    with open(_dir() / name, 'a', encoding='utf-8') as f:
        f.write(line + '\n')
        f.flush()
        os.fsync(f.fileno())


def _order(messages: list[ModelMessage]) -> str:
    for m in messages:
        for p in getattr(m, 'parts', []):
            if isinstance(p, UserPromptPart) and isinstance(p.content, str):
                found = re.search(r'order (\S+)', p.content)
                if found:
                    return found.group(1)
    return '?'


def script(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    order = _order(messages)
    _append('model-requests', f'{order}:{sum(1 for m in messages if m.kind == "response")}')
    returned = [p.tool_name for m in messages for p in getattr(m, 'parts', []) if isinstance(p, ToolReturnPart)]
    if 'load_capability' not in returned:
        return ModelResponse(parts=[ToolCallPart('load_capability', {'id': CAPABILITY})])
    if order.startswith('BROKEN'):
        raise RuntimeError(f'card declined for order {order}')
    if 'charge' not in returned:
        return ModelResponse(parts=[ToolCallPart('charge', {'order_id': order})])
    return ModelResponse(parts=[TextPart(f'charged {order}')])


CAPABILITY = os.environ.get('DURCAP_LEDGER_CAPABILITY', 'billing')
"""The capability's id (`$DURCAP_LEDGER_CAPABILITY`, default `billing`): a test can give it a real-looking one."""

billing = Capability(id=CAPABILITY, description='Use for charging orders.', instructions='Charge once.', defer_loading=True)


@billing.tool_plain
async def charge(order_id: str) -> str:
    """Charge an order (a side effect that must happen exactly once per run)."""
    _append('charges', order_id)
    (_dir() / f'charge-parent-{order_id}').write_text(str(os.getppid()))
    (_dir() / f'charge-started-{order_id}').write_text(str(os.getpid()))
    # Returns once `$DURCAP_LEDGER_CHARGE_SECONDS` have passed, or as soon as a `release` file exists in the ledger
    # folder: a test that has seen what it needed while charges were in flight ends them there (`RELEASE`).
    deadline = time.monotonic() + float(os.environ.get('DURCAP_LEDGER_CHARGE_SECONDS', '3'))
    released = _dir() / RELEASE
    while (left := deadline - time.monotonic()) > 0 and not released.exists():
        await asyncio.sleep(min(0.1, left))
    return f'charged {order_id}'


RELEASE = 'release'
"""A file in `$DURCAP_LEDGER_DIR`: once it exists, `charge` returns at once (a charge in flight within 0.1 s). Tests
create it by name (`(ledger / 'release').touch()`): importing this module builds its agent."""


agent = DurableAgent(os.environ.get('DURCAP_LEDGER_AGENT', 'ledger'), FunctionModel(script), capabilities=[billing])
time.sleep(float(os.environ.get('DURCAP_LEDGER_IMPORT_SECONDS', '0')))
