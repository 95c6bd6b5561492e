"""Secrets in run deps that never enter an engine's records: `WorkerSecret`, resolved where the durable unit runs.

A run's deps are part of what each engine persists: the Temporal workflow input (and every activity input, which
carries the run context), the DBOS workflow inputs in its system database, the Prefect flow-run parameters and
task cache keys. A deps field typed `WorkerSecret` holds only the secret's *name*; the value is looked up by
`get_secret_value()` in the process that runs the tool (the worker), from its environment or a resolver you
install there. So the engines record `{"secret": "PAYMENTS_API_KEY"}`, never the key.

```python
@dataclass
class Payments:
    account: str
    api_key: WorkerSecret  # the caller passes WorkerSecret('PAYMENTS_API_KEY'), the worker has the variable
```

This is the shape each engine's own guidance takes: keep credentials where the work runs (Temporal: in the
worker, not in payloads; Prefect: a Secret block referenced by name; DBOS: the application's environment).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict

from .errors import DurcapError

SecretResolver = Callable[[str], 'str | None']
"""`name -> value`, or `None` when the resolver does not know the name."""

_resolver: SecretResolver | None = None


class SecretNotFoundError(LookupError, DurcapError, code='secret-not-found'):
    """A `WorkerSecret` was read in a process that has no value for its name.

    Attributes:
        name: The secret's name.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        source = 'the installed secret resolver nor the environment' if _resolver is not None else 'the environment'
        super().__init__(
            f'worker secret {name!r} is not set in this process (neither {source} has it); set the environment '
            f'variable {name} where the worker runs, or install a resolver with set_secret_resolver()'
        )


class WorkerSecret(BaseModel):
    """A run deps value that names a secret; the value is read where the durable unit runs, never recorded.

    Args:
        secret: The secret's name: an environment variable of the worker (default), or a key your resolver
            knows (`set_secret_resolver`).

    Serialized (in every engine record and JSON deps) as `{"secret": "<name>"}`; `repr` and `str` show only the
    name. Read it with `get_secret_value()` inside a tool: the lookup happens in the worker process each time
    (nothing is cached on the object, so nothing can be serialized later).
    """

    model_config = ConfigDict(frozen=True)

    secret: str

    def __init__(self, secret: str | None = None, /, **data: Any) -> None:
        if secret is not None:
            data['secret'] = secret
        super().__init__(**data)

    def get_secret_value(self) -> str:
        """The value in this process: the installed resolver's answer, else the environment variable `secret`.

        Raises:
            SecretNotFoundError: neither has it.
        """
        if _resolver is not None and (value := _resolver(self.secret)) is not None:
            return value
        value = os.environ.get(self.secret)
        if value is None:
            raise SecretNotFoundError(self.secret)
        return value

    def __repr__(self) -> str:
        return f'WorkerSecret({self.secret!r})'

    __str__ = __repr__


def set_secret_resolver(resolver: SecretResolver | None) -> None:
    """Install the process-wide lookup `WorkerSecret.get_secret_value` tries before the environment.

    Call it where the worker starts (a vault client, a cloud secret manager); `None` removes it. It returns the
    value, or `None` for a name it does not know (the environment is tried next).
    """
    global _resolver
    _resolver = resolver
