"""Tool-call task results that keep their long texts in the conversation store, once (issue 24).

Prefect persists every task's result (`persist_result=True`: a flow run resumed in another process reads its finished
tasks' results back instead of running them again). A tool's ~50 KB result was stored whole in result storage, and
again in the conversation when the turn was appended: with Prefect's own records per task run, 5x the conversation's
bytes. `ToolResultPieces` is the Prefect result serializer of the tool-call tasks (`_durability.durability_parts`):

- `dumps` pickles the result with every string of `PIECE_FROM` characters or more taken out, each written to the
  conversation store's `durcap_payloads` as a piece (keyed by `piece_digest`, zlib-compressed when that saves a tenth:
  `kind` 3), referred to by the flow run (`durcap_payload_refs.owner` = `prefect:<flow run id>`, the turn's append id,
  so `durcap history delete` removes them with the conversation). Result storage keeps a record of a few hundred bytes.
- once the turn's append has landed, `settle` replaces each such piece whose text the appended messages hold by the
  id of the entry that holds it (`kind` 4, `SQLConversationStore.point_payloads`): the text is then stored once, in the
  conversation.
- `loads` puts the texts back: from the piece, or from the entry's message (its string of the same digest).

The digests are namespaced (`piece_digest`), so these rows are never a Temporal claim check's pieces: turning one into
a pointer changes no other run's data. Results persisted before this serializer (Prefect's `pickle`) read as before:
Prefect records each result's serializer with it. Where no store is reachable, `dumps` raises and Prefect fails (and
retries) the task, as it does when result storage cannot be written.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import pickle
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Literal

from prefect.serializers import Serializer

from ...conversations import process_store
from ...store import CorruptedRowError, resolve_url
from ...store._sql import tool_text_digest
from ._spec import ENGINE

SERIALIZER_TYPE = 'durcap/pieces'
"""The serializer's name, recorded with every result it wrote (Prefect finds the class by it)."""

PIECE_FROM = 1024
"""Strings of this many characters or more are stored as pieces."""

COMPRESS_FROM = 512
KIND_PIECE, KIND_ZPIECE, KIND_IN_ENTRY = 0, 3, 4
"""`durcap_payloads.kind` of a piece stored as it is, compressed, and of a pointer to the entry holding its text."""

_STORE: ContextVar[str | None] = ContextVar('durcap_prefect_result_store', default=None)

_logger = logging.getLogger(__name__)


def piece_digest(text: str) -> str:
    """The `durcap_payloads` key of a text taken out of a tool result (sha256, namespaced; the store's
    `tool_text_digest`, which a conversation's delete uses to give a shared pointer its text back)."""
    return tool_text_digest(text)


@contextmanager
def result_store(url: str) -> Iterator[None]:
    """Within this block (a flow run and its tasks), tool results keep their texts in the store at `url`. Outside
    one, the serializer uses `$DURCAP_STORE`, else the default store."""
    token = _STORE.set(url)
    try:
        yield
    finally:
        _STORE.reset(token)


def _store() -> Any:
    return process_store(_STORE.get() or resolve_url(None))


def _owner() -> str | None:
    """The flow run's append id (`prefect:<flow run id>`), the pieces' owner; `None` outside a flow run."""
    from prefect.context import FlowRunContext, TaskRunContext

    task = TaskRunContext.get()
    if task is not None and task.task_run.flow_run_id is not None:
        return f'{ENGINE}:{task.task_run.flow_run_id}'
    flow = FlowRunContext.get()
    return f'{ENGINE}:{flow.flow_run.id}' if flow is not None and flow.flow_run is not None else None


def _pack(data: bytes, kind: int) -> tuple[bytes, int]:
    if kind == KIND_PIECE and len(data) >= COMPRESS_FROM:
        packed = zlib.compress(data, 6)
        if len(packed) <= len(data) * 0.9:
            return packed, KIND_ZPIECE
    return data, kind


class _Pickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.pieces: dict[str, str] = {}

    def persistent_id(self, obj: Any) -> str | None:  # type: ignore[override]
        if type(obj) is str and len(obj) >= PIECE_FROM:
            digest = piece_digest(obj)
            self.pieces[digest] = obj
            return digest
        return None


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, texts: dict[str, str]) -> None:
        super().__init__(file)
        self.texts = texts

    def persistent_load(self, pid: Any) -> Any:
        return self.texts[pid]


