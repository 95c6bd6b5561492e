"""Temporal's names, prefixes, keys and numbers: the constants every other module of `engines.temporal` imports.

At the bottom of the package: imports nothing of it (nor temporalio), so any module may use these.
"""

from __future__ import annotations

from datetime import timedelta

from .._conversation_unit import UnitRetry

ENGINE = 'temporal'

WORKFLOW_NAME_PREFIX = 'durcap.'
"""Workflow type name: `durcap.{agent name}`. Compatibility data, listed in `durable.lock`."""

WORKFLOW_CLASS_PREFIX = 'DurcapWorkflow_'
"""Generated workflow classes are `DurcapWorkflow_<name>` in `engines.temporal._workflow`."""

DECIDE_UPDATE = 'durcap.decide'
"""Update that delivers one `Decision` (JSON) to a waiting workflow; its validator rejects an unknown call id
or a stale fingerprint before anything is recorded."""

PENDING_QUERY = 'durcap.approvals'
"""Query: the workflow's pending calls (JSON list of `PendingCall`)."""

PENDING_MEMO = 'durcap_approvals'
"""Memo key holding the pending calls, so `durcap approvals list` reads them without a running worker."""

AGENT_MEMO = 'durcap_agent'
"""Memo key holding the agent's name (set by `start_run`)."""

CAPABILITIES_PATCH_ID = 'durcap-capabilities-memo'
STREAMS_PATCH_ID = 'durcap-run-streams'
"""Patch marker of the workflow's own stream events (`_streams.WorkflowStream`: a local activity per publish); a
history recorded without it replays without them."""
FAILED_APPEND_PATCH_ID = 'durcap-stream-failed-append'
"""Patch marker of a workflow whose conversation append activity failed for good publishing `run_failed` (its
closing events rode with the failed activity and were not stored; `_streams.WorkflowStream.settle`); a history recorded
without it replays without that publish (its stream was left open)."""
LATE_CLOSING_PATCH_ID = 'durcap-stream-large-closing-after-append'
"""Patch marker of closing events too large to carry (`_streams.CARRY_MAX_BYTES`: `turn_stored` + `run_completed` of
an answer over 16 KiB) written by `PUBLISH_ACTIVITY` after the conversation append succeeded (`WorkflowStream.late`);
a history recorded without it wrote them before the append, and replays so."""
CARRY_PATCH_ID = 'durcap-stream-events-carried'
"""Patch marker of a workflow's own stream events riding with its next activity (`_streams.CarryStreamEvents`:
`run_started` with the first model request, `run_completed` with the append) instead of a local activity each; a
history recorded without it replays with its local activities."""
CURRENT_PATCH_ID = 'durcap-workflow-3'
"""One patch marker for every run started by this version (`_patches.patched`): a history with it stands for all of
`IMPLIED_PATCH_IDS` without a marker (and a `TemporalChangeVersion` search-attribute upsert) each; a history without
it (recorded before) replays through each of them, exactly as before. Called first in the run (`_workflow`), so a
run whose first workflow task is in its history never records it mid-run. A later change of the workflow's commands
adds its own marker (and a new umbrella only when that saves markers again); never add ids to `IMPLIED_PATCH_IDS`."""
IMPLIED_PATCH_IDS = ('durcap-capabilities-memo', 'durcap-run-streams', 'durcap-stream-failed-append',
                     'durcap-stream-large-closing-after-append', 'durcap-stream-events-carried')
"""The durcap patch markers a history with `CURRENT_PATCH_ID` implies: those that mark a change of durcap's code.
Not the two that also record a run's configuration, asked only where the configuration chose the new commands:
`LOCAL_TOOLS_PATCH_ID` (a leaf marked local: a history recorded before the mark replays with the mark set, as
regular tool activities) and the MCP guard's (`_mcp.TEMPORAL_PATCH_ID`, asked only with the guard on)."""
TURN_REQUEST_LIMIT_PATCH_ID = 'durcap-turn-request-limit'
"""The patch marker of the turn-wide request limit (`turn.TurnRequestLimitError`, DC061), asked only where a turn
reached it with calls waiting for approval: a new run records it there and fails; a history recorded before it went on
to ask for decisions, and replays so (not in `IMPLIED_PATCH_IDS`: asked where the run's course, not its start, chose
the new commands)."""
SEARCH_ATTRIBUTE_MEMO = 'durcap_search_attribute'

