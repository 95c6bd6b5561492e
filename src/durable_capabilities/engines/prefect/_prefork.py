"""`durcap schedule prefect`: each flow run's process forked from a preloaded fork server, not a new Python process
(issue 29).

Prefect's runner starts every flow run of a served deployment as a new process, `python -m prefect.engine` with the
run's id and control channel in its environment (`EngineCommandStarter`: `prefect.serve` adds the deployment, not
the flow object, so the in-memory `DirectSubprocessStarter` is not used, and our flow would not pickle anyway). That
interpreter imports Prefect (~2 CPU-s on this machine), pydantic-ai and durcap (~1.3 CPU-s more) and the target
before the flow starts: most of a flow run's cost, and on a loaded machine tens of seconds from PENDING to RUNNING.

Here the serving process starts multiprocessing's `forkserver` once, preloaded (`_preload`) with Prefect's flow
engine, pydantic-ai, durable_capabilities, TARGET's module and its agents' flows; nothing there starts a thread or
an event loop (`tests/engines/test_prefect_prefork.py`), so forking it is safe. `ForkServer.run_process`, installed at
Prefect's override point for that command (`_upstream.prefect_engine_run_process`), asks the fork server for a
child per flow run. The child takes the environment and folder Prefect's starter built for the run, refreshes
Prefect's settings from that environment (`prefect.context.refresh_global_settings_context`), and runs Prefect's own
`prefect.engine` main (`runpy`, the module as `python -m` runs it). So the flow run keeps what Prefect gives the
process it would start: its id and environment, the runner's control channel (cancellation), its heartbeats, the
exit code the runner reads (a signal as a negative code, as `subprocess` reports it; a crash is proposed CRASHED),
kill by pid, and the liveness beats `_worker.watch_crashed` watches (the serving process beats each run from the
fork until its process exits, the process itself only once the serving process is gone: `run_process`,
`flow_run_main`). Every other command Prefect starts goes to Prefect's own function unchanged.

Prefect's clients in the flow-run process would each check the server's version and fetch a CSRF token (2 clients:
4 requests a run) and each build a TLS context (~20 ms of CPU each, 7 a run): the serving process learns the answers
once (`ServerFacts`: re-read every `FACTS_SECONDS`) and gives them to each run's environment as Prefect's own
settings, only where the child's requests could not have changed anything (a server of this client's version or newer,
CSRF protection off) and the user has not set them; the fork server and the serving process share one TLS context per
CA file among their clients (`_upstream.prefect_share_tls_contexts`).

What differs: a flow-run process is a child of the fork server (itself a child of the serving process) rather than of
the serving process, and it runs TARGET's code as the serving process loaded it at start (as a Temporal or DBOS
worker does): restart the serving process to run new code. If the fork server dies, multiprocessing starts a new one
at the next flow run. `durcap schedule prefect --spawn` keeps Prefect's new process per flow run.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import runpy
import signal
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import anyio

from ... import _upstream
from ._liveness import HELD_ENV, beating

PRELOAD_MODULES = ('__main__', 'durable_capabilities.engines.prefect._preload')
"""What the fork server imports before it forks: the serving process's main script (so a child does not import it
again, as multiprocessing does for each child otherwise) and `_preload` (Prefect, pydantic-ai, durcap, TARGET)."""

_ENGINE_COMMAND_TAIL = ['-m', _upstream.PREFECT_ENGINE_MODULE]

VERSION_CHECK_ENV = 'PREFECT_CLIENT_SERVER_VERSION_CHECK_ENABLED'
CSRF_SUPPORT_ENV = 'PREFECT_CLIENT_CSRF_SUPPORT_ENABLED'

FACTS_SECONDS = 30.0
"""How old `ServerFacts` may be when a flow run starts before they are read again (a server restarted with CSRF
protection on, or replaced by another version, is seen within this)."""

FACTS_TIMEOUT = 5.0
"""Seconds `read_server_facts` may take (a flow run waits for it before its process starts, unbeaten): past it, no
facts, and the flow runs ask the server themselves."""


async def read_server_facts() -> dict[str, str]:
    """Prefect settings a flow-run process of this serving process can take instead of asking the server itself:
    `PREFECT_CLIENT_SERVER_VERSION_CHECK_ENABLED=false` when the server's version has this client's major version and
    is not older (the check would pass without a word: an older server gets a warning in each run's log, so it is
    left on), `PREFECT_CLIENT_CSRF_SUPPORT_ENABLED=false` when the server's CSRF protection is off (the client's token
    fetch would be answered "disabled"). Empty, or partial, when the server did not say within `FACTS_TIMEOUT` (any
    error: logged at debug): the flow runs then ask themselves, as Prefect does. Asks the API of this process's Prefect settings."""
    from packaging.version import Version
    from prefect import get_client

    facts: dict[str, str] = {}
    try:
        with anyio.fail_after(FACTS_TIMEOUT):
            async with get_client() as client:
                server, ours = Version(await client.api_version()), Version(client.client_version())
                if server.major == ours.major and server >= ours:
                    facts[VERSION_CHECK_ENV] = 'false'
                settings = await _upstream.prefect_server_settings(client)
                if settings['server']['api']['csrf_protection_enabled'] is False:
                    facts[CSRF_SUPPORT_ENV] = 'false'
    except Exception:  # any failure (past `FACTS_TIMEOUT` too) leaves the rest to the flow runs
        logging.getLogger(__name__).debug('prefect server facts not read', exc_info=True)
    return facts


