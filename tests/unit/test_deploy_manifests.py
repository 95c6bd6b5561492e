"""deploy/: the compose file, the Kubernetes manifests and the workers' Dockerfile, validated offline.

- Kubernetes: every document against the schemas `kubernetes-validate` ships (strict: unknown fields
  are errors; a kind without a schema is an error too), for every shipped version from 1.30 on.
- Compose: against the Compose Specification schema vendored in deploy/compose/ (compose-go's
  `schema/compose-spec.json`, JSON Schema draft 2020-12), after variable interpolation as Compose does.
- Consistency: every file referenced exists (build context, Dockerfile, mounted files, COPY sources,
  worker entrypoints), every environment variable a worker reads is set for it, and every ConfigMap,
  Secret, claim, Service and address a manifest names exists.
"""

from __future__ import annotations

import ast
import copy
import hashlib
import json
import re
import shlex
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import SchemaNotFoundError, all_versions
from packaging.version import Version

from tests._helpers import ROOT

DEPLOY = ROOT / 'deploy'
COMPOSE_DIR = DEPLOY / 'compose'
COMPOSE_FILE = COMPOSE_DIR / 'compose.yaml'
COMPOSE_SCHEMA = COMPOSE_DIR / 'compose-spec.schema.json'
KUBERNETES_DIR = DEPLOY / 'kubernetes'
DOCKERFILE = DEPLOY / 'Dockerfile'
WORKER_SCRIPTS = ('workers/temporal_worker.py', 'workers/dbos_app.py', 'workers/prefect_flows.py')

MIN_KUBERNETES = Version('1.30')
KUBERNETES_VERSIONS = sorted({v for v in all_versions() if Version(v) >= MIN_KUBERNETES}, key=Version)


# ---- loading ------------------------------------------------------------------------------------


def kubernetes_documents() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for path in sorted(KUBERNETES_DIR.glob('*.yaml')):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                docs.append((path.name, doc))
    return docs


_VARIABLE = re.compile(r'\$(?:\$|\{(?P<braced>[^}]*)\}|(?P<plain>[A-Za-z_][A-Za-z0-9_]*))')
_BRACED = re.compile(r'^(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:-|-|:\?|\?|:\+|\+)(?P<arg>.*))?$', re.DOTALL)


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's variable interpolation (`$VAR`, `${VAR}`, `${VAR:-default}`, `${VAR-default}`,
    `${VAR:?error}`, `${VAR:+alt}`, `$$`), applied to every string of the model, keys excluded."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match[str]) -> str:
        if match.group(0) == '$$':
            return '$'
        if match.group('plain'):
            return env.get(match.group('plain'), '')
        braced = _BRACED.match(match.group('braced') or '')
        assert braced, f'invalid interpolation {match.group(0)!r}'
        name, op, arg = braced['name'], braced['op'], braced['arg'] or ''
        current = env.get(name)
        if op in (':-', '-'):
            return current if current or (op == '-' and current is not None) else interpolate(arg, env)
        if op in (':?', '?'):
            assert current or (op == '?' and current is not None), f'{name} is required: {arg}'
            return current or ''
        if op in (':+', '+'):
            return interpolate(arg, env) if current or (op == '+' and current is not None) else ''
        return current or ''

    return _VARIABLE.sub(substitute, value)


def compose_model(env: dict[str, str] | None = None) -> dict[str, Any]:
    """The compose file as Compose validates it: YAML (merge keys applied), then interpolated."""
    return interpolate(yaml.safe_load(COMPOSE_FILE.read_text()), env or {})


def compose_validator() -> jsonschema.Draft202012Validator:
    schema = json.loads(COMPOSE_SCHEMA.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)