CAPABILITIES_MEMO = 'durcap_capabilities'
"""Memo key holding a run's loaded capability ids."""

CAPABILITIES_SEARCH_ATTRIBUTE = 'DurcapCapabilities'
"""Search attribute (KeywordList) holding a run's loaded capability ids; the dev servers `durcap` starts
(`_server.start_temporal_dev_server`) register it. On another server: `temporal operator search-attribute create
--name DurcapCapabilities --type KeywordList`."""

CONVERSATION_LOAD_SUFFIX = '__conversation_load'
CONVERSATION_APPEND_SUFFIX = '__conversation_append'
"""Suffixes of the conversation activity types: `agent__{name}__conversation_load` / `_append`."""

MODEL_REQUEST_ACTIVITIES = ('__model_request', '__model_request_stream')
"""Suffixes of the model request activity types (upstream's `TemporalOperationNamer`: a plain request, and a streamed
one when the agent has an `event_stream_handler`)."""

LOCAL_TOOLSETS_OPTION = 'local_activity_toolsets'
"""`DurableAgent(engine_options={'temporal': {'local_activity_toolsets': {LEAF_ID: {} | LocalToolConfig keys}}})`: the
leaf toolsets (for a capability's own tools: the capability id) whose tool calls run as Temporal *local* activities.

For short tools only (milliseconds to a few seconds: lookups, arithmetic, a cache read). A local activity runs in the
worker that runs the workflow task, without a round trip through the server: it records one marker event instead of
three activity events plus a workflow task, and it is retried by the worker. Trade-offs (Temporal's own rules):
- no heartbeat: a local activity that hangs is noticed only at its `start_to_close_timeout`;
- bounded by the workflow task: it should finish well within the workflow task timeout (10 s default); longer ones
  keep the workflow task open by heartbeating it, and a worker crash loses the whole attempt;
- at-least-once: if the worker dies before the workflow task completes, the call runs again on another worker
  (as a retried regular activity does), so a short tool with a side effect must be idempotent;
- it runs on the worker holding the workflow, not on any worker of the task queue.
Unmarked and long tools stay regular activities with heartbeats (`DEFAULT_TOOL_HEARTBEAT_TIMEOUT`).
The activity type names do not change, so `durable.lock` is the same; histories recorded before this option was set
(or before this version) replay unchanged: the switch is behind the `LOCAL_TOOLS_PATCH_ID` patch marker."""

LOCAL_TOOLS_PATCH_ID = 'durcap-local-tool-activities'

# ---- Worker Versioning (`_versioning`) ---------------------------------------------------------------------------

BUILD_ID_PREFIX = 'durcap-'
WORKFLOW_REVISION = 3
"""The revision of durcap's own Temporal workflow code, part of every derived build id (`_versioning.build_id`).
Bumped whenever a release makes the workflow issue other commands for the same history (a new patch marker, an
activity or local activity added or removed): a worker of the older code cannot replay a run the newer code started
(Temporal's nondeterminism error), so the newer workers must declare a version of their own, and runs pinned to the
older version stay on the older workers. 1: up to 0.2 and the stream's local activities (`durcap-run-streams`);
2: the workflow's own stream events carried in its activities' headers (`durcap-stream-events-carried`); 3: one
patch marker (`CURRENT_PATCH_ID`) standing for every earlier one in a new run."""
DEPLOYMENT_PREFIX = 'durcap-'
IDENTITY = 'durcap worker temporal'
REGISTRATION_TIMEOUT = 60.0
"""Seconds `make_current` waits for a new version to register its task queues (its pollers reach the server in
about a second; the server refuses to make current a version missing a task queue of the current one)."""

DEFAULT_ADDRESS = '127.0.0.1:7233'
DEFAULT_NAMESPACE = 'default'
DEFAULT_TASK_QUEUE = 'durcap'

# ---- retry and timeout numbers -----------------------------------------------------------------------------------

MODEL_RETRY_ATTEMPTS = 5
"""Attempts of the model request activity's default retry policy (`_durability.DEFAULT_MODEL_RETRY_POLICY`)."""

