"""The cluster config (TOML): nodes, replicas, stripe unit, token, transport preference, and the
coordination service (etcd) the nodes keep views and leases in.

Example::

    replicas = 2
    stripe_unit = "4MiB"
    token_file = "token"          # relative to this file; or token = "..." inline
    transport = ["verbs", "shm", "tcp"]  # first usable wins (shm: same host only, tcp otherwise)
    capacity = "8GiB"             # per node
    coordinator = ["http://10.0.0.1:2379", "http://10.0.0.2:2379", "http://10.0.0.3:2379"]
                                  # etcd client endpoints (required; one string is one endpoint):
                                  # the views and leases that decide who serves live there
                                  # (irdmafs up starts a local etcd and names it)

    [[nodes]]
    name = "n1"
    host = "127.0.0.1"
    port = 7101

Every mistake becomes one ``ConfigError`` naming the file and the key; the CLI prints it and exits
with status 2.

A config must name a coordinator: views in etcd are the only way irdmafs decides who serves
(docs/reliability.md). A config without one is refused, not run on an embedded etcd: one etcd
per node would be as many unrelated clusters, each agreeing only with itself, which is the
split-brain views exist to prevent; ``irdmafs up`` starts the one local etcd a one-machine
cluster needs. The ``routing`` key of earlier configs is accepted only as ``"views"``.
"""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from .errors import ConfigError  # noqa: F401 (the same classes)

TRANSPORTS = ("verbs", "shm", "tcp", "memory")
DEFAULT_TRANSPORT = ["verbs", "shm", "tcp"]  # shm: shared memory with the nodes of this host, tcp to the others


NO_COORDINATOR = (
    "coordinator: none named. irdmafs keeps its views and leases (who serves, who leads each stripe) "
    "in etcd: name its client endpoints (coordinator = [\"http://HOST:2379\"]; deploy/ runs three), "
    "or run a local cluster with 'irdmafs up', which starts one"
)


@dataclass(frozen=True)
class NodeSpec:
    name: str
    host: str
    port: int


@dataclass(frozen=True)
class Members:
    """Who the cluster's nodes are and how many copies a stripe has, as of membership ``epoch``
    (0: as the config file says; a rebalance switches every process to a new one). A value:
    ``Cluster.adopt`` replaces it whole, nobody changes it, and the config stays as loaded."""

    nodes: tuple[NodeSpec, ...]
    replicas: int
    epoch: int = 0

    @property
    def names(self) -> list[str]:
        return [n.name for n in self.nodes]

    def spec(self, name: str) -> NodeSpec | None:
        return next((n for n in self.nodes if n.name == name), None)


@dataclass
class ClusterConfig:
    nodes: list[NodeSpec]
    token: bytes
    replicas: int = 2
    stripe_unit: int = 4 << 20
    capacity: int = 8 << 30
    transport: list[str] = field(default_factory=lambda: list(DEFAULT_TRANSPORT))
    coordinator: list[str] = field(default_factory=list)  # etcd client endpoints (a loaded config always names one)
    heartbeat: float = 0.5  # seconds between heartbeats
    down_after: float = 2.0  # a node silent this long is down
    op_timeout: float = 10.0  # one data operation against one node
    lease_ttl: float = 10.0  # a node serves this long past its last keepalive (server/leases.py)
    name_lease: float = 4.0  # a mount may cache names this long between renewals; 0: no caching (server/namecache.py)
    path: str | None = None

    def node(self, name: str) -> NodeSpec:
        for n in self.nodes:
            if n.name == name:
                return n
        raise ConfigError(f"{self.path}: no node named {name!r} (have {', '.join(self.names)})")

    @property
    def names(self) -> list[str]:
        return [n.name for n in self.nodes]

    def members(self) -> Members:
        """The membership this config names (a running cluster's is ``Cluster.members``)."""
        return Members(tuple(self.nodes), self.replicas)


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tib": 1 << 40}


def parse_size(value: object, key: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    m = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"{key}: {value!r} is not a size (e.g. 4MiB, 1048576)")
    return int(m.group(1)) * _UNITS[m.group(2).lower()]


def parse_endpoints(value: object, key: str) -> list[str]:
    """etcd client endpoints (``http://host:port``; a list, or one string for one endpoint) as a
    list, without trailing slashes."""
    urls = [value] if isinstance(value, str) else value
    if not isinstance(urls, list):
        raise ConfigError(f"{key}: {value!r} is not a list of etcd endpoints (e.g. [\"http://10.0.0.1:2379\"])")
    out = []
    for i, url in enumerate(urls):
        name = key if isinstance(value, str) else f"{key}[{i}]"
        if not isinstance(url, str):
            raise ConfigError(f"{name}: {url!r} is not a string (an etcd endpoint is \"http://host:port\")")
        try:
            parts = urlsplit(url)
            ok = parts.scheme == "http" and bool(parts.hostname) and bool(parts.port) and parts.path in ("", "/")
            ok = ok and not (parts.query or parts.fragment or parts.username)
        except ValueError:  # a port that is no number or out of range, a bad IPv6 literal
            ok = False
        if not ok:
            raise ConfigError(f"{name}: {url!r} is not an etcd endpoint http://host:port (only http: no TLS yet)")
        out.append(url.rstrip("/"))
    if len(set(out)) < len(out):
        raise ConfigError(f"{key}: an endpoint is named twice in {value!r}")
    return out