def worker_env_vars(script: str) -> set[str]:
    """Names of the environment variables a worker reads: `os.environ.get('X')`, `os.environ['X']`, `os.getenv('X')`."""
    names: set[str] = set()
    for node in ast.walk(ast.parse((ROOT / script).read_text())):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            f = node.func
            if isinstance(f, ast.Attribute) and (
                (f.attr == 'get' and ast.unparse(f.value) == 'os.environ') or ast.unparse(f) == 'os.getenv'
            ):
                names.add(node.args[0].value)
        elif isinstance(node, ast.Subscript) and ast.unparse(node.value) == 'os.environ' and isinstance(node.slice, ast.Constant):
            names.add(node.slice.value)
    return names


def command_script(command: Any) -> str | None:
    """The `workers/*.py` a container command runs, if any."""
    words = shlex.split(command) if isinstance(command, str) else list(command or [])
    return next((w for w in words if isinstance(w, str) and w.startswith('workers/') and w.endswith('.py')), None)


# ---- the vendored compose schema --------------------------------------------------------------------


def test_compose_schema_is_the_documented_upstream_file() -> None:
    readme = (DEPLOY / 'README.md').read_text()
    digest = hashlib.sha256(COMPOSE_SCHEMA.read_bytes()).hexdigest()
    assert f'sha256 `{digest}`' in readme, 'deploy/README.md must name the vendored schema checksum'
    assert 'https://github.com/compose-spec/compose-go/blob/' in readme
    assert 'Apache License' in (COMPOSE_DIR / 'compose-spec.LICENSE').read_text()
    schema = json.loads(COMPOSE_SCHEMA.read_text())
    assert schema['$schema'] == 'https://json-schema.org/draft/2020-12/schema'
    assert schema['title'] == 'Compose Specification'


# ---- compose ------------------------------------------------------------------------------------


def test_compose_file_matches_the_compose_specification() -> None:
    errors = sorted(compose_validator().iter_errors(compose_model()), key=lambda e: e.json_path)
    assert not errors, '\n'.join(f'{e.json_path}: {e.message}' for e in errors)


def test_compose_file_validates_with_a_password_set() -> None:
    model = compose_model({'DURCAP_POSTGRES_PASSWORD': 's3cret'})
    assert not list(compose_validator().iter_errors(model))
    env = model['services']['dbos-app-1']['environment']
    assert env['DBOS_SYSTEM_DATABASE_URL'] == 'postgresql://durcap:s3cret@postgresql:5432/durcap_dbos'


@pytest.mark.parametrize(
    'mutate',
    [
        lambda m: m['services']['temporal-worker'].update(comand=['python']),  # unknown key
        lambda m: m['services']['temporal'].update(ports=7233),  # wrong type (a list is required)
        lambda m: m['services']['dbos-app-1']['depends_on'].update(postgresql={'condition': 'healthy'}),  # bad enum
        lambda m: m.update(servics={}),  # unknown top-level key
    ],
    ids=['unknown-key', 'wrong-type', 'bad-enum', 'unknown-top-level'],
)
def test_compose_validation_catches_mistakes(mutate: Any) -> None:
    model = copy.deepcopy(compose_model())
    mutate(model)
    assert list(compose_validator().iter_errors(model))


def test_compose_services() -> None:
    services = compose_model()['services']
    assert set(services) == {'postgresql', 'temporal', 'temporal-worker', 'dbos-app-1', 'dbos-app-2', 'dbos-app-3',
                             'prefect-server', 'prefect-flows'}
    by_script = {name: command_script(s.get('command')) for name, s in services.items() if command_script(s.get('command'))}
    assert set(by_script.values()) == set(WORKER_SCRIPTS)
    for name in by_script:
        service = services[name]
        assert service['build'] == {'context': '../..', 'dockerfile': 'deploy/Dockerfile'}
        assert service['healthcheck']['test'] == ['CMD', 'test', '-f', service['environment']['DURCAP_READY_FILE']]
    for name, service in services.items():  # every dependency is a service of the file
        assert set(service.get('depends_on', {})) <= set(services), name