MODEL_RETRY_INITIAL_INTERVAL = timedelta(seconds=1)

DEFAULT_TOOL_HEARTBEAT_TIMEOUT = timedelta(seconds=1)
"""`heartbeat_timeout` given to every tool activity by default (issue 14 item 4: a killed worker's tool restarts on
another worker within 3 s).

Upstream heartbeats every activity from a background task every `heartbeat_timeout / 2` (0.5 s here; that is the
heartbeat interval, and `HEARTBEAT_THROTTLE` lets the SDK send each beat) but sets no timeout for tool activities, so a
tool whose worker was killed was retried only when `start_to_close_timeout` (60 s) expired. Measured with
`bench/bench_recovery.py` on the dev server: the retry starts on the other worker about heartbeat timeout + retry
interval + ~1 s after the SIGKILL (the server notices a missed heartbeat and fires the retry timer late by up to a
second): 3.8-3.9 s with a 2 s timeout and 0.5 s backoff, 1.6-2.2 s with 1 s and 0.2 s. Hence 1 s.

Trade-off: an *async* tool that blocks the worker's event loop (CPU-bound code without `await`) for more than about
0.5-1 s misses beats and is failed as timed out, then retried (so it runs again: tools are at-least-once on any
engine). Sync tools run in a thread and keep beating. Give such a toolset a longer timeout:
`DurableAgent(engine_options={'temporal': {'toolset_activity_config': {LEAF_ID: {'heartbeat_timeout': ...}}}})`.
"""

TOOL_START_TO_CLOSE_TIMEOUT = timedelta(seconds=60)

TOOL_RETRY_INITIAL_INTERVAL = timedelta(milliseconds=200)
"""`initial_interval` of the retry policy of every non-MCP tool activity without a user `retry_policy`.

Temporal's default is 1 s: after a kill that second comes on top of the heartbeat timeout and the server's ~1 s of
timer lateness, which alone would spend the 3 s budget. 0.2 s, doubling (Temporal's default coefficient 2.0) up to
`TOOL_RETRY_MAXIMUM_INTERVAL`: a tool that keeps raising is retried 0.2, 0.4, 0.8, 1.6 ... s apart, so a failing
dependency is not hammered for long. MCP leaves keep their own bounded policy (`mcp_activity_config`)."""

TOOL_RETRY_MAXIMUM_INTERVAL = timedelta(seconds=30)
"""`maximum_interval` of that retry policy (Temporal's default would be 100 x the initial interval, 50 s)."""

DEFAULT_MODEL_HEARTBEAT_TIMEOUT = timedelta(seconds=5)
"""`heartbeat_timeout` of the model-request activities (upstream's default is 30 s).

Upstream runs each model request activity inside its background heartbeat task (one beat every timeout / 2), so a
request that streams or awaits the provider keeps beating; the timeout only decides how long a request whose worker
died goes unnoticed. With upstream's 30 s a model request killed mid-flight was restarted after ~33 s; with 5 s it is
restarted after 3-6 s (5 s minus the time since the last beat, plus the 1 s retry backoff upstream's policy keeps).
Not 2 s as for tools: a request's own CPU work (building and parsing large messages in the event loop) under load can
stall the loop for a second or two, and a falsely timed-out request is paid again (tokens, latency), so the margin
is larger. Override with `DurableAgent(engine_options={'temporal': {'model_activity_config': {'heartbeat_timeout': ...}}})`.
"""

HEARTBEAT_THROTTLE = timedelta(milliseconds=250)
"""`Worker(max_heartbeat_throttle_interval=...)` of `make_worker`.

The SDK holds heartbeats back for 80% of the heartbeat timeout (0.8 s of a 1 s timeout) unless this caps it, so the
server would see a beat only every 0.8 s and beats arrive just in time under load. Capped at 0.25 s, every beat of
upstream's 0.5 s cadence reaches the server: one small RPC per running tool activity every half second."""

LOCAL_TOOL_START_TO_CLOSE_TIMEOUT = timedelta(seconds=5)
"""Short by contract: 5 s per attempt of a local tool activity, half the default workflow task timeout."""
LOCAL_TOOL_RETRY_INITIAL_INTERVAL = timedelta(milliseconds=100)
LOCAL_TOOL_RETRY_MAXIMUM_INTERVAL = timedelta(seconds=5)
LOCAL_RETRY_THRESHOLD = timedelta(seconds=10)
"""Past this backoff a local activity's retry is scheduled through the server with a timer, as Temporal does."""

