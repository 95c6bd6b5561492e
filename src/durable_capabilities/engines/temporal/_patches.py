"""Workflow code: durcap's patch markers, one for a new run (`_spec.CURRENT_PATCH_ID`) where histories recorded
before it have one per change.

`current()` is called first in every run (`_workflow`): a new run records the one marker `CURRENT_PATCH_ID` (one
command and one `TemporalChangeVersion` upsert, where a run of WORKFLOW_REVISION 2 recorded up to five of each); a
replayed history that has it finds it again, and one recorded before it (no such marker at its first workflow task)
does not. `patched(id)` then answers for an id of `IMPLIED_PATCH_IDS` without a marker of its own when the run has
the umbrella, and through `workflow.patched(id)` otherwise, exactly as before: a history recorded before replays the
same commands. The answer is kept on the workflow instance (one per run), so handlers and interceptors of the run see
it too.
"""

from __future__ import annotations

from typing import Any

from temporalio import workflow

from ._spec import CURRENT_PATCH_ID, IMPLIED_PATCH_IDS

_ATTRIBUTE = '__durcap_current_patch__'


def current() -> bool:
    """In workflow code, at the start of the run (before any command): whether the run has `CURRENT_PATCH_ID` (a new
    run: recorded now; a replay: whether its history has it). Asked once per run; later calls return the answer."""
    instance: Any = workflow.instance()
    found = getattr(instance, _ATTRIBUTE, None)
    if found is None:
        found = workflow.patched(CURRENT_PATCH_ID)
        setattr(instance, _ATTRIBUTE, found)
    return found


def patched(patch_id: str) -> bool:
    """`workflow.patched(patch_id)` for durcap's markers: `True` without a marker when the run has
    `CURRENT_PATCH_ID` and `patch_id` is one it implies; otherwise Temporal's own answer (a history recorded before
    the umbrella, or a run whose `current()` was not asked: its commands are those of the individual markers)."""
    if patch_id in IMPLIED_PATCH_IDS:
        try:
            instance: Any = workflow.instance()
        except Exception:  # noqa: BLE001 - not in a workflow run (`workflow.patched` says so below)
            instance = None
        if getattr(instance, _ATTRIBUTE, None):
            return True
    return workflow.patched(patch_id)