def test_compose_addresses_name_its_services() -> None:
    services = compose_model()['services']
    env = {name: s.get('environment', {}) for name, s in services.items()}
    assert env['temporal-worker']['DURCAP_TEMPORAL_ADDRESS'].split(':')[0] in services
    for url in (*(env[f'dbos-app-{i}']['DBOS_SYSTEM_DATABASE_URL'] for i in (1, 2, 3)), env['prefect-flows']['PREFECT_API_URL'],
                env['prefect-server']['PREFECT_API_DATABASE_CONNECTION_URL']):
        assert urlsplit(url).hostname in services, url
    assert env['temporal']['POSTGRES_SEEDS'] in services


# ---- kubernetes ---------------------------------------------------------------------------------


def test_kubernetes_versions_shipped() -> None:
    assert str(MIN_KUBERNETES) + '.0' in KUBERNETES_VERSIONS
    assert '1.37.0' in KUBERNETES_VERSIONS


@pytest.mark.parametrize('version', KUBERNETES_VERSIONS)
def test_kubernetes_manifests_validate(version: str) -> None:
    docs = kubernetes_documents()
    assert docs
    failures = []
    for filename, doc in docs:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except SchemaNotFoundError as exc:
            failures.append(f'{filename}: {exc.message}')
        except jsonschema.ValidationError as exc:
            failures.append(f'{filename} {doc["kind"]}/{doc["metadata"]["name"]}: {".".join(map(str, exc.path))}: {exc.message}')
    assert not failures, '\n'.join(failures)


def _deployment(name: str) -> dict[str, Any]:
    return next(copy.deepcopy(d) for _, d in kubernetes_documents() if d['kind'] == 'Deployment' and d['metadata']['name'] == name)


@pytest.mark.parametrize(
    'mutate',
    [
        lambda d: d['spec']['template']['spec']['containers'][0].update(envFrm=[]),  # unknown field (strict)
        lambda d: d['spec'].update(replicas='two'),  # wrong type
        lambda d: d.update(kind='Deploymnt'),  # no such kind
        lambda d: d['spec'].pop('selector'),  # required field
    ],
    ids=['unknown-field', 'wrong-type', 'unknown-kind', 'missing-required'],
)
def test_kubernetes_validation_catches_mistakes(mutate: Any) -> None:
    doc = _deployment('temporal-worker')
    mutate(doc)
    with pytest.raises((jsonschema.ValidationError, SchemaNotFoundError)):
        kubernetes_validate.validate(doc, KUBERNETES_VERSIONS[-1], strict=True)


def test_kubernetes_references_resolve() -> None:
    docs = [d for _, d in kubernetes_documents()]
    namespaces = {d['metadata']['name'] for d in docs if d['kind'] == 'Namespace'}
    objects = {(d['kind'], d['metadata']['name']): d for d in docs}
    for d in docs:
        if d['kind'] != 'Namespace':
            assert d['metadata'].get('namespace') in namespaces, d['metadata']['name']

    def data_keys(kind: str, name: str) -> set[str]:
        obj = objects.get((kind, name))
        assert obj is not None, f'{kind} {name!r} is referenced but not defined'
        return set(obj.get('data', {})) | set(obj.get('stringData', {}))

    deployments = [d for d in docs if d['kind'] == 'Deployment']
    for dep in deployments:
        pod = dep['spec']['template']
        assert all(pod['metadata']['labels'].get(k) == v for k, v in dep['spec']['selector']['matchLabels'].items())
        for container in pod['spec']['containers']:
            for source in container.get('envFrom', []):
                if 'configMapRef' in source:
                    data_keys('ConfigMap', source['configMapRef']['name'])
                if 'secretRef' in source:
                    data_keys('Secret', source['secretRef']['name'])
            for var in container.get('env', []):
                ref = var.get('valueFrom', {})
                if 'secretKeyRef' in ref:
                    assert ref['secretKeyRef']['key'] in data_keys('Secret', ref['secretKeyRef']['name']), var
                if 'configMapKeyRef' in ref:
                    assert ref['configMapKeyRef']['key'] in data_keys('ConfigMap', ref['configMapKeyRef']['name']), var
        for volume in pod['spec'].get('volumes', []):
            if 'configMap' in volume:
                data_keys('ConfigMap', volume['configMap']['name'])
            if 'persistentVolumeClaim' in volume:
                assert ('PersistentVolumeClaim', volume['persistentVolumeClaim']['claimName']) in objects
    for svc in (d for d in docs if d['kind'] == 'Service'):
        selected = [dep for dep in deployments
                    if all(dep['spec']['template']['metadata']['labels'].get(k) == v for k, v in svc['spec']['selector'].items())]
        assert len(selected) == 1, f'Service {svc["metadata"]["name"]} selects {len(selected)} Deployments'
        port_names = {p.get('name') for c in selected[0]['spec']['template']['spec']['containers'] for p in c.get('ports', [])}
        for port in svc['spec']['ports']:
            assert port['targetPort'] in port_names, svc['metadata']['name']