class ServerFacts:
    """`read_server_facts` of this serving process, read again when older than `FACTS_SECONDS`."""

    def __init__(self) -> None:
        self._facts: dict[str, str] = {}
        self._url: str | None = None
        self._read_at: float | None = None

    def read_now(self) -> None:
        """Read them (no event loop may run in this thread: `asyncio.run`)."""
        self._read_at = time.monotonic()
        self._url, self._facts = _api_url(), asyncio.run(read_server_facts())

    async def env_for(self, env: dict[str, Any]) -> dict[str, Any]:
        """`env` (a flow-run process's environment, as Prefect's starter built it) with the facts added where it
        does not set them already (a user's own setting wins), if its `PREFECT_API_URL` is the API they were read
        from (Prefect's starter writes this process's). Reads them first when they are stale (one run at a time
        reads; the others meanwhile take the facts as they were)."""
        if self._read_at is None or time.monotonic() - self._read_at > FACTS_SECONDS:
            self._read_at = time.monotonic()
            self._url, self._facts = _api_url(), await read_server_facts()
        if not self._facts or env.get('PREFECT_API_URL') != self._url:
            return env
        return {**self._facts, **env}


def _api_url() -> str | None:
    from prefect.settings import get_current_settings

    return get_current_settings().api.url


FACTS = ServerFacts()
"""This process's `ServerFacts` (a serving process's runner asks it for each flow run it starts)."""


class ForkedProcess:
    """A flow-run process forked by the fork server, as Prefect's `ProcessHandle` reads a process: `pid`, and
    `returncode` (`None` while it runs; the exit code, negative for a signal, once `wait` has returned)."""

    def __init__(self, process: Any) -> None:
        self._process = process
        self.pid: int = process.pid
        self.returncode: int | None = None

    async def wait(self) -> int:
        """Wait (in the event loop, no thread) until the process has exited; returns its exit code.

        The fork server writes the exit code to the process's sentinel pipe: reading it on this one thread keeps
        multiprocessing's own bookkeeping (which reads the same pipe) from racing with it.
        """
        while self.returncode is None:
            await anyio.wait_readable(self._process.sentinel)
            self._process.join(0)
            code = self._process.exitcode
            if code is not None:
                self.returncode = code
                self._process.close()  # the sentinel's file descriptors
        return self.returncode


