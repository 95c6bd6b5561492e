"""The journal engine's adapter: runs a turn in-process, each model request and tool call a journaled step."""

from __future__ import annotations

import json
import os
import sqlite3
import uuid
from collections.abc import Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic_ai.capabilities import AbstractCapability
from pydantic_ai.messages import ModelMessagesTypeAdapter

from durable_capabilities.engines import EngineAdapter, RunInfo, RunNotFoundError, RunOptions
from durable_capabilities.report import RunReport
from durable_capabilities.turn import run_turn

from . import SPEC

SCHEMA = ('CREATE TABLE IF NOT EXISTS steps (run_id TEXT, step INTEGER, name TEXT, result TEXT, PRIMARY KEY (run_id, step));'
          'CREATE TABLE IF NOT EXISTS runs (run_id TEXT PRIMARY KEY, agent TEXT, prompt TEXT, status TEXT, output TEXT)')


def _journal(settings: Mapping[str, Any]) -> sqlite3.Connection:
    path = Path(settings.get('journal') or os.environ.get('DURCAP_JOURNAL') or '.durcap/journal.sqlite')
    path.parent.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(path, isolation_level=None)
    db.executescript(SCHEMA)
    return db


@dataclass
class _Run:
    db: sqlite3.Connection
    run_id: str
    agent: str
    step: int = 0
    units: list[str] = field(default_factory=list)

    async def step_of(self, name: str, call: Any, dump: Any, load: Any) -> Any:
        """The journaled result of the next step, else `call()`'s, journaled before it is returned."""
        self.step += 1
        self.units.append(name)
        row = self.db.execute('SELECT name, result FROM steps WHERE run_id = ? AND step = ?', (self.run_id, self.step)).fetchone()
        if row is not None:
            if row[0] != name:
                raise RuntimeError(f'journal {self.run_id} step {self.step} was {row[0]!r}, the code asks {name!r}')
            return load(row[1])
        result = await call()
        self.db.execute('INSERT INTO steps VALUES (?, ?, ?, ?)', (self.run_id, self.step, name, dump(result)))
        return result


_RUN: ContextVar[_Run] = ContextVar('journal_run')


class Journaled(AbstractCapability[Any]):
    """Makes each model request and tool call of the run in `_RUN` a journaled step."""

    async def wrap_model_request(self, ctx: Any, *, request_context: Any, handler: Any) -> Any:
        run = _RUN.get()
        return await run.step_of(f'journal.{run.agent}.model_request', lambda: handler(request_context),
                                 lambda r: ModelMessagesTypeAdapter.dump_json([r]).decode(),
                                 lambda s: ModelMessagesTypeAdapter.validate_json(s)[0])

    async def wrap_tool_execute(self, ctx: Any, *, call: Any, tool_def: Any, args: Any, handler: Any) -> Any:
        run = _RUN.get()
        return await run.step_of(f'journal.{run.agent}.tool.{call.tool_name}', lambda: handler(args), json.dumps, json.loads)


class JournalAdapter(EngineAdapter):
    """Runs in this process; durable through the journal (a re-run of a run id replays its finished steps)."""

    name, extra, durable = SPEC.name, SPEC.extra, SPEC.durable
    unit, units, container, run_id_label = SPEC.unit, SPEC.units, SPEC.container, SPEC.run_id_label
    lock_sections, features = SPEC.lock_sections, SPEC.features

    def durability_parts(self, agent: Any, options: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]:
        return dict(options), [Journaled()]

    def durable_names(self, agent: Any) -> dict[str, list[str]]:
        tools = sorted(f'journal.{agent.name}.tool.{tool}' for tool in agent.static_tool_names())
        return {'steps': [f'journal.{agent.name}.model_request', *tools]}

    async def run(self, agent: Any, prompt: str | None, options: RunOptions) -> RunReport:
        db = _journal(options.settings)
        run_id = options.run_id or f'{agent.name}-{uuid.uuid4().hex[:8]}'
        db.execute('INSERT OR IGNORE INTO runs VALUES (?, ?, ?, ?, NULL)', (run_id, agent.name, prompt, 'running'))
        options.started(run_id, f'journal run {run_id}')
        run = _Run(db, run_id, agent.name)
        token = _RUN.set(run)
        try:
            turn = await run_turn(agent, agent.build(self.name).run, prompt, deps=options.deps,
                                  message_history=options.message_history, conversation_id=options.conversation_id)
        finally:
            _RUN.reset(token)
        db.execute("UPDATE runs SET status = 'completed', output = ? WHERE run_id = ?", (str(turn.result.output), run_id))
        messages = ModelMessagesTypeAdapter.validate_python(turn.new_messages)
        return RunReport(self.name, run_id, turn.result.output, messages, turn.result.usage, run.units)

    def _info(self, row: Sequence[Any], db: sqlite3.Connection) -> RunInfo:
        done = db.execute('SELECT COUNT(*) FROM steps WHERE run_id = ?', (row[0],)).fetchone()[0]
        return RunInfo(self.name, row[0], row[1], row[3], row[3].upper(), units_done=done)

    async def list_runs(self, settings: Mapping[str, Any], *, status: str | None = None, limit: int = 50) -> list[RunInfo]:
        db = _journal(settings)
        rows = db.execute('SELECT * FROM runs ORDER BY rowid DESC LIMIT ?', (limit,)).fetchall()
        return [info for row in rows if (info := self._info(row, db)).status == status or status is None]

    async def show_run(self, run_id: str, settings: Mapping[str, Any]) -> RunInfo:
        db = _journal(settings)
        row = db.execute('SELECT * FROM runs WHERE run_id = ?', (run_id,)).fetchone()
        if row is None:
            raise RunNotFoundError(f'no journal run {run_id!r}')
        return self._info(row, db)

    async def resume(self, run_id: str, agents: Sequence[Any], options: RunOptions) -> RunReport:
        """Run `run_id` again from its prompt: its journaled steps replay, the rest run."""
        row = _journal(options.settings).execute('SELECT agent, prompt FROM runs WHERE run_id = ?', (run_id,)).fetchone()
        if row is None:
            raise RunNotFoundError(f'no journal run {run_id!r}')
        agent = next((a for a in agents if a.name == row[0]), None)
        if agent is None:
            raise RuntimeError(f'journal run {run_id!r} is of agent {row[0]!r}: pass --target naming it')
        again = RunOptions(settings=options.settings, notify=options.notify, run_id=run_id)
        return await self.run(agent, row[1], again)


ADAPTER = JournalAdapter()