def _service_address(docs: list[dict[str, Any]], host: str, port: int) -> bool:
    """`host:port` names a Service of the manifests (`name`, `name.ns`, `name.ns.svc[.cluster.local]`)."""
    name, _, rest = host.partition('.')
    for svc in docs:
        if svc['kind'] == 'Service' and svc['metadata']['name'] == name:
            ns = svc['metadata']['namespace']
            if rest in ('', ns, f'{ns}.svc', f'{ns}.svc.cluster.local') and port in {p['port'] for p in svc['spec']['ports']}:
                return True
    return False


def test_kubernetes_addresses_name_its_services() -> None:
    docs = [d for _, d in kubernetes_documents()]
    config = next(d for d in docs if d['kind'] == 'ConfigMap' and d['metadata']['name'] == 'durcap-config')['data']
    host, _, port = config['DURCAP_TEMPORAL_ADDRESS'].rpartition(':')
    assert _service_address(docs, host, int(port))
    prefect = urlsplit(config['PREFECT_API_URL'])
    assert _service_address(docs, prefect.hostname or '', prefect.port or 80)
    for dep in (d for d in docs if d['kind'] == 'Deployment'):
        for container in dep['spec']['template']['spec']['containers']:
            for var in container.get('env', []):
                value = var.get('value', '')
                if '://' in value:
                    url = urlsplit(re.sub(r'\$\([A-Z_]+\)', 'x', value))
                    assert _service_address(docs, url.hostname or '', url.port or 0), value
                if var['name'] == 'POSTGRES_SEEDS':
                    assert _service_address(docs, value, 5432)


# ---- files referenced, environment of each worker -----------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = DOCKERFILE.read_text().replace('\\\n', ' ')
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if ' ' in line.strip() else '')
            for line in text.splitlines() if line.strip() and not line.lstrip().startswith('#')]


def test_dockerfile_builds_the_workers_image() -> None:
    instructions = dockerfile_instructions()
    assert instructions[0] == ('FROM', 'python:3.11-slim')
    runs = ' '.join(arg for op, arg in instructions if op == 'RUN')
    assert re.search(r'pip install "\.\[[a-z,]*temporal[a-z,]*\]"', runs) and all(
        extra in runs for extra in ('temporal', 'dbos', 'prefect', 'postgres'))
    cmd = json.loads(next(arg for op, arg in instructions if op == 'CMD'))
    assert command_script(cmd) in WORKER_SCRIPTS
    copied = [arg.split()[:-1] for op, arg in instructions if op == 'COPY']
    sources = [src for group in copied for src in group if not src.startswith('--')]
    for src in sources:  # COPY sources are relative to the build context: the repository root
        assert (ROOT / src).exists(), f'COPY source {src} does not exist'
    for script in WORKER_SCRIPTS:
        assert any(script.startswith(src.rstrip('/') + '/') for src in sources), f'{script} is not copied'
    # What the image copies is not excluded from the build context.
    ignore = [line.strip() for line in (DEPLOY / 'Dockerfile.dockerignore').read_text().splitlines()
              if line.strip() and not line.startswith('#')]
    assert ignore[0] == '*'
    for src in sources:
        assert f'!{src.rstrip("/")}' in ignore, f'{src} is excluded by Dockerfile.dockerignore'


