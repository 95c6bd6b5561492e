"""Deployments registered by 0.2 name `durable_capabilities.engines.prefect_entry:flow__<agent>`; the flows moved to
`engines.prefect._entry` in the package split. The old dotted path still resolves, the way Prefect resolves a
deployment's entrypoint in its flow-run process (`prefect.flows.load_flow_from_entrypoint`, `$DURCAP_TARGET` set).

Run in a subprocess: building the flow claims the agent's names in the process (DC011 for another definition).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip('prefect')

ROOT = Path(__file__).resolve().parents[2]

PROBE = '''
from prefect.flows import load_flow_from_entrypoint
from durable_capabilities.engines.prefect._entry import entrypoint

old = load_flow_from_entrypoint('durable_capabilities.engines.prefect_entry:flow__support')
new = load_flow_from_entrypoint(entrypoint('support'))
print('FLOW', old.name, old is new, old.__durcap_agent__.name)
'''


def test_the_0_2_prefect_entrypoint_still_resolves_to_the_agents_flow() -> None:
    env = {**os.environ, 'PYTHONPATH': str(ROOT), 'DURCAP_TARGET': 'examples/support/agent.py:support',
           'PREFECT_SERVER_ANALYTICS_ENABLED': 'false'}
    result = subprocess.run([sys.executable, '-c', PROBE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith('FLOW '))
    _, name, same, agent = line.split()
    assert same == 'True' and agent == 'support', line
    assert name.endswith('support'), line


def test_the_0_2_module_names_no_flow_without_a_target() -> None:
    env = {k: v for k, v in os.environ.items() if k != 'DURCAP_TARGET'} | {'PYTHONPATH': str(ROOT)}
    probe = ('import durable_capabilities.engines.prefect_entry as m\n'
             'try:\n    m.flow__support\nexcept AttributeError as e:\n    print("ERR", e)\n')
    result = subprocess.run([sys.executable, '-c', probe], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert 'ERR flow__support: $DURCAP_TARGET is not set' in result.stdout, result.stdout + result.stderr
