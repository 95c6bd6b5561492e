"""The agent of `bench_throughput.py` as a TARGET module (`bench/throughput_agent.py:agent`), so its `durcap-measured`
variant runs the real `durcap lock --measure` on it and starts that worker from the lock written (no hand marking).
Model: the scripted `FunctionModel` of `_common.py` (6 requests: `load_capability('ops')`, four tools, the answer).
"""

from __future__ import annotations

import _common as c  # the target's folder is on `sys.path` (`targets.load`): the same module bench_throughput uses

from durable_capabilities import DurableAgent

AGENT_NAME = 'bench_tp_durcap'

agent = DurableAgent(AGENT_NAME, c.make_model(), instructions=c.INSTRUCTIONS, capabilities=[c.make_capability()])
