"""One turn at a time per conversation, without servers: the store's turn claims and rebased appends, the local
engine's strategies, edited approval arguments against the tool's schema, and replay of Temporal histories recorded
with the code before turn claims (tests/histories/turns, recorded by main's code at 1ecafcb on a real dev server with
the scripted race agent: an approved first turn and a second turn on the same conversation).

Model: a scripted `FunctionModel` (tests/engines/race_agent.py) or upstream's `TestModel`.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from pydantic_ai.messages import ModelMessage, ModelRequest, ModelResponse, TextPart, UserPromptPart
from pydantic_ai.models.test import TestModel

from durable_capabilities import DurableAgent, runner
from durable_capabilities.approvals import (
    AlreadyDecidedError,
    ApprovalArgsError,
    Decision,
    PendingCall,
    already_decided,
    check_decision,
)
from durable_capabilities.store import ConversationBusyError, ConversationConflictError, SQLConversationStore
from durable_capabilities.testing import assert_histories_replay
from tests._helpers import ROOT, durcap_here


def run(coro):
    return asyncio.run(coro)


def _turn(text: str) -> list:
    return [ModelRequest(parts=[UserPromptPart(text)]), ModelResponse(parts=[TextPart(f'ok {text}')])]


def test_a_claim_is_held_by_one_run_at_a_time_and_released_by_its_append(store: SQLConversationStore) -> None:
    assert run(store.claim_turn('c', 'run-a')) is None
    assert run(store.claim_turn('c', 'run-a')) is None  # the same run again (a retried unit): still its own
    holder = run(store.claim_turn('c', 'run-b'))
    assert holder is not None and holder[0] == 'run-a'
    assert run(store.release_turn('c', 'run-b')) is False  # not run-b's to release
    run(store.append('c', _turn('one'), expected_revision=None, append_id='a-1', release_claim='run-a'))
    assert run(store.turn_claim('c')) is None  # released in the append's transaction
    assert run(store.claim_turn('c', 'run-b')) is None
    assert run(store.release_turn('c')) is True and run(store.release_turn('c')) is False  # by hand; twice is harmless


def test_a_rebased_append_goes_after_the_other_write_and_a_plain_one_still_conflicts(store: SQLConversationStore) -> None:
    run(store.append('c', _turn('first'), expected_revision=None))
    run(store.append('c', _turn('other'), expected_revision=1))
    with pytest.raises(ConversationConflictError):
        run(store.append('c', _turn('late'), expected_revision=1))
    result = run(store.append('c', _turn('late'), expected_revision=1, append_id='late-1', rebase=True))
    assert result.rebased and result.revision == 3 and result.first_position == 5
    again = run(store.append('c', _turn('late'), expected_revision=1, append_id='late-1', rebase=True))
    assert again.replayed and again.revision == 3  # idempotent by append id: stored once
    prompts = [m.parts[0].content for m in run(store.read('c')).messages if isinstance(m, ModelRequest)]
    assert prompts == ['first', 'other', 'late']


def test_local_runs_reject_or_enqueue_behind_a_claim(tmp_path: Path) -> None:
    """`busy='reject'` (the default) refuses a turn on a claimed conversation with DC050 naming the holder, before the
    model is asked anything; `busy='enqueue'` (per run, or `DurableAgent(busy=...)`) waits for the claim, then runs
    on top of the turn stored meanwhile; the claim is released when the turn is stored."""
    import logging

    from pydantic_ai.models.function import FunctionModel

    url = f'sqlite:///{tmp_path / "c.db"}'
    asked: list[int] = []

    def counting(messages, info):
        asked.append(len(messages))
        return ModelResponse(parts=[TextPart('answered')])

    agent = DurableAgent('claims-local', FunctionModel(counting))
    queued = DurableAgent('claims-queued', FunctionModel(counting), busy='enqueue')

    class Waiting(logging.Handler):
        def __init__(self, event: asyncio.Event) -> None:
            super().__init__()
            self.event = event

        def emit(self, record: logging.LogRecord) -> None:
            if 'waits for run elsewhere' in record.getMessage():
                self.event.set()

    async def scenario() -> None:
        logger = logging.getLogger('durable_capabilities.conversations')
        async with SQLConversationStore(url) as store:
            await store.claim_turn('t', 'elsewhere')
            with pytest.raises(ConversationBusyError) as refused:
                await runner.run(agent, 'hi', conversation_id='t', store=url)
            assert refused.value.code == 'DC050' and refused.value.holder == 'elsewhere'
            assert "run 'elsewhere' holds it" in str(refused.value)
            assert asked == []  # refused before the model was asked
            for waiting in (lambda: runner.run(agent, 'hi', conversation_id='t', store=url, busy='enqueue'),
                            lambda: runner.run(queued, 'hi', conversation_id='t', store=url)):
                event = asyncio.Event()
                handler = Waiting(event)
                logger.addHandler(handler)
                old_level = logger.level
                logger.setLevel(logging.INFO)
                try:
                    task = asyncio.create_task(waiting())
                    await asyncio.wait_for(event.wait(), 30)  # it waits on the claim
                    assert (not task.done() and len(asked) == 0) or asked[-1] > 0
                    count = len(asked)
                    record = await store.read_record('t')
                    revision = (await store.read('t')).revision if record is not None else None
                    await store.append('t', _turn('elsewhere'), expected_revision=revision, release_claim='elsewhere')
                    assert (await asyncio.wait_for(task, 30)).output == 'answered'
                    assert len(asked) == count + 1
                finally:
                    logger.removeHandler(handler)
                    logger.setLevel(old_level)
                assert await store.turn_claim('t') is None
                await store.claim_turn('t', 'elsewhere')
            await store.release_turn('t')
            prompts = [m.parts[0].content for m in (await store.read('t')).messages if isinstance(m, ModelRequest)]
            assert prompts == ['elsewhere', 'hi', 'elsewhere', 'hi']

    run(scenario())


def test_a_failed_turn_releases_its_claim(tmp_path: Path) -> None:
    """The model raises mid-turn: nothing is stored, the claim is released, the next turn runs."""
    from pydantic_ai.models.function import FunctionModel

    url = f'sqlite:///{tmp_path / "c.db"}'

    def broken(messages, info):
        raise RuntimeError('the provider is down')

    agent = DurableAgent('claims-broken', FunctionModel(broken))
    with pytest.raises(RuntimeError, match='the provider is down'):
        run(runner.run(agent, 'hi', conversation_id='t', store=url))

    async def after() -> None:
        async with SQLConversationStore(url) as store:
            assert await store.turn_claim('t') is None and await store.read_record('t') is None

    run(after())
    assert run(runner.run(DurableAgent('claims-fixed', TestModel()), 'hi', conversation_id='t', store=url)).output


def test_bad_strategies_are_refused() -> None:
    with pytest.raises(ValueError, match="busy must be 'reject', 'enqueue' or 'interrupt'"):
        DurableAgent('claims-bad', TestModel(), busy='later')  # type: ignore[arg-type]
    result = durcap_here('run', 'tests.fixtures.good_agent:second', 'hi', '--busy', 'later')
    assert result.exit_code == 2, result.stdout + result.stderr
    assert "DC040 --busy: 'later' is not a strategy; use one of reject, enqueue, interrupt" in result.stderr


def test_a_stop_request_lives_on_the_holders_claim(store: SQLConversationStore) -> None:
    """`request_stop` marks the holder's claim once (the first asker is kept), only while that run holds it; the
    holder reads it by its run id; the claim's release (its append) takes the request with it."""
    assert run(store.request_stop('c', 'run-a', 'run-b')) is None  # nobody holds 'c': nothing to stop
    assert run(store.claim_turn('c', 'run-a')) is None
    assert run(store.stop_requested('run-a')) is None and run(store.turn_stop('c')) == ('run-a', None)
    assert run(store.request_stop('c', 'run-x', 'run-b')) is None  # run-x does not hold it: nothing changed
    assert run(store.request_stop('c', 'run-a', 'run-b')) == 'run-b'
    assert run(store.request_stop('c', 'run-a', 'run-c')) == 'run-b'  # idempotent: the first asker is kept
    assert run(store.stop_requested('run-a')) == 'run-b' and run(store.turn_stop('c')) == ('run-a', 'run-b')
    assert run(store.stop_requested('run-b')) is None
    run(store.append('c', _turn('one'), expected_revision=None, append_id='a-1', release_claim='run-a'))
    assert run(store.turn_stop('c')) is None and run(store.stop_requested('run-a')) is None
    assert run(store.claim_turn('c', 'run-b')) is None and run(store.stop_requested('run-b')) is None


