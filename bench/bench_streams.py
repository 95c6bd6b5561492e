"""Run event streams: what publishing costs a run, how soon a subscriber in another process sees a delta, and what a
subscriber's memory does over a 10,000-event run.

    .venv/bin/python bench/bench_streams.py [--runs 5] [--engines local,dbos,temporal,prefect] [--deltas 200]
        [--delay 0] [--sides off,on] [--only a] [--order rotate|blocked|both] [--block 5]
        [--temporal-address HOST:PORT] [--conversation] [--prefect-api-url URL]

Model: a scripted `FunctionModel` with both `function` and `stream_function`, answering in `--deltas` words (no
provider). Side by side in one process, in two orders (`--order`, default both, one after the other):
`rotate`, rounds of one run of each side, the rounds' orders from a Williams design (each side right after each
other side equally often), with the median of each side and the median of the rounds' own on/off ratios (paired);
`blocked`, each side's runs one after another in blocks of `--block`, each block after an unmeasured warm-up run of
its side, the blocks in turn. Why both: a run's wall time can depend on the run before it (a Temporal worker's
pollers, the writer thread, the disk's flushes, the previous run's teardown overlapping this one's start), so an
alternation that puts every `off` right after an `on` (as `off,on` in turn did) measures `off` in one context
only. The blocked figure is the comparison of a worker running only unstreamed against one running only streamed
runs; the rotated one spreads every predecessor evenly over every side. Each also prints the first quartile (p25):
on this shared machine the runs other processes delayed least, closest to an idle machine's figure.
(a) wall time of a run with its stream published (`$DURCAP_STREAMS` on: the request streamed inside the model
    request unit, every event written to the store) over the same run unstreamed (`DURCAP_STREAMS=0`: the plain
    request, nothing written), per engine; target <= 1.10x; one warm-up run (or round) of each side first;
    `--sides off,read,bare,timer,on` adds sides to (a), each run in turn with the others: `read`, the request
    streamed through `request_stream` and its events read and dropped (what pydantic-ai's streaming costs alone:
    the floor of any streamed run); `bare`, the request streamed and its events built, joined and encoded as JSON
    but never written (the publisher's writes replaced in this process: what our event handling adds to `read`);
    and `timer`, the writes batched as before group commit (a unit's
    pending events written when an event arrives 50 ms or more after the last write, and at the unit's end:
    `TimerBatches` below, the code this bench measured before);
(b) delay from the model producing a text delta (its wall-clock time, written by the model) to a subscriber in
    another process (`durcap runs watch --format jsonl`) printing it, median and p95;
(c) a subscriber process's RSS while it reads a 10,000-event run (`watch()`, events not kept), every 1,000 events.
Temporal: one worker of one agent in this process for each series (its activities read `$DURCAP_STREAMS` as each run
goes), on the server at `--temporal-address` (default `$DURCAP_TEST_TEMPORAL_ADDRESS`, `$DURCAP_TEMPORAL_ADDRESS`,
else a dev server started here); each run is `runner.run(..., engine='temporal')` against it (`--conversation`: in
a conversation of its own); (a) also prints this process's CPU per run (client and worker threads). Unstreamed, the
workflow still schedules its `durcap.stream_publish` local activity (none with `--conversation`: its own events ride
with its activities), which then writes nothing. `read` drops only the model request's own events: the workflow's
(`run_started` carried by the activity and stored at its end, `run_completed` by the local activity) are stored.
`--phases` prints where each side's time goes from the runs' histories (`history_phases`).
Prefect: each run is `runner.run(..., engine='prefect')` in this process (a flow run on the server at
`--prefect-api-url`, its tasks in this process), as `durcap run --engine prefect` runs it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pydantic_ai.messages import ModelResponse, TextPart  # noqa: E402
from pydantic_ai.models.function import AgentInfo, FunctionModel  # noqa: E402
from pydantic_core import to_json  # noqa: E402

from durable_capabilities import DurableAgent, runner  # noqa: E402
from durable_capabilities.streams._events import dump_event, kind_of  # noqa: E402
from durable_capabilities.streams._log import in_thread  # noqa: E402
from durable_capabilities.streams._publish import _UnitPublisher  # noqa: E402

PRODUCED: dict[str, float] = {}
"""When the model produced each word of its stream (the words are all different)."""

PREFECT_GATE: dict[str, Any] = {}
"""(b) on Prefect, whose flow run id the server picks when the run starts: the model's stream puts the id under
`run_id` and waits for the `gate` (a `threading.Event`) the bench sets once a watcher of that run is up."""


def model(deltas: int, delay: float = 0.0) -> FunctionModel:
    words = [f'w{n} ' for n in range(deltas)]

    async def plain(messages: list[Any], info: AgentInfo) -> ModelResponse:
        for _ in words:  # the same generation, token by token, unstreamed (one sleep per token, as the stream)
            if delay:
                await asyncio.sleep(delay)
        return ModelResponse(parts=[TextPart(''.join(words))])

    async def stream(messages: list[Any], info: AgentInfo) -> AsyncIterator[str]:
        if (gate := PREFECT_GATE.get('gate')) is not None:  # (b) on Prefect: the flow run's id, then wait for the watcher
            from prefect.runtime import flow_run

            PREFECT_GATE['run_id'] = flow_run.id
            await asyncio.to_thread(gate.wait, 120)
        for word in words:
            if delay:
                await asyncio.sleep(delay)
            PRODUCED[word] = time.time()
            yield word

    return FunctionModel(plain, stream_function=stream)


SIDES = ('off', 'read', 'bare', 'timer', 'on')
"""(a)'s sides: unstreamed; streamed with its events read and dropped (upstream's streaming alone); streamed with its
events built and encoded, nothing stored; streamed with the writes batched on a 50 ms timer (before); streamed (the
current group commit)."""


class TimerBatches(_UnitPublisher):
    """The unit publisher's writes as they were before group commit (bench side `timer`): pending events were handed
    to a chain of background writes when an event arrived 50 ms or more after the last write, and at the unit's end,
    one row per event."""

    def __init__(self, context: Any, unit: str):
        super().__init__(context, unit)
        self.last_flush = time.monotonic()
        self.flush()  # the attempt was claimed before the request, in a write of its own

    async def event(self, event: Any, data: dict[str, Any] | None = None) -> None:
        self.add(event, data)

    def add(self, event: Any, data: dict[str, Any] | None = None) -> None:
        self.pending.append((event, None, data))
        if time.monotonic() - self.last_flush >= 0.05:
            self.flush()

    def flush(self) -> None:
        entries = []
        for event, kind, extra in self.pending:  # one row per event, none joined
            entries.append((self.seq, kind, extra) if event is None else (
                self.seq, kind_of(event), {'event': dump_event(event), **({'data': extra} if extra else {})}))
            self.seq += 1
        self.pending = []
        self.writing = asyncio.ensure_future(self._write(self.writing, entries))
        self.last_flush = time.monotonic()

    async def close(self) -> None:
        self.flush()
        if self.writing is not None:
            await self.writing

    async def _write(self, previous: asyncio.Future[None] | None, entries: list[Any]) -> None:
        if previous is not None:
            await previous
        if not entries and self.attempt is not None:
            return
        self.attempt = await in_thread(self.context.log.append_unit_sync, self.context.run_id, self.context.engine,
                                       self.unit, entries, self.attempt, at_least=self.context.attempt)


@contextlib.contextmanager
def side(name: str) -> Any:
    """This process set up for (a)'s side `name` (see `SIDES`) while the block runs."""
    from durable_capabilities.streams import _publish

    os.environ['DURCAP_STREAMS'] = '0' if name == 'off' else '1'
    saved = (_publish._UnitPublisher, _UnitPublisher._submit, _UnitPublisher.event, _UnitPublisher.add,
             _publish.StreamContext.write)
    if name == 'timer':
        _publish._UnitPublisher = TimerBatches  # type: ignore[misc]
    if name in ('bare', 'read'):
        async def write(self: Any, items: list[Any], *, close: bool = False, **_: Any) -> None:
            for item in items:  # encoded as a write would, never written
                to_json(item.body, fallback=repr)

        def submit(self: Any) -> None:
            for _, _, body in self._take():
                to_json(body, fallback=repr)

        _UnitPublisher._submit = submit  # type: ignore[method-assign]
        _publish.StreamContext.write = write  # type: ignore[method-assign]
    if name == 'read':  # the request streamed, its events read and dropped: upstream's streaming alone
        async def event(self: Any, event: Any, data: Any = None) -> None:
            return None

        def add(self: Any, event: Any, data: Any = None) -> None:
            return None

        _UnitPublisher.event = event  # type: ignore[method-assign]
        _UnitPublisher.add = add  # type: ignore[method-assign]
    try:
        yield
    finally:
        (_publish._UnitPublisher, _UnitPublisher._submit, _UnitPublisher.event, _UnitPublisher.add,  # type: ignore[misc]
         _publish.StreamContext.write) = saved  # type: ignore[method-assign]


