"""Benchmark: validating a definition of 1,000 deferred capabilities x 10 tools against plain upstream construction.

    python bench/bench_validate.py                  # warm, interleaved, 15 repetitions, plus cold runs
    python bench/bench_validate.py --reps 31 --no-cold
    python bench/bench_validate.py --profile        # cProfile of DurableAgent construction (top 30)

What is timed:
- `DurableAgent(name, 'test', capabilities=caps)`: stabilize every leaf id and validate for all three durable
  engines (no `pydantic_ai.Agent` is built; that happens lazily in `.build(engine)`).
- `pydantic_ai.Agent('test', capabilities=caps)`: the plain upstream agent with the same capability objects.
Both receive the same, already constructed capabilities (building 10,000 tool schemas is not timed). Warm runs are
interleaved, alternating which one goes first, with a `gc.collect()` before each; the median is reported. Cold runs
time the first construction in a fresh interpreter (lazy imports included), one process per side.

Targets (issue 2): <= 0.2 s, and <= 1.0x the upstream construction.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time
from typing import Any

N_CAPABILITIES = 1_000
TOOLS_PER_CAPABILITY = 10
TARGET_SECONDS = 0.2
TARGET_RATIO = 1.0


def _tool_functions() -> list[Any]:
    def lookup(order_id: str) -> str:
        """Look up an order."""
        return order_id

    def refund(order_id: str, amount: float, reason: str = '') -> str:
        """Refund an order."""
        return order_id

    def search(query: str, limit: int = 10) -> list[str]:
        """Search."""
        return [query]

    def status(ticket: int) -> dict[str, str]:
        """Ticket status."""
        return {}

    def note(text: str, tags: list[str] | None = None) -> str:
        """Add a note."""
        return text

    return [lookup, refund, search, status, note]


def build_capabilities(n: int = N_CAPABILITIES, tools: int = TOOLS_PER_CAPABILITY) -> list[Any]:
    from pydantic_ai import Tool
    from pydantic_ai.capabilities import Capability

    functions = _tool_functions()
    return [
        Capability(
            id=f'area-{i:04d}',
            description=f'Use for questions about area {i}.',
            instructions=f'Rules for area {i}: quote the reference number.',
            defer_loading=True,
            tools=[Tool(functions[j % len(functions)], name=f'a{i:04d}_tool_{j}') for j in range(tools)],
        )
        for i in range(n)
    ]


def construct_durable(capabilities: list[Any], name: str) -> Any:
    from durable_capabilities import DurableAgent

    return DurableAgent(name, 'test', capabilities=capabilities)


def construct_upstream(capabilities: list[Any], name: str) -> Any:
    from pydantic_ai import Agent

    return Agent('test', name=name, capabilities=capabilities)


def _timed(fn: Any, *args: Any) -> float:
    gc.collect()
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def warm(reps: int) -> dict[str, Any]:
    capabilities = build_capabilities()
    # Warm-up (lazy imports, first-use caches) for both sides, untimed.
    definition = construct_durable(capabilities, 'bench-warmup')
    assert definition.report().ok, definition.report().to_text()
    assert sum(len(v) for v in definition.leaf_ids().values()) == N_CAPABILITIES
    construct_upstream(capabilities, 'bench-warmup')

    from durable_capabilities.ids import stabilize

    durable: list[float] = []
    upstream: list[float] = []
    stabilize_only: list[float] = []
    for rep in range(reps):
        order = (construct_durable, construct_upstream) if rep % 2 == 0 else (construct_upstream, construct_durable)
        for fn in order:
            elapsed = _timed(fn, capabilities, f'bench-{rep}')
            (durable if fn is construct_durable else upstream).append(elapsed)
        stabilize_only.append(_timed(stabilize, capabilities))
    return {
        'reps': reps,
        'durable_median_s': statistics.median(durable),
        'durable_min_s': min(durable),
        'upstream_median_s': statistics.median(upstream),
        'upstream_min_s': min(upstream),
        'stabilize_median_s': statistics.median(stabilize_only),
        'ratio_median': statistics.median(durable) / statistics.median(upstream),
        'ratio_min': min(durable) / min(upstream),
    }


_COLD_SNIPPET = """
import sys, time
sys.path.insert(0, {bench_dir!r})
import bench_validate as b
caps = b.build_capabilities()
start = time.perf_counter()
b.{fn}(caps, 'bench-cold')
print(time.perf_counter() - start)
"""


def cold() -> dict[str, float]:
    import os

    bench_dir = os.path.dirname(os.path.abspath(__file__))
    result = {}
    for key, fn in (('durable_cold_s', 'construct_durable'), ('upstream_cold_s', 'construct_upstream')):
        done = subprocess.run(
            [sys.executable, '-c', _COLD_SNIPPET.format(bench_dir=bench_dir, fn=fn)],
            capture_output=True,
            text=True,
            check=True,
        )
        result[key] = float(done.stdout.strip().splitlines()[-1])
    return result


def profile(top: int = 30) -> None:
    import cProfile
    import pstats

    capabilities = build_capabilities()
    construct_durable(capabilities, 'bench-profile-warmup')
    profiler = cProfile.Profile()
    profiler.enable()
    for rep in range(5):
        construct_durable(capabilities, f'bench-profile-{rep}')
    profiler.disable()
    pstats.Stats(profiler).sort_stats('tottime').print_stats(top)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--reps', type=int, default=15, help='interleaved warm repetitions (default 15)')
    parser.add_argument('--no-cold', action='store_true', help='skip the two fresh-interpreter runs')
    parser.add_argument('--json', action='store_true', help='print the figures as JSON')
    parser.add_argument('--profile', action='store_true', help='profile DurableAgent construction and exit')
    args = parser.parse_args()

    if args.profile:
        profile()
        return

    figures = warm(args.reps)
    if not args.no_cold:
        figures.update(cold())
    figures['meets_seconds_target'] = figures['durable_median_s'] <= TARGET_SECONDS
    figures['meets_ratio_target'] = figures['ratio_median'] <= TARGET_RATIO

    if args.json:
        print(json.dumps(figures, indent=2))
        return
    ok = {True: 'met', False: 'MISSED'}
    print(f'{N_CAPABILITIES} deferred capabilities x {TOOLS_PER_CAPABILITY} tools, {args.reps} interleaved repetitions')
    print(f'  DurableAgent(...) (stabilize + validate) median {figures["durable_median_s"]:.4f} s'
          f'  (min {figures["durable_min_s"]:.4f} s; stabilize alone {figures["stabilize_median_s"]:.4f} s)')
    print(f'  pydantic_ai.Agent(...)                  median {figures["upstream_median_s"]:.4f} s'
          f'  (min {figures["upstream_min_s"]:.4f} s)')
    print(f'  ratio (medians)                         {figures["ratio_median"]:.2f}x'
          f'  (of the minima {figures["ratio_min"]:.2f}x: less sensitive to other load on the machine)')
    print(f'  target <= {TARGET_SECONDS} s: {ok[figures["meets_seconds_target"]]}; '
          f'target <= {TARGET_RATIO:.1f}x: {ok[figures["meets_ratio_target"]]}')
    if 'durable_cold_s' in figures:
        print(f'  first construction in a fresh interpreter: DurableAgent {figures["durable_cold_s"]:.4f} s, '
              f'Agent {figures["upstream_cold_s"]:.4f} s')


if __name__ == '__main__':
    main()
