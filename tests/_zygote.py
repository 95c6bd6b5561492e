"""A fork server for the test suite's Python subprocesses (test infrastructure only: never imported by the package).

Why: most engine tests start `durcap` (and `python -c` / `python -m tests.engines...`) subprocesses, and a fresh
interpreter spends ~1.5 s of CPU importing pydantic-ai and its dependencies before it does anything. On the 2-core CI
machine those imports were most of the suite's CPU time. Here one server process per pytest process imports those
third-party modules once (never `durable_capabilities`, `tests`, `examples`, nor the engine SDKs, SQLAlchemy or MCP:
tests/unit/test_lazy_imports.py checks that a command does not import them) and forks a child for each eligible
`subprocess.Popen`. The child is a real process with its own pid: it is signalled, SIGKILLed and put in its own
session exactly as before; it sets up `sys.argv`, `sys.path`, the environment, the working directory, stdio and
`__main__` as `python [-u] -m MOD ARGS` / `python [-u] -c CODE ARGS` would, and exits as the interpreter would
(non-daemon threads joined, atexit handlers run; an uncaught KeyboardInterrupt ends it by SIGINT).

Anything else (another executable, `preexec_fn`, `pass_fds`, uid/gid/umask, `-X`/`-W` options, PYTHON* variables
that change start-up, `DURCAP_TEST_ZYGOTE=0` in the child's or the suite's environment) runs through the real
`subprocess.Popen`, unchanged. The test process installs the client with `install()` (tests/conftest.py).

Protocol: the client connects to the server's Unix socket once per child, sends one JSON request with the child's
three stdio descriptors (SCM_RIGHTS), gets the child's pid back, and later its raw wait status on the same
connection (the server reaps its children on SIGCHLD), which `Popen._try_wait` hands to `_handle_exitstatus`.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
from typing import Any

PRELOAD = (
    'pydantic', 'pydantic_core', 'httpx', 'anyio', 'typer', 'click', 'rich.console', 'rich.table', 'yaml',
    'jsonschema', 'pydantic_ai', 'pydantic_ai.agent', 'pydantic_ai.messages', 'pydantic_ai.models',
    'pydantic_ai.models.function', 'pydantic_ai.models.test', 'pydantic_ai.toolsets', 'pydantic_ai.capabilities',
    'pydantic_ai.durable_exec',
)
"""Third-party modules the server imports once. Never ours, never an engine SDK, SQLAlchemy or MCP."""

FORBIDDEN = ('durable_capabilities', 'tests', 'examples', 'temporalio', 'dbos', 'prefect', 'sqlalchemy', 'mcp',
             'fastmcp', 'opentelemetry.sdk', 'logfire')
"""Top-level packages the server must not hold (checked after the preload; the server refuses to start if it does)."""

_STARTUP_VARIABLES = ('PYTHONSTARTUP', 'PYTHONWARNINGS', 'PYTHONHASHSEED', 'PYTHONDEVMODE', 'PYTHONTRACEMALLOC',
                      'PYTHONFAULTHANDLER', 'PYTHONPROFILEIMPORTTIME', 'PYTHONNOUSERSITE', 'PYTHONHOME',
                      'PYTHONSAFEPATH', 'PYTHONINSPECT', 'PYTHONOPTIMIZE',
                      'PYTHONEXECUTABLE', 'PYTHONUTF8', 'PYTHONIOENCODING')


# ---- server ------------------------------------------------------------------------------------------------------


def _recv_request(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    header = b''
    fds: list[int] = []
    while len(header) < 4:
        data, got, _flags, _addr = socket.recv_fds(conn, 4 - len(header), 8)
        if not data:
            raise EOFError
        header += data
        fds += got
    size = struct.unpack('!I', header)[0]
    body = b''
    while len(body) < size:
        chunk = conn.recv(size - len(body))
        if not chunk:
            raise EOFError
        body += chunk
    return json.loads(body), fds


def _child(request: dict[str, Any], fds: list[int], base_path: list[str], warning_filters: list[Any]) -> None:
    """Runs in the forked child: become `python [-u] -m/-c ...` and never return."""
    import warnings

    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for target, fd in enumerate(fds):
            if fd != target:
                os.dup2(fd, target)
        os.closerange(3, 65536)
        if request['session']:
            os.setsid()
        elif request['process_group'] is not None and request['process_group'] >= 0:
            os.setpgid(0, request['process_group'])
        env = request['env']
        os.environ.clear()
        os.environ.update(env)
        sys.dont_write_bytecode = bool(env.get('PYTHONDONTWRITEBYTECODE'))  # as the interpreter reads it at start
        os.chdir(request['cwd'] or '.')
        unbuffered = request['unbuffered'] or bool(env.get('PYTHONUNBUFFERED'))
        sys.stdin = open(0, encoding='utf-8', closefd=False)
        sys.stdout = open(1, 'w', encoding='utf-8', closefd=False, buffering=1 if os.isatty(1) else -1,
                          errors='strict')
        sys.stderr = open(2, 'w', encoding='utf-8', closefd=False, buffering=1, errors='backslashreplace')
        if unbuffered:
            sys.stdout.reconfigure(write_through=True)
            sys.stderr.reconfigure(write_through=True)
        sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
        extra = [p for p in env.get('PYTHONPATH', '').split(os.pathsep) if p]
        mode, what, args = request['mode'], request['what'], request['args']
        first = '' if mode == '-c' else os.getcwd()
        sys.path[:] = [first, *(os.path.abspath(p) for p in extra), *base_path]
        warnings.filters[:] = warning_filters
        warnings._filters_mutated()  # type: ignore[attr-defined]
        import runpy

        if mode == '-m':
            sys.argv = [what, *args]
            runpy._run_module_as_main(what, alter_argv=True)  # type: ignore[attr-defined]
        else:
            import types

            main = types.ModuleType('__main__')
            import builtins

            main.__dict__['__builtins__'] = builtins
            sys.modules['__main__'] = main
            sys.argv = ['-c', *args]
            exec(compile(what, '<string>', 'exec'), main.__dict__)  # noqa: S102
        code = 0
    except SystemExit as stop:
        if stop.code is None:
            code = 0
        elif isinstance(stop.code, int):
            code = stop.code
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        _finish()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:  # noqa: BLE001
        import traceback

        traceback.print_exc()
        code = 1
    _finish()
    os._exit(code & 0xFF)


def _finish() -> None:
    try:
        threading._shutdown()  # type: ignore[attr-defined]
    except BaseException:  # noqa: BLE001, S110
        pass
    try:
        import atexit

        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001, S110
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001, S110
            pass


def serve(path: str, control_fd: int) -> None:
    """The server's loop: accept requests on the Unix socket `path`, fork, report pids and wait statuses; exit when
    `control_fd` (the client's pipe) reaches EOF."""
    import selectors
    import warnings

    base_path = [p for p in sys.path[1:] if p]  # started without PYTHONPATH: the interpreter's and site's own
    warning_filters = list(warnings.filters)
    for name in PRELOAD:
        __import__(name)
    held = [m for m in sys.modules if any(m == f or m.startswith(f + '.') for f in FORBIDDEN)]
    if held or threading.active_count() != 1:
        print(f'zygote: refusing to serve: holds {held[:5]} or runs threads', file=sys.stderr)
        sys.exit(3)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, 'accept')
    selector.register(wake_r, selectors.EVENT_READ, 'child')
    selector.register(control_fd, selectors.EVENT_READ, 'control')
    waiting: dict[int, socket.socket] = {}
    sys.stdout.write('ready\n')
    sys.stdout.flush()
    while True:
        for key, _ in selector.select():
            if key.data == 'control':
                if not os.read(control_fd, 1024):
                    for conn in waiting.values():
                        conn.close()
                    os._exit(0)
            elif key.data == 'child':
                try:
                    while os.read(wake_r, 1024):
                        pass
                except BlockingIOError:
                    pass
                while True:
                    try:
                        pid, status = os.waitpid(-1, os.WNOHANG)
                    except ChildProcessError:
                        break
                    if pid == 0:
                        break
                    conn = waiting.pop(pid, None)
                    if conn is not None:
                        try:
                            conn.sendall(json.dumps({'status': status}).encode() + b'\n')
                        except OSError:
                            pass
                        conn.close()
            else:
                conn, _ = listener.accept()
                try:
                    request, fds = _recv_request(conn)
                except (EOFError, OSError, ValueError):
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    listener.close()
                    _child(request, fds, base_path, warning_filters)
                for fd in fds:
                    os.close(fd)
                waiting[pid] = conn
                try:
                    conn.sendall(json.dumps({'pid': pid}).encode() + b'\n')
                except OSError:
                    pass


