"""Benchmark: 100 concurrent 6-request runs on one Temporal worker and on one DBOS process: durcap against the
engine's floor and against upstream.

    .venv/bin/python bench/bench_throughput.py                      # both engines: 100 runs a batch, 3 interleaved
                                                                    # rounds; an in-memory Temporal dev server and
                                                                    # SQLite DBOS databases started here
    .venv/bin/python bench/bench_throughput.py --engines dbos --rounds 5
    .venv/bin/python bench/bench_throughput.py --engines dbos --dbos-postgres postgresql://postgres@127.0.0.1:5432
    .venv/bin/python bench/bench_throughput.py --engines temporal --runs 50 --rounds 5 --address 127.0.0.1:7233

Temporal: four worker processes, one per variant, each on its own task queue, all alive throughout (started here,
stopped by pid):
- durcap:   `engines.temporal.make_worker` serving a `DurableAgent` of the scripted 6-request run (`_common.py`).
- upstream: a plain `Worker` serving `_common.UpstreamWorkflow` (`Agent(capabilities=[..., TemporalDurability()])`).
- floor:    a plain `Worker` serving `_common.FloorWorkflow`: as many no-op activities, one after another, as one
            durcap run schedules (counted from a first run), no agent, no model.
- durcap-local: as durcap, the capability's tools marked short by hand (`local_activity_toolsets`: local activities).
- durcap-measured: as durcap, no hand marking: after a few durcap runs are recorded, this script runs
            `durcap lock bench/throughput_agent.py:agent --measure` (a subprocess; the lock written to a temporary
            folder), and this worker loads the agent with that lock (`targets.load_checked`, as `durcap worker
            temporal` does): the leaves the lock decided local run as local activities.
Workers use the SDK's default concurrency (100 workflow tasks, 100 activities at once). A batch starts `--runs`
workflows at once from this process (`start_workflow` for each side alike, no eager start: the worker is elsewhere)
and waits for every result; throughput = runs / (seconds from the first start to the last result).

DBOS: four processes, one per variant, each with its own system database (SQLite in WAL mode in a temporary folder,
or with `--dbos-postgres` a new PostgreSQL database per variant, dropped at the end), all alive throughout; each
runs its batches itself when this process asks (a line on its stdin), so a batch is `--runs` workflows started at
once in that one DBOS process (`asyncio.gather` of the workflow calls) and throughput = runs / seconds to the last
result:
- dbos-durcap:         `engines.dbos.agent_workflow(agent)` (what `durcap run` and `durcap worker dbos` run), tool
                       steps on (the default): 6 model-request steps and 4 tool steps a run.
- dbos-upstream:       `Agent(capabilities=[..., DBOSDurability()])` in a hand-written `@DBOS.workflow` (function
                       tools inline, unrecorded: 6 steps a run).
- dbos-upstream-steps: the same with each tool function a hand-written `@DBOS.step` (10 steps a run, as durcap).
- dbos-floor:          a `@DBOS.workflow` running as many no-op async `@DBOS.step`s, one after another, as one durcap
                       run records (counted from a first run), no agent, no model.
Each DBOS process also reports its own CPU seconds per run (`time.process_time`, every thread), steadier than
throughput on a shared machine.

Rounds cycle the order of the variants; ratios are per round (same conditions), their median reported.

Targets (issue 14): durcap >= 0.8x the floor on Temporal and >= 0.6x on DBOS, >= 1.0x upstream in throughput on
both; peak RSS of the durcap worker / process <= 1.1x the upstream one's (VmHWM from /proc after all rounds).
Issue 29 (item 5): durcap-measured >= 1.2x upstream per worker.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / 'src'))

import _common as c  # noqa: E402

AGENT_NAME = 'bench_tp_durcap'  # the agent of `throughput_agent.py` (the measured variant's TARGET)
MEASURED_TARGET = str(HERE / 'throughput_agent.py') + ':agent'
TARGET_FLOOR, TARGET_UPSTREAM, TARGET_RSS = 0.8, 1.0, 1.1
TARGET_MEASURED = 1.2  # issue 29 item 5: a worker whose local tools the measured lock decided, against upstream
TARGET_DBOS_FLOOR = 0.6
MEASURE_RUNS = 3  # durcap runs recorded before `durcap lock --measure` (4 tool calls each; it needs 5 to decide)
KINDS = ('durcap', 'upstream', 'floor', 'durcap-local', 'durcap-measured')
DBOS_KINDS = ('dbos-durcap', 'dbos-upstream', 'dbos-upstream-steps', 'dbos-floor')


T = TypeVar('T')


async def interleaved_rounds(
    rounds: int, kinds: Sequence[str], batch: Callable[[str], Awaitable[T]], show: Callable[[T], str]
) -> tuple[list[dict[str, T]], list[float]]:
    """`rounds` rounds of one `batch(kind)` per kind, each round in the next permutation of `kinds` (so no kind
    always runs first or last), printing each round with `show` and the 1-minute load average.

    Returns:
        `(per_round, loads)`: each round's `{kind: batch result}` and the load average after it.
    """
    orders = list(itertools.permutations(kinds))
    per_round: list[dict[str, T]] = []
    loads: list[float] = []
    for r in range(rounds):
        figures = {kind: await batch(kind) for kind in orders[r % len(orders)]}
        loads.append(os.getloadavg()[0])
        per_round.append(figures)
        print(f'round {r + 1}: ' + ', '.join(f'{k} {show(v)}' for k, v in figures.items()) + f' (load {loads[-1]:.1f})',
              flush=True)
    return per_round, loads


def durcap_agent(local: bool = False) -> Any:
    """The durcap agent; `local=True` marks the capability's tools short (Temporal local activities)."""
    from durable_capabilities import DurableAgent

    options = {'temporal': {'local_activity_toolsets': {c.CAPABILITY_ID: {}}}} if local else None
    return DurableAgent(AGENT_NAME, c.make_model(), instructions=c.INSTRUCTIONS, capabilities=[c.make_capability()],
                        engine_options=options)


