"""A reverse proxy in front of a real Prefect server that answers 503 to some writes, as a Prefect server on SQLite
under load does (`database is locked`: its retryable-error handler answers 503) for seconds at a time.

    python -m tests.engines.refusing_proxy UPSTREAM_API_URL PORT_FILE LOG_FILE PATH_REGEX REFUSE_SECONDS

Every request is forwarded to UPSTREAM_API_URL (`http://127.0.0.1:4200/api`) unchanged, except a POST whose path
(after `/api`) matches PATH_REGEX: from the first such request on, for REFUSE_SECONDS (negative: for good), it is
answered 503 with Prefect's body and never forwarded. One line per refused request goes to LOG_FILE
(`503 POST /flow_runs/<id>/resume`). The bound port is written to PORT_FILE once it listens.
"""

from __future__ import annotations

import re
import socket
import sys
import time
from pathlib import Path

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route


def main() -> None:
    upstream, port_file, log_file, pattern, seconds = sys.argv[1:6]
    refuse_for, matcher = float(seconds), re.compile(pattern)
    first: list[float] = []
    client = httpx.AsyncClient(base_url=upstream, timeout=60)

    async def forward(request: Request) -> Response:
        path = request.url.path.removeprefix('/api')
        if request.method == 'POST' and matcher.search(path):
            now = time.monotonic()
            first[:] = first or [now]
            if refuse_for < 0 or now - first[0] < refuse_for:
                with open(log_file, 'a') as log:
                    log.write(f'503 POST {path}\n')
                return JSONResponse({'exception_message': 'Service Unavailable'}, status_code=503)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ('host', 'content-length')}
        answer = await client.request(request.method, path, params=request.query_params, headers=headers,
                                      content=await request.body())
        drop = ('content-length', 'content-encoding', 'transfer-encoding', 'connection')
        return Response(answer.content, answer.status_code,
                        {k: v for k, v in answer.headers.items() if k.lower() not in drop})

    app = Starlette(routes=[Route('/api/{rest:path}', forward, methods=['GET', 'POST', 'PUT', 'PATCH', 'DELETE'])])
    sock = socket.socket()
    sock.bind(('127.0.0.1', 0))
    Path(port_file).write_text(str(sock.getsockname()[1]))
    uvicorn.Server(uvicorn.Config(app, log_level='warning')).run(sockets=[sock])


if __name__ == '__main__':
    main()
