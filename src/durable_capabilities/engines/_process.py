"""Processes of this host, as the engines' liveness checks see them (DBOS peers, Prefect flow-run processes)."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """Whether process `pid` of this host is running: it exists (signal 0 reaches it, or it belongs to another user)
    and is not a zombie (killed, not yet reaped by its parent: Linux's `/proc/PID/stat` state `Z`).

    Args:
        pid: A process id of this host (of this pid namespace).

    Returns:
        `False` when no such process runs; `True` otherwise (also where `/proc` cannot tell, e.g. macOS).
    """
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f'/proc/{pid}/stat', encoding='ascii', errors='replace') as stat:
            state = stat.read().rpartition(')')[2].split()
    except OSError:
        return True
    return not (state and state[0] == 'Z')