async def one_run(engine: str, streamed: bool | str, deltas: int, folder: Path, run_id: str | None = None,
                  delay: float = 0.0) -> float:
    name = streamed if isinstance(streamed, str) else ('on' if streamed else 'off')
    agent = DurableAgent(f'bench-{uuid.uuid4().hex[:6]}', model(deltas, delay), engines=[engine] if engine != 'local' else [])
    settings: dict[str, Any] = {'store': f'sqlite:///{folder / "conversations.db"}'}
    if engine == 'dbos':
        settings['db'] = f'sqlite:///{folder / "dbos.sqlite"}'
    with side(name):
        started = time.perf_counter()
        await runner.run(agent, 'go', engine=engine, run_id=run_id, notify=lambda line: None, **settings)
        return time.perf_counter() - started


TEMPORAL_ADDRESS: list[str] = []
CPU: list[float] = []
"""This process's CPU seconds (`time.process_time`: every thread, the Temporal worker's included) of each Temporal run
of the last `temporal_runs`, in order."""
PHASES: list[dict[str, float]] = []
"""With `--phases`: for each Temporal run of the last `temporal_runs`, in order, its phases in seconds from the
workflow's history (`history_phases`), read after the runs."""
WANT_PHASES: list[bool] = [False]
CONVERSATION: list[bool] = [False]
"""`--conversation`: each Temporal run in a conversation of its own (a load and an append activity)."""


