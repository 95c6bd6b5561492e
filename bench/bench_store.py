"""Benchmark: resuming a stored conversation of 1,000 and 10,000 messages from `SQLConversationStore`.

    python bench/bench_store.py                       # SQLite in a temporary folder, 15 interleaved repetitions
    python bench/bench_store.py --reps 31
    python bench/bench_store.py --url postgresql://postgres@127.0.0.1:5432/bench   # an existing, empty database
    python bench/bench_store.py --json

What is timed ("resume"): `await store.read(conversation_id)` (one read transaction: the conversation row and
its history's entry rows, linked up from the head, decoded with pydantic-ai's `ModelMessagesTypeAdapter`) plus
`loaded_capability_ids(messages)` (which capabilities the history loaded: what upstream rebuilds on resume).

Baseline, side by side: `ModelMessagesTypeAdapter.validate_json` of the same messages as one JSON array, i.e.
upstream's own decoding of the history with no database at all. The store cannot resume faster than that.

The messages are real: the scripted 6-request run of `bench/_common.py` (a `load_capability` call, four tool
calls and an answer) run by a `DurableAgent` on the local engine, then a second turn continuing it, repeated
until the conversation holds N messages. They are stored with `append` in chunks of 500 (not timed).
Repetitions are interleaved (1,000 then 10,000, store then baseline), with `gc.collect()` before each.

Targets (issue 4): <= 0.1 s at 10,000 messages, growth linear (10,000 / 1,000 ~ 10x).

Engine path (issue 10): what every engine runs to resume, timed the same way with the worker's caches empty
(emptied before the clock starts; the store the process keeps open, `conversations.process_store`, stays open,
as in a worker that ran any turn before):
the load unit (`conversations.load_conversation`: `read_json`, one decode of the history and the drift check)
plus the decode in the workflow (`turn.decode_history`, which finds the load unit's messages in the worker's
cache). Target: <= 1.3x the baseline, judged on the median of the per-repetition ratios (each engine time over the
baseline timed right after it, so a load that changes during the run moves both alike). The payload conversion between
the two (Temporal's JSON converter of the load activity's result, a claim check above the threshold) is
printed beside it, not counted: DBOS, Prefect and local runs do not have it.

Next turn (issue 10): the same two units with the worker's caches warm from the previous turn of a 10,000-message
conversation, after one more turn (4 messages) was appended: only the new rows are read, scanned and
decoded. Target: <= 0.05 s.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import INSTRUCTIONS, PROMPT, make_capability, make_model
from pydantic_ai.messages import ModelMessage, ModelMessagesTypeAdapter

from durable_capabilities import DurableAgent, conversations, turn
from durable_capabilities.store import SQLConversationStore, loaded_capability_ids

SIZES = (1_000, 10_000)
TARGET_SECONDS = 0.1
ENGINE_RATIO_TARGET = 1.3
NEXT_TURN_TARGET_SECONDS = 0.05
CHUNK = 500


async def conversation(n: int) -> list[ModelMessage]:
    """`n` messages: a scripted first run (it loads capability `ops`), then second turns repeated."""
    agent = DurableAgent('bench-store', make_model(), instructions=INSTRUCTIONS, capabilities=[make_capability()], engines=())
    first = await agent.run(PROMPT)
    history = first.all_messages()
    second = await agent.run('And order A-2?', message_history=history)
    turn = second.new_messages()
    messages = list(history)
    while len(messages) < n:
        messages.extend(turn)
    return messages[:n]


async def fill(store: SQLConversationStore, conversation_id: str, messages: list[ModelMessage]) -> None:
    revision = None
    for start in range(0, len(messages), CHUNK):
        result = await store.append(conversation_id, messages[start : start + CHUNK], expected_revision=revision)
        revision = result.revision


async def resume(store: SQLConversationStore, conversation_id: str) -> tuple[int, list[str]]:
    stored = await store.read(conversation_id)
    return len(stored.messages), loaded_capability_ids(stored.messages)


def clear_caches() -> None:
    """Empty the worker's caches of stored rows and decoded histories (not timed: a cold worker has nothing to
    free, while freeing the previous repetition's 10,000 decoded messages costs ~30 ms of CPU)."""
    conversations._LOAD_CACHE.clear()
    turn._DECODED.clear()