def test_a_local_turn_is_interrupted_before_its_next_model_request_and_both_turns_are_stored(tmp_path: Path) -> None:
    """`busy='interrupt'` on the local engine: the first turn runs a tool held by the test; the second turn asks it to
    stop (the log line says so) and waits; the tool returns, the first turn's next model request is not sent and it
    ends with the interrupted answer naming the second run; its tool result is stored, then the second turn runs on
    top of it. Model: a scripted `FunctionModel`."""
    import logging

    from pydantic_ai.messages import ToolCallPart, ToolReturnPart
    from pydantic_ai.models.function import FunctionModel

    from durable_capabilities.interrupts import INTERRUPTED_PREFIX

    url = f'sqlite:///{tmp_path / "c.db"}'
    asked: list[str] = []
    ran: list[str] = []
    started, go = asyncio.Event(), asyncio.Event()

    def script(messages, info):
        prompt = next(p.content for m in reversed(messages) if isinstance(m, ModelRequest) for p in m.parts
                      if isinstance(p, UserPromptPart))
        asked.append(str(prompt))
        if isinstance(messages[-1], ModelRequest) and any(isinstance(p, ToolReturnPart) for p in messages[-1].parts):
            return ModelResponse(parts=[TextPart('done')])
        return ModelResponse(parts=[ToolCallPart('charge', {'user': str(prompt)})])

    async def charge(user: str) -> str:
        ran.append(user)
        if user == 'alice':
            started.set()
            await go.wait()
        return f'charged {user}'

    agent = DurableAgent('claims-interrupt', FunctionModel(script), tools=[charge])

    class Asked(logging.Handler):
        def __init__(self) -> None:
            super().__init__()
            self.event = asyncio.Event()

        def emit(self, record: logging.LogRecord) -> None:
            if 'to stop at its next safe point' in record.getMessage():
                self.event.set()

    async def scenario() -> None:
        logger = logging.getLogger('durable_capabilities.conversations')
        handler, old_level = Asked(), logger.level
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        try:
            first = asyncio.create_task(runner.run(agent, 'alice', conversation_id='t', store=url))
            await asyncio.wait_for(started.wait(), 30)
            second = asyncio.create_task(runner.run(agent, 'bob', conversation_id='t', store=url, busy='interrupt'))
            await asyncio.wait_for(handler.event.wait(), 30)
            async with SQLConversationStore(url) as store:
                holder, by = await store.turn_stop('t')  # type: ignore[misc]
            # the holders are the runs' own ids (`local-...`, their event streams' ids), not ids of the claim alone
            assert holder.startswith('local-') and by is not None and by.startswith('local-')
            go.set()
            interrupted = await asyncio.wait_for(first, 30)
            assert interrupted.output.startswith(INTERRUPTED_PREFIX) and f'(run {by})' in interrupted.output
            assert (await asyncio.wait_for(second, 30)).output == 'done'
        finally:
            logger.removeHandler(handler)
            logger.setLevel(old_level)
        assert ran == ['alice', 'bob'] and asked == ['alice', 'bob', 'bob']  # alice's second request never sent
        async with SQLConversationStore(url) as store:
            assert await store.turn_claim('t') is None
            messages = (await store.read('t')).messages
        prompts = [p.content for m in messages if isinstance(m, ModelRequest) for p in m.parts if isinstance(p, UserPromptPart)]
        returns = [p.content for m in messages if isinstance(m, ModelRequest) for p in m.parts if isinstance(p, ToolReturnPart)]
        assert prompts == ['alice', 'bob'] and returns == ['charged alice', 'charged bob']

    run(scenario())


