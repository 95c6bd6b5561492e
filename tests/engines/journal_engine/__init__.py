"""journal: a small durable test engine written against the public adapter protocol (`engines.EngineSpec`,
`engines.EngineAdapter`), to prove that adding a durable engine is one subpackage and one registry line.

Its durable container is a SQLite journal: each model request and tool call of a run is a step keyed by run id and
step number; running a run id again (`durcap runs resume`) replays the journaled results instead of calling again.
This module is the spec only (importing it imports nothing else); the adapter is in `_adapter`.
"""

from durable_capabilities.engines import ConnectionSetting, EngineSpec

SPEC = EngineSpec(
    name='journal',
    module=f'{__name__}._adapter',
    label='journal',
    settings=(ConnectionSetting('journal', ('--journal',), 'Journal engine SQLite file (default: $DURCAP_JOURNAL or '
                                '.durcap/journal.sqlite).', env=('DURCAP_JOURNAL',), kind='text',
                                commands=frozenset({'read', 'run', 'demo'}), unset='.durcap/journal.sqlite'),),
    describe=('journal', '{journal}'),
    where='--journal',
    lock_sections={'steps': 'step'},
    unit='step', units='steps', container='journal', run_id_label='journal run id',
    features=frozenset({'approvals'}),
)