def engine_resume(agent: DurableAgent[Any, Any], loop: Any, conversation_id: str, *, cold: bool) -> int:
    """The load unit then the workflow decode (worker caches cleared first when `cold`); the message count."""
    if cold:
        clear_caches()
    loaded = loop.run_until_complete(conversations.load_conversation(agent, conversation_id))
    return len(turn.decode_history((agent.durable_name, conversation_id), loaded.rows or [], conversation_id))


def payload_round_trip(agent: DurableAgent[Any, Any], loop: Any, conversation_id: str) -> float:
    """Seconds of Temporal's default converter encoding and decoding the load activity's result."""
    from temporalio.converter import DataConverter

    loaded = loop.run_until_complete(conversations.load_conversation(agent, conversation_id))
    converter = DataConverter.default.payload_converter
    return timed(lambda: converter.from_payloads(converter.to_payloads([loaded]), [conversations.LoadedConversation]))


CLOCK = time.perf_counter
"""Wall-clock seconds by default; `--clock cpu` uses `time.process_time` (CPU seconds of every thread of this
process), which other programs' load on the machine barely moves."""


def timed(fn: Any, setup: Any = None) -> float:
    """Seconds of `fn()` on `CLOCK`, after `setup()` (not timed) and a full garbage collection."""
    if setup is not None:
        setup()
    gc.collect()
    start = CLOCK()
    fn()
    return CLOCK() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--reps', type=int, default=15)
    parser.add_argument('--url', help='store URL (default: SQLite in a temporary folder)')
    parser.add_argument('--json', action='store_true', help='print the figures as JSON')
    parser.add_argument('--clock', choices=('wall', 'cpu'), default='wall',
                        help='wall: time.perf_counter (default); cpu: time.process_time, steadier on a loaded machine')
    args = parser.parse_args()
    global CLOCK
    CLOCK = time.process_time if args.clock == 'cpu' else time.perf_counter

    loop = asyncio.new_event_loop()
    with tempfile.TemporaryDirectory() as tmp:
        url = args.url or f'sqlite:///{tmp}/conversations.db'
        store = SQLConversationStore(url)
        histories = {n: loop.run_until_complete(conversation(n)) for n in SIZES}
        arrays = {n: ModelMessagesTypeAdapter.dump_json(histories[n]) for n in SIZES}
        for n in SIZES:
            loop.run_until_complete(fill(store, f'bench-{n}', histories[n]))
            count, loaded = loop.run_until_complete(resume(store, f'bench-{n}'))
            assert count == n and loaded == ['ops'], (count, loaded)
        agent = DurableAgent('bench-store', make_model(), instructions=INSTRUCTIONS, capabilities=[make_capability()],
                             engines=(), conversation_store=url)
        for n in SIZES:
            assert engine_resume(agent, loop, f'bench-{n}', cold=True) == n
        seconds: dict[str, dict[int, list[float]]] = {
            side: {n: [] for n in SIZES} for side in ('store', 'baseline', 'engine', 'payload')
        }
        for _ in range(args.reps):
            for n in SIZES:
                seconds['store'][n].append(timed(lambda n=n: loop.run_until_complete(resume(store, f'bench-{n}'))))
                seconds['engine'][n].append(timed(lambda n=n: engine_resume(agent, loop, f'bench-{n}', cold=False), setup=clear_caches))
                seconds['baseline'][n].append(timed(lambda n=n: ModelMessagesTypeAdapter.validate_json(arrays[n])))
                seconds['payload'][n].append(payload_round_trip(agent, loop, f'bench-{n}'))
        # Next turn: warm caches at the previous turn, one more turn (4 messages) appended, then resume.
        large_id, next_turn = f'bench-{SIZES[-1]}', []
        more = histories[SIZES[-1]][-4:]
        engine_resume(agent, loop, large_id, cold=True)
        for _ in range(args.reps):
            revision = loop.run_until_complete(store.read_json(large_id)).revision
            loop.run_until_complete(store.append(large_id, more, expected_revision=revision))
            next_turn.append(timed(lambda: engine_resume(agent, loop, large_id, cold=False)))
        next_turn_messages = engine_resume(agent, loop, large_id, cold=False)
        store.close()
    loop.close()

    med = {side: {n: statistics.median(v) for n, v in per.items()} for side, per in seconds.items()}
    low = {side: {n: min(v) for n, v in per.items()} for side, per in seconds.items()}
    small, large = SIZES
    figures = {
        'url': 'sqlite (temporary file)' if not args.url else args.url,
        'reps': args.reps,
        'clock': args.clock,
        'load_average': os.getloadavg(),
        'json_megabytes': {n: round(len(arrays[n]) / 1e6, 2) for n in SIZES},
        'resume_median_s': med['store'],
        'resume_min_s': low['store'],
        'baseline_median_s': med['baseline'],
        'baseline_min_s': low['baseline'],
        'growth_resume': med['store'][large] / med['store'][small],
        'growth_baseline': med['baseline'][large] / med['baseline'][small],
        'ratio_to_baseline': {n: med['store'][n] / med['baseline'][n] for n in SIZES},
        'target_s': TARGET_SECONDS,
        'target_met': med['store'][large] <= TARGET_SECONDS,
        'engine_median_s': med['engine'],
        'engine_min_s': low['engine'],
        # Paired: each repetition's engine time over the baseline time measured right after it, then the median
        # of those ratios; a load that changes during the run moves both sides of a pair alike.
        'engine_ratio_to_baseline': {
            n: statistics.median(e / b for e, b in zip(seconds['engine'][n], seconds['baseline'][n], strict=True))
            for n in SIZES
        },
        'growth_engine': med['engine'][large] / med['engine'][small],
        'engine_ratio_target': ENGINE_RATIO_TARGET,
        'engine_ratio_of_minimums': {n: low['engine'][n] / low['baseline'][n] for n in SIZES},
        'payload_round_trip_median_s': med['payload'],
        'next_turn_messages': next_turn_messages,
        'next_turn_median_s': statistics.median(next_turn),
        'next_turn_min_s': min(next_turn),
        'next_turn_target_s': NEXT_TURN_TARGET_SECONDS,
        'next_turn_target_met': statistics.median(next_turn) <= NEXT_TURN_TARGET_SECONDS,
    }
    figures['engine_target_met'] = all(r <= ENGINE_RATIO_TARGET for r in figures['engine_ratio_to_baseline'].values())
    if args.json:
        print(json.dumps(figures, indent=2))
        return
    load = ', '.join(f'{x:.1f}' for x in figures['load_average'])
    print(f'store: {figures["url"]}, {args.reps} interleaved repetitions, {args.clock} clock, load average {load}; '
          'median (min)')
    print(f'{"messages":>9}  {"JSON":>8}  {"resume (read + loaded ids)":>28}  {"baseline (validate_json)":>26}  {"ratio":>6}')
    for n in SIZES:
        print(
            f'{n:>9,}  {figures["json_megabytes"][n]:>6} MB  {med["store"][n]:>17.4f} s ({low["store"][n]:.4f})'
            f'  {med["baseline"][n]:>15.4f} s ({low["baseline"][n]:.4f})  {figures["ratio_to_baseline"][n]:>5.2f}x'
        )
    print(
        f'growth {large:,} / {small:,}: resume {figures["growth_resume"]:.2f}x, baseline {figures["growth_baseline"]:.2f}x '
        f'(linear = {large // small}x)'
    )
    verdict = 'met' if figures['target_met'] else 'MISSED'
    print(f'target <= {TARGET_SECONDS} s at {large:,} messages: {verdict} ({med["store"][large]:.4f} s)')
    print()
    print('engine path: load unit (read_json + decode + drift) + workflow decode, worker caches empty, median (min);')
    print('ratio: median of the paired per-repetition ratios (ratio of the minimums)')
    for n in SIZES:
        ratio = figures['engine_ratio_to_baseline'][n]
        print(
            f'{n:>9,}  engine {med["engine"][n]:.4f} s ({low["engine"][n]:.4f})  baseline {med["baseline"][n]:.4f} s'
            f' ({low["baseline"][n]:.4f})  ratio {ratio:.2f}x ({figures["engine_ratio_of_minimums"][n]:.2f}x)'
            f'  (target <= {ENGINE_RATIO_TARGET}x: {"met" if ratio <= ENGINE_RATIO_TARGET else "MISSED"})'
            f'  [Temporal payload conversion of the load result, not counted: {med["payload"][n]:.4f} s]'
        )
    print(f'growth {large:,} / {small:,}: engine {figures["growth_engine"]:.2f}x (linear = {large // small}x)')
    nt = figures['next_turn_median_s']
    print(
        f'next-turn resume of {next_turn_messages:,} messages (caches warm, 4 new): {nt:.4f} s '
        f'({figures["next_turn_min_s"]:.4f})  (target <= {NEXT_TURN_TARGET_SECONDS} s: '
        f'{"met" if figures["next_turn_target_met"] else "MISSED"})'
    )


if __name__ == '__main__':
    main()
