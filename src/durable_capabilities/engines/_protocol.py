"""Engine knowledge as data: one `EngineSpec` per engine, read by everything outside the engine's own code.

The settings (`settings.Settings`), the connection flags of the CLI and their help, the hints of the error lines,
the DC017 / DC024 checks, the `durable.lock` sections and recorded package versions, and the engine commands
(`worker`, `dev`, `schedule`, `history export`) are built from the registered specs: adding an engine adds its
flags, its settings and its lock section without another module naming it. Nothing here imports an engine SDK.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

SettingKind = Literal['text', 'address', 'database', 'flag']
"""How the CLI checks a setting's value before anything connects: `address` (`HOST:PORT`, exit 2 otherwise, its
environment variables checked the same way), `database` (a `sqlite:///` or `postgresql://` URL, shown redacted;
a PostgreSQL one probed once when the run is on this engine), `flag` (a boolean `--x/--no-x`), `text` (as given)."""

Command = Literal['read', 'run', 'demo']
"""Where a connection setting is a flag: `read` (`durcap runs`, `approvals`, `approve|deny`, `ui`), `run`
(`durcap run`), `demo` (`durcap demo`)."""

LeafKind = Literal['function', 'mcp', 'dynamic']
"""Upstream's words for a leaf toolset (`RuntimeToolsetKind`): a function toolset, an MCP server, a dynamic toolset."""

LEAF_KINDS: tuple[LeafKind, ...] = ('function', 'mcp', 'dynamic')


@dataclass(frozen=True)
class ConnectionSetting:
    """One connection setting of an engine: where a value comes from and how the CLI offers it.

    Attributes:
        field: The key adapters read in their settings (`RunOptions.settings['address']`), also the `Settings`
            attribute.
        env: Environment variables read when the flag is not given, the first one set wins.
        options: The CLI option names (`('--address',)`); the first one names the setting in messages.
        help: The flag's help text (`help_in` overrides it per command).
        default: The value when neither the flag nor the environment gives one.
        kind: How the value is checked (`SettingKind`).
        secret: A database URL or a credential: shown with its password as `***` (`describe()`).
        commands: The commands offering the flag (`Command`).
        help_in / default_in: Per-command help text and default (`durcap demo` uses another task queue).
        unset: What `describe()` shows when the value is `None` (the engine's own default applies).
        resolve_in_cli: `durcap run` resolves the environment itself (`address`) instead of leaving `None` for the
            engine to read.
        created_by_worker: A `database` the engine's worker creates on a PostgreSQL server that has none of its name
            (DBOS's system database, at launch): `durcap worker` starts on it; every other command refuses it.
    """

    field: str
    options: tuple[str, ...]
    help: str
    env: tuple[str, ...] = ()
    default: Any = None
    kind: SettingKind = 'text'
    secret: bool = False
    commands: frozenset[Command] = frozenset({'read'})
    help_in: Mapping[str, str] = dataclasses.field(default_factory=dict)
    default_in: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    unset: str | None = None
    resolve_in_cli: bool = False
    created_by_worker: bool = False

    @property
    def option(self) -> str:
        """The flag's main name (`--address`)."""
        return self.options[0]

    def help_for(self, command: str) -> str:
        """The help text of the flag in `command`."""
        return self.help_in.get(command, self.help)

    def default_for(self, command: str) -> Any:
        """The flag's default in `command`."""
        return self.default_in.get(command, self.default)