async def serve(kind: str, address: str, queue: str, lock: str | None = None) -> None:
    """`--serve KIND`: run one worker until SIGTERM; print READY once it polls. `lock`: for `durcap-measured`, the
    lockfile `durcap lock --measure` wrote."""
    from temporalio.worker import Worker
    from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner, SandboxRestrictions

    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    runner = SandboxedWorkflowRunner(restrictions=SandboxRestrictions.default.with_passthrough_modules(c.__name__))
    if kind in ('durcap', 'durcap-local'):
        from durable_capabilities.engines import temporal

        client = await temporal.connect(address)
        worker = temporal.make_worker(client, [durcap_agent(kind == 'durcap-local')], queue)
    elif kind == 'durcap-measured':
        from durable_capabilities.engines import temporal
        from durable_capabilities.targets import load_checked

        # What `durcap worker temporal TARGET --lock LOCK` loads: the definitions compared with the lock and the lock's
        # decisions (`local_activity_toolsets`) applied.
        loaded = load_checked(MEASURED_TARGET, lock=lock, engines=['temporal'])
        marked = {a.name: sorted(a.engine_options.get('temporal', {}).get(temporal.LOCAL_TOOLSETS_OPTION, {}))
                  for a in loaded.agents}
        print(f'local leaves from the lock: {marked}', flush=True)
        client = await temporal.connect(address)
        worker = temporal.make_worker(client, loaded.agents, queue)
    elif kind == 'upstream':
        from pydantic_ai.durable_exec.temporal import PydanticAIPlugin
        from temporalio.client import Client

        client = await Client.connect(address, plugins=[PydanticAIPlugin()])
        worker = Worker(client, task_queue=queue, workflows=[c.UpstreamWorkflow], workflow_runner=runner)
    else:
        from temporalio.client import Client

        client = await Client.connect(address)
        worker = Worker(client, task_queue=queue, workflows=[c.FloorWorkflow], activities=[c.noop_activity],
                        workflow_runner=runner)
    async with worker:
        print('READY', flush=True)
        await stop.wait()