def test_files_referenced_exist() -> None:
    model = compose_model()
    for name, service in model['services'].items():
        build = service.get('build')
        if build:
            context = (COMPOSE_DIR / build['context']).resolve()
            assert context == ROOT, name
            assert (context / build['dockerfile']).resolve() == DOCKERFILE.resolve()
        for volume in service.get('volumes', []):
            source = volume.split(':')[0] if isinstance(volume, str) else volume.get('source', '')
            if source.startswith(('.', '/')):
                assert (COMPOSE_DIR / source).exists(), f'{name}: {source} does not exist'
            else:
                assert source in model.get('volumes', {}), f'{name}: named volume {source} is not declared'
    commands = [s.get('command') for s in model['services'].values()]
    commands += [c.get('command', []) + c.get('args', [])
                 for _, d in kubernetes_documents() if d['kind'] == 'Deployment'
                 for c in d['spec']['template']['spec']['containers']]
    commands += [json.loads(arg) for op, arg in dockerfile_instructions() if op == 'CMD']
    scripts = {command_script(c) for c in commands} - {None}
    assert scripts == set(WORKER_SCRIPTS)
    for script in scripts:
        assert (ROOT / script).is_file(), script
    init_sql = (COMPOSE_DIR / 'postgres-init.sql').read_text()
    k8s_init = next(d for _, d in kubernetes_documents() if d['metadata']['name'] == 'durcap-postgres-init')
    assert [line for line in init_sql.splitlines() if not line.startswith('--')] == \
        next(iter(k8s_init['data'].values())).splitlines()


def test_workers_read_the_documented_variables() -> None:
    expected = {
        'workers/temporal_worker.py': {'DURCAP_TARGET', 'DURCAP_TEMPORAL_ADDRESS', 'DURCAP_TASK_QUEUE',
                                       'DURCAP_GRACEFUL_SHUTDOWN', 'DURCAP_READY_FILE'},
        'workers/dbos_app.py': {'DURCAP_TARGET', 'DBOS_SYSTEM_DATABASE_URL', 'DURCAP_DBOS_QUEUE', 'DURCAP_DBOS_EXECUTOR_ID',
                                'DURCAP_DBOS_CONCURRENCY', 'DURCAP_DBOS_PEER_TIMEOUT', 'DURCAP_GRACEFUL_SHUTDOWN',
                                'DURCAP_READY_FILE'},
        'workers/prefect_flows.py': {'DURCAP_TARGET', 'PREFECT_API_URL', 'DURCAP_PREFECT_LIMIT', 'DURCAP_READY_FILE'},
    }
    for script, names in expected.items():
        found = worker_env_vars(script)
        assert found == names, script
        doc = ast.get_docstring(ast.parse((ROOT / script).read_text())) or ''
        for name in names:
            assert name in doc, f'{script} reads {name} but its docstring does not document it'


def test_every_variable_a_worker_reads_is_set_in_compose() -> None:
    for name, service in compose_model()['services'].items():
        script = command_script(service.get('command'))
        if script:
            missing = worker_env_vars(script) - set(service.get('environment', {}))
            assert not missing, f'compose service {name} runs {script} without {sorted(missing)}'


def test_every_variable_a_worker_reads_is_set_in_kubernetes() -> None:
    docs = [d for _, d in kubernetes_documents()]
    objects = {(d['kind'], d['metadata']['name']): d for d in docs}
    covered = set()
    for dep in (d for d in docs if d['kind'] == 'Deployment'):
        for container in dep['spec']['template']['spec']['containers']:
            script = command_script(container.get('command', []) + container.get('args', []))
            if not script:
                continue
            covered.add(script)
            env = {v['name'] for v in container.get('env', [])}
            for source in container.get('envFrom', []):
                ref = source.get('configMapRef') or source.get('secretRef')
                obj = objects[('ConfigMap' if 'configMapRef' in source else 'Secret', ref['name'])]
                env |= set(obj.get('data', {})) | set(obj.get('stringData', {}))
            missing = worker_env_vars(script) - env
            assert not missing, f'Deployment {dep["metadata"]["name"]} runs {script} without {sorted(missing)}'
            assert container['image'] == compose_model()['services']['temporal-worker']['image']
            probe = container['readinessProbe']['exec']['command']
            assert probe == ['test', '-f', objects[('ConfigMap', 'durcap-config')]['data']['DURCAP_READY_FILE']]
    assert covered == set(WORKER_SCRIPTS)


