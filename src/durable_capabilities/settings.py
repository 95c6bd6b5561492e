"""Where the engines and the conversation store are: the one settings object of `durcap runs`, `durcap approvals`,
`durcap approve|deny` and `durcap ui`.

Each field comes from its CLI flag, else its environment variable, else the default:

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
from dataclasses import dataclass
from typing import Any

from ._limits import redact_database_url
from .store import DEFAULT_URL, resolve_url

DEFAULT_TEMPORAL_ADDRESS = '127.0.0.1:7233'
"""The Temporal frontend asked when neither `--address` nor the environment names one."""


@dataclass(frozen=True)
class Settings:
    """Connection settings for reading and deciding on runs.

    Attributes:
        address: Temporal frontend `HOST:PORT`.
        namespace: Temporal namespace.
        db: DBOS system database URL, `None` for the default SQLite file (`engines.dbos.system_database_url`).
        store: Conversation store URL (`sqlite:///path.db` or `postgresql://...`).
    """

    address: str = DEFAULT_TEMPORAL_ADDRESS
    namespace: str = 'default'
    db: str | None = None
    store: str = DEFAULT_URL

    @classmethod
    def resolve(cls, *, address: str | None = None, namespace: str | None = None, db: str | None = None,
                store: str | None = None) -> Settings:
        """Settings from flags (`None`: not given), then the environment, then the defaults (module table)."""
        env = os.environ.get
        return cls(
            address=address or env('DURCAP_TEMPORAL_ADDRESS') or env('TEMPORAL_ADDRESS') or DEFAULT_TEMPORAL_ADDRESS,
            namespace=namespace or 'default',
            db=db or env('DURCAP_DBOS_DB') or None,
            store=resolve_url(store),
        )

    def engine(self) -> dict[str, Any]:
        """The engine settings the adapters read (`EngineAdapter.list_runs / show_run / pending_approvals / decide`):
        `{'address', 'namespace', 'db'}`."""
        return {'address': self.address, 'namespace': self.namespace, 'db': self.db}

    def describe(self) -> dict[str, str]:
        """What a page or a log line may show: every field, database URLs without their passwords."""
        return {'Temporal': f'{self.address} (namespace {self.namespace})',
                'DBOS system database': redact_database_url(self.db) if self.db else 'SQLite .durcap/dbos.sqlite',
                'conversation store': redact_database_url(self.store)}

