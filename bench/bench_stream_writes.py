"""Benchmark: what a run's live event stream costs the process whose durable units publish it (issue 29 item 5),
apart from any engine: CPU a run of the stream's work and CPU a write of the store's writer thread.

    PYTHONPATH=src:bench .venv/bin/python bench/bench_stream_writes.py [--runs 100] [--rounds 5] [--group 20]

(a) `--runs` concurrent runs in one event loop, each the 6 model requests of `_common.py`'s scripted run (the
    messages each request of the real run is sent, recorded from one `Agent` run of the same model and capability)
    sent through `streams.StreamingModel` as a Temporal worker's model request activity sends them: each request
    inside `streams.publishing(run, 'temporal', store, attempt=1)` (a durable unit: every write flushed, its close
    awaited), the first carrying `run_started` + `capability_catalog` (`StreamContext.carried`), then `run_completed`
    closing the stream (`EventLog.append`, what the publish local activity writes). Against the same requests sent
    with no stream; rounds alternate the two. Prints the process's CPU a run (`time.process_time`, every thread) on
    and off, their difference (the stream), and the writer thread's own CPU a run.
(b) The writer thread alone: `--group` model-request batches (2 events each, `EventLog.append_unit_in`, each run's
    first: the stream row created) queued while the thread is held, then committed as one group (as 100 runs in
    flight queue them), 150 groups a round; prints the writer thread's CPU a write (`time.thread_time` read in the
    thread itself).

Model: the scripted `FunctionModel` of `_common.py`. Store: SQLite files in a temporary folder. No targets; the
figures are for side by side runs of two checkouts (bench/README.md).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import tempfile
import threading
import time
import uuid
from typing import Any

import _common as c
from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessage, ModelResponse
from pydantic_ai.models import ModelRequestParameters
from pydantic_ai.models.function import AgentInfo, FunctionModel

from durable_capabilities import streams
from durable_capabilities.streams._log import EventLog, Item
from durable_capabilities.streams._publish import StreamingModel


def recorded_requests() -> list[list[ModelMessage]]:
    """The messages each of the scripted run's 6 model requests is sent."""
    captured: list[list[ModelMessage]] = []

    def capture(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        captured.append(list(messages))
        return c.script(messages, info)

    Agent(FunctionModel(capture), instructions=c.INSTRUCTIONS, capabilities=[c.make_capability()]).run_sync(c.PROMPT)
    assert len(captured) == c.MODEL_REQUESTS, len(captured)
    return captured


def writer_cpu(log: EventLog) -> float:
    """The store's writer thread's CPU seconds so far, read in that thread."""
    return log.submit('bench-clock', lambda cur: time.thread_time()).result()


async def stream_cost(requests: list[list[ModelMessage]], runs: int, rounds: int, gap: float) -> None:
    params = ModelRequestParameters()
    model = StreamingModel(c.make_model())
    url = f'sqlite:///{tempfile.mkdtemp(prefix="bench-stream-writes-")}/store.db'
    log = EventLog(url)

    async def one_run(on: bool) -> None:
        run_id = f'bench-{uuid.uuid4().hex}'
        for index, messages in enumerate(requests):
            await asyncio.sleep(random.uniform(0, gap))  # noqa: S311 - the workflow's turn between activities, spread
            if not on:
                await model.request(messages, None, params)
                continue
            with streams.publishing(run_id, 'temporal', url, attempt=1) as context:
                assert context is not None
                if index == 0:
                    context.carried = [Item('run', 0, 0, 'run_started', {'data': {'agent': 'bench'}}),
                                       Item('run', 0, 1, 'capability_catalog', {'data': {'capabilities': ['ops']}})]
                await model.request(messages, None, params)
        if on:
            await log.append(run_id, 'temporal', [Item('run', 0, 2, 'run_completed', {'data': {'output': c.ANSWER}})],
                             close=True)

    await asyncio.gather(*(one_run(True) for _ in range(10)))  # warm-up: the store's schema, imports
    cpu: dict[bool, list[float]] = {True: [], False: []}
    writer: list[float] = []
    for r in range(rounds):
        for on in (True, False) if r % 2 == 0 else (False, True):
            began, thread_began = time.process_time(), writer_cpu(log)
            await asyncio.gather(*(one_run(on) for _ in range(runs)))
            cpu[on].append((time.process_time() - began) / runs)
            if on:
                writer.append((writer_cpu(log) - thread_began) / runs)
    on, off = statistics.median(cpu[True]), statistics.median(cpu[False])
    print(f'(a) {runs} concurrent runs x {rounds} rounds: CPU a run with the stream {on * 1e3:.2f} ms, without '
          f'{off * 1e3:.2f} ms: the stream {(on - off) * 1e3:.2f} ms a run, of which the writer thread '
          f'{statistics.median(writer) * 1e3:.2f} ms (load {os.getloadavg()[0]:.1f})', flush=True)


def writer_cost(group: int, groups: int = 150, rounds: int = 3) -> None:
    log = EventLog(f'sqlite:///{tempfile.mkdtemp(prefix="bench-stream-writes-")}/store.db')
    log.append_sync('bench-clock', 'temporal', [Item('run', 0, 0, 'x', {})])
    body: dict[str, Any] = {'event': {'part': {'tool_name': 'lookup_order', 'args': {'order_id': 'A-1'},
                                               'tool_call_id': 'call-1', 'part_kind': 'tool-call'},
                                      'event_kind': 'part_start', 'index': 0}}
    per_write = []
    for r in range(rounds):
        began = writer_cpu(log)
        for g in range(groups):
            gate = threading.Event()
            log.submit('bench-clock', lambda cur, gate=gate: gate.wait())
            futures = [log.submit(run_id, lambda cur, run_id=run_id: log.append_unit_in(
                cur, run_id, 'temporal', 'model_request:1', [(0, 'model_event', body), (1, 'model_event', body)], None,
                at_least=1)) for run_id in (f'w{r}-{g}-{i}' for i in range(group))]
            gate.set()
            for future in futures:
                future.result()
        per_write.append((writer_cpu(log) - began) / (groups * group))
    print(f'(b) writer thread CPU a write ({group} writes a group): {statistics.median(per_write) * 1e3:.3f} ms '
          f'(rounds {", ".join(f"{x * 1e3:.3f}" for x in per_write)}; load {os.getloadavg()[0]:.1f})', flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--runs', type=int, default=100)
    parser.add_argument('--rounds', type=int, default=5)
    parser.add_argument('--gap', type=float, default=0.05, help='most seconds a run waits before each request')
    parser.add_argument('--group', type=int, default=20)
    args = parser.parse_args()
    asyncio.run(stream_cost(recorded_requests(), args.runs, args.rounds, args.gap))
    writer_cost(args.group)


if __name__ == '__main__':
    main()
