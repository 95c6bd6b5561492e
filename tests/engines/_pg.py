"""Fresh PostgreSQL databases on 127.0.0.1:5432 (trust auth) for engine tests, dropped afterwards."""

from __future__ import annotations

import uuid

ADMIN_URL = 'postgresql://postgres@127.0.0.1:5432/postgres'


def create_database(prefix: str = 'durcap') -> str:
    """Create an empty database named `{prefix}_<random>`; returns its name."""
    import psycopg

    name = f'{prefix}_{uuid.uuid4().hex[:12]}'
    with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE {name}')
    return name


def drop_database(name: str) -> None:
    """Drop a database made by `create_database`, closing its connections."""
    import psycopg

    with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS {name} WITH (FORCE)')


def url(name: str) -> str:
    return f'postgresql://postgres@127.0.0.1:5432/{name}'