MCP_RETRY_MAXIMUM_INTERVAL = timedelta(seconds=10)

LOAD_RETRY = UnitRetry(attempts=5)
"""The load activity: 5 attempts (Temporal's default waits, 1 s doubling)."""

APPEND_RETRY = UnitRetry(attempts=0, initial_seconds=1.0, backoff=1.5, maximum_seconds=60.0)
"""The append activity: the run's side effects happened, so retry until the store takes it (no attempt cap,
backoff 1.5x up to a minute); an error of `PERMANENT_APPEND_ERRORS` fails at once."""

STORE_ACTIVITY_TIMEOUT = timedelta(seconds=15)
"""`start_to_close_timeout` of the conversation activities: a store call takes milliseconds, and a killed worker's
call is retried once this expires."""

ENQUEUE_WAIT_TIMEOUT = timedelta(hours=48)
"""Start-to-close timeout of an enqueued turn's load activity, which waits (heartbeating every poll) for the turn
holding the conversation: longer than that turn's approval wait (24 hours by default)."""

DEFAULT_STICKY_SCHEDULE_TO_START = timedelta(milliseconds=500)
"""How long a workflow task waits on a worker's sticky queue before any worker may take it.

Temporal's default is 5 s. After a SIGKILL the server does not know the worker is gone, so the next workflow task of
every workflow it cached (the one that records the re-run tool's result) waits this long on the dead worker's sticky
queue before another worker gets it: it adds to the recovery time once per killed worker and run (measured: 1.0 s with
1 s, on top of the re-run and the replay). 0.5 s keeps a recovered run near 3 s + tool time. Trade-off: a live worker
that has no sticky poll waiting for 0.5 s (all workflow task slots busy under load) loses the task to the normal queue,
where a worker replays the history from the start: more CPU, same result (`bench/bench_throughput.py` shows the cost).
Pass `sticky_queue_schedule_to_start_timeout=` to `make_worker` to change it."""

DEFAULT_DEADLOCK_TIMEOUT = 8.0
"""Seconds a workflow activation may run before the worker fails it as deadlocked (temporalio's own default is 2 s).

Measured with `tests/engines/test_payload_sizes.py` (a 10,000-message, 7.6 MB conversation resumed on Temporal): a
busy 2-core machine (load average 7) took over 2 s for one activation and the run never ended, each retry of the
workflow task failing the same way. 8 s keeps real deadlocks (a blocking call in workflow code) reported, and stays
under the workflow task timeout (10 s by default), which would otherwise fail the task first. Change it with
`make_worker(deadlock_timeout=...)` or `$DURCAP_TEMPORAL_DEADLOCK_TIMEOUT`."""

DEADLOCK_TIMEOUT_ENV = 'DURCAP_TEMPORAL_DEADLOCK_TIMEOUT'

NO_POLLER_NOTICE_SECONDS = 3.0
"""How long `durcap run` waits for a worker to poll the run's task queue before saying none does."""

RECONNECT_SECONDS = 1.0
"""Pause between attempts to reach the Temporal server again while waiting for a run's result."""

HEALTH_TIMEOUT_SECONDS = 2.0
"""How long one health check of the Temporal server may take before the server counts as lost."""

CONNECT_TIMEOUT_SECONDS = 10.0
"""Seconds `connect` waits for a Temporal server to answer before it gives up (issue 29 item 6): an address that
accepts TCP connections but never answers gRPC (a wrong port, a proxy, a server that is still starting) kept the
SDK retrying for about 33 s without a word. Change it with `$DURCAP_TEMPORAL_CONNECT_TIMEOUT` (seconds, > 0)."""

CONNECT_TIMEOUT_ENV = 'DURCAP_TEMPORAL_CONNECT_TIMEOUT'


def workflow_type(agent_name: str) -> str:
    """The workflow type name of an agent name: `durcap.{agent name}`."""
    return f'{WORKFLOW_NAME_PREFIX}{agent_name}'
