"""The agents `durcap serve` tests serve (one TARGET, so one `durcap worker dbos` runs both). Models: scripted
`FunctionModel`s, no provider: `streamer` (tests/engines/stream_agent.py: a tool call, then the answer streamed word
by word) and `gated` (tests/engines/approval_agent.py: `revoke_sessions(user)` waits for a person's approval)."""

from examples.support.agent import support
from tests.engines.approval_agent import gated
from tests.engines.stream_agent import agent as streamer

agents = [streamer, gated, support]
