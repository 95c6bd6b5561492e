"""Bounds on every input durable-capabilities reads, and the escaping of what it echoes back.

One module so that every reader applies the same limits: files are read only when they are regular files
and at most `limit` bytes long (a FIFO or a device would block a read forever; a huge file would fill
memory); JSON and YAML are parsed with a nesting bound (Python's parsers recurse, 5,000 levels escape as
`RecursionError`) and YAML without aliases (a handful of anchors can expand exponentially: the
"billion laughs" document); slow engine calls run under a time limit.

Every failure is an `InputError`: a `ValueError` whose text is one line, `DC040 <where>: <what>. <fix>`.

`printable` turns ids and stored values into text safe to print on a terminal: C0 and C1 control
characters and the Unicode bidirectional overrides and isolates (which can make a terminal show text
in an order other than the stored one, CVE-2021-42574 "Trojan Source") become visible escapes.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
from pathlib import Path
from typing import Any

import yaml

from .errors import DurcapError

MAX_DEPTH = 64
"""Nesting bound for JSON and YAML inputs (lists and mappings inside each other). Our own files nest at
most 5 levels (a lockfile) or about 20 (a Temporal history export); deps rarely more than a few."""

MAX_LOCK_BYTES = 4 * 1024 * 1024
"""Largest lockfile read (4 MiB): a lockfile of 100 agents with 200 durable names each is about 1 MiB."""

MAX_HISTORY_BYTES = 128 * 1024 * 1024
"""Largest Temporal history export read (128 MiB): Temporal caps a history at 50 MB of payloads
(docs.temporal.io, "Temporal Cloud limits"); its JSON export with base64 payloads is about 4/3 of that."""

MAX_SKILL_BYTES = 1024 * 1024
"""Largest skill file read (1 MiB): a skill's body becomes instructions in every request that loads it."""

MAX_JSON_ARG_BYTES = 1024 * 1024
"""Largest JSON given on the command line (`--deps-json`, `--args`): 1 MiB (Linux caps one argument at 128 KiB)."""

REPLAY_TIMEOUT = 120.0
"""Seconds one history may take to replay (`$DURCAP_REPLAY_TIMEOUT` overrides it). The recorded support
histories replay in under a second each on a 2-core machine."""

INPUT_CODE = 'DC040'


class InputError(ValueError, DurcapError, code='DC040'):
    """An input is unusable: over a size, depth, expansion or time bound, not a regular file, not of the
    expected shape, or an unusable option value.

    Attributes:
        code: The stable code (`DC040`, see `validation.CODES`).
        where: What was read: a path, an option name (`--deps-json`), a URL.
        reason: What is wrong and how to fix it.

    `str(error)` is one line: `DC040 <where>: <reason>`.
    """

    def __init__(self, where: str, reason: str, code: str = INPUT_CODE):
        self.code, self.where, self.reason = code, where, one_line(reason)
        super().__init__(f'{code} {printable(where)}: {self.reason}')

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.where, self.reason, self.code))


def env_seconds(name: str, default: float, example: float | None = None) -> float:
    """`$name` as a number of seconds above 0, else `default` when it is unset or empty.

    Raises:
        InputError: DC040 naming `$name`, any other value (the fix names `default` and `example`, default `default`).
    """
    raw = os.environ.get(name)
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if not 0 < value < float('inf'):
        raise InputError(f'${name}', f'must be a number of seconds above 0, got {raw!r}. Fix: unset it (default '
                         f'{default:g} s) or give e.g. {default if example is None else example:g}.')
    return value


# ---- files -------------------------------------------------------------------------------------------


def _size(n: int) -> str:
    return f'{n / 1024 / 1024:g} MiB' if n >= 1024 * 1024 else f'{n} bytes'


def read_bytes(path: str | Path, *, limit: int, what: str) -> bytes:
    """The bytes of `path`, read only when it is a regular file (symlinks followed) of at most `limit` bytes.

    Args:
        path: The file.
        limit: Largest size accepted, in bytes.
        what: What the file should be (`'lockfile'`), for the message.

    Raises:
        FileNotFoundError, IsADirectoryError, PermissionError: as `open` raises them (the callers word these).
        InputError: not a regular file (a FIFO, socket or device would block or never end), or over `limit`.
    """
    path = Path(path)
    info = path.stat()
    if stat.S_ISDIR(info.st_mode):
        raise IsADirectoryError(21, 'Is a directory', str(path))
    if not stat.S_ISREG(info.st_mode):
        raise InputError(str(path), f'the {what} is not a regular file (a FIFO, socket or device); refusing to read '
                         'it. Point at a regular file.')
    if info.st_size > limit:
        raise InputError(str(path), f'the {what} is {_size(info.st_size)}, over the limit of {_size(limit)}. '
                         f'Check that it is the right file.')
    # O_NONBLOCK: had the path been swapped for a FIFO since the stat, the open still returns at once.
    fd = os.open(path, os.O_RDONLY | getattr(os, 'O_NONBLOCK', 0))
    with os.fdopen(fd, 'rb') as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            raise InputError(str(path), f'the {what} is not a regular file; refusing to read it.')
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise InputError(str(path), f'the {what} is over the limit of {_size(limit)}. Check that it is the right file.')
    return data