def _strings(value: Any) -> Iterator[str]:
    """Every string of `PIECE_FROM` characters or more in decoded JSON `value`."""
    if isinstance(value, str):
        if len(value) >= PIECE_FROM:
            yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def _from_entry(store: Any, digest: str, entry_id: str) -> str:
    message = store._sql.entry_message(entry_id)
    if message is not None:
        for text in _strings(json.loads(message)):
            if piece_digest(text) == digest:
                return text
    raise CorruptedRowError(
        f'a Prefect tool result refers to its text in conversation entry {entry_id!r}, which '
        f'{"no longer holds it" if message is not None else "is not in durcap_entries (the conversation was deleted)"}; '
        'the task run\'s result cannot be read back.', conversation_id=None, table='durcap_payloads', row=digest)


class ToolResultPieces(Serializer):  # type: ignore[type-arg]
    """Prefect result serializer of durcap's tool-call tasks: a pickle whose long strings are pieces in the
    conversation store (see the module docstring). Chosen by `_durability.durability_parts`; a user's
    `tool_task_config={'result_serializer': ...}` wins."""

    type: Literal['durcap/pieces'] = 'durcap/pieces'

    def dumps(self, obj: Any) -> bytes:
        """The pickle of `obj` (base64), its long strings written to the store (raises the store's error when it cannot
        be written)."""
        buffer = io.BytesIO()
        pickler = _Pickler(buffer)
        pickler.dump(obj)
        if pickler.pieces:
            store = _store()
            owner = _owner()
            for digest, text in pickler.pieces.items():
                store._sql.put_tree(digest, [(digest, text.encode(), KIND_PIECE)], owner, _pack)
        return base64.b64encode(buffer.getvalue())  # Prefect writes the record as JSON text, as its pickle does

    def loads(self, blob: bytes) -> Any:
        """The object `dumps` pickled, its strings read back from the store.

        Raises:
            CorruptedRowError: a piece is missing from the store, or the entry it points to no longer holds it.
        """
        blob = base64.b64decode(blob)
        digests: list[str] = []

        class _Find(pickle.Unpickler):
            def persistent_load(self, pid: Any) -> Any:
                digests.append(pid)
                return ''

        _Find(io.BytesIO(blob)).load()
        texts: dict[str, str] = {}
        if digests:
            store = _store()
            rows = store._sql.get_rows(digests)
            for digest in dict.fromkeys(digests):
                if digest not in rows:
                    raise CorruptedRowError(
                        f'a Prefect tool result\'s text {digest[:12]} is not in durcap_payloads of {store.location} '
                        '(its conversation was deleted, or the flow run used another --store); the task run\'s result '
                        'cannot be read back.', conversation_id=None, table='durcap_payloads', row=digest)
                data, kind = rows[digest]
                if kind == KIND_IN_ENTRY:
                    texts[digest] = _from_entry(store, digest, data.decode())
                else:
                    texts[digest] = (zlib.decompress(data) if kind == KIND_ZPIECE else data).decode()
        return _Unpickler(io.BytesIO(blob), texts).load()


def settle(conversation_id: str, append_id: str) -> int:
    """After the append `append_id` landed: the pieces the flow run's tool results wrote whose texts the appended
    messages hold point to those entries instead (`SQLConversationStore.point_payloads`). Idempotent; returns the bytes
    freed. A failure is logged, not raised: the pieces then keep their bytes (stored twice, still correct)."""
    try:
        store = _store()
        digests = set(store._sql.pieces_of(append_id))
        if not digests:
            return 0
        pointers: dict[str, str] = {}
        for entry_id, message in store._sql.appended_entries(conversation_id, append_id).items():
            for text in _strings(json.loads(message)):
                digest = piece_digest(text)
                if digest in digests:
                    pointers.setdefault(digest, entry_id)
        return store._sql.point_payloads(pointers) if pointers else 0
    except Exception as exc:  # noqa: BLE001 - the texts stay in their pieces: correct, stored twice
        _logger.warning('flow run %s: its tool results\' texts were kept in durcap_payloads as well as in the '
                        'conversation (%s)', append_id, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return 0