async def temporal_runs(sides: list[tuple[bool | str, str | None]], deltas: int, folder: Path,
                        delay: float) -> list[float]:
    """Wall times of runs of one agent on Temporal, one per `(side, run id)` of `sides` (a side: `SIDES`, or a bool
    for `on`/`off`), with one worker of it in this process on a task queue of its own."""
    from durable_capabilities.engines.temporal import connect, make_worker

    address, store = TEMPORAL_ADDRESS[0], f'sqlite:///{folder / "conversations.db"}'
    agent = DurableAgent(f'bench-{uuid.uuid4().hex[:6]}', model(deltas, delay), engines=['temporal'])
    queue = f'bench-{uuid.uuid4().hex[:8]}'
    times, ids = [], []
    CPU.clear()
    PHASES.clear()
    client = await connect(address, store=store)
    async with make_worker(client, [agent], queue, store=store):
        for streamed, run_id in sides:
            run_id = run_id or f'bench-{uuid.uuid4().hex}'
            ids.append(run_id)
            extra = {'conversation_id': f'bench-{uuid.uuid4().hex[:8]}'} if CONVERSATION[0] else {}
            with side(streamed if isinstance(streamed, str) else ('on' if streamed else 'off')):
                started, cpu = time.perf_counter(), time.process_time()
                await runner.run(agent, 'go', engine='temporal', run_id=run_id, address=address, task_queue=queue,
                                 inline_worker=False, store=store, notify=lambda line: None, **extra)
                times.append(time.perf_counter() - started)
                CPU.append(time.process_time() - cpu)
    if WANT_PHASES[0]:
        for run_id, took in zip(ids, times, strict=True):
            PHASES.append({**await history_phases(client, run_id), 'client': took})
            PHASES[-1]['client'] -= PHASES[-1]['history']
    return times


async def history_phases(client: Any, run_id: str) -> dict[str, float]:
    """Seconds a Temporal run spent in each phase, from its history's event times (the server's clock):
    `history` (started to closed), `wft1_wait` / `wft1` (its first workflow task scheduled to started / started to
    completed: the workflow up to its model request), `activity` (the model request activity, started to completed;
    its `scheduled -> started` is ~0, eager dispatch), `wft2_wait` / `wft2` (the last workflow task, the local
    activity writing `run_completed` inside it)."""
    from temporalio.api.enums.v1 import EventType

    events = [(event.event_type, event.event_time.seconds + event.event_time.nanos / 1e9)
              async for event in client.get_workflow_handle(run_id).fetch_history_events()]
    tasks = [at for kind, at in events if kind in (EventType.EVENT_TYPE_WORKFLOW_TASK_SCHEDULED,
                                                   EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED,
                                                   EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED)]
    activity = [at for kind, at in events if kind in (EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED,
                                                      EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED)]
    return {'history': events[-1][1] - events[0][1], 'wft1_wait': tasks[1] - tasks[0], 'wft1': tasks[2] - tasks[1],
            'activity': activity[-1] - activity[0] if len(activity) >= 2 else 0.0, 'wft2_wait': tasks[-2] - tasks[-3],
            'wft2': tasks[-1] - tasks[-2]}


