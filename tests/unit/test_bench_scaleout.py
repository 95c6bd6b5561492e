"""`bench/bench_scaleout.py --kill`'s verdict on a tool ledger: a lost side effect or one repeated beyond the one re-run
allowed for a tool in flight on the killed worker fails the bench. Plain functions on ledger lines; no engine."""

from __future__ import annotations

from pathlib import Path

from bench.bench_scaleout import Entry, check_ledger, parser, read_ledger

KILLED = 100


def entries(*lines: str) -> list[Entry]:
    return [Entry(e, k, int(pid), 1, 0.0) for e, k, pid in (line.split() for line in lines)]


def on_killed(entry: Entry) -> bool:
    return entry.pid == KILLED


def test_a_tool_in_flight_on_the_killed_worker_may_run_once_more_and_others_exactly_once() -> None:
    ledger = entries('start a 100', 'start b 200', 'done b 200', 'start a 200', 'done a 200')
    assert check_ledger(ledger, ['a', 'b'], on_killed) == (1, [])
    # Its side effect done on the killed worker and again on a survivor (killed before the engine recorded it): allowed.
    ledger = entries('start a 100', 'done a 100', 'start a 200', 'done a 200')
    assert check_ledger(ledger, ['a'], on_killed) == (1, [])


def test_a_repeat_beyond_the_allowance_or_a_missing_side_effect_is_named() -> None:
    ledger = entries('start a 200', 'done a 200', 'start a 300', 'done a 300',  # never on the killed worker
                     'start b 100', 'start b 200', 'start b 300', 'done b 300')  # three starts
    reran, bad = check_ledger(ledger, ['a', 'b', 'c'], on_killed)
    assert reran == 2
    assert bad == ['a: started 2, done 2', 'b: started 3, done 1', 'c: started 0, done 0']


def test_ledger_lines_are_read_and_a_torn_last_line_skipped(tmp_path: Path) -> None:
    path = tmp_path / 'ledger'
    path.write_text('start k1 10 9 1.5\ndone k1 10 9 2.5\ndone k2 1')
    assert read_ledger(path) == [Entry('start', 'k1', 10, 9, 1.5), Entry('done', 'k1', 10, 9, 2.5)]
    assert read_ledger(tmp_path / 'none') == []


def test_arguments() -> None:
    args = parser().parse_args(['--kill', '--engines', 'dbos', 'prefect', '--kill-runs', '10'])
    assert (args.kill, args.engines, args.kill_runs, args.kill_workers, args.concurrency) == (
        True, ['dbos', 'prefect'], 10, 3, 4)