def test_interrupt_is_refused_for_an_agent_whose_output_is_not_text(tmp_path: Path) -> None:
    """DC053 where `'interrupt'` is chosen for an agent with a structured output: `DurableAgent(busy=...)` and
    `runner.run(busy=...)` (before anything runs); an output type that allows text is accepted."""
    from pydantic import BaseModel

    from durable_capabilities import InputError

    class Verdict(BaseModel):
        ok: bool

    with pytest.raises(InputError) as refused:
        DurableAgent('claims-typed', TestModel(), output_type=Verdict, busy='interrupt')
    assert refused.value.code == 'DC053' and 'Verdict' in str(refused.value) and "busy='enqueue'" in str(refused.value)
    typed = DurableAgent('claims-typed-2', TestModel(), output_type=Verdict)
    url = f'sqlite:///{tmp_path / "c.db"}'
    with pytest.raises(InputError) as refused:
        run(runner.run(typed, 'hi', conversation_id='t', store=url, busy='interrupt'))
    assert refused.value.code == 'DC053' and str(refused.value).startswith('DC053 busy: ')
    assert not (tmp_path / 'c.db').exists()  # refused before the store was opened
    assert DurableAgent('claims-either', TestModel(), output_type=[Verdict, str], busy='interrupt').busy == 'interrupt'


