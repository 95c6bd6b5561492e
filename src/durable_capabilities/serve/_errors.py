"""The coded refusals of `durcap serve` (the DC041-DC045 family beside DC040): each maps to one HTTP status, and the
response body is `{"error": {"code", "status", "message"}}`, never a traceback. The message leads with the code, as
every coded error's does (`lead_with_code`)."""

from __future__ import annotations

from typing import Any

from ..errors import DurcapError


class ServeError(DurcapError, code='serve'):
    """Base of the refusals `durcap serve` answers with a coded body (`status` is the HTTP status).

    Attributes:
        status: The HTTP status of the response.
        detail: Extra JSON-compatible facts for the body (e.g. `{"field": "prompt"}`).
    """

    status: int = 400

    def __init__(self, message: str, **detail: Any):
        super().__init__(lead_with_code(self.code, message))
        self.detail = detail

    def body(self) -> dict[str, Any]:
        """The response body: `{"error": {"code", "status", "message", **detail}}`."""
        return {'error': {'code': self.code, 'status': self.status, 'message': str(self), **self.detail}}


def lead_with_code(code: str, message: str) -> str:
    """`message` with `code` first (`'DC044 no run ...'`) when `code` is a DC code and the message does not lead with
    it already (one from an error that leads with its own code, e.g. an `ApprovalError` of kind `unknown-run`)."""
    if not code.startswith('DC') or message.startswith(code):
        return message
    return f'{code} {message}'


class RequestTooLargeError(ServeError, code='DC041'):
    """A request body is over the server's bound (`create_app(max_body_bytes=...)`, default 1 MiB): 413, nothing
    read further, nothing stored. Build it with `over`, whose message ends with the fix."""

    status = 413

    @classmethod
    def over(cls, what: str, limit: int, size: int | None = None) -> RequestTooLargeError:
        """The refusal of `what`'s body (`'prompt'`, `'decision'`: the request's part) over `limit` bytes.

        Args:
            what: What the body is for, first in the message.
            limit: The server's bound in bytes.
            size: The body's declared size (its `Content-Length`), `None` when it was found over the limit while
                being read.
        """
        found = f'the body is {size} bytes, over' if size is not None else 'the body is over'
        return cls(f'{what}: {found} the limit of {limit} bytes. Fix: send a smaller body (large content belongs in '
                   "the agent's tools or deps, not the prompt), or start the server with a larger bound: "
                   '`durcap serve --max-body-bytes N` (`create_app(max_body_bytes=N)`)', limit=limit)


class BadRequestError(ServeError, code='DC042'):
    """A request body or header is unusable: not JSON, nested too deep, of the wrong shape (a missing or unknown
    field, a wrong type), deps that do not fit the agent's `deps_type`: 400 (422 for a well-formed decision that
    cannot apply), the message naming the field."""

    status = 400


class UnauthenticatedError(ServeError, code='DC043'):
    """No credentials, or credentials the server's `auth` does not accept (default: `Authorization: Bearer
    $DURCAP_SERVE_TOKEN`): 401."""

    status = 401


class NotFoundError(ServeError, code='DC044'):
    """No such agent, run, conversation or pending call for this principal: 404. A conversation or run another
    principal owns is answered the same way (its existence is not disclosed)."""

    status = 404


class IdempotencyConflictError(ServeError, code='DC045'):
    """An `Idempotency-Key` sent again with a different request (another conversation, agent, prompt or deps): 409,
    nothing started."""

    status = 409