# ---- JSON --------------------------------------------------------------------------------------------


def check_depth(value: Any, *, where: str, max_depth: int = MAX_DEPTH) -> Any:
    """`value` itself when its lists and dicts nest at most `max_depth` deep (checked without recursion).

    Raises:
        InputError: nested deeper.
    """
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > max_depth:
            raise InputError(where, f'the JSON nests deeper than {max_depth} levels. Flatten it.')
        stack.extend((child, depth + 1) for child in children)
    return value


def load_json(text: str | bytes, *, where: str, limit: int = MAX_JSON_ARG_BYTES, max_depth: int = MAX_DEPTH) -> Any:
    """Parse JSON `text` of at most `limit` bytes nesting at most `max_depth` levels.

    Raises:
        InputError: over `limit`, nested deeper, or not JSON (the parser's reason and position follow ours).
    """
    if len(text) > limit:
        raise InputError(where, f'the JSON is {_size(len(text))}, over the limit of {_size(limit)}.')
    try:
        value = json.loads(text)
    except RecursionError:
        raise InputError(where, f'the JSON nests deeper than {max_depth} levels. Flatten it.') from None
    except (ValueError, TypeError) as exc:
        raise InputError(where, f'not valid JSON: {one_line(str(exc))}.') from None
    return check_depth(value, where=where, max_depth=max_depth)


# ---- YAML --------------------------------------------------------------------------------------------


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader without aliases and with a nesting bound (`MAX_DEPTH`)."""

    max_depth = MAX_DEPTH
    _depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.constructor.ConstructorError(
                None, None, 'YAML aliases (`*name`) are not accepted here; write the value out', event.start_mark)
        self._depth += 1
        try:
            if self._depth > self.max_depth:
                raise yaml.constructor.ConstructorError(
                    None, None, f'the YAML nests deeper than {self.max_depth} levels', self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def load_yaml(text: str, *, where: str) -> Any:
    """`yaml.safe_load(text)` refusing aliases and nesting deeper than `MAX_DEPTH` (the caller bounds the size).

    Raises:
        yaml.YAMLError: invalid YAML, an alias, or too deep (with the line in `problem_mark`).
        ValueError, TypeError: a value YAML parses but cannot build (`!!int abc`), as PyYAML raises them.
    """
    loader = _BoundedLoader(text)
    try:
        return loader.get_single_data()
    except RecursionError:  # a flow collection nested deeper than the parser's own recursion
        raise yaml.constructor.ConstructorError(None, None, f'the YAML nests deeper than {MAX_DEPTH} levels', None) \
            from None
    finally:
        loader.dispose()


# ---- output ------------------------------------------------------------------------------------------

_UNSAFE = re.compile('[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]')
_UNSAFE_KEEP_LINES = re.compile('[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]')
_NAMED = {'\n': '\\n', '\r': '\\r', '\t': '\\t', '\x1b': '\\x1b'}


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    if char in _NAMED:
        return _NAMED[char]
    code = ord(char)
    return f'\\x{code:02x}' if code < 0x100 else f'\\u{code:04x}'


def printable(value: object, *, keep_newlines: bool = False) -> str:
    """`str(value)` with every C0 and C1 control character (newline and tab too), DEL, and every Unicode
    bidirectional mark, embedding, override and isolate (U+061C, U+200E, U+200F, U+202A-U+202E,
    U+2066-U+2069) replaced by a visible escape (`\\x1b`, `\\u202e`), so text from ids, stored rows and
    user input cannot move the cursor, recolour the terminal or reorder what is shown.

    Args:
        value: Anything; `str(value)` is escaped.
        keep_newlines: Keep `\n` and `\t` as they are (a multi-line answer), escaping the rest.

    Use it on anything echoed to a terminal that did not come from this package's own literals. Rich
    markup in the result is not escaped: print it as `rich.text.Text` or with `markup=False`.
    """
    if keep_newlines:
        return _UNSAFE_KEEP_LINES.sub(_escape, str(value))
    return _UNSAFE.sub(_escape, str(value))


def is_digits(text: str) -> bool:
    """Whether `text` is a whole number `int()` reads: ASCII digits 0-9 only, at least one. Not `str.isdigit`, which
    is true of `'¹'` and other Unicode digits `int()` refuses (a ValueError where a coded refusal was meant: a
    hypothesis case in `replay`'s event ids; `--address`'s port, `Content-Length` and `?after` had the same gap)."""
    return text.isascii() and text.isdecimal()


def one_line(text: str) -> str:
    """`text` on one line: its first non-empty line, made `printable`."""
    lines = [line for line in str(text).splitlines() if line.strip()]
    return printable(lines[0].strip()) if lines else ''


def replay_timeout() -> float:
    """`$DURCAP_REPLAY_TIMEOUT` seconds if set to a positive number, else `REPLAY_TIMEOUT`."""
    raw = os.environ.get('DURCAP_REPLAY_TIMEOUT', '')
    try:
        value = float(raw)
    except ValueError:
        return REPLAY_TIMEOUT
    return value if value > 0 else REPLAY_TIMEOUT


# ---- files we create ---------------------------------------------------------------------------------


def private_dir(path: str | Path) -> Path:
    """Create folder `path` (and missing parents) readable by its owner only (0700); returns it.

    Folders that already exist are left as they are, except a `.durcap` folder (ours: it holds the
    conversation store and the DBOS system database), which is set to 0700.
    """
    path = Path(path)
    missing = [p for p in (path, *path.parents) if not p.exists()]
    for folder in reversed(missing):
        with contextlib.suppress(FileExistsError):
            folder.mkdir(mode=0o700)
        os.chmod(folder, 0o700)  # mkdir's mode is filtered by the umask
    if path.name == '.durcap' and path.is_dir() and not missing:
        with contextlib.suppress(PermissionError):
            os.chmod(path, 0o700)
    return path


def private_file(path: str | Path) -> Path:
    """Create the empty file `path` (its folder with `private_dir`) readable and writable by its owner only
    (0600) unless it exists; returns it. SQLite creates a database's `-wal` and `-shm` files with the
    database file's permissions, so creating the file first keeps them private too."""
    path = Path(path)
    private_dir(path.parent)
    with contextlib.suppress(FileExistsError):
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        os.chmod(path, 0o600)
    return path