class WorkerProc:
    def __init__(self, kind: str, address: str, queue: str, tmp: Path, lock: Path | None = None) -> None:
        self.kind, self.queue, self.log = kind, queue, tmp / f'{kind}.log'
        with open(self.log, 'wb') as out:
            self.popen = subprocess.Popen(
                [sys.executable, __file__, '--serve', kind, '--address', address, '--queue', queue,
                 *(['--lock', str(lock)] if lock is not None else [])],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, 'PYTHONPATH': f'{ROOT / "src"}{os.pathsep}{HERE}'})

    def wait_ready(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if 'READY' in self.log.read_text(errors='replace'):
                return
            if self.popen.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError(f'{self.kind} worker not ready:\n{self.log.read_text(errors="replace")[-3000:]}')

    def cpu_seconds(self) -> float:
        """CPU seconds the worker process has used so far (user + system, every thread; `/proc/PID/stat`)."""
        fields = Path(f'/proc/{self.popen.pid}/stat').read_text().rsplit(')', 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf('SC_CLK_TCK')

    def peak_rss_mib(self) -> float:
        for line in Path(f'/proc/{self.popen.pid}/status').read_text().splitlines():
            if line.startswith('VmHWM:'):
                return int(line.split()[1]) / 1024
        raise RuntimeError('no VmHWM')

    def stop(self) -> None:
        if self.popen.poll() is None:
            os.kill(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.kill(self.popen.pid, signal.SIGKILL)
                self.popen.wait(timeout=30)


async def amain_temporal(args: argparse.Namespace) -> None:
    from pydantic_ai.durable_exec.temporal import PydanticAIPlugin
    from temporalio.api.enums.v1 import EventType
    from temporalio.client import Client

    from durable_capabilities.engines import temporal
    from durable_capabilities.engines.temporal import AgentRunInput, AgentRunOutput, start_temporal_dev_server

    tmp = Path(tempfile.mkdtemp(prefix='bench-throughput-'))
    server = None
    address = args.address
    if address is None:
        server = start_temporal_dev_server(state_dir=tmp / 'temporal', persistent=False)
        address = server.address
        print(f'temporal dev server pid {server.pid} at {address}', flush=True)
    tag = uuid.uuid4().hex[:6]
    workers = {kind: WorkerProc(kind, address, f'tp-{kind}-{tag}', tmp) for kind in KINDS if kind != 'durcap-measured'}
    try:
        for w in workers.values():
            await asyncio.to_thread(w.wait_ready)
        durcap_client = await temporal.connect(address)
        upstream_client = await Client.connect(address, plugins=[PydanticAIPlugin()])
        floor_client = await Client.connect(address)

        # One durcap run first: check it and count its activities (the floor runs as many).
        handle = await durcap_client.start_workflow(f'durcap.{AGENT_NAME}', AgentRunInput(prompt=c.PROMPT),
                                                    id=f'tp-first-{uuid.uuid4()}', task_queue=workers['durcap'].queue,
                                                    result_type=AgentRunOutput)
        c.check_messages((await handle.result()).new_messages)
        history = [e async for e in handle.fetch_history_events()]
        activities = sum(1 for e in history if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED)
        print(f'one durcap run: {len(history)} history events, {activities} activities; the floor runs {activities} '
              'no-op activities', flush=True)
        workers['durcap-measured'] = await measured_worker(durcap_client, address, workers['durcap'].queue, tmp, tag)

        def starter(kind: str) -> Any:
            queue = workers[kind].queue
            if kind in ('durcap', 'durcap-local', 'durcap-measured'):
                return lambda i: durcap_client.start_workflow(
                    f'durcap.{AGENT_NAME}', AgentRunInput(prompt=c.PROMPT), id=f'tp-d-{tag}-{i}-{uuid.uuid4().hex[:6]}',
                    task_queue=queue, result_type=AgentRunOutput)
            if kind == 'upstream':
                return lambda i: upstream_client.start_workflow(
                    c.UpstreamWorkflow.run, c.PROMPT, id=f'tp-u-{tag}-{i}-{uuid.uuid4().hex[:6]}', task_queue=queue)
            return lambda i: floor_client.start_workflow(
                c.FloorWorkflow.run, activities, id=f'tp-f-{tag}-{i}-{uuid.uuid4().hex[:6]}', task_queue=queue)

        async def batch(kind: str) -> tuple[float, float]:
            start = starter(kind)
            cpu = workers[kind].cpu_seconds()
            began = time.perf_counter()
            handles = await asyncio.gather(*(start(i) for i in range(args.runs)))
            results = await asyncio.gather(*(h.result() for h in handles))
            elapsed = time.perf_counter() - began
            expected = {'durcap': lambda r: r.output == c.ANSWER, 'durcap-local': lambda r: r.output == c.ANSWER,
                        'durcap-measured': lambda r: r.output == c.ANSWER,
                        'upstream': lambda r: r == c.ANSWER,
                        'floor': lambda r: r == activities}[kind]
            if not all(expected(r) for r in results):
                raise AssertionError(f'{kind}: unexpected results')
            return args.runs / elapsed, (workers[kind].cpu_seconds() - cpu) / args.runs

        await batch('floor')  # warm-up: every worker's first batch (imports, sandbox caches)
        await batch('upstream')
        await batch('durcap')
        await batch('durcap-local')
        await batch('durcap-measured')
        kinds = KINDS
        per_round, loads = await interleaved_rounds(args.rounds, kinds, batch,
                                                    lambda v: f'{v[0]:.1f} runs/s ({v[1] * 1e3:.0f} ms CPU/run)')
        rss = {k: w.peak_rss_mib() for k, w in workers.items()}
    finally:
        for w in workers.values():
            w.stop()
        if server is not None:
            server.stop()

    def ratio(a: str, b: str, index: int = 0) -> float:
        return statistics.median(f[a][index] / f[b][index] for f in per_round)

    def verdict(value: float, target: float, above: bool = True) -> str:
        return 'met' if (value >= target if above else value <= target) else 'NOT met'

    med = {k: statistics.median(f[k][0] for f in per_round) for k in kinds}
    cpu = {k: statistics.median(f[k][1] for f in per_round) for k in kinds}
    rss_ratio = rss['durcap'] / rss['upstream']
    print(f'\n{args.runs} concurrent runs a batch, {args.rounds} rounds; load average (1 min) per round '
          f'{", ".join(f"{x:.1f}" for x in loads)} on {os.cpu_count()} CPU')
    print('throughput medians (runs/s), worker CPU per run medians (ms): ' + ', '.join(
        f'{k} {med[k]:.1f} ({cpu[k] * 1e3:.0f} ms)' for k in kinds))
    print('ratios are medians of per-round ratios; "CPU" = upstream worker CPU per run / this worker\'s (higher is '
          'better, as throughput: the runs one worker serves per CPU second)')
    for kind, target in (('durcap', TARGET_UPSTREAM), ('durcap-local', TARGET_UPSTREAM),
                         ('durcap-measured', TARGET_MEASURED)):
        vs_up, vs_floor = ratio(kind, 'upstream'), ratio(kind, 'floor')
        cpu_up = statistics.median(f['upstream'][1] / f[kind][1] for f in per_round)
        print(f'{kind + " / upstream":<27} {vs_up:.3f}x (CPU {cpu_up:.3f}x)   target >= {target}x: '
              f'{verdict(vs_up, target)};   / floor {vs_floor:.3f}x   target >= {TARGET_FLOOR}x: '
              f'{verdict(vs_floor, TARGET_FLOOR)}')
    print(f'upstream / floor            {ratio("upstream", "floor"):.2f}x   (info)')
    print(f'peak RSS (MiB): durcap {rss["durcap"]:.0f}, upstream {rss["upstream"]:.0f}, floor {rss["floor"]:.0f}, '
          f'durcap-local {rss["durcap-local"]:.0f}, durcap-measured {rss["durcap-measured"]:.0f}; durcap / upstream '
          f'{rss_ratio:.2f}x   target <= {TARGET_RSS}x: {verdict(rss_ratio, TARGET_RSS, above=False)}')


async def measured_worker(client: Any, address: str, queue: str, tmp: Path, tag: str) -> WorkerProc:
    """The `durcap-measured` worker: record `MEASURE_RUNS` more durcap runs on `queue` (the plain durcap worker's), run
    `durcap lock TARGET --measure` on the server, and start a worker from the lock it wrote; returns it ready."""
    from durable_capabilities.engines.temporal import AgentRunInput, AgentRunOutput

    handles = [await client.start_workflow(f'durcap.{AGENT_NAME}', AgentRunInput(prompt=c.PROMPT),
                                           id=f'tp-measure-{tag}-{i}', task_queue=queue, result_type=AgentRunOutput)
               for i in range(MEASURE_RUNS)]
    for handle in handles:
        await handle.result()
    query = f'WorkflowType = "durcap.{AGENT_NAME}" AND ExecutionStatus != "Running"'
    for _ in range(200):  # visibility is eventually consistent
        if (await client.count_workflows(query)).count >= MEASURE_RUNS + 1:
            break
        await asyncio.sleep(0.05)
    lock = tmp / 'durable.lock'
    measure = await asyncio.to_thread(
        subprocess.run, [sys.executable, '-m', 'durable_capabilities.cli', 'lock', MEASURED_TARGET, '--measure',
                         '--address', address, '--output', str(lock)],
        capture_output=True, text=True, env={**os.environ, 'PYTHONPATH': f'{ROOT / "src"}{os.pathsep}{HERE}'})
    if measure.returncode != 0:
        raise RuntimeError(f'durcap lock --measure failed ({measure.returncode}):\n{measure.stderr[-3000:]}')
    print('durcap lock --measure: ' + ' | '.join(line for line in measure.stderr.splitlines() if line.strip()),
          flush=True)
    worker = WorkerProc('durcap-measured', address, f'tp-durcap-measured-{tag}', tmp, lock=lock)
    await asyncio.to_thread(worker.wait_ready)
    print(next(line for line in worker.log.read_text().splitlines() if line.startswith('local leaves')), flush=True)
    return worker


# ---- DBOS ---------------------------------------------------------------------------------------------


async def serve_dbos(kind: str, db: str) -> None:
    """`--serve-dbos KIND --db URL`: one DBOS process running one variant's workflows. Prints `READY`, then answers
    each line of stdin: `count` (one run; prints `COUNT {steps it recorded}`), `batch N [STEPS]` (N runs at once;
    prints `BATCH {seconds} {cpu seconds}`), `quit`."""
    import uuid as uuid_

    from dbos import DBOS, SetWorkflowID
    from pydantic_ai.durable_exec.dbos import DBOSDurability

    floor_steps = 0
    if kind == 'dbos-durcap':
        from durable_capabilities.engines import dbos as durcap_dbos

        workflow = durcap_dbos.agent_workflow(durcap_agent())

        async def run() -> Any:
            return (await workflow(c.PROMPT))['output']
    elif kind in ('dbos-upstream', 'dbos-upstream-steps'):
        name = 'bench_tp_up_dbos' + ('_steps' if kind == 'dbos-upstream-steps' else '')
        tools = c.dbos_step_tools(name) if kind == 'dbos-upstream-steps' else c.TOOLS
        agent = c.upstream_agent(name, DBOSDurability(), tools=tools)

        @DBOS.workflow(name=f'{name}.run')
        async def upstream_run(prompt: str) -> str:
            return (await agent.run(prompt)).output

        async def run() -> Any:
            return await upstream_run(c.PROMPT)
    else:
        @DBOS.step(name='bench.noop')
        async def noop(i: int) -> int:
            return i

        @DBOS.workflow(name='bench.floor')
        async def floor(count: int) -> int:
            for i in range(count):
                await noop(i)
            return count

        async def run() -> Any:
            await floor(floor_steps)
            return c.ANSWER

    if kind == 'dbos-durcap':
        durcap_dbos.launch('bench-tp', system_database_url_=db)
    else:
        DBOS(config={'name': 'bench-tp', 'system_database_url': db, 'log_level': 'WARNING'})  # type: ignore[typeddict-item]
        DBOS.launch()
    try:
        print('READY', flush=True)
        while True:
            line = (await asyncio.to_thread(sys.stdin.readline)).split()
            if not line or line[0] == 'quit':
                break
            if line[0] == 'count':
                workflow_id = f'tp-count-{uuid_.uuid4()}'
                with SetWorkflowID(workflow_id):
                    if await run() != c.ANSWER:
                        raise AssertionError(f'{kind}: unexpected output')
                print(f'COUNT {len(await DBOS.list_workflow_steps_async(workflow_id))}', flush=True)
                continue
            runs = int(line[1])
            if len(line) > 2:
                floor_steps = int(line[2])
            cpu, began = time.process_time(), time.perf_counter()
            outputs = await asyncio.gather(*(run() for _ in range(runs)))
            elapsed, cpu = time.perf_counter() - began, time.process_time() - cpu
            if any(output != c.ANSWER for output in outputs):
                raise AssertionError(f'{kind}: unexpected output')
            print(f'BATCH {elapsed} {cpu}', flush=True)
    finally:
        DBOS.destroy()


class DBOSProc(WorkerProc):
    """A `--serve-dbos` process, driven through its stdin."""

    def __init__(self, kind: str, db: str, tmp: Path) -> None:
        self.kind, self.log = kind, tmp / f'{kind}.log'
        with open(self.log, 'wb') as out:
            self.popen = subprocess.Popen(
                [sys.executable, __file__, '--serve-dbos', kind, '--db', db], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=out, start_new_session=True, text=True,
                env={**os.environ, 'PYTHONPATH': f'{ROOT / "src"}{os.pathsep}{HERE}'})

    def ask(self, command: str, expect: str, timeout: float = 600) -> list[str]:
        """Send `command`, return the fields of the answer line starting with `expect`."""
        assert self.popen.stdin is not None and self.popen.stdout is not None
        if command:
            self.popen.stdin.write(command + '\n')
            self.popen.stdin.flush()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.popen.stdout.readline()
            if not line:
                break
            if line.startswith(expect):
                return line.split()[1:]
        raise RuntimeError(f'{self.kind}: no {expect} answer:\n{self.log.read_text(errors="replace")[-3000:]}')

    def stop(self) -> None:
        if self.popen.poll() is None and self.popen.stdin is not None:
            try:
                self.popen.stdin.write('quit\n')
                self.popen.stdin.flush()
                self.popen.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                pass
        super().stop()


def _postgres_databases(base: str, tag: str) -> tuple[dict[str, str], Any]:
    """One new database per DBOS variant on the server of `base` (`postgresql://user@host:port`); returns the URLs
    and a function that drops them."""
    import psycopg

    admin = f'{base.rstrip("/")}/postgres'
    names = {kind: f'bench_tp_{kind.replace("-", "_")}_{tag}' for kind in DBOS_KINDS}
    with psycopg.connect(admin, autocommit=True) as conn:
        for name in names.values():
            conn.execute(f'CREATE DATABASE {name}')

    def drop() -> None:
        with psycopg.connect(admin, autocommit=True) as conn:
            for name in names.values():
                conn.execute(f'DROP DATABASE IF EXISTS {name} WITH (FORCE)')

    return {kind: f'{base.rstrip("/")}/{name}' for kind, name in names.items()}, drop


async def amain_dbos(args: argparse.Namespace) -> None:
    import sqlite3

    tmp = Path(tempfile.mkdtemp(prefix='bench-throughput-dbos-'))
    tag = uuid.uuid4().hex[:6]
    drop = None
    if args.dbos_postgres:
        urls, drop = _postgres_databases(args.dbos_postgres, tag)
        backend = 'PostgreSQL'
    else:
        urls = {}
        for kind in DBOS_KINDS:
            path = tmp / f'{kind}.sqlite'
            with sqlite3.connect(path) as conn:  # as durcap's default database: WAL journal mode
                conn.execute('PRAGMA journal_mode=WAL')
            urls[kind] = f'sqlite:///{path}'
        backend = 'SQLite (WAL)'
    procs = {kind: DBOSProc(kind, urls[kind], tmp) for kind in DBOS_KINDS}
    per_round: list[dict[str, tuple[float, float]]] = []
    loads = []
    try:
        for proc in procs.values():
            await asyncio.to_thread(proc.ask, '', 'READY', 180)
        steps = int((await asyncio.to_thread(procs['dbos-durcap'].ask, 'count', 'COUNT'))[0])
        hand_steps = int((await asyncio.to_thread(procs['dbos-upstream-steps'].ask, 'count', 'COUNT'))[0])
        print(f'[dbos] {backend}; one durcap run records {steps} steps (upstream with @DBOS.step tools: {hand_steps}); '
              f'the floor runs {steps} no-op steps', flush=True)

        async def batch(kind: str) -> tuple[float, float]:
            extra = f' {steps}' if kind == 'dbos-floor' else ''
            seconds, cpu = (float(x) for x in await asyncio.to_thread(procs[kind].ask, f'batch {args.runs}{extra}', 'BATCH'))
            return args.runs / seconds, cpu / args.runs

        for kind in DBOS_KINDS:  # warm-up: every process's first batch
            await batch(kind)
        per_round, loads = await interleaved_rounds(args.rounds, DBOS_KINDS, batch,
                                                    lambda v: f'{v[0]:.1f} runs/s ({v[1] * 1e3:.0f} ms CPU/run)')
        rss = {k: p.peak_rss_mib() for k, p in procs.items()}
    finally:
        for proc in procs.values():
            proc.stop()
        if drop is not None:
            drop()

    def ratio(a: str, b: str, index: int = 0) -> float:
        return statistics.median(f[a][index] / f[b][index] for f in per_round)

    med = {k: statistics.median(f[k][0] for f in per_round) for k in DBOS_KINDS}
    cpu = {k: statistics.median(f[k][1] for f in per_round) for k in DBOS_KINDS}
    print(f'\n[dbos] {args.runs} concurrent runs a batch in one process, {args.rounds} rounds, {backend}; load average '
          f'(1 min) per round {", ".join(f"{x:.1f}" for x in loads)} on {os.cpu_count()} CPU')
    print('throughput medians (runs/s), CPU per run medians (ms): ' + ', '.join(
        f'{k.removeprefix("dbos-")} {med[k]:.1f} ({cpu[k] * 1e3:.0f} ms)' for k in DBOS_KINDS))

    def verdict(value: float, target: float, above: bool = True) -> str:
        return 'met' if (value >= target if above else value <= target) else 'NOT met'

    vs_floor = ratio('dbos-durcap', 'dbos-floor')
    vs_up = ratio('dbos-durcap', 'dbos-upstream')
    vs_up_steps = ratio('dbos-durcap', 'dbos-upstream-steps')
    print(f'durcap / floor                  {vs_floor:.2f}x   target >= {TARGET_DBOS_FLOOR}x: '
          f'{verdict(vs_floor, TARGET_DBOS_FLOOR)}')
    print(f'durcap / upstream (tools inline) {vs_up:.2f}x   target >= {TARGET_UPSTREAM}x: {verdict(vs_up, TARGET_UPSTREAM)}')
    print(f'durcap / upstream (@DBOS.step)   {vs_up_steps:.2f}x   target >= {TARGET_UPSTREAM}x: '
          f'{verdict(vs_up_steps, TARGET_UPSTREAM)}')
    print(f'upstream / floor {ratio("dbos-upstream", "dbos-floor"):.2f}x, upstream (@DBOS.step) / floor '
          f'{ratio("dbos-upstream-steps", "dbos-floor"):.2f}x   (info)')
    print(f'CPU per run, durcap / upstream (inline) {ratio("dbos-durcap", "dbos-upstream", 1):.2f}x, durcap / upstream '
          f'(@DBOS.step) {ratio("dbos-durcap", "dbos-upstream-steps", 1):.2f}x   (info; lower is better)')
    for other in ('dbos-upstream', 'dbos-upstream-steps'):
        rss_ratio = rss['dbos-durcap'] / rss[other]
        print(f'peak RSS (MiB): durcap {rss["dbos-durcap"]:.0f}, {other.removeprefix("dbos-")} {rss[other]:.0f}; '
              f'durcap / {other.removeprefix("dbos-")} {rss_ratio:.2f}x   target <= {TARGET_RSS}x: '
              f'{verdict(rss_ratio, TARGET_RSS, above=False)}')
    print(f'peak RSS (MiB): floor {rss["dbos-floor"]:.0f}   (info)')


def _interrupt(*_: Any) -> None:
    """SIGTERM handled as Ctrl-C: the `finally` blocks stop the worker processes and drop the PostgreSQL databases."""
    raise KeyboardInterrupt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--engines', default='temporal,dbos', help='comma-separated: temporal, dbos')
    parser.add_argument('--runs', type=int, default=100)
    parser.add_argument('--rounds', type=int, default=3)
    parser.add_argument('--address', default=None, help='Temporal server (default: an in-memory dev server started here)')
    parser.add_argument('--dbos-postgres', metavar='URL', help='PostgreSQL server URL without a database '
                        '(postgresql://user@host:port): one new database per DBOS variant, dropped at the end; '
                        'default SQLite (WAL) files in a temporary folder')
    parser.add_argument('--serve', choices=KINDS, help=argparse.SUPPRESS)
    parser.add_argument('--queue', help=argparse.SUPPRESS)
    parser.add_argument('--lock', help=argparse.SUPPRESS)
    parser.add_argument('--serve-dbos', choices=DBOS_KINDS, help=argparse.SUPPRESS)
    parser.add_argument('--db', help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve(args.serve, args.address, args.queue, args.lock))
        return
    if args.serve_dbos:
        asyncio.run(serve_dbos(args.serve_dbos, args.db))
        return
    signal.signal(signal.SIGTERM, _interrupt)
    engines = [e.strip() for e in args.engines.split(',') if e.strip()]
    unknown = set(engines) - {'temporal', 'dbos'}
    if unknown:
        parser.error(f'unknown engines: {", ".join(sorted(unknown))}')
    for engine in engines:
        asyncio.run({'temporal': amain_temporal, 'dbos': amain_dbos}[engine](args))


if __name__ == '__main__':
    main()
