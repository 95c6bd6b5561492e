"""The built-in engines' specs (`_protocol.EngineSpec`): local, Temporal, DBOS, Prefect.

The registry (`engines/__init__.py`) registers one `LazyAdapter(spec)` per engine, and each built-in adapter class
takes its name, nouns, extra and features from its spec (`class DBOSAdapter(EngineAdapter, spec=DBOS)`). The specs
live here rather than in `engines/<name>/_spec.py` because importing a module of an engine's subpackage runs that
package's `__init__`, which imports the engine's SDK: the registry answers `--help`, `check` and the availability of
an extra without importing any SDK. An engine's own constants (unit names, prefixes, retry numbers) are in its `_spec`.
"""

from __future__ import annotations

from ._protocol import ConnectionSetting, EmbeddedServer, EngineSpec

DEFAULT_TEMPORAL_ADDRESS = '127.0.0.1:7233'
"""The Temporal frontend asked when neither `--address` nor the environment names one."""


_CONTINUE_AS_NEW = ':continue-as-new'


def _temporal_run_of(append_id: str) -> str | None:
    """Temporal's appends are `WORKFLOW_ID:RUN_ID`, or `WORKFLOW_ID:RUN_ID:continue-as-new` for the part stored before
    continue-as-new (`engines/temporal/_conversation.py`, `_workflow.py`); the run id (a UUID) has no ':', the
    workflow id may."""
    body = append_id.removesuffix(_CONTINUE_AS_NEW)
    workflow_id, sep, run_id = body.rpartition(':')
    return workflow_id if sep and workflow_id and run_id else None

LOCAL = EngineSpec(name='local', module='durable_capabilities.engines.local', durable=False, label='local',
                   append_prefix='local:', features=frozenset({'streams'}))

TEMPORAL = EngineSpec(
    name='temporal',
    module='durable_capabilities.engines.temporal',
    extra='temporal',
    requires='temporalio',
    durability='pydantic_ai.durable_exec.temporal:TemporalDurability',
    label='Temporal',
    settings=(
        ConnectionSetting(
            'address', ('--address',), 'Temporal frontend HOST:PORT (default: $DURCAP_TEMPORAL_ADDRESS or 127.0.0.1:7233).',
            env=('DURCAP_TEMPORAL_ADDRESS', 'TEMPORAL_ADDRESS'), default=DEFAULT_TEMPORAL_ADDRESS, kind='address',
            commands=frozenset({'read', 'run', 'demo'}), resolve_in_cli=True,
            help_in={'run': 'Temporal frontend HOST:PORT (default: $DURCAP_TEMPORAL_ADDRESS; none: start the embedded '
                            'dev server).',
                     'demo': 'Temporal frontend HOST:PORT (default: start the embedded dev server).'}),
        ConnectionSetting('namespace', ('--namespace',), 'Temporal namespace.', default='default',
                          default_in={'read': 'default'}),
        # No default for `run` here (the adapter's is `durcap`): `durcap run --engine dbos --task-queue Q` is told from
        # a flag not given (`cli._options.queue_setting`: the DBOS queue's first spelling).
        ConnectionSetting('task_queue', ('--task-queue',), 'Temporal task queue.', commands=frozenset({'run', 'demo'}),
                          default_in={'demo': 'durcap-demo'},
                          help_in={'run': 'Temporal task queue (default: durcap). With --engine dbos: the same as '
                                          '--queue.'}),
        ConnectionSetting('inline_worker', ('--inline-worker',), 'Serve the Temporal task queue from this process for '
                          'the run.', kind='flag', commands=frozenset({'run', 'demo'}),
                          default_in={'run': False, 'demo': True},
                          help_in={'demo': 'Serve the Temporal task queue from this process (off: use a running '
                                           '`durcap worker temporal`).'}),
    ),
    describe=('Temporal', '{address} (namespace {namespace})'),
    where='--address',
    lock_sections={'workflows': 'workflow', 'activities': 'activity'},
    packages=('temporalio',),
    unit='activity', units='activities', container='workflow', run_id_label='workflow id',
    features=frozenset({'worker', 'dev-server', 'history', 'approvals', 'claim-checks', 'streams'}),
    embedded=EmbeddedServer('address', DEFAULT_TEMPORAL_ADDRESS, 'durable_capabilities.engines.temporal._server:start_temporal_dev_server',
                            'Temporal dev server', implies={'inline_worker': True}),
    retains=('the workflow history: the input and result of every activity (messages and tool results inline up to the '
             'claim-check threshold, larger ones as references into the store), until the namespace\'s retention '
             'period after the workflow closes'),
    forget='temporal workflow delete --workflow-id {run_id}',
    run_of_append=_temporal_run_of,
)

DBOS = EngineSpec(
    name='dbos',
    module='durable_capabilities.engines.dbos',
    extra='dbos',
    requires='dbos',
    durability='pydantic_ai.durable_exec.dbos:DBOSDurability',
    label='DBOS',
    settings=(
        ConnectionSetting('db', ('--db',), 'DBOS system database URL (default: $DURCAP_DBOS_DB or SQLite '
                          '.durcap/dbos.sqlite).', env=('DURCAP_DBOS_DB',), kind='database', secret=True,
                          commands=frozenset({'read', 'run', 'demo'}), unset='SQLite .durcap/dbos.sqlite',
                          created_by_worker=True),
        ConnectionSetting('queue', ('--queue',), 'DBOS: hand the run to this queue (what `durcap worker dbos '
                          '--queue` serves) and wait for a worker to run it (default: run it in this process).',
                          commands=frozenset({'run'})),
    ),
    describe=('DBOS system database', '{db}'),
    where='--db',
    lock_sections={'workflows': 'workflow', 'steps': 'step'},
    packages=('dbos',),
    unit='step', units='steps', container='workflow', run_id_label='workflow id',
    features=frozenset({'worker', 'approvals', 'fixed-model', 'streams'}),
    retains=('the workflow\'s status, inputs, output (the turn\'s new messages) and the output of every step (model '
             'responses, tool results; the conversation load records ids, not messages) in its system database, until '
             'deleted'),
    forget="python -c \"from dbos import DBOSClient; DBOSClient(system_database_url='<--db>').delete_workflows(['{run_id}'])\"",
    append_prefix='dbos:',
)

PREFECT = EngineSpec(
    name='prefect',
    module='durable_capabilities.engines.prefect',
    runs_in_caller=True,
    extra='prefect',
    requires='prefect',
    durability='pydantic_ai.durable_exec.prefect:PrefectDurability',
    label='Prefect',
    # No setting of ours: Prefect's client reads PREFECT_API_URL (environment or Prefect profile).
    where='PREFECT_API_URL',
    lock_sections={'flows': 'flow', 'tasks': 'task', 'recovered_tasks': 'recovered task',
                   'cache_toolset_ids': 'cache toolset id'},
    packages=('prefect',),
    unit='task', units='tasks', container='flow', run_id_label='flow run id',
    features=frozenset({'schedule', 'approvals', 'streams', 'claim-checks'}),
    retains=('the flow run, its task runs and their parameters in the Prefect API\'s database, and the tasks\' persisted '
             'results in result storage (by default ~/.prefect/storage), until deleted'),
    forget='prefect flow-run delete {run_id} (and the result files of its task runs in result storage)',
    append_prefix='prefect:',
)

DEFAULT_ENGINE = DBOS.name
"""The engine commands use when `--engine` is not given (`durcap demo`, `approvals`): DBOS on SQLite, nothing to start."""
