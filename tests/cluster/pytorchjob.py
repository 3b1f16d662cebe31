"""A ``kubeflow.org/v1`` PyTorchJob started the way Kubeflow's training operator starts it, with
its pods on the test cluster's hosts.

What the operator does, read from its source (kubeflow/training-operator v1.9,
``pkg/controller.v1/pytorch/envvar.go``, ``master.go``, ``elastic.go`` and
``pkg/apis/kubeflow.org/v1/pytorch_defaults.go``; the same since v1.7):

- defaults: the container named ``pytorch`` gets the port ``pytorchjob-port`` (23456) unless it
  declares one; without an ``elasticPolicy``, ``nprocPerNode`` defaults to ``"auto"``;
- one headless Service per pod, ``<job>-<replica type>-<index>``, resolving to the pod's address
  (the node's, under ``hostNetwork``); worker pods wait in an init container until the master's
  name resolves;
- each container's ``env`` gets, after the template's own entries (a later entry of the same
  name wins): ``PYTHONUNBUFFERED=1``; ``MASTER_ADDR`` and ``PET_MASTER_ADDR`` = the master's
  Service name ``<job>-master-0``; ``MASTER_PORT`` and ``PET_MASTER_PORT`` = the master's
  ``pytorchjob-port``; ``WORLD_SIZE`` = pods x ``nprocPerNode`` when that is an integer, else
  pods (so it counts nodes under the default ``"auto"`` and processes under ``nprocPerNode:
  "8"``); ``RANK`` and ``PET_NODE_RANK`` = the pod's index (Master 0, Worker i -> i + 1);
  ``PET_NPROC_PER_NODE`` = ``nprocPerNode``; ``PET_NNODES`` = pods (with an ``elasticPolicy``:
  ``"min:max"`` and the ``PET_RDZV_*`` variables instead, not modelled here).

``torchrun`` reads ``PET_<FLAG>`` as the default of each of its flags, so a pod that runs plain
``torchrun script.py`` gets ``--nnodes``, ``--node_rank``, ``--nproc_per_node`` and the master
from them; flags given on the command line win.

Here a pod is a process tree on one host (Master on node1, Worker i on node i + 2) in its own
mount namespace, where ``/etc/hosts`` also names every pod's Service and an ``emptyDir`` of
``medium: Memory`` is a fresh tmpfs. Where the image differs from this machine, paths are
mapped: the image (``fsdp-rlhf:latest``, the package at ``/workspace/fsdp-rlhf``) is this
repository with its venv; a ``configMap`` volume item is written to a file under the pod's
folder and a ``persistentVolumeClaim`` is a folder shared by all hosts, their ``mountPath``
replaced by those folders in the container's command, args and env values.
"""

from __future__ import annotations

import copy
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

import yaml

from tests.cluster.cluster import Cluster
from tests.cluster.runs import REPO, VENV_BIN

DEFAULT_CONTAINER = "pytorch"
DEFAULT_PORT_NAME = "pytorchjob-port"
DEFAULT_PORT = 23456
DEFAULT_NPROC_PER_NODE = "auto"
# The image's own environment (Dockerfile: the package installed in /workspace/fsdp-rlhf, its
# WORKDIR): here, this repository and the venv running the tests.
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
IMAGE_ENV = {"PATH": f"{VENV_BIN}:{SYSTEM_PATH}", "HOME": "/root", "PYTHONPATH": str(REPO)}
IMAGE_WORKDIR = REPO


def load(manifest: Path) -> tuple[dict, dict[str, dict]]:
    """The PyTorchJob of ``manifest`` and its ConfigMaps by name."""
    docs = [d for d in yaml.safe_load_all(manifest.read_text()) if d]
    (job,) = [d for d in docs if d.get("kind") == "PyTorchJob"]
    maps = {d["metadata"]["name"]: d for d in docs if d.get("kind") == "ConfigMap"}
    return job, maps


def with_defaults(job: dict) -> dict:
    """The job as the operator's defaulting webhook leaves it (the parts used here)."""
    job = copy.deepcopy(job)
    spec = job["spec"]
    for replica in spec["pytorchReplicaSpecs"].values():
        replica.setdefault("replicas", 1)
        for c in replica["template"]["spec"]["containers"]:
            if c["name"] == DEFAULT_CONTAINER:
                ports = c.setdefault("ports", [])
                if not any(p.get("name") == DEFAULT_PORT_NAME for p in ports):
                    ports.append({"name": DEFAULT_PORT_NAME, "containerPort": DEFAULT_PORT})
    elastic = spec.get("elasticPolicy")
    if elastic is None or "nProcPerNode" not in elastic:
        spec.setdefault("nprocPerNode", DEFAULT_NPROC_PER_NODE)
    return job


def _master_port(job: dict) -> int:
    for c in job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"]:
        if c["name"] == DEFAULT_CONTAINER:
            for p in c.get("ports", []):
                if p.get("name") == DEFAULT_PORT_NAME:
                    return int(p["containerPort"])
    raise ValueError("the Master has no pytorchjob-port")


def pod_name(job: dict, rtype: str, index: int) -> str:
    return f"{job['metadata']['name']}-{rtype.lower()}-{index}"


def pods(job: dict) -> list[tuple[str, int]]:
    """(replica type, index) of every pod, Master first."""
    specs = job["spec"]["pytorchReplicaSpecs"]
    order = sorted(specs, key=lambda t: t != "Master")
    return [(t, i) for t in order for i in range(int(specs[t].get("replicas", 1)))]


