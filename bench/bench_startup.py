"""Benchmark: how long `durcap` takes to start, beside a bare `import pydantic_ai` in the same run (issue 14).

    python bench/bench_startup.py              # 7 interleaved repetitions of each command
    python bench/bench_startup.py --reps 15 --json
    python bench/bench_startup.py --against /path/to/other/checkout --sides check,check_dbos,demo   # before/after

Each command runs in a fresh interpreter (a subprocess of this venv's Python), wall-clock seconds, the three
sides interleaved and their order rotated every repetition, so they share the machine's load:

- baseline: `python -c 'import pydantic_ai'`, the floor for anything built on pydantic-ai;
- `durcap --help`;
- `durcap check examples/support/agent.py:support` (import the support example, validate it for every engine);
- `build('local')` of a one-capability agent with no MCP capability and no conversation (what a script pays);
- `durcap check examples/support/agent.py:support --engine dbos` (the lock diff for DBOS only: what `durcap run
  --engine dbos` and a DBOS worker compare before they start);
- `durcap demo` (DBOS on SQLite in an empty temporary folder: the whole demo, one run).

Each side's CPU time (user + sys of the child, from `getrusage(RUSAGE_CHILDREN)`) is printed beside its wall time:
on a shared machine the CPU seconds move far less with the load than the wall seconds. `--against CHECKOUT` runs
every `durcap` side a second time with another checkout's `src/` first on `PYTHONPATH` (same interpreter, same
packages), interleaved with this one's, as `<side>@against`: a before/after comparison at the same load.

Targets (issue 14, item 5): `durcap --help` within 0.3 s of the baseline. The check and build figures are
printed beside it with their own difference; they import the example's code and (for check) every engine's
naming rules, so they have no target of their own.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
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
DURCAP = [sys.executable, '-m', 'durable_capabilities.cli']
SUPPORT = str(ROOT / 'examples' / 'support' / 'agent.py') + ':support'
SIDES = {
    'baseline': [sys.executable, '-c', 'import pydantic_ai'],
    'help': [*DURCAP, '--help'],
    'check': [*DURCAP, 'check', SUPPORT],
    'build_local': [sys.executable, '-c', BUILD_LOCAL],
    'check_dbos': [*DURCAP, 'check', SUPPORT, '--engine', 'dbos'],
    'demo': [*DURCAP, 'demo'],
}
DEFAULT_SIDES = ('baseline', 'help', 'check', 'build_local')
IN_EMPTY_FOLDER = {'demo'}
"""Sides run in a new empty folder (the demo writes its SQLite files in the current folder)."""


def run(argv: list[str], *, src: Path = ROOT, empty_folder: bool = False) -> tuple[float, float]:
    """`(wall s, CPU s)` of one run of `argv` with checkout `src`'s `src/` and root first on `PYTHONPATH`."""
    env = {**os.environ, 'NO_COLOR': '1', 'PYTHONPATH': os.pathsep.join([str(src / 'src'), str(src)])}
    for name in ('DURCAP_STORE', 'DURCAP_DBOS_DB', 'DURCAP_TEMPORAL_ADDRESS', 'PREFECT_API_URL'):
        env.pop(name, None)
    folder = Path(tempfile.mkdtemp(prefix='bench-startup-')) if empty_folder else None
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    try:
        subprocess.run(argv, cwd=folder or src, check=True, capture_output=True, timeout=300, env=env)
    finally:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--reps', type=int, default=7)
    parser.add_argument('--json', action='store_true')
    parser.add_argument('--sides', default=','.join(DEFAULT_SIDES),
                        help=f'comma-separated, of: {", ".join(SIDES)} (baseline is always run)')
    parser.add_argument('--against', type=Path, default=None,
                        help='another checkout: each durcap side also runs with its src/ (as SIDE@against)')
    args = parser.parse_args()
    chosen = ['baseline', *(s for s in args.sides.split(',') if s and s != 'baseline')]
    unknown = [s for s in chosen if s not in SIDES]
    if unknown:
        parser.error(f'--sides: unknown {", ".join(unknown)}; expected some of {", ".join(SIDES)}')
    runs: dict[str, tuple[list[str], Path]] = {side: (SIDES[side], ROOT) for side in chosen}
    if args.against is not None:
        against = args.against.resolve()
        if not (against / 'src' / 'durable_capabilities').is_dir():
            parser.error(f'--against {against}: no src/durable_capabilities there')
        runs |= {f'{side}@against': (SIDES[side], against) for side in chosen if SIDES[side][:3] == DURCAP}
    for side, (argv, src) in runs.items():  # warm the file cache; not timed
        run(argv, src=src, empty_folder=side.split('@')[0] in IN_EMPTY_FOLDER)
    seconds: dict[str, list[float]] = {side: [] for side in runs}
    cpu: dict[str, list[float]] = {side: [] for side in runs}
    names = list(runs)
    for rep in range(args.reps):
        for side in names[rep % len(names):] + names[: rep % len(names)]:
            argv, src = runs[side]
            wall, used = run(argv, src=src, empty_folder=side.split('@')[0] in IN_EMPTY_FOLDER)
            seconds[side].append(wall)
            cpu[side].append(used)
    med = {side: statistics.median(v) for side, v in seconds.items()}
    figures: dict[str, object] = {
        'reps': args.reps,
        'load_average': os.getloadavg(),
        'median_s': med,
        'min_s': {side: min(v) for side, v in seconds.items()},
        'median_cpu_s': {side: statistics.median(v) for side, v in cpu.items()},
        'over_baseline_s': {side: med[side] - med['baseline'] for side in runs if side != 'baseline'},
        'help_target_s': HELP_TARGET_SECONDS,
    }
    if 'help' in med:
        figures['help_target_met'] = med['help'] - med['baseline'] <= HELP_TARGET_SECONDS
    if args.json:
        print(json.dumps(figures, indent=2))
        return
    load = ', '.join(f'{x:.1f}' for x in os.getloadavg())
    print(f'{args.reps} interleaved repetitions, fresh interpreter each, load average {load}; median (min), median CPU')
    for side in runs:
        extra = '' if side == 'baseline' else f'  +{med[side] - med["baseline"]:.2f} s over baseline'
        if side == 'help':
            verdict = 'met' if figures['help_target_met'] else 'MISSED'
            extra += f'  (target <= +{HELP_TARGET_SECONDS} s: {verdict})'
        cpu_s = statistics.median(cpu[side])
        print(f'{side:>20}  {med[side]:.2f} s ({min(seconds[side]):.2f})  cpu {cpu_s:.2f} s{extra}')


if __name__ == '__main__':
    main()