# ---- client ------------------------------------------------------------------------------------------------------

_lock = threading.Lock()
_server: dict[str, Any] = {}


def _server_path() -> str | None:
    """The running server's socket path, starting the server on first use; None when it cannot start."""
    with _lock:
        if 'path' in _server:
            return _server['path']
        import tempfile

        folder = tempfile.mkdtemp(prefix='durcap-zygote-')
        path = os.path.join(folder, 's')
        read_end, write_end = os.pipe()
        # No PYTHONPATH: the server's sys.path is the interpreter's and site's alone (a .pth entry that PYTHONPATH
        # names too, as with an editable install, stays), and each child puts its own PYTHONPATH in front of it.
        env = {k: v for k, v in os.environ.items() if k not in _STARTUP_VARIABLES and k != 'PYTHONPATH'}
        here = os.path.dirname(os.path.abspath(__file__))
        proc = _REAL_POPEN([sys.executable, os.path.join(here, '_zygote.py'), path, str(read_end)],
                           pass_fds=(read_end,), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                           stderr=None, env=env, start_new_session=True)
        os.close(read_end)
        line = proc.stdout.readline() if proc.stdout else b''
        if line.strip() != b'ready':
            os.close(write_end)
            _server['path'] = None
            return None
        _server.update(path=path, control=write_end, proc=proc)
        return path