def test_the_model_wrapper_answers_a_stopped_turn_also_when_streamed(store: SQLConversationStore, store_url: str) -> None:
    """`InterruptModel` inside `watching`: the request of a turn asked to stop is not sent (plain and streamed), the
    answer is the interrupted text; another run's requests, and requests outside `watching`, go to the model.
    Model: a scripted `FunctionModel`."""
    from pydantic_ai.models import ModelRequestParameters
    from pydantic_ai.models.function import FunctionModel

    from durable_capabilities.interrupts import InterruptModel, interrupted_text, watching

    sent: list[str] = []

    def answer(messages, info):
        sent.append('plain')
        return ModelResponse(parts=[TextPart('sent')])

    async def stream(messages, info):
        sent.append('stream')
        yield 'sent'

    model = InterruptModel(FunctionModel(answer, stream_function=stream))
    messages: list[ModelMessage] = [ModelRequest(parts=[UserPromptPart('hi')])]
    params = ModelRequestParameters()

    async def scenario() -> None:
        await store.claim_turn('c', 'run-a')
        await store.request_stop('c', 'run-a', 'run-b')
        with watching('run-a', store_url):
            plain = await model.request(messages, None, params)
            async with model.request_stream(messages, None, params) as streamed:
                async for _ in streamed:
                    pass
            assert [p.content for p in plain.parts] == [interrupted_text('run-b')]  # type: ignore[attr-defined]
            assert [p.content for p in streamed.get().parts] == [interrupted_text('run-b')]  # type: ignore[attr-defined]
        assert sent == []
        with watching('run-other', store_url):
            assert (await model.request(messages, None, params)).parts[0].content == 'sent'  # type: ignore[attr-defined]
        assert (await model.request(messages, None, params)).parts[0].content == 'sent'  # type: ignore[attr-defined]
        assert sent == ['plain', 'plain']

    run(scenario())


def _call(schema: dict | None) -> PendingCall:
    return PendingCall('run-1', 'call-1', 'revoke_sessions', {'user': 'alice'}, 'f' * 64, '', '', schema=schema)


SCHEMA = {'type': 'object', 'properties': {'user': {'type': 'string'}, 'hours': {'type': 'integer'}},
          'required': ['user'], 'additionalProperties': False}


@pytest.mark.parametrize(('args', 'field', 'said'), [
    ({'nope': 1}, '$', "'nope' was unexpected"),
    ({}, '$', "'user' is a required property"),
    ({'user': 'bob', 'hours': 'two'}, '$.hours', "'two' is not of type 'integer'"),
    (['bob'], None, 'must be a JSON object'),
])
def test_edited_arguments_that_do_not_fit_the_schema_are_dc051_naming_the_field(args, field, said) -> None:
    with pytest.raises(ApprovalArgsError) as refused:
        check_decision([_call(SCHEMA)], Decision('call-1', 'f' * 64, True, override_args=args), 'run-1')
    assert refused.value.code == 'DC051' and refused.value.kind == 'invalid-args'
    text = str(refused.value)
    assert text.startswith("DC051 run 'run-1': call 'call-1' (revoke_sessions)") and said in text, text
    if field is not None:
        assert f'at {field}:' in text and 'The tool takes hours, user (required: user)' in text, text
    assert check_decision([_call(SCHEMA)], Decision('call-1', 'f' * 64, True, override_args={'user': 'bob'}), 'run-1')
    # Temporal's update validator (workflow code) skips the schema; its client checked it.
    check_decision([_call(SCHEMA)], Decision('call-1', 'f' * 64, True, override_args={'nope': 1}), 'run-1',
                   validate_args=False)
    check_decision([_call(None)], Decision('call-1', 'f' * 64, True, override_args={'nope': 1}), 'run-1')  # no schema


def test_the_published_call_carries_the_tools_schema_and_a_second_decision_is_coded() -> None:
    from tests.engines.race_agent import racer

    schema = racer.tool_schema('revoke_sessions')
    assert schema is not None and schema['required'] == ['user'] and racer.tool_schema('no_such_tool') is None
    first = Decision('call-1', 'f' * 64, True, by='alice')
    error = already_decided('run-1', 'call-1', first, received=False)
    assert isinstance(error, AlreadyDecidedError) and error.code == 'DC054'
    assert error.kind == 'already-decided' and 'already approved by alice' in str(error)
    import pickle

    assert str(pickle.loads(pickle.dumps(error))) == str(error)  # DBOS and Prefect pickle what a step raises


