"""Temporal's Workflow Streams (`temporalio.contrib.workflow_streams`, what pydantic-ai 2.68's
`TemporalDurability.stream_agent_events` runs on), measured for the choice in docs/watching.md.

    .venv/bin/python bench/bench_workflow_streams.py [--address HOST:PORT] [--events 300]

One workflow hosting a `WorkflowStream`; its activity publishes `--events` events 10 ms apart at upstream's 100 ms
batches; one subscriber in this process polls every 50 ms. Prints: events received, publish-to-subscriber delay
(median, p95), the workflow's history events by type, and whether a subscriber that comes after the run ended, with
no worker running, receives anything within 10 s. Unsandboxed workflow runner (the history is the same).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
import uuid
from datetime import timedelta

from temporalio import activity, workflow
from temporalio.client import Client
from temporalio.contrib.workflow_streams import WorkflowStream, WorkflowStreamClient
from temporalio.worker import UnsandboxedWorkflowRunner, Worker


@activity.defn
async def produce(count: int) -> int:
    info = activity.info()
    client = activity.client()
    handle = client.get_workflow_handle(info.workflow_id or '', run_id=info.workflow_run_id)
    async with WorkflowStreamClient(handle, client=client, batch_interval=timedelta(milliseconds=100)) as stream:
        topic = stream.topic('events')
        for index in range(count):
            topic.publish({'i': index, 't': time.time()})
            await asyncio.sleep(0.01)
    return count


@workflow.defn
class Streaming:
    @workflow.init
    def __init__(self, count: int) -> None:
        self.stream = WorkflowStream()

    @workflow.run
    async def run(self, count: int) -> int:
        done = await workflow.execute_activity(produce, count, start_to_close_timeout=timedelta(seconds=60))
        await workflow.sleep(1)  # the subscriber drains
        self.stream.detach_pollers()
        await workflow.wait_condition(workflow.all_handlers_finished)
        return done


async def main(address: str, count: int) -> None:
    client = await Client.connect(address)
    queue, workflow_id = f'ws-{uuid.uuid4().hex[:6]}', f'ws-{uuid.uuid4()}'
    delays: list[float] = []
    async with Worker(client, task_queue=queue, workflows=[Streaming], activities=[produce],
                      workflow_runner=UnsandboxedWorkflowRunner()):
        handle = await client.start_workflow(Streaming.run, count, id=workflow_id, task_queue=queue)
        async for item in WorkflowStreamClient.create(client, workflow_id).subscribe(
                ['events'], poll_cooldown=timedelta(milliseconds=50)):
            delays.append(time.time() - item.data['t'])
            if len(delays) == count:
                break
        await handle.result()
    delays.sort()
    kinds: dict[str, int] = {}
    async for event in handle.fetch_history_events():
        kind = str(event.WhichOneof('attributes')).removesuffix('_event_attributes')
        kinds[kind] = kinds.get(kind, 0) + 1
    print(f'received {len(delays)}/{count}; delay median {delays[len(delays) // 2] * 1000:.0f} ms, '
          f'p95 {delays[int(len(delays) * 0.95)] * 1000:.0f} ms')
    print(f'history: {sum(kinds.values())} events: {kinds}')
    late: list[object] = []

    async def read_late() -> None:
        async for item in WorkflowStreamClient.create(client, workflow_id).subscribe(['events']):
            late.append(item)

    try:
        await asyncio.wait_for(read_late(), 10)
        print(f'late subscriber, no worker: {len(late)} events')
    except TimeoutError:
        print(f'late subscriber, no worker: {len(late)} events in 10 s (timed out)')


if __name__ == '__main__':
    parser = argparse.ArgumentParser()
    parser.add_argument('--address', default=os.environ.get('DURCAP_TEST_TEMPORAL_ADDRESS', '127.0.0.1:7233'))
    parser.add_argument('--events', type=int, default=300)
    args = parser.parse_args()
    asyncio.run(main(args.address, args.events))