def _eligible(args: Any, kwargs: dict[str, Any]) -> tuple[str, str, list[str], bool] | None:
    if os.environ.get('DURCAP_TEST_ZYGOTE', '1') == '0':
        return None
    if isinstance(args, (str, bytes)) or not args or kwargs.get('shell') or kwargs.get('executable'):
        return None
    for name in ('preexec_fn', 'pass_fds', 'user', 'group', 'extra_groups', 'umask', 'startupinfo'):
        value = kwargs.get(name)
        if value not in (None, (), -1, 0) or (name == 'umask' and value not in (None, -1)):
            return None
    if kwargs.get('close_fds') is False or kwargs.get('restore_signals') is False:
        return None
    args = [os.fspath(a) for a in args]
    if not all(isinstance(a, str) for a in args) or args[0] != sys.executable:
        return None
    env = kwargs.get('env')
    env = os.environ if env is None else env
    if env.get('DURCAP_TEST_ZYGOTE') == '0' or any(env.get(k) for k in _STARTUP_VARIABLES):
        return None
    rest = args[1:]
    unbuffered = False
    if rest[:1] == ['-u']:
        unbuffered, rest = True, rest[1:]
    if len(rest) < 2 or rest[0] not in ('-m', '-c'):
        return None
    if rest[0] == '-m' and rest[1].split('.')[0] not in ('durable_capabilities', 'tests'):
        return None
    return rest[0], rest[1], rest[2:], unbuffered


_REAL_POPEN = subprocess.Popen


