"""`durcap wire`: serve the provider wire server (`durable_capabilities.wire`) on 127.0.0.1.

Exit codes: 0 stopped (Ctrl-C / SIGTERM); 2 unusable input (a script that does not parse, the port is taken,
the `providers` extra is not installed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .._limits import INPUT_CODE
from . import _err, _unusable, app


@app.command()
def wire(
    port: Annotated[int, typer.Option(help='TCP port on 127.0.0.1.', min=1, max=65535)] = 8765,
    script: Annotated[Path | None, typer.Option(help='A JSON or YAML wire script (default: the bundled support '
                                                      'conversation about order ABC-123).')] = None,
) -> None:
    """Serve OpenAI Chat Completions, OpenAI Responses and Anthropic Messages from a script, no API key needed.

    Point a model at it: `--model openai:gpt-4o --base-url http://127.0.0.1:PORT/v1` (`durcap demo`, `durcap run`),
    `openai-responses:...` likewise, `anthropic:...` with `--base-url http://127.0.0.1:PORT`.
    """
    import socket

    try:
        import uvicorn

        from ..wire import create_app, load_script
    except ImportError as exc:
        _unusable(f'durcap wire needs its extra: pip install "durable-capabilities[providers]" ({exc})')
    try:
        played = load_script(script) if script is not None else None
    except (OSError, ValueError, TypeError, KeyError) as exc:
        _unusable(f'cannot read the wire script {script}: {exc}')
    try:
        with socket.create_server(('127.0.0.1', port)):
            pass  # free: uvicorn binds it next
    except OSError as exc:
        _unusable(f'{INPUT_CODE} cannot serve on 127.0.0.1:{port}: {exc.strerror or exc}')
    _err.print(f'durcap wire: http://127.0.0.1:{port} (OpenAI base URL http://127.0.0.1:{port}/v1, Anthropic base URL '
               f'http://127.0.0.1:{port}); script: {script or "bundled support conversation"}', markup=False)
    uvicorn.Server(uvicorn.Config(create_app(played), host='127.0.0.1', port=port, log_level='warning',
                                  access_log=False)).run()
