"""Benchmark: 100 concurrent 6-request runs on one Temporal worker: durcap against the floor and against upstream.

    .venv/bin/python bench/bench_throughput.py                      # 100 runs a batch, 3 interleaved rounds; an
                                                                    # in-memory dev server started here
    .venv/bin/python bench/bench_throughput.py --runs 50 --rounds 5 --address 127.0.0.1:7233

Four worker processes, one per variant, each on its own task queue, all alive throughout (started here, stopped by
pid):
- durcap:   `engines.temporal.make_worker` serving a `DurableAgent` of the scripted 6-request run (`_common.py`).
- upstream: a plain `Worker` serving `_common.UpstreamWorkflow` (`Agent(capabilities=[..., TemporalDurability()])`).
- floor:    a plain `Worker` serving `_common.FloorWorkflow`: as many no-op activities, one after another, as one
            durcap run schedules (counted from a first run), no agent, no model.
- durcap-local: as durcap, the capability's tools marked short (`local_activity_toolsets`: local activities).
Workers use the SDK's default concurrency (100 workflow tasks, 100 activities at once). A batch starts `--runs`
workflows at once from this process (`start_workflow` for each side alike, no eager start: the worker is elsewhere)
and waits for every result; throughput = runs / (seconds from the first start to the last result). Rounds cycle the
order of the variants; ratios are per round (same conditions), their median reported.

Targets (issue 14): durcap >= 0.8x the floor and >= 1.0x upstream in throughput; peak RSS of the durcap worker
<= 1.1x the upstream worker's (VmHWM from /proc after all rounds).
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
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / 'src'))

import _common as c  # noqa: E402

AGENT_NAME = 'bench_tp_durcap'
TARGET_FLOOR, TARGET_UPSTREAM, TARGET_RSS = 0.8, 1.0, 1.1
KINDS = ('durcap', 'upstream', 'floor', 'durcap-local')


def durcap_agent(local: bool = False) -> Any:
    """The durcap agent; `local=True` marks the capability's tools short (Temporal local activities)."""
    from durable_capabilities import DurableAgent

    options = {'temporal': {'local_activity_toolsets': {c.CAPABILITY_ID: {}}}} if local else None
    return DurableAgent(AGENT_NAME, c.make_model(), instructions=c.INSTRUCTIONS, capabilities=[c.make_capability()],
                        engine_options=options)


