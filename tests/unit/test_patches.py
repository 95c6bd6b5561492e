"""durcap's one patch marker for a new Temporal run (`engines.temporal._patches`, `_spec.CURRENT_PATCH_ID`).

Recorded histories, no server: `tests/histories/patches/` holds a run of the bench's 6-request agent (scripted
`FunctionModel` of `bench/_common.py`, its `ops` tools marked local) recorded by main's code at 5d08c66, before the
umbrella marker (`before-*`: five durcap markers), and one recorded by this code (`current-*`: one).
"""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path
from typing import Any

from tests._helpers import HISTORIES, ROOT

sys.path.insert(0, str(ROOT / 'bench'))

import _common as c


def _patches(path: Path) -> list[str]:
    events = json.loads(path.read_text())['history']['events']
    found = []
    for event in events:
        attrs = event.get('markerRecordedEventAttributes') or {}
        if attrs.get('markerName') == 'core_patch':
            found.append(json.loads(base64.b64decode(attrs['details']['patch-data']['payloads'][0]['data']))['id'])
    return found


def _agent() -> Any:
    from durable_capabilities import DurableAgent

    return DurableAgent('patches_lt', c.make_model(), instructions=c.INSTRUCTIONS, capabilities=[c.make_capability()],
                        engine_options={'temporal': {'local_activity_toolsets': {c.CAPABILITY_ID: {}}}})


def test_a_new_run_records_one_durcap_marker_and_histories_from_before_it_still_replay() -> None:
    """The history recorded before the umbrella has four durcap markers (streams, carried events, local tools,
    capabilities memo), each with its `TemporalChangeVersion` upsert; this code's has `durcap-workflow-3` and the
    local-tools marker (a configuration's, not implied; upstream's own marker stays), 4 events fewer; both replay
    against this code (the older one through each individual marker, as before)."""
    from durable_capabilities.engines.temporal._spec import CURRENT_PATCH_ID
    from durable_capabilities.testing import assert_histories_replay

    folder = HISTORIES / 'patches'
    before, current = _patches(folder / 'before-local-tools.json'), _patches(folder / 'current-local-tools.json')
    assert before == ['durcap-run-streams', 'durcap-stream-events-carried', 'pydantic_ai:stable_default_run_id',
                      'durcap-local-tool-activities', 'durcap-capabilities-memo']
    assert current == [CURRENT_PATCH_ID, 'pydantic_ai:stable_default_run_id', 'durcap-local-tool-activities']
    sizes = [len(json.loads((folder / f'{n}-local-tools.json').read_text())['history']['events']) for n in ('before', 'current')]
    assert sizes == [58, 54]
    assert assert_histories_replay(folder, [_agent()]) == 2


def test_the_umbrella_implies_the_code_markers_not_those_of_a_runs_configuration() -> None:
    """`IMPLIED_PATCH_IDS` names every durcap marker of a code change; the local-tools and MCP-guard markers stay
    their own: they are asked only where a run's configuration chose the new commands, so a run recorded before its
    leaf was marked local (or its guard turned on) replays with the mark (`tests/engines/test_local_tools.py`)."""
    from durable_capabilities.engines import _mcp
    from durable_capabilities.engines.temporal import _spec

    assert set(_spec.IMPLIED_PATCH_IDS) == {
        _spec.CAPABILITIES_PATCH_ID, _spec.STREAMS_PATCH_ID, _spec.FAILED_APPEND_PATCH_ID, _spec.LATE_CLOSING_PATCH_ID,
        _spec.CARRY_PATCH_ID}
    assert _spec.LOCAL_TOOLS_PATCH_ID not in _spec.IMPLIED_PATCH_IDS and _mcp.TEMPORAL_PATCH_ID not in _spec.IMPLIED_PATCH_IDS
    assert _spec.CURRENT_PATCH_ID not in _spec.IMPLIED_PATCH_IDS
