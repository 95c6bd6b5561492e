"""Where the engines and the conversation store are: the one settings object of `durcap runs`, `durcap approvals`,
`durcap approve|deny` and `durcap ui`.

Each field comes from its CLI flag, else its environment variables (the first one set), else the default. The
fields are the connection settings every registered engine declares in its spec (`engines.EngineSpec.settings`
offered to the `read` commands), plus `store`:

| field | flag | environment | default |
|---|---|---|---|
| `address` (Temporal frontend) | `--address` | `DURCAP_TEMPORAL_ADDRESS`, `TEMPORAL_ADDRESS` | `127.0.0.1:7233` |
| `namespace` (Temporal) | `--namespace` | | `default` |
| `db` (DBOS system database) | `--db` | `DURCAP_DBOS_DB` | SQLite `.durcap/dbos.sqlite` (`None` here) |
| `store` (conversation store) | `--store` | `DURCAP_STORE` | `sqlite:///.durcap/conversations.db` |

Prefect has no field: its client reads `PREFECT_API_URL` (environment or Prefect profile), as every durcap
command does.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

from ._limits import redact_database_url
from .engines import ConnectionSetting, specs
from .engines._specs import DEFAULT_TEMPORAL_ADDRESS
from .store import DEFAULT_URL, resolve_url

__all__ = ['DEFAULT_TEMPORAL_ADDRESS', 'Settings', 'read_settings']


def read_settings(command: str = 'read') -> list[ConnectionSetting]:
    """The connection settings of every registered engine offered to `command` (`'read' | 'run' | 'demo'`), in
    registration order, each field once (the first engine declaring it owns it)."""
    seen: dict[str, ConnectionSetting] = {}
    for spec in specs():
        for setting in spec.settings:
            if command in setting.commands:
                seen.setdefault(setting.field, setting)
    return list(seen.values())


def _from_env(setting: ConnectionSetting) -> Any:
    return next((os.environ[name] for name in setting.env if os.environ.get(name)), None)


class Settings:
    """Connection settings for reading and deciding on runs: one attribute per engine connection setting
    (`address`, `namespace`, `db`, ...) plus `store`, the conversation store URL.

    `Settings(*values, store=...)` takes the engine fields positionally in `read_settings()` order, then `store`;
    a field not given is its default. Immutable; equal when every field is.

    Raises:
        TypeError: more positional values than fields, or an unknown keyword.
        AttributeError: reading a field no registered engine declares.
    """

    __slots__ = ('_values',)

    def __init__(self, *values: Any, **fields: Any):
        names = [s.field for s in read_settings()] + ['store']
        if len(values) > len(names):
            raise TypeError(f'Settings takes at most {len(names)} values ({", ".join(names)})')
        unknown = set(fields) - set(names)
        if unknown:
            raise TypeError(f'Settings has no field {", ".join(sorted(unknown))}')
        resolved = {s.field: s.default for s in read_settings()} | {'store': DEFAULT_URL}
        resolved |= dict(zip(names, values, strict=False)) | fields
        object.__setattr__(self, '_values', resolved)

    def __getattr__(self, name: str) -> Any:
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(f'Settings has no field {name!r}') from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError('Settings is immutable')

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Settings) and self._values == other._values

    def __hash__(self) -> int:
        return hash(tuple(sorted((k, str(v)) for k, v in self._values.items())))

    def __repr__(self) -> str:
        shown = {k: redact_database_url(v) if isinstance(v, str) and _secret(k) else v for k, v in self._values.items()}
        return 'Settings(' + ', '.join(f'{k}={v!r}' for k, v in shown.items()) + ')'

    @property
    def store(self) -> str:
        """Conversation store URL (`sqlite:///path.db` or `postgresql://...`)."""
        return self._values['store']

    @classmethod
    def resolve(cls, *, store: str | None = None, **flags: Any) -> Settings:
        """Settings from flags (`None`: not given), then the environment, then the defaults (module table).

        Args:
            store: `--store`.
            flags: The engine settings by field (`address=`, `namespace=`, `db=`, ...).
        """
        values = {s.field: flags.get(s.field) or _from_env(s) or s.default for s in read_settings()}
        return cls(**values, store=resolve_url(store))

    def engine(self) -> dict[str, Any]:
        """The engine settings the adapters read (`EngineAdapter.list_runs / show_run / pending_approvals / decide`):
        every field but `store`."""
        return {k: v for k, v in self._values.items() if k != 'store'}

    def describe(self, engines: Iterable[str] | None = None) -> dict[str, str]:
        """What a page or a log line may show: each engine's line (`EngineSpec.describe`), then the store; database
        URLs without their passwords.

        Args:
            engines: Only these engines' lines (names as in `EngineSpec.name`); `None`: every engine's.
        """
        wanted = None if engines is None else set(engines)
        shown: dict[str, str] = {}
        for spec in specs():
            if spec.describe is None or (wanted is not None and spec.name not in wanted):
                continue
            label, template = spec.describe
            shown[label] = template.format_map(_Shown(self._values, {s.field: s for s in spec.settings}))
        shown['conversation store'] = redact_database_url(self.store)
        return shown


def _secret(field: str) -> bool:
    return any(s.secret for s in read_settings() if s.field == field)


class _Shown(dict[str, str]):
    """Field values for a `describe` template: secrets redacted, `None` as the setting's `unset` text."""

    def __init__(self, values: Mapping[str, Any], settings: Mapping[str, ConnectionSetting]):
        super().__init__()
        self._values, self._settings = values, settings

    def __missing__(self, key: str) -> str:
        value, setting = self._values.get(key), self._settings.get(key)
        if value is None:
            return (setting.unset if setting is not None else None) or '-'
        return redact_database_url(value) if setting is not None and setting.secret else str(value)
