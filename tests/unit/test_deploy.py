"""The deploy files: Kubernetes manifests consistent with the cluster config they carry,
systemd units that systemd-analyze accepts, a Slurm script that parses; in each, the etcd that
serves as the coordination service, named by the config's ``coordinator`` key."""

import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from irdmafs import config as C

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def k8s_objects() -> list[dict]:
    out = []
    for f in sorted((DEPLOY / "k8s").glob("*.yaml")):
        out += [d for d in yaml.safe_load_all(f.read_text()) if d]
    return out


def by_kind(kind: str, *, etcd: bool = False) -> list[dict]:
    """The objects of ``kind`` of irdmafs itself, or (``etcd``) those of its coordination service."""
    return [o for o in k8s_objects() if o["kind"] == kind and (o["metadata"]["name"] == "etcd") == etcd]


def containers(obj: dict) -> list[dict]:
    return obj["spec"]["template"]["spec"]["containers"]


def test_k8s_config_is_a_valid_cluster_config_naming_the_statefulset_pods(tmp_path):
    [cm] = by_kind("ConfigMap")
    [sts] = by_kind("StatefulSet")
    [svc] = by_kind("Service")
    doc = tomllib.loads(cm["data"]["cluster.toml"])
    (tmp_path / "token").write_text("x" * 64)
    cfg = C.from_dict(dict(doc, token_file=str(tmp_path / "token")), base=tmp_path)
    ns, name = sts["metadata"]["namespace"], sts["metadata"]["name"]
    assert sts["spec"]["serviceName"] == svc["metadata"]["name"] and svc["spec"]["clusterIP"] == "None"
    assert len(cfg.nodes) == sts["spec"]["replicas"]
    for i, node in enumerate(cfg.nodes):
        assert node.name == f"{name}-{i}"  # the pod name is passed as --node
        assert node.host == f"{name}-{i}.{svc['metadata']['name']}.{ns}.svc.cluster.local"
    [c] = containers(sts)
    ports = {p["containerPort"] for p in c["ports"] if p["name"] == "irdmafs"}
    metrics = {p["containerPort"] for p in c["ports"] if p["name"] == "metrics"}
    assert metrics == {int(c["command"][c["command"].index("--metrics") + 1].rpartition(":")[2])}
    assert sts["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == str(metrics.pop())
    assert {n.port for n in cfg.nodes} == ports == {p["targetPort"] for p in svc["spec"]["ports"]}
    assert "$(POD_NAME)" in c["command"] and c["env"][0]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"


def test_k8s_every_container_mounts_the_config_and_the_token_where_the_config_says():
    [cm] = by_kind("ConfigMap")
    [secret] = by_kind("Secret")
    token_file = tomllib.loads(cm["data"]["cluster.toml"])["token_file"]
    images = set()
    for obj in by_kind("StatefulSet") + by_kind("DaemonSet"):
        vols = {v["name"]: v for v in obj["spec"]["template"]["spec"]["volumes"]}
        for c in containers(obj):
            images.add(c["image"])
            mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
            config_path = c["command"][c["command"].index("--config") + 1]
            assert vols[mounts[config_path]["name"]]["configMap"]["name"] == cm["metadata"]["name"]
            secret_mount = mounts[str(Path(token_file).parent)]
            assert vols[secret_mount["name"]]["secret"]["secretName"] == secret["metadata"]["name"]
            assert "token" in secret["stringData"]
            assert c["resources"]["limits"]["rdma/hca_shared_devices_a"] == 1
            assert "IPC_LOCK" in c["securityContext"]["capabilities"]["add"]
    assert len(images) == 1 and not next(iter(images)).endswith(":latest")  # one pinned image
    assert {o["metadata"]["namespace"] for o in k8s_objects() if o["kind"] != "Namespace"} == {by_kind("Namespace")[0]["metadata"]["name"]}


def test_k8s_etcd_is_three_members_and_the_config_names_each():
    [cm] = by_kind("ConfigMap")
    [sts] = by_kind("StatefulSet", etcd=True)
    [svc] = by_kind("Service", etcd=True)
    ns, name = sts["metadata"]["namespace"], sts["metadata"]["name"]
    assert sts["spec"]["serviceName"] == svc["metadata"]["name"] and svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["publishNotReadyAddresses"] and sts["spec"]["podManagementPolicy"] == "Parallel"  # else no quorum ever forms
    assert sts["spec"]["selector"]["matchLabels"] == svc["spec"]["selector"] == sts["spec"]["template"]["metadata"]["labels"]
    members = sts["spec"]["replicas"]
    assert members == 3
    dns = [f"{name}-{i}.{svc['metadata']['name']}.{ns}.svc.cluster.local" for i in range(members)]
    [c] = containers(sts)
    flags = dict(a.split("=", 1) for a in c["command"][1:])
    assert c["command"][0] == "etcd" and not c["image"].endswith(":latest") and ":v3.4." in c["image"]
    assert flags["--initial-cluster"] == ",".join(f"{name}-{i}=http://{d}:2380" for i, d in enumerate(dns))
    assert flags["--name"] == "$(POD_NAME)" and c["env"][0]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert flags["--advertise-client-urls"] == f"http://$(POD_NAME).{svc['metadata']['name']}.{ns}.svc.cluster.local:2379"
    assert {p["containerPort"] for p in c["ports"]} == {p["targetPort"] for p in svc["spec"]["ports"]} == {2379, 2380}
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": 2379}
    [data] = sts["spec"]["volumeClaimTemplates"]
    assert {m["name"]: m["mountPath"] for m in c["volumeMounts"]} == {data["metadata"]["name"]: flags["--data-dir"]}
    cfg = C.from_dict(dict(tomllib.loads(cm["data"]["cluster.toml"]), token="x" * 64))
    assert cfg.coordinator == [f"http://{d}:2379" for d in dns]


def test_k8s_nodes_get_no_privileges_beyond_ipc_lock_and_the_mount_shares_its_mountpoint():
    [sts] = by_kind("StatefulSet")
    [c] = containers(sts)
    sc = c["securityContext"]
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]} and not sc.get("privileged")
    [ds] = by_kind("DaemonSet")
    [m] = containers(ds)
    mp = m["command"][m["command"].index("/mnt/ps")] if "/mnt/ps" in m["command"] else None
    mounts = {v["mountPath"]: v for v in m["volumeMounts"]}
    vols = {v["name"]: v for v in ds["spec"]["template"]["spec"]["volumes"]}
    assert mp and mounts[mp]["mountPropagation"] == "Bidirectional"
    assert vols[mounts[mp]["name"]]["hostPath"]["path"] == mp
    assert vols[mounts["/dev/fuse"]["name"]]["hostPath"] == {"path": "/dev/fuse", "type": "CharDevice"}
    # Bidirectional propagation is refused by Kubernetes outside privileged containers
    assert m["securityContext"]["privileged"] is True
    assert m["command"][:2] == ["irdmafs", "mount"] and "-f" in m["command"]


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="systemd-analyze not installed")
def test_systemd_units_verify(tmp_path):
    venv_python = shutil.which("python3")
    units = []
    for f in (DEPLOY / "systemd").iterdir():
        if f.suffix not in (".service", ".mount"):
            continue  # the config and etcd's environment file that go with them
        # an instance of the template, with the ExecStart pointing at a python that exists here
        name = f.name.replace("@.", "@n1.")
        text = f.read_text().replace("/opt/irdmafs/.venv/bin/python", venv_python)
        (tmp_path / name).write_text(text)
        units.append(str(tmp_path / name))
    r = subprocess.run(["systemd-analyze", "verify", *units], capture_output=True, text=True, timeout=60)
    problems = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    assert r.returncode == 0 and not problems, problems
    node = (DEPLOY / "systemd" / "irdmafs-node@.service").read_text()
    assert "Type=notify" in node and "--node %i" in node