SECRET_QUERY_KEYS = frozenset({'password', 'sslpassword', 'passwd', 'pwd', 'secret', 'token', 'access_token',
                               'api_key', 'apikey', 'key'})
"""Query parameters of a database URL whose value `redact_database_url` hides: libpq takes `password` and `sslpassword`
there (`postgresql://u@host/db?password=...`, PostgreSQL docs, "Connection URIs"); the rest are common spellings."""


def redact_database_url(url: str) -> str:
    """`url` (a database URL, e.g. `postgresql://user:secret@db:5432/dbos`) with its password shown as `***`, by
    SQLAlchemy's own `URL.render_as_string(hide_password=True)`, and the value of every secret query parameter
    (`SECRET_QUERY_KEYS`, e.g. `?password=...`) shown as `***` too: what a page, a log line or an error may show.
    A string SQLAlchemy cannot parse is shown from after its last `@` (user info dropped), without its query.
    Never raises."""
    from sqlalchemy.engine import make_url

    try:
        parsed = make_url(url)
        shown = parsed.render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - never fail on showing a URL
        return url.split('@')[-1].split('?')[0]
    if not any(key.lower() in SECRET_QUERY_KEYS for key in parsed.query):
        return shown
    base = shown.split('?')[0]
    pairs = [(key, '***' if key.lower() in SECRET_QUERY_KEYS else value) for key, values in parsed.query.items()
             for value in ((values,) if isinstance(values, str) else values)]
    return base + '?' + '&'.join(f'{key}={value}' for key, value in pairs)


def postgres_database_missing(url: Any, reason: str = '', *, timeout: float = 5) -> str | None:
    """The database name of a PostgreSQL `url` whose server answers but has no database of that name, else `None`:
    what to name, with `createdb`, after a connection to `url` failed. Known from the driver's `reason` when it says
    so (`database "NAME" does not exist`, the server's English message), else asked of the server through its
    `postgres` maintenance database (`pg_database`). Only reads: never creates anything.

    Args:
        url: A `postgresql://` (or `postgres://`) URL, as text or a SQLAlchemy `URL`; any other URL gives `None`.
        reason: The failed connection's error text, if any.
        timeout: Seconds to wait for the maintenance connection.

    Returns:
        The missing database's name; `None` when it exists, when the server (or its `postgres` database) cannot be
        reached, or for a URL without a database name. Never raises.
    """
    import sqlalchemy as sa

    try:
        parsed = url if isinstance(url, sa.URL) else sa.make_url(str(url).replace('postgres://', 'postgresql://', 1))
        if parsed.get_backend_name() != 'postgresql' or not parsed.database:
            return None
        if f'database "{parsed.database}" does not exist' in reason:
            return parsed.database
        engine = sa.create_engine(parsed.set(drivername='postgresql+psycopg', database='postgres'),
                                  connect_args={'connect_timeout': max(1, int(timeout))})
        try:
            with engine.connect() as conn:
                found = conn.execute(sa.text('SELECT 1 FROM pg_database WHERE datname = :name'),
                                     {'name': parsed.database}).scalar()
        finally:
            engine.dispose()
    except Exception:  # noqa: BLE001 - unreachable, refused, no `postgres` database: not known to be missing
        return None
    return parsed.database if found is None else None


def postgres_connect_fix(url: Any, reason: str = '') -> str:
    """The fix to print after a connection to PostgreSQL `url` failed with `reason`: create the database (naming it
    and `createdb`) when the server answers without it (`postgres_database_missing`), else start the database or
    fix the URL. Never raises."""
    missing = postgres_database_missing(url, reason)
    if missing is None:
        return 'start the database or fix the URL'
    import shlex

    return f'create the database (`createdb {printable(shlex.quote(missing))}` on that server) or fix the URL'