# ---- three workers per engine: replicas, executor ids, drain time, disruption budgets ------------------

WORKERS_PER_ENGINE = 3
DRAIN_MARGIN_SECONDS = 10
"""What a grace period must leave beyond the drain: the DBOS app stops its heartbeat thread (up to 4 s) before
DBOS's own drain, and the interpreter exits after it."""

DEFAULT_DRAIN_SECONDS = 30.0  # workers/_common.py DEFAULT_GRACEFUL_SHUTDOWN


def _seconds(duration: str) -> float:
    """A Compose duration (`45s`, `1m30s`, `500ms`) in seconds."""
    parts = re.findall(r'(\d+(?:\.\d+)?)(ms|us|h|m|s)', duration)
    assert parts and ''.join(n + u for n, u in parts) == duration, f'not a duration: {duration!r}'
    scale = {'h': 3600, 'm': 60, 's': 1, 'ms': 1e-3, 'us': 1e-6}
    return sum(float(n) * scale[u] for n, u in parts)


def _compose_workers() -> dict[str, list[tuple[str, dict[str, Any]]]]:
    """`{worker script: [(service name, service)]}` of the compose file."""
    found: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    for name, service in compose_model()['services'].items():
        if script := command_script(service.get('command')):
            found.setdefault(script, []).append((name, service))
    return found


def test_compose_runs_three_of_each_worker() -> None:
    workers = _compose_workers()
    assert set(workers) == set(WORKER_SCRIPTS)
    for script, services in workers.items():
        count = sum(service.get('deploy', {}).get('replicas', 1) for _, service in services)
        assert count == WORKERS_PER_ENGINE, f'{script}: {count} containers'


def test_compose_dbos_apps_have_distinct_stable_executor_ids() -> None:
    """Each DBOS app container is a service of its own with a fixed executor id (so a recreated container recovers
    its own pending workflows at launch, and peers tell each other apart); a replicated service would share one."""
    services = _compose_workers()['workers/dbos_app.py']
    assert all(service.get('deploy', {}).get('replicas', 1) == 1 for _, service in services)
    ids = [service['environment']['DURCAP_DBOS_EXECUTOR_ID'] for _, service in services]
    assert len(set(ids)) == len(ids) == WORKERS_PER_ENGINE, ids
    assert all(executor_id.strip() for executor_id in ids)
    urls = {service['environment']['DBOS_SYSTEM_DATABASE_URL'] for _, service in services}
    queues = {service['environment']['DURCAP_DBOS_QUEUE'] for _, service in services}
    assert len(urls) == 1 and urls.pop().startswith('postgresql://') and len(queues) == 1  # one application


def test_compose_grace_period_outlasts_the_drain() -> None:
    for script, services in _compose_workers().items():
        for name, service in services:
            drain = float(service['environment'].get('DURCAP_GRACEFUL_SHUTDOWN', DEFAULT_DRAIN_SECONDS))
            grace = _seconds(service['stop_grace_period'])
            assert grace >= drain + DRAIN_MARGIN_SECONDS, f'{name} ({script}): {grace:g} s grace, {drain:g} s drain'


def _worker_deployments() -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """`(worker script, Deployment, its worker container)` of the Kubernetes manifests."""
    found = []
    for _, doc in kubernetes_documents():
        if doc['kind'] != 'Deployment':
            continue
        for container in doc['spec']['template']['spec']['containers']:
            if script := command_script(container.get('command', []) + container.get('args', [])):
                found.append((script, doc, container))
    return found