def test_temporal_histories_recorded_before_turn_claims_replay() -> None:
    from tests.engines.race_agent import racer

    assert assert_histories_replay(ROOT / 'tests/histories/turns', [racer]) == 2


def test_the_api_refuses_interrupt_for_an_agent_whose_output_is_not_text(tmp_path: Path) -> None:
    """`POST /v1/conversations/{id}/turns` with `"busy": "interrupt"`: 400 DC053 naming the field for an agent with a
    structured output, nothing started or stored; an unknown strategy is 400 DC042 (the body's shape)."""
    from pydantic import BaseModel
    from starlette.testclient import TestClient

    from durable_capabilities.serve import bearer_auth, create_app

    class Verdict(BaseModel):
        ok: bool

    typed = DurableAgent('claims-api-typed', TestModel(), output_type=Verdict)
    url = f'sqlite:///{tmp_path / "serve.db"}'
    app = create_app(typed, settings={'store': url}, auth=bearer_auth('s3cret'))
    headers = {'Authorization': 'Bearer s3cret'}
    with TestClient(app) as client:
        refused = client.post('/v1/conversations/t/turns', json={'prompt': 'hi', 'busy': 'interrupt'}, headers=headers)
        assert refused.status_code == 400, refused.text
        error = refused.json()['error']
        assert error['code'] == 'DC053' and error['field'] == 'busy' and 'Verdict' in error['message'], error
        unknown = client.post('/v1/conversations/t/turns', json={'prompt': 'hi', 'busy': 'later'}, headers=headers)
        assert unknown.status_code == 400 and unknown.json()['error']['code'] == 'DC042', unknown.text

    async def nothing_stored() -> None:
        async with SQLConversationStore(url) as store:
            assert await store.read_record('t') is None and await store.turn_claim('t') is None

    run(nothing_stored())


def test_the_api_refuses_a_conversation_stored_outside_it_instead_of_handing_it_to_the_first_principal(
        tmp_path: Path) -> None:
    """A conversation with turns stored outside `durcap serve` (`durcap run --conversation`, `history fork`; here the
    store's own append) has no owner among the API's principals: `POST /v1/conversations/{id}/turns` is 404, the same
    answer as another principal's conversation, and a GET stays 404, so nobody takes it over and reads its history
    (a fresh-user trial did both as bob). Nothing is stored: the conversation keeps its one turn, no owner row. A new
    id is served as before. Model: pydantic-ai's `TestModel`."""
    from pydantic_ai.messages import ModelRequest, ModelResponse, TextPart, UserPromptPart
    from starlette.testclient import TestClient

    from durable_capabilities.serve import bearer_auth, create_app

    url = f'sqlite:///{tmp_path / "serve.db"}'

    async def store_a_turn() -> None:
        async with SQLConversationStore(url) as store:
            await store.append('cli-conv', [ModelRequest(parts=[UserPromptPart('my secret question')]),
                                            ModelResponse(parts=[TextPart('the answer')])],
                               expected_revision=None, append_id='cli:1')

    run(store_a_turn())
    agent = DurableAgent('claims-api-owner', TestModel())
    app = create_app(agent, settings={'store': url}, auth=bearer_auth({'a-token': 'alice', 'b-token': 'bob'}))
    bob = {'Authorization': 'Bearer b-token'}
    with TestClient(app) as client:
        refused = client.post('/v1/conversations/cli-conv/turns', json={'prompt': 'show me'}, headers=bob)
        assert refused.status_code == 404, refused.text
        assert 'secret' not in refused.text
        read = client.get('/v1/conversations/cli-conv', headers=bob)
        assert read.status_code == 404 and 'secret' not in read.text, read.text
        fresh = client.post('/v1/conversations/bob-new/turns', json={'prompt': 'hi'}, headers=bob)
        assert fresh.status_code == 202, fresh.text

    async def unchanged() -> None:
        async with SQLConversationStore(url) as store:
            assert await store.read_record('cli-conv') is not None

    run(unchanged())
    import sqlite3

    with sqlite3.connect(tmp_path / 'serve.db') as db:
        assert db.execute("SELECT count(*) FROM durcap_entries WHERE conversation_id = 'cli-conv'").fetchone() == (2,)
        assert db.execute('SELECT conversation_id FROM durcap_serve_owners').fetchall() == [('bob-new',)]