async def serve(kind: str, address: str, queue: str) -> None:
    """`--serve KIND`: run one worker until SIGTERM; print READY once it polls."""
    from temporalio.worker import Worker
    from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner, SandboxRestrictions

    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    runner = SandboxedWorkflowRunner(restrictions=SandboxRestrictions.default.with_passthrough_modules(c.__name__))
    if kind in ('durcap', 'durcap-local'):
        from durable_capabilities.engines import temporal

        client = await temporal.connect(address)
        worker = temporal.make_worker(client, [durcap_agent(kind == 'durcap-local')], queue)
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
    def __init__(self, kind: str, address: str, queue: str, tmp: Path) -> None:
        self.kind, self.queue, self.log = kind, queue, tmp / f'{kind}.log'
        with open(self.log, 'wb') as out:
            self.popen = subprocess.Popen(
                [sys.executable, __file__, '--serve', kind, '--address', address, '--queue', queue],
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


async def amain(args: argparse.Namespace) -> None:
    from pydantic_ai.durable_exec.temporal import PydanticAIPlugin
    from temporalio.api.enums.v1 import EventType
    from temporalio.client import Client

    from durable_capabilities._servers import start_temporal_dev_server
    from durable_capabilities.engines import temporal
    from durable_capabilities.engines.temporal import AgentRunInput, AgentRunOutput

    tmp = Path(tempfile.mkdtemp(prefix='bench-throughput-'))
    server = None
    address = args.address
    if address is None:
        server = start_temporal_dev_server(state_dir=tmp / 'temporal', persistent=False)
        address = server.address
        print(f'temporal dev server pid {server.pid} at {address}', flush=True)
    tag = uuid.uuid4().hex[:6]
    workers = {kind: WorkerProc(kind, address, f'tp-{kind}-{tag}', tmp) for kind in KINDS}
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

        def starter(kind: str) -> Any:
            queue = workers[kind].queue
            if kind in ('durcap', 'durcap-local'):
                return lambda i: durcap_client.start_workflow(
                    f'durcap.{AGENT_NAME}', AgentRunInput(prompt=c.PROMPT), id=f'tp-d-{tag}-{i}-{uuid.uuid4().hex[:6]}',
                    task_queue=queue, result_type=AgentRunOutput)
            if kind == 'upstream':
                return lambda i: upstream_client.start_workflow(
                    c.UpstreamWorkflow.run, c.PROMPT, id=f'tp-u-{tag}-{i}-{uuid.uuid4().hex[:6]}', task_queue=queue)
            return lambda i: floor_client.start_workflow(
                c.FloorWorkflow.run, activities, id=f'tp-f-{tag}-{i}-{uuid.uuid4().hex[:6]}', task_queue=queue)

        async def batch(kind: str) -> float:
            start = starter(kind)
            began = time.perf_counter()
            handles = await asyncio.gather(*(start(i) for i in range(args.runs)))
            results = await asyncio.gather(*(h.result() for h in handles))
            elapsed = time.perf_counter() - began
            expected = {'durcap': lambda r: r.output == c.ANSWER, 'durcap-local': lambda r: r.output == c.ANSWER,
                        'upstream': lambda r: r == c.ANSWER,
                        'floor': lambda r: r == activities}[kind]
            if not all(expected(r) for r in results):
                raise AssertionError(f'{kind}: unexpected results')
            return args.runs / elapsed

        await batch('floor')  # warm-up: every worker's first batch (imports, sandbox caches)
        await batch('upstream')
        await batch('durcap')
        await batch('durcap-local')
        kinds = KINDS
        orders = list(itertools.permutations(kinds))
        per_round: list[dict[str, float]] = []
        loads = []
        for r in range(args.rounds):
            figures = {}
            for kind in orders[r % len(orders)]:
                figures[kind] = await batch(kind)
            loads.append(os.getloadavg()[0])
            per_round.append(figures)
            print(f'round {r + 1}: ' + ', '.join(f'{k} {v:.1f} runs/s' for k, v in figures.items())
                  + f' (load {os.getloadavg()[0]:.1f})', flush=True)
        rss = {k: w.peak_rss_mib() for k, w in workers.items()}
    finally:
        for w in workers.values():
            w.stop()
        if server is not None:
            server.stop()

    med = {k: statistics.median(f[k] for f in per_round) for k in kinds}
    vs_floor = statistics.median(f['durcap'] / f['floor'] for f in per_round)
    vs_up = statistics.median(f['durcap'] / f['upstream'] for f in per_round)
    up_floor = statistics.median(f['upstream'] / f['floor'] for f in per_round)
    rss_ratio = rss['durcap'] / rss['upstream']
    print(f'\n{args.runs} concurrent runs a batch, {args.rounds} rounds; load average (1 min) per round '
          f'{", ".join(f"{x:.1f}" for x in loads)} on {os.cpu_count()} CPU')
    print(f'throughput medians: durcap {med["durcap"]:.1f}, upstream {med["upstream"]:.1f}, floor {med["floor"]:.1f} runs/s')
    print(f'durcap / floor    {vs_floor:.2f}x   target >= {TARGET_FLOOR}x: {"met" if vs_floor >= TARGET_FLOOR else "NOT met"}')
    print(f'durcap / upstream {vs_up:.2f}x   target >= {TARGET_UPSTREAM}x: {"met" if vs_up >= TARGET_UPSTREAM else "NOT met"}')
    print(f'upstream / floor  {up_floor:.2f}x   (info)')
    local_floor = statistics.median(f['durcap-local'] / f['floor'] for f in per_round)
    local_up = statistics.median(f['durcap-local'] / f['upstream'] for f in per_round)
    print(f'durcap with local tools: {med["durcap-local"]:.1f} runs/s; / floor {local_floor:.2f}x (target >= '
          f'{TARGET_FLOOR}x: {"met" if local_floor >= TARGET_FLOOR else "NOT met"}), / upstream {local_up:.2f}x '
          f'(target >= {TARGET_UPSTREAM}x: {"met" if local_up >= TARGET_UPSTREAM else "NOT met"}); peak RSS '
          f'{rss["durcap-local"]:.0f} MiB')
    print(f'peak RSS (MiB): durcap {rss["durcap"]:.0f}, upstream {rss["upstream"]:.0f}, floor {rss["floor"]:.0f}; '
          f'durcap / upstream {rss_ratio:.2f}x   target <= {TARGET_RSS}x: {"met" if rss_ratio <= TARGET_RSS else "NOT met"}')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--runs', type=int, default=100)
    parser.add_argument('--rounds', type=int, default=3)
    parser.add_argument('--address', default=None)
    parser.add_argument('--serve', choices=KINDS, help=argparse.SUPPRESS)
    parser.add_argument('--queue', help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve(args.serve, args.address, args.queue))
    else:
        asyncio.run(amain(args))


if __name__ == '__main__':
    main()