class ForkServer:
    """multiprocessing's fork server of this process, preloaded (`PRELOAD_MODULES`), starting Prefect's flow-run
    processes once `start` has returned."""

    def __init__(self) -> None:
        self.context = multiprocessing.get_context('forkserver')
        self._prefect_run_process: Callable[..., Any] | None = None

    def start(self) -> float:
        """Start the fork server and wait until it has preloaded (a first child forked and exited); returns the
        seconds that took.

        Raises:
            RuntimeError: the fork server's first child did not exit 0.
            OSError: the fork server could not be started.
        """
        began = time.monotonic()
        self.context.set_forkserver_preload(list(PRELOAD_MODULES))
        probe = self.context.Process(target=_probe, name='durcap-fork-server-probe')
        probe.start()
        probe.join()
        if probe.exitcode != 0:
            raise RuntimeError(f'the fork server\'s first child exited with {probe.exitcode}')
        probe.close()
        return time.monotonic() - began

    def install(self) -> None:
        """Make Prefect's runner in this process start its flow-run processes through `run_process`.

        Raises:
            RuntimeError: Prefect moved its override point (`_upstream.prefect_engine_run_process`).
        """
        self._prefect_run_process = _upstream.prefect_engine_run_process(self.run_process)

    def forks(self, command: list[str], stream_output: Any, kwargs: dict[str, Any]) -> bool:
        """Whether `run_process` forks this call: Prefect's flow-run command (`python -m prefect.engine` with this
        interpreter), an environment given, and nothing asked of the process but its folder and whether its output
        shows (a process group of its own, output sinks: Prefect's own function starts those)."""
        return (list(command[1:]) == _ENGINE_COMMAND_TAIL and command[0] == sys.executable
                and isinstance(stream_output, bool) and 'env' in kwargs and set(kwargs) <= {'env', 'cwd'})

    async def run_process(self, command: list[str], *, stream_output: Any = False, task_status: Any = None,
                          task_status_handler: Callable[[Any], Any] | None = None, **kwargs: Any) -> Any:
        """Prefect's `run_process` for a flow run's process (see `forks`; anything else goes to Prefect's own):
        fork a child of the fork server that runs `flow_run_main`, report it to `task_status` (through
        `task_status_handler`, as Prefect's does: the runner gets a `ProcessHandle` of it), and wait until it
        exits. Cancelled (the runner stopping), the child gets SIGTERM, as Prefect's own function sends it, and is
        waited for. Returns the `ForkedProcess`."""
        if not self.forks(command, stream_output, kwargs):
            prefect_run_process = self._prefect_run_process or _upstream.prefect_engine_run_process()
            return await prefect_run_process(command, stream_output=stream_output, task_status=task_status,
                                             task_status_handler=task_status_handler, **kwargs)
        env = {key: value for key, value in (await FACTS.env_for(kwargs['env'])).items() if value is not None}
        cwd = kwargs.get('cwd')
        flow_run_id = env.get('PREFECT__FLOW_RUN_ID')
        if flow_run_id:
            env[HELD_ENV] = str(os.getpid())  # this process beats the run; the child only once this one is gone
        # The run is PENDING until its process reaches the flow; a silent PENDING run is declared dead (`_liveness`).
        with beating(flow_run_id) if flow_run_id else contextlib.nullcontext():
            process = self.context.Process(target=flow_run_main,
                                           args=(env, None if cwd is None else str(cwd), stream_output),
                                           name='durcap-flow-run')
            process.start()
            forked = ForkedProcess(process)
            try:
                if task_status is not None:
                    task_status.started(task_status_handler(forked) if task_status_handler else forked.pid)
                await forked.wait()
            finally:
                if forked.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(forked.pid, signal.SIGTERM)
                    with anyio.CancelScope(shield=True):
                        await forked.wait()
        return forked


def _probe() -> None:
    """The fork server's first child: exits 0 at once (its start says the preload is done)."""