@dataclass(frozen=True)
class EmbeddedServer:
    """An engine that starts a throwaway in-memory server for a command when none is configured or listening.

    Attributes:
        setting: The connection setting naming the server (`address`).
        default: Where a server is looked for when none is configured (`127.0.0.1:7233`).
        start: `module:function` starting the server (`state_dir=`, `persistent=False`); returns an object with
            `.address` and `.stop()`.
        label: How messages name the server (`Temporal dev server`).
        implies: Run settings a command forces when it started the server (no other worker serves it:
            `{'inline_worker': True}`).
    """

    setting: str
    default: str
    start: str
    label: str
    implies: Mapping[str, Any] = field(default_factory=dict)

    def listening(self) -> bool:
        """Whether something accepts connections at `default`."""
        from .._servers import port_open

        host, _, port = self.default.rpartition(':')
        return port_open(host, int(port))

    def starter(self) -> Callable[..., Any]:
        """The function of `start`, imported."""
        module, _, name = self.start.partition(':')
        return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class EngineSpec:
    """What the package knows about one engine without importing it.

    Attributes:
        name: `--engine NAME`, `DurableAgent(engines=[NAME])`, the `durable.lock` section.
        module: The module holding the engine's adapter as `ADAPTER`.
        durable: Whether runs survive a crash (False for local).
        extra: The `durable-capabilities[...]` extra installing the engine (`None`: nothing to install).
        requires: Top-level module of the engine's SDK, found without importing it.
        durability: `module:Class` of upstream's durability capability; the leaf kinds it refuses inside a run are
            read from it (`rejected_at_run_time`). `None`: the engine refuses none.
        label: The engine's name in sentences (`Temporal`).
        settings: Its connection settings, in the order the CLI lists them.
        describe: `(label, format)` for `Settings.describe()`: `format` names fields (`'{address} (namespace
            {namespace})'`); `None`: not shown.
        where: The flag or variable saying where the engine is, added to an "cannot reach" error that does not
            name it (`--address`, `--db`, `PREFECT_API_URL`).
        lock_sections: Section names of the engine's `durable.lock` entry mapped to the singular word used in
            messages (`{'workflows': 'workflow', 'activities': 'activity'}`).
        packages: The distributions whose versions `durable.lock` records for the engine.
        unit / units / container / run_id_label: The engine's nouns (activity/activities, workflow, workflow id).
        features: What else the engine offers, each a command: `worker`, `dev-server`, `schedule`, `history`,
            and what its runs support: `approvals`, `streams`, `claim-checks` (its runs store large payloads in the
            conversation store: `durcap store gc` asks it `EngineAdapter.run_states`).
        embedded: The throwaway server a command starts when none is configured, if any.
        retains: What the engine keeps of a run after it ends, and for how long (`durcap history delete` says it).
        append_prefix: The engine's conversation appends are `append_prefix` + the run id (`'dbos:'`): the store
            keeps `append_id`s as given, and `durcap history delete` reads from them which runs wrote (`run_of`).
        run_of_append: For an engine whose appends have no prefix of their own: the run id its `append_id` names,
            `None` when the id is not one of its (tried after every engine's `append_prefix`).
        forget: How to remove one run's records on the engine, `{run_id}` standing for the run's id (printed by
            `durcap history delete`; `--engines` calls the adapter's `delete_run` instead).
        runs_in_caller: Whether a run `durcap run` starts executes in that command's own process and stops with it
            (Prefect: a flow run outside a deployment), rather than going on in the engine's workers; what an
            interrupted `durcap run` tells the user depends on it.
    """

    name: str
    module: str
    durable: bool = True
    extra: str | None = None
    requires: str | None = None
    durability: str | None = None
    label: str = ''
    settings: tuple[ConnectionSetting, ...] = ()
    describe: tuple[str, str] | None = None
    where: str | None = None
    lock_sections: Mapping[str, str] = field(default_factory=dict)
    packages: tuple[str, ...] = ()
    unit: str = 'call'
    units: str = 'calls'
    container: str = 'run'
    run_id_label: str = 'run id'
    features: frozenset[str] = frozenset()
    embedded: EmbeddedServer | None = None
    retains: str = ''
    forget: str = ''
    append_prefix: str | None = None
    run_of_append: Callable[[str], str | None] | None = None
    runs_in_caller: bool = False

    def available(self) -> bool:
        """Whether the engine's SDK is installed, without importing it (importing Prefect alone takes ~1.4 s)."""
        return self.requires is None or importlib.util.find_spec(self.requires) is not None

    def setting(self, name: str) -> ConnectionSetting | None:
        """The connection setting whose `field` is `name`, if the engine has one."""
        return next((s for s in self.settings if s.field == name), None)

    def rejected_at_run_time(self) -> frozenset[str]:
        """Leaf kinds (`LEAF_KINDS`) the engine refuses inside a run unless they are the objects it wrapped at build
        time, read from upstream's durability class (`_upstream.runtime_rejected_kinds`). When the engine's SDK is
        not installed, every kind (the engine cannot run there anyway; the check stays on the safe side)."""
        if self.durability is None:
            return frozenset()
        from .. import _upstream

        module, _, name = self.durability.partition(':')
        try:
            cls = getattr(importlib.import_module(module), name)
        except ImportError:
            return frozenset(LEAF_KINDS)
        return _upstream.runtime_rejected_kinds(cls)


def run_of(specs: Sequence[EngineSpec], append_id: str) -> tuple[EngineSpec, str] | None:
    """`(engine spec, run id)` of the run that wrote a conversation append, from its `append_id`: first the
    engines whose appends carry a prefix of their own (`append_prefix`), then those that parse theirs
    (`run_of_append`); `None` when no engine claims it."""
    for spec in specs:
        prefix = spec.append_prefix
        if prefix and append_id.startswith(prefix) and len(append_id) > len(prefix):
            return spec, append_id[len(prefix):]
    for spec in specs:
        if spec.append_prefix is None and spec.run_of_append is not None and (run := spec.run_of_append(append_id)):
            return spec, run
    return None
