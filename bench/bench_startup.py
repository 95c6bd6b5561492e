"""Benchmark: how long `durcap` takes to start, beside a bare `import pydantic_ai` in the same run (issue 14).

    python bench/bench_startup.py              # 7 interleaved repetitions of each command
    python bench/bench_startup.py --reps 15 --json

Each command runs in a fresh interpreter (a subprocess of this venv's Python), wall-clock seconds, the three
sides interleaved and their order rotated every repetition, so they share the machine's load:

- baseline: `python -c 'import pydantic_ai'`, the floor for anything built on pydantic-ai;
- `durcap --help`;
- `durcap check examples/support/agent.py:support` (import the support example, validate it for every engine);
- `build('local')` of a one-capability agent with no MCP capability and no conversation (what a script pays).

Targets (issue 14, item 5): `durcap --help` within 0.3 s of the baseline. The check and build figures are
printed beside it with their own difference; they import the example's code and (for check) every engine's
naming rules, so they have no target of their own.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HELP_TARGET_SECONDS = 0.3
BUILD_LOCAL = (
    'from durable_capabilities import DurableAgent\n'
    'from pydantic_ai.capabilities import Capability\n'
    'def lookup(order_id: str) -> str:\n    return order_id\n'
    "DurableAgent('b', 'test', capabilities=[Capability(id='orders', defer_loading=True, tools=[lookup])],"
    " engines=()).build('local')\n"
)
SIDES = {
    'baseline': [sys.executable, '-c', 'import pydantic_ai'],
    'help': [sys.executable, '-m', 'durable_capabilities.cli', '--help'],
    'check': [sys.executable, '-m', 'durable_capabilities.cli', 'check', 'examples/support/agent.py:support'],
    'build_local': [sys.executable, '-c', BUILD_LOCAL],
}


def run(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, cwd=ROOT, check=True, capture_output=True, timeout=300, env={**os.environ, 'NO_COLOR': '1'})
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--reps', type=int, default=7)
    parser.add_argument('--json', action='store_true')
    args = parser.parse_args()
    for argv in SIDES.values():  # warm the file cache; not timed
        run(argv)
    seconds: dict[str, list[float]] = {side: [] for side in SIDES}
    names = list(SIDES)
    for rep in range(args.reps):
        for side in names[rep % len(names):] + names[: rep % len(names)]:
            seconds[side].append(run(SIDES[side]))
    med = {side: statistics.median(v) for side, v in seconds.items()}
    figures = {
        'reps': args.reps,
        'load_average': os.getloadavg(),
        'median_s': med,
        'min_s': {side: min(v) for side, v in seconds.items()},
        'over_baseline_s': {side: med[side] - med['baseline'] for side in SIDES if side != 'baseline'},
        'help_target_s': HELP_TARGET_SECONDS,
        'help_target_met': med['help'] - med['baseline'] <= HELP_TARGET_SECONDS,
    }
    if args.json:
        print(json.dumps(figures, indent=2))
        return
    load = ', '.join(f'{x:.1f}' for x in figures['load_average'])
    print(f'{args.reps} interleaved repetitions, fresh interpreter each, load average {load}; median (min)')
    for side in SIDES:
        extra = '' if side == 'baseline' else f'  +{figures["over_baseline_s"][side]:.2f} s over baseline'
        if side == 'help':
            verdict = 'met' if figures['help_target_met'] else 'MISSED'
            extra += f'  (target <= +{HELP_TARGET_SECONDS} s: {verdict})'
        print(f'{side:>12}  {med[side]:.2f} s ({figures["min_s"][side]:.2f}){extra}')


if __name__ == '__main__':
    main()