def flow_run_main(env: dict[str, str], cwd: str | None, stream_output: bool) -> None:
    """A forked flow-run process: Prefect's `python -m prefect.engine`, in this already-loaded interpreter.

    Args:
        env: The process's whole environment, as Prefect's starter built it (the flow run's id, control channel,
            heartbeat frequency, the serving process's own variables).
        cwd: The folder to run in (`None`: the fork server's, which is the serving process's).
        stream_output: False: stdout and stderr go to /dev/null (Prefect's `stream_output=False`); True: they are the
            serving process's own, where Prefect would copy them.

    Raises:
        SystemExit: Prefect's engine exits with the flow run's exit code (multiprocessing makes it the process's).
    """
    os.environ.clear()
    os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    if not stream_output:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        os.close(devnull)
    from prefect.context import refresh_global_settings_context

    refresh_global_settings_context()  # Prefect's settings from this run's environment, not the fork server's
    sys.argv = ['']  # prefect.engine reads a flow run id from argv[1] before $PREFECT__FLOW_RUN_ID; runpy sets argv[0]
    # runpy warns that the module is loaded already (the fork server preloaded it); its main block is what runs.
    warnings.filterwarnings('ignore', message=r"'prefect\.engine' found in sys\.modules", category=RuntimeWarning)
    flow_run_id = env.get('PREFECT__FLOW_RUN_ID')
    # The serving process beats the run while it lives (`ForkServer.run_process`); this process's beats take over
    # from its start if that process dies and this one lives on (`_liveness.beating`, `HELD_ENV`).
    with beating(flow_run_id) if flow_run_id else contextlib.nullcontext():
        runpy.run_module(_upstream.PREFECT_ENGINE_MODULE, run_name='__main__', alter_sys=True)


def beat_spawned() -> None:
    """`durcap schedule prefect --spawn` (or no fork server): the serving process beats each flow run whose process it
    starts (`_liveness.beating`) until that process exits.

    Why: a PENDING flow run that does not beat is declared dead (`_liveness.DeadRunWatch`), and a new Python process
    takes 8-70 s to import Prefect, pydantic-ai and the target before its flow beats itself; its serving process's
    beats cover that time (and stop with it: a serving process that dies leaves the run silent). Every other command
    goes to Prefect's own function unchanged.

    Raises:
        RuntimeError: Prefect moved its override point (`_upstream.prefect_engine_run_process`).
    """
    prefect_run_process = _upstream.prefect_engine_run_process()

    async def run_process(command: list[str], *, stream_output: Any = False, task_status: Any = None,
                          task_status_handler: Callable[[Any], Any] | None = None, **kwargs: Any) -> Any:
        env = kwargs.get('env')
        flow_run_id = (env.get('PREFECT__FLOW_RUN_ID') if isinstance(env, dict)
                       and list(command[1:]) == _ENGINE_COMMAND_TAIL else None)
        if flow_run_id and isinstance(env, dict):
            env = await FACTS.env_for(env)  # no version check or CSRF fetch where the answers are known
            kwargs['env'] = {**env, HELD_ENV: str(os.getpid())}  # its flow beats once this process is gone
        with beating(flow_run_id) if flow_run_id else contextlib.nullcontext():
            return await prefect_run_process(command, stream_output=stream_output, task_status=task_status,
                                             task_status_handler=task_status_handler, **kwargs)

    _upstream.prefect_engine_run_process(run_process)


def share_tls_contexts() -> None:
    """Prefect's clients in this process share one TLS context per CA file (`_upstream.prefect_share_tls_contexts`);
    when this Prefect no longer allows it, each builds its own as before (logged at debug)."""
    try:
        _upstream.prefect_share_tls_contexts()
    except RuntimeError:
        logging.getLogger(__name__).debug('prefect clients build their own TLS contexts', exc_info=True)


def start_fork_server(notify: Callable[[str], None], target: str) -> ForkServer | None:
    """Start the fork server (`ForkServer.start`) and say so through `notify`; `None` (Prefect's new process per flow
    run, said through `notify`) when it cannot start."""
    server = ForkServer()
    try:
        seconds = server.start()
        server.install()
    except (OSError, RuntimeError) as exc:
        notify(f'warning: no fork server ({exc}): each flow run starts a new Python process')
        return None
    notify(f'flow runs start from a fork server preloaded with Prefect, pydantic-ai and {target} (ready in '
           f'{seconds:.1f} s); --spawn starts a new Python process per flow run')
    return server