class ZygotePopen(subprocess.Popen):  # type: ignore[type-arg]
    """`subprocess.Popen` that forks eligible Python children from the zygote (module docstring)."""

    _zygote_conn: socket.socket | None = None

    def __init__(self, args: Any, *posargs: Any, **kwargs: Any) -> None:
        # asyncio's subprocess transport waits for its child with waitpid/pidfd: a zygote child is not this process's.
        caller = sys._getframe(1)
        from_asyncio = any(str(f.f_globals.get('__name__', '')).startswith(('asyncio', 'anyio', 'trio'))
                           for f in (caller, caller.f_back, caller.f_back.f_back if caller.f_back else None) if f)
        self._zygote_plan = None if posargs or from_asyncio else _eligible(args, kwargs)
        self._zygote_env = kwargs.get('env')
        self._zygote_session = bool(kwargs.get('start_new_session'))
        self._zygote_group = kwargs.get('process_group')
        super().__init__(args, *posargs, **kwargs)

    def _execute_child(self, args: Any, executable: Any, preexec_fn: Any, close_fds: Any, pass_fds: Any, cwd: Any,
                       env: Any, startupinfo: Any, creationflags: Any, shell: Any, p2cread: int, p2cwrite: int,
                       c2pread: int, c2pwrite: int, errread: int, errwrite: int, *rest: Any) -> None:
        plan = getattr(self, '_zygote_plan', None)
        path = _server_path() if plan else None
        if plan is None or path is None:
            return super()._execute_child(args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                                          creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread,
                                          errwrite, *rest)
        mode, what, child_args, unbuffered = plan
        child_env = dict(os.environ if env is None else {os.fsdecode(k): os.fsdecode(v) for k, v in env.items()})
        fds = [p2cread if p2cread != -1 else 0, c2pwrite if c2pwrite != -1 else 1, errwrite if errwrite != -1 else 2]
        request = {'mode': mode, 'what': what, 'args': child_args, 'unbuffered': unbuffered, 'env': child_env,
                   'cwd': os.fspath(cwd) if cwd is not None else os.getcwd(), 'session': self._zygote_session,
                   'process_group': self._zygote_group}
        body = json.dumps(request).encode()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(path)
        socket.send_fds(conn, [struct.pack('!I', len(body))], fds)
        conn.sendall(body)
        buffer = b''
        while b'\n' not in buffer:
            chunk = conn.recv(4096)
            if not chunk:
                raise OSError('zygote: the server closed the connection before it sent the pid')
            buffer += chunk
        reply, self._zygote_buffer = buffer.split(b'\n', 1)
        self.pid = json.loads(reply)['pid']
        self._child_created = True
        self._zygote_conn = conn
        # What the real `_execute_child` does once the child runs: close this process's copies of the child's ends,
        # so the pipes reach EOF when the child exits.
        devnull = getattr(self, '_devnull', None)
        if p2cread != -1 and p2cwrite != -1 and p2cread != devnull:
            os.close(p2cread)
        if c2pwrite != -1 and c2pread != -1 and c2pwrite != devnull:
            os.close(c2pwrite)
        if errwrite != -1 and errread != -1 and errwrite != devnull:
            os.close(errwrite)
        if devnull is not None:
            os.close(devnull)
        self._closed_child_pipe_fds = True

    def _zygote_status(self, block: bool) -> int | None:
        conn = self._zygote_conn
        assert conn is not None
        conn.setblocking(block)
        try:
            while b'\n' not in self._zygote_buffer:
                chunk = conn.recv(4096)
                if not chunk:
                    return 0
                self._zygote_buffer += chunk
        except BlockingIOError:
            return None
        finally:
            conn.setblocking(True)
        return json.loads(self._zygote_buffer.split(b'\n')[0])['status']

    def _try_wait(self, wait_flags: int) -> tuple[int, int]:
        if self._zygote_conn is None:
            return super()._try_wait(wait_flags)
        status = self._zygote_status(block=not wait_flags & os.WNOHANG)
        return (0, 0) if status is None else (self.pid, status)

    def _internal_poll(self, _deadstate: Any = None, **kwargs: Any) -> int | None:
        if self._zygote_conn is None:
            return super()._internal_poll(_deadstate, **kwargs)
        if self.returncode is None:
            if not self._waitpid_lock.acquire(False):
                return None
            try:
                if self.returncode is None:
                    status = self._zygote_status(block=False)
                    if status is not None:
                        self._handle_exitstatus(status)
            finally:
                self._waitpid_lock.release()
        return self.returncode


def install() -> None:
    """Route eligible `subprocess.Popen` calls of this process through the zygote (module docstring)."""
    if os.environ.get('DURCAP_TEST_ZYGOTE', '1') != '0' and sys.platform == 'linux':
        subprocess.Popen = ZygotePopen  # type: ignore[misc]


if __name__ == '__main__':
    serve(sys.argv[1], int(sys.argv[2]))
