"""`DurcapError`: the one base of every error durable-capabilities raises for a user to catch.

Each error class keeps the built-in base it always had (`ValueError`, `LookupError`, `RuntimeError`, upstream's
`AgentRunError` or `ConversationConflict`), so `except ValueError` written against an earlier version still
catches it; `DurcapError` is added beside it, so `except DurcapError` catches them all:

```python
from durable_capabilities import DurcapError

try:
    ...
except DurcapError as exc:
    print(exc.code, exc)
```

`code` is a stable string: the `DC0xx` code of `validation.CODES` where the failure has one (`DC040` for an unusable
input, the first error's code for a `DurableConfigError`), else a short name of its own (`'store-unavailable'`,
`'run-not-found'`, ...), given on the class line: `class StoreError(DurcapError, code='store')`. `docs/errors.md` ("Exception types") lists every class with its code; a code never
changes meaning. Private control-flow exceptions (`store._sql._ProbeDone`, `wire._Cut`) are not `DurcapError`s:
they never leave the package.

This module is the bottom layer: it imports nothing of the package.
"""

from __future__ import annotations

import re

__all__ = ['DurcapError']

NOT_FOUND_CODE = 'DC044'
"""The `validation.CODES` code of an id that names nothing (a conversation not in the store, a run no engine has, a
call no run waits on): `durcap serve` answers it with 404, a `durcap` command leads its one line with it (exit 2)."""

_LED_BY_CODE = re.compile(r'DC\d{3} ')


def with_code(code: str, message: str) -> str:
    """`message` led by `code` (`'DC044 conversation ...'`); unchanged when it already starts with a `DC0xx` code.

    Args:
        code: A `validation.CODES` code, e.g. `NOT_FOUND_CODE`.
        message: The error's one line.

    Returns:
        The line as shown to users.
    """
    return message if _LED_BY_CODE.match(message) else f'{code} {message}'


_LEADING_CODES = re.compile(r'(?:DC\d{3} )+')
_WRAPPED_CODE = re.compile(r'(?<=: )DC\d{3} ')


def one_code(message: str, default: str | None) -> str:
    """`message` led by exactly one `DC0xx` code, for a `durcap: error:` line.

    A message that leads with a code keeps it (`'DC040 DC044 x'`, two leading codes from a call site that added its
    own: the last, the wrapped error's); else a code a wrapped error's message leads with after `': '` (`"cannot
    repair 'w': DC044 conversation ..."`) moves to the front; else `default` leads. A code an error wrapped after
    `': '` is dropped where the line already leads with one, so the line never names two. A code named in passing
    (`'(DC050)'`) stays where it is.

    Args:
        message: The error's one line.
        default: The code for a line without one, e.g. `'DC040'` (unusable input); `None`: such a line stays
            without one (a run that failed in its engine).

    Returns:
        The line, led by one code and a space (unchanged when it has none and `default` is `None`).
    """
    led = _LEADING_CODES.match(message)
    if led is not None:
        code, rest = led.group().split()[-1], message[led.end():]
    elif (wrapped := _WRAPPED_CODE.search(message)) is not None:
        code, rest = wrapped.group().strip(), message[:wrapped.start()] + message[wrapped.end():]
    elif default is None:
        return message
    else:
        code, rest = default, message
    return f'{code} {_WRAPPED_CODE.sub("", rest)}'


class DurcapError(Exception):
    """Base of every error durable-capabilities raises for its users to catch.

    Attributes:
        code: The error's stable code (a class attribute; a few classes set it per instance, e.g.
            `DurableConfigError` to its first error's `DC0xx` code). `'durcap'` on the base itself.
    """

    code: str = 'durcap'

    def __init_subclass__(cls, code: str | None = None, **kwargs: object) -> None:
        """`class StoreError(DurcapError, code='store')`: the code is given on the class line.

        Raises:
            TypeError: `code` is empty or not a string.
        """
        super().__init_subclass__(**kwargs)
        if code is not None:
            if not isinstance(code, str) or not code:
                raise TypeError(f'{cls.__name__}: code must be a non-empty string, not {code!r}')
            cls.code = code