def load(path: str | os.PathLike) -> ClusterConfig:
    path = Path(path)
    try:
        doc = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    try:
        return from_dict(doc, base=path.parent, where=str(path))
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def from_dict(doc: dict, *, base: Path = Path("."), where: str | None = None) -> ClusterConfig:
    known = {"nodes", "token", "token_file", "replicas", "stripe_unit", "capacity", "transport", "coordinator", "routing"}
    known |= {"heartbeat", "down_after", "op_timeout", "lease_ttl", "name_lease"}
    unknown = set(doc) - known
    if unknown:
        raise ConfigError(f"unknown key(s) {sorted(unknown)}")
    raw_nodes = doc.get("nodes")
    if not isinstance(raw_nodes, list) or not raw_nodes:
        raise ConfigError("nodes: need at least one [[nodes]] table with name, host, port")
    nodes, seen = [], set()
    for i, n in enumerate(raw_nodes):
        if not isinstance(n, dict) or not {"name", "host", "port"} <= set(n):
            raise ConfigError(f"nodes[{i}]: needs name, host and port")
        if not isinstance(n["port"], int) or not 0 < n["port"] < 65536:
            raise ConfigError(f"nodes[{i}].port: {n['port']!r} is not a TCP port")
        if n["name"] in seen or not re.fullmatch(r"[A-Za-z0-9_.-]+", str(n["name"])):
            raise ConfigError(f"nodes[{i}].name: {n['name']!r} is a duplicate or not [A-Za-z0-9_.-]+")
        seen.add(n["name"])
        nodes.append(NodeSpec(str(n["name"]), str(n["host"]), n["port"]))
    if "token" in doc:
        token = str(doc["token"]).encode()
    elif "token_file" in doc:
        tpath = base / doc["token_file"]
        try:
            token = tpath.read_bytes().strip()
        except OSError as exc:
            raise ConfigError(f"token_file: cannot read {tpath}: {exc.strerror}") from None
    else:
        raise ConfigError("token or token_file: a cluster token is required")
    if len(token) < 8:
        raise ConfigError("token: must be at least 8 bytes")
    replicas = doc.get("replicas", min(2, len(nodes)))  # default: 2, or 1 for a one-node cluster
    if not isinstance(replicas, int) or not 1 <= replicas <= len(nodes):
        raise ConfigError(f"replicas: {replicas!r} must be between 1 and the number of nodes ({len(nodes)})")
    transport = doc.get("transport", DEFAULT_TRANSPORT)
    if isinstance(transport, str):
        transport = [transport]
    if not transport or any(t not in TRANSPORTS for t in transport):
        raise ConfigError(f"transport: {transport!r}; choose from {list(TRANSPORTS)}")
    unit = parse_size(doc.get("stripe_unit", 4 << 20), "stripe_unit")
    if unit < 4096 or unit & (unit - 1):
        raise ConfigError("stripe_unit: must be a power of two of at least 4KiB")
    cfg = ClusterConfig(
        nodes=nodes,
        token=token,
        replicas=replicas,
        stripe_unit=unit,
        capacity=parse_size(doc.get("capacity", 8 << 30), "capacity"),
        transport=list(transport),
        coordinator=parse_endpoints(doc.get("coordinator", []), "coordinator"),
        path=where,
    )
    if doc.get("routing", "views") != "views":
        raise ConfigError(f"routing: {doc['routing']!r}: the heartbeat routing was removed; views in the coordinator are the only routing (drop the key)")
    if not cfg.coordinator:
        raise ConfigError(NO_COORDINATOR)
    for key in ("heartbeat", "down_after", "op_timeout", "lease_ttl"):
        if key in doc:
            value = doc[key]
            if not isinstance(value, (int, float)) or value <= 0:
                raise ConfigError(f"{key}: must be a positive number of seconds")
            setattr(cfg, key, float(value))
    if "name_lease" not in doc:  # the default, within what a change may wait for (op_timeout)
        cfg.name_lease = min(cfg.name_lease, cfg.op_timeout / 2)
    else:
        value = doc["name_lease"]
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < cfg.op_timeout:
            raise ConfigError(f"name_lease: seconds a mount may cache names, from 0 (no caching) to below op_timeout ({cfg.op_timeout}), not {value!r}")
        cfg.name_lease = float(value)
    return cfg


def dump(cfg: ClusterConfig, token_file: str = "token") -> str:
    """TOML text for ``cfg`` (the token goes in a file of its own, mode 0600)."""
    lines = [
        f"replicas = {cfg.replicas}",
        f"stripe_unit = {cfg.stripe_unit}",
        f"capacity = {cfg.capacity}",
        f"token_file = {token_file!r}",
        "transport = [" + ", ".join(repr(t) for t in cfg.transport) + "]",
        *(["coordinator = [" + ", ".join(repr(e) for e in cfg.coordinator) + "]"] if cfg.coordinator else []),
        f"heartbeat = {cfg.heartbeat}",
        f"down_after = {cfg.down_after}",
        f"op_timeout = {cfg.op_timeout}",
        f"lease_ttl = {cfg.lease_ttl}",
        f"name_lease = {cfg.name_lease}",
    ]
    for n in cfg.nodes:
        lines += ["", "[[nodes]]", f"name = {n.name!r}", f"host = {n.host!r}", f"port = {n.port}"]
    return "\n".join(lines).replace("'", '"') + "\n"
