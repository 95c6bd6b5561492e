"""The connection flags of the commands, built from the engines' specs (`engines.EngineSpec.settings`), and the
values they resolve to: `settings.Settings` for `durcap runs`, `durcap approvals`, `durcap approve|deny` and
`durcap ui` (flag, else environment, else default: see `settings.py`), the run settings of `durcap run` and
`durcap demo`.

A command declares `conn: dict[str, Any]` and is decorated with `connection_options(command)`: the decorator
offers one flag per connection setting of every registered engine (`--address`, `--namespace`, `--db`, ...) and
hands their values to the command as `conn`, by field.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Mapping
from typing import Annotated, Any, TypeVar

import typer

from .._limits import INPUT_CODE, InputError
from ..engines import ConnectionSetting, get
from ..settings import Settings, read_settings
from ..store import DEFAULT_URL

StoreOption = Annotated[str | None, typer.Option('--store', help=f'Conversation store URL (default: $DURCAP_STORE or '
                                                                 f'{DEFAULT_URL}).')]

F = TypeVar('F', bound=Callable[..., Any])


def _parameter(setting: ConnectionSetting, command: str) -> inspect.Parameter:
    """The typer parameter of one setting in `command` (a boolean `--x/--no-x` for a flag)."""
    default = setting.default_in.get(command)
    derived = '--' + setting.field.replace('_', '-')
    decls = () if setting.kind == 'flag' or setting.options == (derived,) else setting.options
    kind: Any = bool if setting.kind == 'flag' else (str if default is not None else str | None)
    option = typer.Option(*decls, help=setting.help_for(command))
    return inspect.Parameter(setting.field, inspect.Parameter.KEYWORD_ONLY, default=default,
                             annotation=Annotated[kind, option])


def connection_options(command: str) -> Callable[[F], F]:
    """Decorator for a typer command taking `conn: dict[str, Any]`: adds the connection flags of every registered
    engine offered to `command` (`'read' | 'run' | 'demo'`) and passes their values (`None`: not given) as `conn`."""
    settings = read_settings(command)

    def decorate(func: F) -> F:
        signature = inspect.signature(func, eval_str=True)
        kept = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in signature.parameters.values() if p.name != 'conn']
        params = kept + [_parameter(s, command) for s in settings]

        def command_with_connection(**kwargs: Any) -> Any:
            conn = {s.field: kwargs.pop(s.field) for s in settings}
            return func(**kwargs, conn=conn)

        command_with_connection.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
        command_with_connection.__annotations__ = {p.name: p.annotation for p in params}
        for name in ('__name__', '__qualname__', '__doc__', '__module__'):
            setattr(command_with_connection, name, getattr(func, name))
        return command_with_connection  # type: ignore[return-value]

    return decorate


def _env_value(setting: ConnectionSetting) -> tuple[str, str] | None:
    """`(value, $NAME)` of the first environment variable of `setting` that is set."""
    return next(((os.environ[n], f'${n}') for n in setting.env if os.environ.get(n)), None)


def checked(setting: ConnectionSetting, value: Any, *, probe: bool = False, worker: bool = False) -> Any:
    """A setting's flag value checked before anything connects (exit 2, DC040, on a bad one): an `address` is
    `HOST:PORT` (its environment variables checked the same way when the flag is absent; resolved here when the
    setting says so, else `None`), a `database` a usable URL (`probe`: a PostgreSQL server is asked once; `worker`:
    for `durcap worker`, which starts on a database the server does not have yet when the setting is
    `created_by_worker`)."""
    from . import database_url, temporal_address

    if setting.kind == 'address':
        if value:
            return temporal_address(value, setting.option)
        found = _env_value(setting)
        checked_env = temporal_address(found[0], found[1]) if found else None
        return checked_env if setting.resolve_in_cli else None
    if setting.kind == 'database':
        return database_url(value, setting.option, probe=probe, missing_ok=worker and setting.created_by_worker)
    return value


def connection_settings(conn: Mapping[str, Any], store: str | None = None) -> Settings:
    """`Settings.resolve` of the flags given (`None`: not given), after each is checked as `durcap run` checks it
    (exit 2, DC040, for a malformed address, or an empty, in-memory or unsupported database URL)."""
    from . import database_url

    flags = {s.field: checked(s, conn.get(s.field)) for s in read_settings()}
    return Settings.resolve(**flags, store=database_url(store, '--store'))


def check_stream_env() -> None:
    """Exit 2 (DC040) on a bad `$DURCAP_STREAM_MAX_EVENTS`, `$DURCAP_STREAM_MAX_BYTES` or `$DURCAP_STREAM_RETENTION`
    (`streams.Limits.from_env`), before anything runs: a run, a worker or `durcap serve` publishes or reads run
    streams with them (a bad value failed the run at its first event, exit 1, after the engine had started it)."""
    from ..streams import Limits
    from . import _unusable

    try:
        Limits.from_env()
    except InputError as exc:
        _unusable(str(exc))


def run_settings(conn: Mapping[str, Any], engine: str, *, defaults: bool = False, worker: bool = False) -> dict[str, Any]:
    """The settings `durcap run` / `durcap demo` / `durcap worker` hand the engine: each flag checked (`checked`), a
    database of the engine the run is on probed once; with `defaults`, a setting left `None` is its default (a worker
    asks the default Temporal address, where a run starts an embedded server instead); the run-stream settings too
    (`check_stream_env`). `worker`: for `durcap worker`, whose engine creates a `created_by_worker` database (DBOS's
    system database on a PostgreSQL server that does not have it yet); every other command refuses one."""
    check_stream_env()
    own = {s.field for s in get(engine).spec.settings}
    values = {field: checked(setting, conn.get(field), probe=field in own, worker=worker)
              for setting in _all_settings() if (field := setting.field) in conn}
    if defaults:
        values = {s.field: s.default if values[s.field] is None else values[s.field]
                  for s in _all_settings() if s.field in values}
    return values


def queue_setting(conn: Mapping[str, Any], engine: str) -> dict[str, Any]:
    """`conn` with the queue flags read for `engine`: Temporal's task queue is `--task-queue`, a DBOS queue `--queue`,
    and `--task-queue` is taken as the DBOS queue when `--queue` is not given (the spelling `durcap worker dbos` had
    first). Exit 2 (DC040) on a spelling that names nothing on `engine` (`--queue` with Temporal), on two spellings
    of one DBOS queue that disagree, on an empty name, or on a name that is a flag (`--queue --db URL` took `--db` as
    the queue); a flag
    left `None` stays `None`."""
    from . import _unusable

    values = dict(conn)
    queue, task_queue = values.get('queue'), values.get('task_queue')
    for flag, name in (('--queue', queue), ('--task-queue', task_queue)):
        if isinstance(name, str) and name.startswith('-'):  # `--queue --db URL`: the next flag taken as the name
            _unusable(f'{INPUT_CODE} {flag} {name!r}: expected a queue name, got a flag (a queue name never starts '
                      f'with "-"); write {flag} NAME, e.g. {flag} durcap')
        if isinstance(name, str) and not name.strip():  # `--task-queue ''`: Temporal's RPCError after the run started
            _unusable(f'{INPUT_CODE} {flag} {name!r}: expected a queue name, got an empty one; write {flag} NAME, e.g. '
                      f'{flag} durcap')
    if engine == 'dbos' and task_queue is not None:
        if queue is not None and queue != task_queue:
            _unusable(f'{INPUT_CODE} --queue {queue!r} and --task-queue {task_queue!r}: a DBOS run is handed to one '
                      'queue; give --queue only')
        values['queue'], values['task_queue'] = task_queue, None
    elif engine == 'temporal' and queue is not None:
        _unusable(f'{INPUT_CODE} --queue names a DBOS queue; a Temporal run\'s task queue is --task-queue (what `durcap '
                  'worker temporal --task-queue` polls)')
    return values


def _all_settings() -> list[ConnectionSetting]:
    seen: dict[str, ConnectionSetting] = {}
    for command in ('run', 'demo', 'read'):
        for setting in read_settings(command):
            seen.setdefault(setting.field, setting)
    return list(seen.values())


def where_flags(engine: str, values: Mapping[str, Any]) -> str:
    """` --address X --db Y`: the flags of `engine`'s connection settings that the operator commands (`runs`,
    `approvals`, `approve|deny`) need to find a run, for those set in `values`."""
    return ''.join(f' {s.option} {values[s.field]}' for s in get(engine).spec.settings
                   if 'read' in s.commands and values.get(s.field))