def operator_env(job: dict, rtype: str, index: int) -> list[tuple[str, str]]:
    """The variables the operator appends to each container of pod (``rtype``, ``index``), in
    its order; ``job`` as :func:`with_defaults` leaves it."""
    spec = job["spec"]
    if spec.get("elasticPolicy") is not None:
        raise NotImplementedError("elasticPolicy (PET_RDZV_*, PET_NNODES=min:max)")
    replicas = sum(int(r.get("replicas", 1)) for r in spec["pytorchReplicaSpecs"].values())
    nproc = spec.get("nprocPerNode")
    per_node = int(nproc) if nproc is not None and str(nproc).isdigit() else 1
    env = [("PYTHONUNBUFFERED", "1")]
    if "Master" in spec["pytorchReplicaSpecs"]:
        port, addr = str(_master_port(job)), pod_name(job, "Master", 0)
        env += [("MASTER_PORT", port), ("PET_MASTER_PORT", port)]
        env += [("MASTER_ADDR", addr), ("PET_MASTER_ADDR", addr)]
        rank = index + 1 if rtype == "Worker" else index
        env += [("WORLD_SIZE", str(replicas * per_node)), ("RANK", str(rank))]
        env += [("PET_NODE_RANK", str(rank))]
    if nproc is not None:
        env.append(("PET_NPROC_PER_NODE", str(nproc)))
    env.append(("PET_NNODES", str(replicas)))
    return env


def _map_path(value: str, mounts: list[tuple[str, str]]) -> str:
    for inside, outside in mounts:
        if value == inside or value.startswith(inside.rstrip("/") + "/"):
            return outside + value[len(inside) :]
    return value


@dataclass
class Pod:
    name: str
    host: str  # the cluster host it runs on
    argv: list[str]  # command + args, paths mapped
    env: dict[str, str]
    hosts_file: Path
    tmpfs: list[str]  # emptyDir medium Memory mount points that exist here

    def launch_argv(self) -> list[str]:
        """The container's command inside a private mount namespace with the pod's /etc/hosts
        and fresh tmpfs mounts."""
        steps = [f"mount --bind {shlex.quote(str(self.hosts_file))} /etc/hosts"]
        steps += [f"mount -t tmpfs -o mode=1777 pod-shm {shlex.quote(p)}" for p in self.tmpfs]
        script = " && ".join([*steps, 'exec "$@"'])
        unshare = ["unshare", "--mount", "--propagation", "private"]
        return [*unshare, "sh", "-c", script, self.name, *self.argv]


def make_pods(
    cluster: Cluster,
    manifest: Path,
    root: Path,
    pvc: Path,
    container_env: dict[str, str],
    args: list[str],
) -> list[Pod]:
    """The pods of ``manifest`` as the operator would create them, placed on the cluster's
    nodes, with ``container_env`` added to each container's ``env`` (as a user sets paths and
    sizes) and ``args`` as its ``args``: the test's only changes to the manifest."""
    raw, maps = load(manifest)
    job = with_defaults(raw)
    placed = pods(job)
    if len(placed) > cluster.nodes:
        raise ValueError(f"{len(placed)} pods for {cluster.nodes} hosts")
    nodes = [cluster.node(i + 1) for i in range(len(placed))]
    services = {pod_name(job, t, i): h.addr for (t, i), h in zip(placed, nodes, strict=True)}
    base_hosts = (cluster.root / "hosts").read_text()
    out = []
    for (rtype, index), host in zip(placed, nodes, strict=True):
        name = pod_name(job, rtype, index)
        pod_root = root / name
        pod_root.mkdir(parents=True, exist_ok=True)
        hosts_file = pod_root / "hosts"
        extra = "".join(f"{addr} {svc}\n" for svc, addr in services.items())
        hosts_file.write_text(base_hosts + extra)
        pod_spec = job["spec"]["pytorchReplicaSpecs"][rtype]["template"]["spec"]
        (container,) = [c for c in pod_spec["containers"] if c["name"] == DEFAULT_CONTAINER]
        volumes = {v["name"]: v for v in pod_spec.get("volumes", [])}
        mounts, tmpfs = [], []
        for m in container.get("volumeMounts", []):
            vol, where = volumes[m["name"]], m["mountPath"]
            if "configMap" in vol:
                data = maps[vol["configMap"]["name"]]["data"]
                path = pod_root / where.lstrip("/")
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(data[m["subPath"]])
                mounts.append((where, str(path)))
            elif "persistentVolumeClaim" in vol:
                mounts.append((where, str(pvc)))
            elif vol.get("emptyDir", {}).get("medium") == "Memory" and Path(where).is_dir():
                tmpfs.append(where)
            else:
                raise NotImplementedError(f"volume {vol}")
        # kubelet: a later entry of the same name wins (the operator's come last)
        env = dict(IMAGE_ENV, HOSTNAME=host.name)
        added = [{"name": k, "value": v} for k, v in container_env.items()]
        for entry in [*container.get("env", []), *added]:
            env[entry["name"]] = entry["value"]
        env.update(operator_env(job, rtype, index))
        env = {k: _map_path(v, mounts) for k, v in env.items()}
        argv = [*container["command"], *container.get("args", []), *args]
        argv = [_map_path(a, mounts) for a in argv]
        out.append(Pod(name, host.name, argv, env, hosts_file, tmpfs))
    return out


def start(cluster: Cluster, pods_: list[Pod], logs: Path) -> dict[str, subprocess.Popen]:
    """Start every pod (logs under ``logs/<pod>.log``); returns {pod name: process}."""
    return {
        p.name: cluster.hosts[p.host].popen(
            p.launch_argv(), env=p.env, cwd=IMAGE_WORKDIR, log=logs / f"{p.name}.log"
        )
        for p in pods_
    }