ORDERS = ('rotate', 'blocked', 'both')
"""(a)'s run orders (`--order`): `rotate`, rounds of one run of each side in the orders of a Williams design (a
balanced Latin square: `williams`), so each side runs in each position and right after each other side equally
often, and a side's figure is not that of the one side that happens to precede it;
`blocked`, each side's runs one after another in a block that begins with an unmeasured warm-up run of that side,
the blocks in turn (each side measured after itself, as a deployment running only that configuration)."""


def williams(count: int) -> list[list[int]]:
    """The rows of a Williams design for `count` treatments: orders of `range(count)` in which each treatment follows
    each other one equally often (`count` rows; for an odd `count`, those and their mirror images, `2 * count`)."""
    first, low, high = [0], 1, count - 1
    while len(first) < count:
        first.append(low)
        low += 1
        if len(first) < count:
            first.append(high)
            high -= 1
    rows = [[(value + shift) % count for value in first] for shift in range(count)]
    return rows + ([row[::-1] for row in rows] if count % 2 else [])


def schedule(sides: list[str], runs: int, order: str, block: int) -> list[tuple[str, str | None, int]]:
    """(a)'s runs in order, each `(side, series or None: a warm-up, not measured, round or block number)`: for
    `rotate`, a warm-up round then `runs` rounds; for `blocked`, blocks of `block` measured runs (after their warm-up)
    until each side has `runs`; `both`, the rotated rounds then the blocks."""
    plan: list[tuple[str, str | None, int]] = []
    if order in ('rotate', 'both'):
        plan += [(name, None, -1) for name in sides]
        rows = williams(len(sides))
        for number in range(runs):
            plan += [(sides[index], 'rotate', number) for index in rows[number % len(rows)]]
    if order in ('blocked', 'both'):
        for number in range(-(-runs // block)):
            shift = number % len(sides)
            for name in sides[shift:] + sides[:shift]:
                count = min(block, runs - number * block)
                plan += [(name, None, -1)] + [(name, 'blocked', number)] * count
    return plan


def wall_times(engines: list[str], runs: int, deltas: int, folder: Path, delay: float, sides: list[str],
               order: str = 'both', block: int = 5) -> None:
    print(f'(a) wall time over unstreamed, {deltas} deltas per answer {delay * 1000:g} ms apart, {runs} runs of each '
          f'side ({",".join(sides)}) per order ({order}; blocked: blocks of {block} after a warm-up run), medians')
    plan = schedule(sides, runs, order, block)
    for engine in engines:
        if engine == 'temporal':
            measured = asyncio.run(temporal_runs([(name, None) for name, _, _ in plan], deltas, folder, delay))
            spent, phases = list(CPU), list(PHASES)
        else:
            measured = [asyncio.run(one_run(engine, name, deltas, folder, delay=delay)) for name, _, _ in plan]
            spent, phases = [0.0] * len(plan), []
        for series in ('rotate', 'blocked'):
            rows = [(name, number, took, cpu) for (name, kind, number), took, cpu in zip(plan, measured, spent, strict=True)
                    if kind == series]
            if rows:
                report_series(engine, series, sides, rows)
            if series == 'rotate' and rows:  # each side after each other side (the rounds' first runs included)
                after: dict[tuple[str, str], list[float]] = {}
                for index in range(1, len(plan)):
                    if plan[index][1] == 'rotate':
                        after.setdefault((plan[index][0], plan[index - 1][0]), []).append(measured[index])
                print(f'  {"":8s} {"after":7s} ' + '  '.join(
                    f'{name}<{before} {statistics.median(values) * 1000:.1f} ms (n={len(values)})'
                    for (name, before), values in sorted(after.items())))
            if phases and rows:
                picked = [(name, phase) for (name, kind, _), phase in zip(plan, phases, strict=True) if kind == series]
                keys = ['client', 'history', 'wft1_wait', 'wft1', 'activity', 'wft2_wait', 'wft2']
                for name in sides:
                    mine = [phase for side_name, phase in picked if side_name == name]
                    print(f'  {"":8s} {"phases":7s} {name:5s} ' + '  '.join(
                        f'{key} {statistics.median(p[key] for p in mine) * 1000:.1f}' for key in keys) + ' ms')


def report_series(engine: str, series: str, sides: list[str], rows: list[tuple[str, int, float, float]]) -> None:
    """Print one order's figures: each side's median wall time (and first quartile: the runs the machine's other load
    delayed least) over `off`'s; for `rotate` also the median of the rounds' own on/off ratios (paired); on Temporal
    the process's CPU per run."""
    times = {name: [took for side_name, _, took, _ in rows if side_name == name] for name in sides}
    cpu = {name: [spent for side_name, _, _, spent in rows if side_name == name] for name in sides}

    def quartile(values: list[float]) -> float:
        return sorted(values)[len(values) // 4]

    off, off_q = statistics.median(times['off']), quartile(times['off'])
    cells = [f'{name} {statistics.median(times[name]) * 1000:7.1f} ms' + (
        '' if name == 'off' else f' {statistics.median(times[name]) / off:.2f}x') for name in sides]
    paired = ''
    if series == 'rotate' and 'on' in sides:
        by_round: dict[int, dict[str, float]] = {}
        for name, number, took, _ in rows:
            by_round.setdefault(number, {})[name] = took
        ratios = [r['on'] / r['off'] for r in by_round.values() if 'on' in r and 'off' in r]
        paired = f'; paired on/off {statistics.median(ratios):.2f}x'
    print(f'  {engine:8s} {series:7s} ' + '  '.join(cells) + paired + '  (target: on <= 1.10x)')
    print(f'  {"":8s} {"p25":7s} ' + '  '.join(f'{name} {quartile(times[name]) * 1000:7.1f} ms' + (
        '' if name == 'off' else f' {quartile(times[name]) / off_q:.2f}x') for name in sides))
    if engine == 'temporal':  # the process's CPU per run (client and worker): steadier than wall time under load
        base = statistics.median(cpu['off'])
        print(f'  {"":8s} {"CPU":7s} ' + '  '.join(f'{name} {statistics.median(cpu[name]) * 1000:7.1f} ms' + (
            '' if name == 'off' else f' {statistics.median(cpu[name]) / base:.2f}x') for name in sides)
            + f'  ({"conversation" if CONVERSATION[0] else "no conversation"})')


def latency(engine: str, deltas: int, folder: Path, delay: float, name: str = 'on') -> None:
    store = f'sqlite:///{folder / "conversations.db"}'
    env = {**os.environ, 'PYTHONPATH': str(ROOT / 'src')}
    if engine == 'prefect':
        prefect_latency(deltas, folder, delay, name, store, env)
        return
    run_id = f'bench-latency-{uuid.uuid4().hex[:8]}' if engine != 'local' else f'local-{uuid.uuid4().hex}'
    watcher = subprocess.Popen([sys.executable, '-m', 'durable_capabilities.cli', 'runs', 'watch', run_id, '--store',
                                store, '--format', 'jsonl', '--wait', '120'], stdout=subprocess.PIPE, text=True, env=env)
    received: list[tuple[float, str]] = []

    ready = threading.Event()

    def read() -> None:  # each line timed as it arrives, while the run goes on
        assert watcher.stdout is not None
        for line in watcher.stdout:
            ready.set()
            event = json.loads(line)
            if event['kind'] == 'text_delta':
                body = event['event']
                received.append((time.time(), body.get('delta', {}).get('content_delta') or body.get('part', {}).get(
                    'content', '')))

    # A first event, before the run, that the subscriber must print: it is then up and polling (starting the CLI takes
    # seconds on a loaded machine, which is not the delay measured here).
    from durable_capabilities.streams import EventLog
    from durable_capabilities.streams._log import Item

    EventLog(store).append_sync(run_id, engine, [Item('bench', 0, 0, 'model_event', {})])
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        while not ready.is_set() and watcher.poll() is None:
            time.sleep(0.05)
        PRODUCED.clear()
        if engine == 'temporal':
            asyncio.run(temporal_runs([(name, run_id)], deltas, folder, delay))
        else:
            asyncio.run(one_run(engine, name, deltas, folder, run_id=run_id, delay=delay))
        watcher.wait(timeout=60)
        reader.join(timeout=10)
    finally:
        if watcher.poll() is None:
            watcher.kill()
            watcher.wait()
    # Lines are read as they come (the pipe is line-buffered by the watcher's flush); the receive time of each is
    # when this process read it.
    report_delays(engine, name, received)


def prefect_latency(deltas: int, folder: Path, delay: float, name: str, store: str, env: dict[str, str]) -> None:
    """(b) on Prefect: the run starts in a thread of this process (`runner.run`, a flow run on the server), its model
    stream holds its first delta until a watcher of the flow run (another process, as on the other engines) has
    printed the run's first event (`run_started`, written before the model request), then produces the deltas."""
    gate = threading.Event()
    PREFECT_GATE.clear()
    PREFECT_GATE['gate'] = gate
    PRODUCED.clear()
    failed: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(one_run('prefect', name, deltas, folder, delay=delay))
        except BaseException as exc:  # noqa: BLE001 - reported below
            failed.append(exc)

    runner_thread = threading.Thread(target=run, daemon=True)
    runner_thread.start()
    deadline = time.monotonic() + 120
    while 'run_id' not in PREFECT_GATE and runner_thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    run_id = PREFECT_GATE.get('run_id')
    if run_id is None:
        gate.set()
        runner_thread.join(timeout=60)
        print(f'  prefect: the run never reached its model request ({failed[0] if failed else "timeout"})')
        return
    watcher = subprocess.Popen([sys.executable, '-m', 'durable_capabilities.cli', 'runs', 'watch', str(run_id),
                                '--store', store, '--format', 'jsonl', '--wait', '120'], stdout=subprocess.PIPE,
                               text=True, env=env)
    received: list[tuple[float, str]] = []

    def read() -> None:
        assert watcher.stdout is not None
        for line in watcher.stdout:
            gate.set()  # the watcher is up and has read what the run wrote so far
            event = json.loads(line)
            if event['kind'] == 'text_delta':
                body = event['event']
                received.append((time.time(), body.get('delta', {}).get('content_delta') or body.get('part', {}).get(
                    'content', '')))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        runner_thread.join(timeout=180)
        watcher.wait(timeout=60)
        reader.join(timeout=10)
    finally:
        gate.set()
        PREFECT_GATE.clear()
        if watcher.poll() is None:
            watcher.kill()
            watcher.wait()
    if failed:
        print(f'  prefect: the run failed: {failed[0]!r}')
    report_delays('prefect', name, received)


def report_delays(engine: str, name: str, received: list[tuple[float, str]]) -> None:
    """Print the median and p95 of each received word's delay from the model producing it."""
    # Each word's delay, from the model producing it to this process reading the event that holds it (deltas that
    # arrived while a write was in flight are one event: each of their words counts).
    delays = sorted(max(0.0, at - PRODUCED[word]) * 1000 for at, text in received
                    for word in re.findall(r'w\d+ ', text) if word in PRODUCED)
    if not delays:
        print(f'  {engine}: no deltas received')
        return
    p95 = delays[min(len(delays) - 1, int(len(delays) * 0.95))]
    print(f'  {engine:8s} {name:5s} {len(delays)} words: median {statistics.median(delays):.1f} ms, p95 {p95:.1f} ms')


def subscriber_memory(folder: Path, count: int = 10_000) -> None:
    from durable_capabilities.streams import EventLog
    from durable_capabilities.streams._log import Item

    store = f'sqlite:///{folder / "memory.db"}'
    log = EventLog(store)
    run_id = f'bench-memory-{uuid.uuid4().hex[:8]}'
    body = {'event': {'index': 0, 'delta': {'content_delta': 'word ', 'part_delta_kind': 'text'},
                      'event_kind': 'part_delta'}}
    for start in range(0, count, 1000):
        log.append_sync(run_id, 'local', [Item('model_request:1', 1, seq, 'text_delta', body)
                                          for seq in range(start, start + 1000)])
    log.append_sync(run_id, 'local', [Item('run', 0, 0, 'run_completed', {'data': {'output': 'x'}})], close=True)
    code = f"""
import asyncio, resource
from durable_capabilities import watch

def rss():
    for line in open('/proc/self/status'):
        if line.startswith('VmRSS:'):
            return int(line.split()[1]) / 1024

async def main():
    n = 0
    async for event in watch({run_id!r}, store={store!r}):
        n += 1
        if n % 1000 == 0:
            print(n, round(rss(), 1), flush=True)
asyncio.run(main())
"""
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True,
                         env={**os.environ, 'PYTHONPATH': str(ROOT / 'src')}).stdout.split()
    samples = [(int(out[i]), float(out[i + 1])) for i in range(0, len(out), 2)]
    first, last = samples[0][1], samples[-1][1]
    print(f'(c) subscriber RSS over {count} events: ' + ', '.join(f'{n}: {mb} MB' for n, mb in samples)
          + f'; growth {last - first:+.1f} MB from 1,000 to {samples[-1][0]} events')


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument('--runs', type=int, default=5)
    parser.add_argument('--engines', default='local,dbos,temporal')
    parser.add_argument('--deltas', type=int, default=200)
    parser.add_argument('--delay', type=float, default=0.0, help='seconds between the model\'s deltas (0: as fast as '
                        'the scripted model goes; the unstreamed side sends the plain request, with no delay)')
    parser.add_argument('--sides', default='off,on', help='(a)\'s sides, from off,read,bare,timer,on (see the module '
                        'docstring); off is always measured')
    parser.add_argument('--only', choices=['a', 'b', 'c'], help='run only this part')
    parser.add_argument('--order', choices=ORDERS, default='both', help='(a)\'s run order: rotated rounds, blocks of '
                        'each side, or both in turn (see ORDERS)')
    parser.add_argument('--phases', action='store_true', help='(a) on Temporal: also the median of each phase of '
                        'the runs from their histories (`history_phases`), and `client`: wall time outside the history')
    parser.add_argument('--block', type=int, default=5, help='(a) blocked: measured runs per block (after its '
                        'warm-up run)')
    parser.add_argument('--prefect-api-url', default=os.environ.get('DURCAP_TEST_PREFECT_API_URL')
                        or os.environ.get('PREFECT_API_URL'), help='a Prefect server for `--engines prefect` (default: '
                        '$DURCAP_TEST_PREFECT_API_URL, $PREFECT_API_URL, else a server started here)')
    parser.add_argument('--temporal-address', default=os.environ.get('DURCAP_TEST_TEMPORAL_ADDRESS')
                        or os.environ.get('DURCAP_TEMPORAL_ADDRESS'), help='a Temporal server (default: '
                        '$DURCAP_TEST_TEMPORAL_ADDRESS, $DURCAP_TEMPORAL_ADDRESS, else a dev server started here)')
    parser.add_argument('--conversation', action='store_true', help='Temporal: each run of (a) in a conversation of '
                        'its own (a load and an append activity)')
    args = parser.parse_args()
    CONVERSATION[0] = args.conversation
    WANT_PHASES[0] = args.phases
    engines = args.engines.split(',')
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        folder = Path(tmp)
        if 'temporal' in engines:
            address = args.temporal_address
            if not address:
                from durable_capabilities.engines.temporal import start_temporal_dev_server

                server = start_temporal_dev_server(state_dir=folder / 'temporal', persistent=False)
                stack.callback(server.stop)
                address = server.address
            TEMPORAL_ADDRESS.append(address)
        if 'prefect' in engines:
            url = args.prefect_api_url
            if not url:
                from durable_capabilities.engines.prefect import start_prefect_server

                prefect_server = start_prefect_server(home=folder / 'prefect-server')
                stack.callback(prefect_server.stop)
                url = prefect_server.address
            os.environ['PREFECT_API_URL'] = url  # the flow runs of this process, and the watcher's
        sides = ['off', *(name for name in args.sides.split(',') if name != 'off')]
        if any(name not in SIDES for name in sides):
            parser.error(f'--sides {args.sides}: each side is one of {", ".join(SIDES)}')
        if args.only in (None, 'a'):
            wall_times(engines, args.runs, args.deltas, folder, args.delay, sides, args.order, args.block)
        if args.only in (None, 'b'):
            print('(b) delta latency, model -> subscriber in another process (durcap runs watch --format jsonl), '
                  '100 deltas 20 ms apart')
            for engine in engines:
                for name in [side for side in sides if side in ('timer', 'on')]:
                    latency(engine, 100, folder, 0.02, name)
        if args.only in (None, 'c'):
            subscriber_memory(folder)


if __name__ == '__main__':
    main()
