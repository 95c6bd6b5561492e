"""A small real MCP server for engine tests, served over streamable HTTP on 127.0.0.1.

`python -m tests.engines.mcp_server --name NAME [--calls FILE]` binds a free port itself (port 0, so
no other process can take it between choosing and binding), prints `MCP READY http://127.0.0.1:PORT/mcp`
and serves until SIGTERM. Tools, all named after `NAME` so two servers never share a tool name:

- `{NAME}_add(a, b)`: `a + b`;
- `{NAME}_whoami()`: the server's name.

With `--calls FILE` every tool call appends one line (`tool args`) to FILE, so a test can count the
calls that really reached the server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket

import uvicorn
from fastmcp import FastMCP


def build(name: str, calls: str | None) -> FastMCP:
    server = FastMCP(name, instructions=f'Server {name}: adds numbers.')

    def record(tool: str, args: dict) -> None:
        if calls:
            with open(calls, 'a', encoding='utf-8') as f:
                f.write(f'{tool} {json.dumps(args, sort_keys=True)}\n')

    @server.tool(name=f'{name}_add')
    def add(a: int, b: int) -> int:
        """Add two integers."""
        record(f'{name}_add', {'a': a, 'b': b})
        return a + b

    @server.tool(name=f'{name}_whoami')
    def whoami() -> str:
        """Name of this server."""
        record(f'{name}_whoami', {})
        return name

    return server


async def serve(name: str, calls: str | None) -> None:
    app = build(name, calls).http_app(path='/mcp', transport='streamable-http')
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(('127.0.0.1', 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level='warning', lifespan='on')
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            await task
            return
        await asyncio.sleep(0.02)
    print(f'MCP READY http://127.0.0.1:{port}/mcp', flush=True)
    await task


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument('--name', required=True)
    parser.add_argument('--calls')
    args = parser.parse_args()
    asyncio.run(serve(args.name, args.calls))


if __name__ == '__main__':
    main()
