"""`TurnLog` places compaction summaries where the stored conversation's post-compaction window stays whole, and
records a summary written again (after Temporal's continue-as-new reloaded the conversation) once (issue 24 item 5).
No server: the log is fed run message lists by hand, as `TurnRecorder` would."""

from __future__ import annotations

from pydantic_ai.messages import (
    CompactionPart,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
    post_compaction_window,
)

from durable_capabilities._turn_log import TurnLog

RUN = 'run-1'


def call(n: int) -> ModelResponse:
    return ModelResponse(parts=[ToolCallPart('tick', {'n': n}, tool_call_id=f't{n}')], run_id=RUN)


def ret(n: int) -> ModelRequest:
    return ModelRequest(parts=[ToolReturnPart('tick', str(n), tool_call_id=f't{n}')], run_id=RUN)


def summary(text: str) -> ModelRequest:
    return ModelRequest(parts=[CompactionPart(text)])


def test_a_mid_turn_summary_waits_for_the_end_of_the_tool_calls() -> None:
    prompt = ModelRequest(parts=[UserPromptPart('go')], run_id=RUN)
    log = TurnLog([])
    log.start([prompt], RUN)
    run = [prompt, call(1), ret(1), call(2), ret(2)]
    log.observe(run)
    compacted = [summary('up to 1'), call(2), ret(2)]
    compacted[1:] = run[3:]  # the processor keeps the last call and its return (the same objects)
    log.observe(compacted)
    placed, pending = log.split()
    assert [m for m in placed if any(isinstance(p, CompactionPart) for p in m.parts)] == []
    assert [p.content for m in pending for p in m.parts] == ['up to 1']  # tool calls follow it: no place yet
    answer = ModelResponse(parts=[TextPart('done')], run_id=RUN)
    log.observe([*compacted, answer])
    stored = log.stored()
    assert stored[:-1] == [*run, answer] and isinstance(stored[-1].parts[0], CompactionPart)
    assert post_compaction_window(stored) == [stored[-1]]  # no orphan return in the window


def test_a_summary_written_again_after_a_reload_is_recorded_once() -> None:
    history = [ModelRequest(parts=[UserPromptPart('go')]), call(1), ret(1)]
    carried = [summary('up to 1')]
    log = TurnLog(list(history), carried=carried)
    log.start(history, RUN)
    again = summary('up to 1')  # the reloaded run's processor writes the same summary
    log.observe([again, *history[1:]])
    answer = ModelResponse(parts=[TextPart('done')], run_id=RUN)
    log.observe([again, *history[1:], answer])
    stored = log.stored()
    assert [p.content for m in stored for p in m.parts if isinstance(p, CompactionPart)] == ['up to 1']
    assert stored[0] is answer  # the carried summary after the answer, where no call waits