def test_systemd_config_names_the_etcd_members_of_etcd_default(tmp_path):
    """cluster.toml's coordinator is the client URLs of the members etcd.default sets up."""
    doc = tomllib.loads((DEPLOY / "systemd" / "cluster.toml").read_text())
    cfg = C.from_dict(dict(doc, token="x" * 64))
    env = dict(re.findall(r'^(ETCD_\w+)="(.*)"$', (DEPLOY / "systemd" / "etcd.default").read_text(), re.M))
    members = dict(m.split("=", 1) for m in env["ETCD_INITIAL_CLUSTER"].split(","))
    assert len(members) == len(cfg.coordinator) == 3
    assert cfg.coordinator == [url.replace(":2380", ":2379") for url in members.values()]
    assert members[env["ETCD_NAME"]] == env["ETCD_INITIAL_ADVERTISE_PEER_URLS"]
    assert env["ETCD_ADVERTISE_CLIENT_URLS"] in cfg.coordinator
    node = (DEPLOY / "systemd" / "irdmafs-node@.service").read_text()
    assert re.search(r"^After=.*\betcd\.service\b", node, re.M) and "/etc/irdmafs/cluster.toml" in node


def test_slurm_script_parses_and_tears_down():
    script = DEPLOY / "slurm" / "irdmafs-train.sbatch"
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    text = script.read_text()
    assert "trap cleanup EXIT" in text and "fusermount3 -u" in text and "torchrun" in text
    # etcd is started before the PS nodes and stopped after them
    assert text.index("ETCD_STEP=$!") < text.index("PS_STEP=$!")
    cleanup = text[text.index("cleanup() {") : text.index("trap cleanup EXIT")]
    assert cleanup.index('kill "$PS_STEP"') < cleanup.index('kill "$ETCD_STEP"')


def test_slurm_config_names_the_jobs_etcd(tmp_path):
    """The config the job writes (its write_config function, run with a made-up allocation)
    is a valid cluster config whose coordinator is the etcd the job starts on its first host."""
    text = (DEPLOY / "slurm" / "irdmafs-train.sbatch").read_text()
    [function] = re.findall(r"^write_config\(\) \{\n.*?^\}$", text, re.M | re.S)
    setup = 'HOSTS=(h1 h2 h3); PS_NODES=2; REPLICAS=2; PORT=7100; ETCD_URL="http://h1:7179"'
    r = subprocess.run(["bash", "-c", f"{setup}\n{function}\nwrite_config"], capture_output=True, text=True, timeout=10)
    assert r.returncode == 0, r.stderr
    cfg = C.from_dict(dict(tomllib.loads(r.stdout), token="x" * 64))
    assert cfg.coordinator == ["http://h1:7179"] and cfg.names == ["ps0", "ps1"]
    assert 'ETCD_URL="http://${HOSTS[0]}:$ETCD_PORT"' in text and "--advertise-client-urls '$ETCD_URL'" in text