def _config() -> dict[str, str]:
    return next(d for _, d in kubernetes_documents() if d['kind'] == 'ConfigMap'
                and d['metadata']['name'] == 'durcap-config')['data']


def test_kubernetes_runs_three_of_each_worker_and_rolls_without_losing_one() -> None:
    deployments = _worker_deployments()
    assert sorted(script for script, _, _ in deployments) == sorted(WORKER_SCRIPTS)
    for script, dep, _ in deployments:
        spec = dep['spec']
        assert spec['replicas'] == WORKERS_PER_ENGINE, script
        # A new pod is ready before an old one stops: never fewer than 3 serving during a rollout.
        assert spec['strategy'] == {'type': 'RollingUpdate', 'rollingUpdate': {'maxSurge': 1, 'maxUnavailable': 0}}, script


def test_kubernetes_disruption_budget_selects_each_worker() -> None:
    docs = [d for _, d in kubernetes_documents()]
    budgets = [d for d in docs if d['kind'] == 'PodDisruptionBudget']
    for script, dep, _ in _worker_deployments():
        labels = dep['spec']['template']['metadata']['labels']
        selecting = [b for b in budgets if b['metadata']['namespace'] == dep['metadata']['namespace']
                     and all(labels.get(k) == v for k, v in b['spec']['selector']['matchLabels'].items())]
        assert len(selecting) == 1, f'{dep["metadata"]["name"]} ({script}): {len(selecting)} PodDisruptionBudgets'
        spec = selecting[0]['spec']
        # Keeps 2 of 3 through voluntary disruptions, and still lets a drain evict one at a time.
        assert spec.get('maxUnavailable') == 1 or spec.get('minAvailable') == WORKERS_PER_ENGINE - 1, spec
        assert set(spec) & {'maxUnavailable', 'minAvailable'} and not {'maxUnavailable', 'minAvailable'} <= set(spec)
    for budget in budgets:  # no budget selects something else (the servers, PostgreSQL)
        selected = [dep for _, dep, _ in _worker_deployments() if all(
            dep['spec']['template']['metadata']['labels'].get(k) == v
            for k, v in budget['spec']['selector']['matchLabels'].items())]
        assert len(selected) == 1, budget['metadata']['name']


def test_kubernetes_grace_period_outlasts_the_drain() -> None:
    config = _config()
    for _, dep, container in _worker_deployments():
        env = {v['name']: v.get('value') for v in container.get('env', [])}
        drain = float(env.get('DURCAP_GRACEFUL_SHUTDOWN') or config.get('DURCAP_GRACEFUL_SHUTDOWN')
                      or DEFAULT_DRAIN_SECONDS)
        grace = dep['spec']['template']['spec'].get('terminationGracePeriodSeconds', 30)  # Kubernetes' default: 30
        assert grace >= drain + DRAIN_MARGIN_SECONDS, f'{dep["metadata"]["name"]}: {grace} s grace, {drain:g} s drain'


def test_kubernetes_dbos_replicas_each_get_their_own_executor_id() -> None:
    """The executor id comes from the pod's own name (downward API), distinct for every replica, never from the shared
    ConfigMap or a literal (which every replica would share)."""
    config = _config()
    assert 'DURCAP_DBOS_EXECUTOR_ID' not in config
    (dep, container), = [(d, c) for script, d, c in _worker_deployments() if script == 'workers/dbos_app.py']
    (var,) = [v for v in container['env'] if v['name'] == 'DURCAP_DBOS_EXECUTOR_ID']
    assert var == {'name': 'DURCAP_DBOS_EXECUTOR_ID', 'valueFrom': {'fieldRef': {'fieldPath': 'metadata.name'}}}
    assert dep['spec']['replicas'] == WORKERS_PER_ENGINE
    assert float(config['DURCAP_DBOS_PEER_TIMEOUT']) > 0  # peers recover a lost pod's workflows
    assert int(config['DURCAP_DBOS_CONCURRENCY']) >= 1
