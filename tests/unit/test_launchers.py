"""Launchers: examples/*.sh, slurm/*.sbatch and the k8s PyTorchJob manifests.

The shell scripts are run for real with ``DRY_RUN=1`` (they print the command they would run), and
through their signal paths with stub ``srun``/``scontrol``/``torchrun`` executables on PATH, so no
Slurm, Kubernetes or GPU is needed. The manifests are checked against JSON schemas covering the
part of the ConfigMap and PyTorchJob APIs they use.
"""

from __future__ import annotations

import copy
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from jsonschema import Draft202012Validator

REPO = Path(__file__).resolve().parents[2]
CMD_SCRIPTS = {
    "train-rm": REPO / "examples" / "train_rm.sh",
    "ppo": REPO / "examples" / "ppo.sh",
    "sft": REPO / "examples" / "sft.sh",
    "dpo": REPO / "examples" / "dpo.sh",
}
SBATCH = {
    "train-rm": REPO / "slurm" / "train_rm.sbatch",
    "ppo": REPO / "slurm" / "ppo.sbatch",
    "sft": REPO / "slurm" / "sft.sbatch",
    "dpo": REPO / "slurm" / "dpo.sbatch",
}
MANIFESTS = {
    "train-rm": REPO / "k8s" / "rm-pytorchjob.yaml",
    "ppo": REPO / "k8s" / "ppo-pytorchjob.yaml",
    "sft": REPO / "k8s" / "sft-pytorchjob.yaml",
    "dpo": REPO / "k8s" / "dpo-pytorchjob.yaml",
}
TIMEOUT = 10

# Default paths of the AIAK-RLHF examples (RM: section 1.5's save path; 1.3 reuses the SFT name).
RM_PATHS = {
    "SAVE_PATH": "/mnt/cluster/models/Llama-2-7b-rm-model-ocra-500k/",
    "SFT_MODEL_PATH": "/mnt/cluster/test/models/Llama-2-7b-sft-model-ocra-500k/",
    "DATASET_PATH": "/mnt/cluster/test/dataset/openai/webgpt_comparisons",
    "TENSORBOARD_PATH": "/mnt/cluster/tensorboard-log",
}
PPO_PATHS = {
    "SAVE_PATH": "/mnt/cluster/llama2-ppo-model",
    "SFT_MODEL_PATH": "/mnt/cluster/test/models/Llama-2-7b-sft-model-ocra-500k/",
    "REWARD_MODEL_PATH": (
        "/mnt/cluster/test/models/Llama-2-7b-rm-anthropic_hh-lmsys-oasst-webgpt/"
    ),
    "DATASET_PATH": "/mnt/cluster/test/dataset/OpenLLMAI/prompt-collection-v0.1",
    "TENSORBOARD_PATH": "/mnt/cluster/tensorboard-log",
}


# Periodic checkpoints (issue #19): the launchers save every SAVE_STEPS steps (default 20) where
# AIAK-RLHF's RM script had --save_steps -1, so a crash loses at most that many steps.
SAVE_STEPS = "20"


def aiak_rm_flags(p: dict[str, str] = RM_PATHS, save_steps: str = SAVE_STEPS) -> list[str]:
    """The training flags of AIAK-RLHF's RM launch script (its guide's sections 1.3/1.5), in
    order, with periodic checkpoints in place of its ``--save_steps -1``."""
    return shlex.split(
        f"--save_path {p['SAVE_PATH']} --save_steps {save_steps} --logging_steps 1 --eval_steps -1"
        f" --train_batch_size 128 --micro_train_batch_size 1 --pretrain {p['SFT_MODEL_PATH']}"
        " --bf16 --max_epochs 1 --max_len 2048 --zero_stage 3 --learning_rate 9e-6"
        f" --dataset {p['DATASET_PATH']} --dataset_probs 1 --flash_attn"
        f" --tensorboard {p['TENSORBOARD_PATH']} --gradient_checkpointing"
    )


def aiak_ppo_flags(
    nnodes: int, gpus: int, tp: int, engines: int, p: dict[str, str] = PPO_PATHS
) -> list[str]:
    """The flags AIAK-RLHF's PPO script (its guide's section 2.3) passes to
    train_ppo_ray_optim.py, in order."""
    return shlex.split(
        f"--num_nodes {nnodes} --num_gpus_per_node {gpus} --vllm_num_engines {engines}"
        f" --vllm_tensor_parallel_size {tp} --vllm_gpu_memory_utilization 0.9 --colocate_all"
        f" --ref_reward_offload --pretrain {p['SFT_MODEL_PATH']}"
        f" --reward_pretrain {p['REWARD_MODEL_PATH']} --save_path {p['SAVE_PATH']}"
        " --micro_train_batch_size 8 --micro_rollout_batch_size 16 --rollout_batch_size 1024"
        " --max_samples 1000000 --max_epochs 1 --prompt_max_len 1024 --generate_max_len 1024"
        " --zero_stage 3 --bf16 --actor_learning_rate 5e-7 --critic_learning_rate 9e-6"
        f" --init_kl_coef 0.01 --prompt_data {p['DATASET_PATH']} --input_key context_messages"
        " --apply_chat_template --normalize_reward --adam_offload --flash_attn"
        f" --tensorboard {p['TENSORBOARD_PATH']} --gradient_checkpointing"
    )


# OpenRLHF's train_sft / train_dpo examples (Llama 3 8B), on AIAK-style paths.
SFT_PATHS = {
    "SAVE_PATH": "/mnt/cluster/models/Llama-2-7b-sft-model-ocra-500k/",
    "PRETRAIN_PATH": "/mnt/cluster/test/models/Llama-2-7b-hf/",
    "DATASET_PATH": "/mnt/cluster/test/dataset/Open-Orca/OpenOrca",
    "TENSORBOARD_PATH": "/mnt/cluster/tensorboard-log",
}
DPO_PATHS = {
    "SAVE_PATH": "/mnt/cluster/models/Llama-2-7b-dpo-model/",
    "SFT_MODEL_PATH": "/mnt/cluster/test/models/Llama-2-7b-sft-model-ocra-500k/",
    "DATASET_PATH": "/mnt/cluster/test/dataset/OpenRLHF/preference_dataset_mixture2_and_safe_pku",
    "TENSORBOARD_PATH": "/mnt/cluster/tensorboard-log",
}


def sft_flags(p: dict[str, str] = SFT_PATHS) -> list[str]:
    return shlex.split(
        f"--save_path {p['SAVE_PATH']} --save_steps {SAVE_STEPS} --logging_steps 1"
        " --eval_steps -1 --train_batch_size 256 --micro_train_batch_size 2"
        f" --pretrain {p['PRETRAIN_PATH']} --bf16 --max_epochs 1 --max_len 2048 --zero_stage 2"
        f" --learning_rate 5e-6 --dataset {p['DATASET_PATH']} --input_key question"
        " --output_key response --max_samples 500000 --flash_attn"
        f" --tensorboard {p['TENSORBOARD_PATH']} --gradient_checkpointing"
    )


def dpo_flags(p: dict[str, str] = DPO_PATHS) -> list[str]:
    return shlex.split(
        f"--save_path {p['SAVE_PATH']} --save_steps {SAVE_STEPS} --logging_steps 1"
        " --eval_steps -1 --train_batch_size 256 --micro_train_batch_size 1"
        f" --pretrain {p['SFT_MODEL_PATH']} --bf16 --max_epochs 1 --max_len 8192 --zero_stage 3"
        f" --learning_rate 5e-7 --beta 0.1 --dataset {p['DATASET_PATH']} --apply_chat_template"
        " --chosen_key chosen --rejected_key rejected --flash_attn"
        f" --tensorboard {p['TENSORBOARD_PATH']} --gradient_checkpointing"
    )


# Launchers whose flags are the same on every platform (only train-rm and ppo differ: seeds).
OFFLINE_FLAGS = {"sft": (sft_flags, SFT_PATHS), "dpo": (dpo_flags, DPO_PATHS)}


def ckpt_flags(save_path: str) -> list[str]:
    return ["--ckpt_path", save_path.rstrip("/") + "/checkpoints"]


def resume_flags(save_path: str) -> list[str]:
    return [*ckpt_flags(save_path), "--load_checkpoint"]


PPO_PERIODIC = ["--save_steps", SAVE_STEPS]  # after AIAK's flags, which have no --save_steps


# ---------------------------------------------------------------- helpers

# Environment variables the launchers read; cleared so the host's values cannot leak in.
LAUNCHER_VARS = (
    "MASTER_ADDR MASTER_PORT WORLD_SIZE RANK GPUS_PER_NODE VLLM_TENSOR_PARALLEL_SIZE SAVE_PATH"
    " CKPT_PATH SFT_MODEL_PATH REWARD_MODEL_PATH DATASET_PATH TENSORBOARD_PATH"
    " AIHC_TENSORBOARD_LOG_PATH NCCL_SOCKET_IFNAME NCCL_IB_HCA NCCL_IB_GID_INDEX DRY_RUN"
    " GLOO_SOCKET_IFNAME TORCH_ELASTIC_SHUTDOWN_TIMEOUT SAVE_STEPS PRETRAIN_PATH"
).split()


def clean_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in LAUNCHER_VARS and not k.startswith(("SLURM_", "PET_"))
    }
    env.update(extra)
    return env


def run_script(script: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(script), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        cwd=REPO,
    )


def dry_run(script: Path, *args: str, **env: str) -> list[str]:
    """The command a launcher would run, as argv."""
    res = run_script(script, clean_env(DRY_RUN="1", **env), *args)
    assert res.returncode == 0, res.stderr
    argv = shlex.split(res.stdout)
    assert argv, f"{script.name} printed no command"
    return argv


def split_at_cli(argv: list[str]) -> tuple[list[str], str, list[str]]:
    """(everything before `-m fsdp_rlhf.cli`, subcommand, the subcommand's flags)."""
    for i in range(len(argv) - 1):
        if argv[i] == "-m" and argv[i + 1] == "fsdp_rlhf.cli":
            return argv[:i], argv[i + 2], argv[i + 3 :]
    raise AssertionError(f"no `-m fsdp_rlhf.cli` in {argv}")


def opt(argv: list[str], name: str) -> str:
    """Value of `name VALUE` in argv (exactly one occurrence)."""
    hits = [i for i, a in enumerate(argv) if a == name]
    assert len(hits) == 1, f"{name} appears {len(hits)} times in {argv}"
    return argv[hits[0] + 1]


def load_manifest(path: Path) -> list[dict]:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert docs, f"{path} holds no YAML document"
    return docs


def configmaps(docs: list[dict]) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d.get("kind") == "ConfigMap"}


def pytorchjob(docs: list[dict]) -> dict:
    jobs = [d for d in docs if d.get("kind") == "PyTorchJob"]
    assert len(jobs) == 1, "expected exactly one PyTorchJob per manifest"
    return jobs[0]


def launch_script(path: Path, tmp_path: Path) -> Path:
    """The ConfigMap's launch.sh written to a file."""
    docs = load_manifest(path)
    (cm,) = configmaps(docs).values()
    out = tmp_path / f"{path.stem}-launch.sh"
    out.write_text(cm["data"]["launch.sh"])
    return out


# Stub executables for the signal-path tests. They stand in for Slurm and torchrun: srun runs its
# command locally in a new process group and forwards SIGUSR1/SIGTERM to the whole group (Slurm
# signals every process of a step), torchrun starts one "rank" and exits with its status, and the
# rank behaves like a trainer: on SIGUSR1/SIGTERM it records the signal ("writes a checkpoint")
# and exits 0. The rank keeps Python's handler, which is reset to the default action at
# interpreter exit, so a second delivery of the signal kills it: the tests catch launchers that
# deliver a signal twice.
FAKE_SCONTROL = r"""#!/bin/bash
if [[ $1 == show && $2 == hostnames ]]; then
    printf 'node-a\nnode-b\n'
elif [[ $1 == requeue ]]; then
    state=$(ls "$FAKE_OUT" | tr '\n' ' ')
    echo "requeue $2 | $state" >> "$FAKE_OUT/scontrol.log"
else
    echo "fake scontrol: unexpected $*" >&2
    exit 1
fi
"""
FAKE_SRUN = r"""#!/bin/bash
echo "$@" > "$FAKE_OUT/srun.args"
while [[ $# -gt 0 && $1 == -* ]]; do shift; done
setsid "$@" &
child=$!
echo $child > "$FAKE_OUT/step.pgid"
# Like slurmstepd, deliver a forwarded signal to every process of the step, exactly once.
trap 'kill -USR1 -- -$child' USR1
trap 'kill -TERM -- -$child' TERM
while kill -0 $child 2>/dev/null; do wait $child; done
wait $child
"""
FAKE_TORCHRUN = """#!{python}
import json, os, subprocess, sys
from pathlib import Path

out = Path(os.environ["FAKE_OUT"])
if os.environ.get("FAKE_TORCHRUN") == "dump":
    prefixes = ("NCCL_", "GLOO_", "TORCH_ELASTIC_")
    env = {{k: v for k, v in os.environ.items() if k.startswith(prefixes)}}
    (out / "torchrun.json").write_text(json.dumps({{"argv": sys.argv[1:], "env": env}}))
    sys.exit(0)
rank = subprocess.Popen([sys.executable, {worker!r}])
rc = rank.wait()
(out / "torchrun_exit").write_text(str(rc))
sys.exit(rc)
"""
FAKE_RANK = """import os, signal, time
from pathlib import Path

out = Path(os.environ["FAKE_OUT"])
stop = []


def on_signal(signum, frame):
    stop.append(signal.Signals(signum).name)


signal.signal(signal.SIGUSR1, on_signal)
signal.signal(signal.SIGTERM, on_signal)
(out / "rank_ready").write_text(str(os.getpid()))
deadline = time.monotonic() + float(os.environ.get("FAKE_RANK_SECONDS", "30"))
while not stop and time.monotonic() < deadline:
    time.sleep(0.01)
if stop:
    (out / ("rank_got_" + stop[0])).write_text("")  # the checkpoint
"""


@pytest.fixture
def fakes(tmp_path: Path) -> tuple[Path, Path]:
    """(bin dir with stub scontrol/srun/torchrun, output dir the stubs write to)."""
    bin_dir, out = tmp_path / "bin", tmp_path / "out"
    bin_dir.mkdir()
    out.mkdir()
    rank = tmp_path / "fake_rank.py"
    rank.write_text(FAKE_RANK)
    stubs = {
        "scontrol": FAKE_SCONTROL,
        "srun": FAKE_SRUN,
        "torchrun": FAKE_TORCHRUN.format(python=sys.executable, worker=str(rank)),
    }
    for name, text in stubs.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return bin_dir, out


def stub_env(bin_dir: Path, out: Path, **extra: str) -> dict[str, str]:
    return clean_env(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", FAKE_OUT=str(out), **extra)


def slurm_env(bin_dir: Path, out: Path, **extra: str) -> dict[str, str]:
    return stub_env(
        bin_dir,
        out,
        SLURM_JOB_NODELIST="node-[a-b]",
        SLURM_NNODES="2",
        SLURM_JOB_ID="123",
        **extra,
    )


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"launcher exited {proc.returncode} early:\n{out}\n{err}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {path.name}")
        time.sleep(0.02)


def start(argv: list[str], env: dict[str, str]) -> subprocess.Popen:
    # Own session, so that cleanup can end exactly the processes this test started.
    return subprocess.Popen(
        argv,
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def finish(proc: subprocess.Popen, out: Path) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        groups = [proc.pid]
        if (out / "step.pgid").exists():  # the fake srun's step runs in its own group
            groups.append(int((out / "step.pgid").read_text()))
        for pgid in groups:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.communicate()
        raise AssertionError("launcher did not exit after the signal") from None
    return proc.returncode, err


needs_pkill = pytest.mark.skipif(shutil.which("pkill") is None, reason="needs pkill (procps)")
needs_setsid = pytest.mark.skipif(shutil.which("setsid") is None, reason="needs setsid")


# ---------------------------------------------------------------- shell syntax


def all_shell_files() -> list[Path]:
    return sorted([*REPO.glob("examples/*.sh"), *REPO.glob("slurm/*.sbatch")])


def test_launcher_files_exist():
    files = {p.relative_to(REPO).as_posix() for p in all_shell_files()}
    launchers = {f"examples/{c}.sh" for c in ("train_rm", "ppo", "sft", "dpo")}
    assert launchers | {f"slurm/{c}.sbatch" for c in ("train_rm", "ppo", "sft", "dpo")} <= files
    for path in MANIFESTS.values():
        assert path.is_file()


@pytest.mark.parametrize("path", all_shell_files(), ids=lambda p: p.name)
def test_shell_syntax(path: Path):
    res = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("cmd", MANIFESTS)
def test_configmap_launch_script_syntax(cmd: str, tmp_path: Path):
    script = launch_script(MANIFESTS[cmd], tmp_path)
    res = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


# ---------------------------------------------------------------- k8s schemas

DNS_LABEL = {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63}
METADATA = {
    "type": "object",
    "required": ["name"],
    "properties": {"name": DNS_LABEL, "namespace": DNS_LABEL, "labels": {"type": "object"}},
}
CONFIGMAP_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "data"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "v1"},
        "kind": {"const": "ConfigMap"},
        "metadata": METADATA,
        "data": {
            "type": "object",
            "minProperties": 1,
            "propertyNames": {"pattern": r"^[-._a-zA-Z0-9]+$"},
            "additionalProperties": {"type": "string"},
        },
    },
}
QUANTITY = {
    "anyOf": [
        {"type": "integer", "minimum": 0},
        {"type": "string", "pattern": r"^[0-9]+(\.[0-9]+)?([KMGTPE]i?|m)?$"},
    ]
}
ENV_VAR = {
    "type": "object",
    "required": ["name"],
    "additionalProperties": False,
    "properties": {
        "name": {"type": "string", "pattern": r"^[A-Za-z_][A-Za-z0-9_]*$"},
        "value": {"type": "string"},  # Kubernetes rejects numbers here: quote them
        "valueFrom": {"type": "object"},
    },
}
VOLUME_MOUNT = {
    "type": "object",
    "required": ["name", "mountPath"],
    "additionalProperties": False,
    "properties": {
        "name": DNS_LABEL,
        "mountPath": {"type": "string", "pattern": "^/"},
        "subPath": {"type": "string", "minLength": 1},
        "readOnly": {"type": "boolean"},
    },
}
CONTAINER = {
    "type": "object",
    "required": ["name", "image", "command", "resources", "volumeMounts"],
    "properties": {
        "name": DNS_LABEL,
        "image": {"type": "string", "minLength": 1},
        "imagePullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]},
        "command": {"type": "array", "minItems": 1, "items": {"type": "string"}},
        "args": {"type": "array", "items": {"type": "string"}},
        "env": {"type": "array", "items": ENV_VAR},
        "resources": {
            "type": "object",
            "required": ["limits"],
            "additionalProperties": False,
            "properties": {
                "limits": {
                    "type": "object",
                    "required": ["nvidia.com/gpu"],
                    "additionalProperties": QUANTITY,
                },
                "requests": {"type": "object", "additionalProperties": QUANTITY},
            },
        },
        "securityContext": {
            "type": "object",
            "properties": {
                "privileged": {"type": "boolean"},
                "capabilities": {
                    "type": "object",
                    "properties": {"add": {"type": "array", "items": {"type": "string"}}},
                },
            },
        },
        "volumeMounts": {"type": "array", "items": VOLUME_MOUNT},
    },
}
VOLUME = {
    "type": "object",
    "required": ["name"],
    "minProperties": 2,
    "maxProperties": 2,  # the name and exactly one source
    "properties": {
        "name": DNS_LABEL,
        "emptyDir": {
            "type": "object",
            "additionalProperties": False,
            "properties": {"medium": {"enum": ["", "Memory"]}, "sizeLimit": QUANTITY},
        },
        "configMap": {
            "type": "object",
            "required": ["name"],
            "properties": {"name": DNS_LABEL, "defaultMode": {"type": "integer"}},
        },
        "persistentVolumeClaim": {
            "type": "object",
            "required": ["claimName"],
            "properties": {"claimName": DNS_LABEL, "readOnly": {"type": "boolean"}},
        },
    },
    "additionalProperties": False,
}
REPLICA_SPEC = {
    "type": "object",
    "required": ["replicas", "restartPolicy", "template"],
    "additionalProperties": False,
    "properties": {
        "replicas": {"type": "integer", "minimum": 1},
        "restartPolicy": {"enum": ["Always", "OnFailure", "Never", "ExitCode"]},
        "template": {
            "type": "object",
            "required": ["spec"],
            "properties": {
                "metadata": {"type": ["object", "null"]},
                "spec": {
                    "type": "object",
                    "required": ["containers", "volumes"],
                    "properties": {
                        "containers": {
                            "type": "array",
                            "minItems": 1,
                            "items": CONTAINER,
                            # The operator wires its env and ports into the container named so.
                            "contains": {"properties": {"name": {"const": "pytorch"}}},
                        },
                        "volumes": {"type": "array", "items": VOLUME},
                        "hostNetwork": {"type": "boolean"},
                        "dnsPolicy": {
                            "enum": ["ClusterFirst", "ClusterFirstWithHostNet", "Default", "None"]
                        },
                        "terminationGracePeriodSeconds": {"type": "integer", "minimum": 0},
                        "schedulerName": {"type": "string"},
                    },
                },
            },
        },
    },
}
PYTORCHJOB_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "kubeflow.org/v1"},
        "kind": {"const": "PyTorchJob"},
        "metadata": METADATA,
        "spec": {
            "type": "object",
            "required": ["pytorchReplicaSpecs"],
            "properties": {
                "runPolicy": {
                    "type": "object",
                    "properties": {
                        "backoffLimit": {"type": "integer", "minimum": 0},
                        "cleanPodPolicy": {"enum": ["All", "Running", "None"]},
                    },
                },
                "elasticPolicy": {"type": "object"},
                "nprocPerNode": {"type": "string"},
                "pytorchReplicaSpecs": {
                    "type": "object",
                    "required": ["Master", "Worker"],
                    "additionalProperties": False,
                    "properties": {
                        "Master": {
                            "allOf": [REPLICA_SPEC, {"properties": {"replicas": {"const": 1}}}]
                        },
                        "Worker": REPLICA_SPEC,
                    },
                },
            },
        },
    },
}
SCHEMAS = {"ConfigMap": CONFIGMAP_SCHEMA, "PyTorchJob": PYTORCHJOB_SCHEMA}


def schema_errors(doc: dict) -> list[str]:
    schema = SCHEMAS.get(doc.get("kind"))
    if schema is None:
        return [f"unexpected kind {doc.get('kind')!r}"]
    validator = Draft202012Validator(schema)
    return [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)
    ]


def consistency_errors(docs: list[dict]) -> list[str]:
    """Cross-references the schemas cannot express."""
    errors = []
    cms = configmaps(docs)
    job = pytorchjob(docs)
    for role, replica in job["spec"]["pytorchReplicaSpecs"].items():
        pod = replica["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        if len(volumes) != len(pod["volumes"]):
            errors.append(f"{role}: duplicate volume names")
        for v in volumes.values():
            if "configMap" in v and v["configMap"]["name"] not in cms:
                errors.append(f"{role}: volume {v['name']} references a ConfigMap not in the file")
        for c in pod["containers"]:
            mounted = {}
            for m in c["volumeMounts"]:
                if m["name"] not in volumes:
                    errors.append(f"{role}: mount {m['name']} has no volume")
                    continue
                mounted[m["mountPath"]] = m
                cm = cms.get(volumes[m["name"]].get("configMap", {}).get("name"))
                if cm and "subPath" in m and m["subPath"] not in cm["data"]:
                    errors.append(f"{role}: subPath {m['subPath']} is no key of the ConfigMap")
            scripts = [a for a in c["command"] if a.endswith(".sh")]
            for s in scripts:
                if s not in mounted:
                    errors.append(f"{role}: command runs {s}, which is not mounted")
    return errors


@pytest.mark.parametrize("schema", SCHEMAS.values(), ids=SCHEMAS.keys())
def test_schemas_are_valid(schema: dict):
    Draft202012Validator.check_schema(schema)


@pytest.mark.parametrize("cmd", MANIFESTS)
def test_manifest_matches_schemas(cmd: str):
    docs = load_manifest(MANIFESTS[cmd])
    assert [d["kind"] for d in docs] == ["ConfigMap", "PyTorchJob"]  # ConfigMap applied first
    for doc in docs:
        assert schema_errors(doc) == []
    assert consistency_errors(docs) == []


def _mutate(path: str, value):
    def apply(docs: list[dict]) -> None:
        node = docs
        *parents, last = path.split(".")
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if value is KeyError:
            del node[last]
        elif isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value

    return apply


POD = "1.spec.pytorchReplicaSpecs.Master.template.spec"
POD_ERR = "spec/pytorchReplicaSpecs/Master/template/spec"
# mutation -> the error it must raise (the check that catches it, by the path it names)
BROKEN = {
    "container-name": (
        _mutate(f"{POD}.containers.0.name", "trainer"),
        f"{POD_ERR}/containers: [{{'name': 'trainer'",
    ),
    "restart-policy": (
        _mutate("1.spec.pytorchReplicaSpecs.Worker.restartPolicy", "Sometimes"),
        "spec/pytorchReplicaSpecs/Worker/restartPolicy: 'Sometimes' is not one of",
    ),
    "replicas-string": (
        _mutate("1.spec.pytorchReplicaSpecs.Worker.replicas", "1"),
        "spec/pytorchReplicaSpecs/Worker/replicas: '1' is not of type 'integer'",
    ),
    "two-masters": (
        _mutate("1.spec.pytorchReplicaSpecs.Master.replicas", 2),
        "spec/pytorchReplicaSpecs/Master/replicas: 1 was expected",
    ),
    "no-worker": (
        _mutate("1.spec.pytorchReplicaSpecs.Worker", KeyError),
        "spec/pytorchReplicaSpecs: 'Worker' is a required property",
    ),
    "env-number": (
        _mutate(f"{POD}.containers.0.env.0.value", 0),
        f"{POD_ERR}/containers/0/env/0/value: 0 is not of type 'string'",
    ),
    "no-gpu-limit": (
        _mutate(f"{POD}.containers.0.resources.limits", {"cpu": 8}),
        f"{POD_ERR}/containers/0/resources/limits: 'nvidia.com/gpu' is a required property",
    ),
    "missing-volume": (
        _mutate(f"{POD}.volumes", []),
        "Master: mount config-volume has no volume",
    ),
    "foreign-configmap": (
        _mutate(f"{POD}.volumes.1.configMap.name", "other-launch"),
        "Master: volume config-volume references a ConfigMap not in the file",
    ),
    "bad-subpath": (
        _mutate(f"{POD}.containers.0.volumeMounts.1.subPath", "run.sh"),
        "Master: subPath run.sh is no key of the ConfigMap",
    ),
    "bad-api": (
        _mutate("1.apiVersion", "kubeflow.org/v2"),
        "apiVersion: 'kubeflow.org/v1' was expected",
    ),
}


@pytest.mark.parametrize("mutation,error", BROKEN.values(), ids=BROKEN.keys())
def test_checks_reject_broken_manifest(mutation, error):
    docs = copy.deepcopy(load_manifest(MANIFESTS["ppo"]))
    assert not [e for d in docs for e in schema_errors(d)] and not consistency_errors(docs)
    mutation(docs)
    errors = [e for d in docs for e in schema_errors(d)] + consistency_errors(docs)
    assert any(e.startswith(error) for e in errors), errors


@pytest.mark.parametrize("cmd", MANIFESTS)
def test_pytorchjob_pod_setup(cmd: str):
    docs = load_manifest(MANIFESTS[cmd])
    cm_name = next(iter(configmaps(docs)))
    job = pytorchjob(docs)
    spec = job["spec"]
    # Fixed size; nprocPerNode left to the operator ("auto"): WORLD_SIZE then counts pods.
    assert "elasticPolicy" not in spec and "nprocPerNode" not in spec
    for replica in spec["pytorchReplicaSpecs"].values():
        assert replica["restartPolicy"] == "OnFailure"
        pod = replica["template"]["spec"]
        assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
        (c,) = pod["containers"]
        assert c["image"] == "fsdp-rlhf:latest"
        assert c["command"] == ["bash", "/workspace/launch.sh"]
        assert c["resources"]["limits"] == {"nvidia.com/gpu": 8, "rdma/hca": 1}
        assert "IPC_LOCK" in c["securityContext"]["capabilities"]["add"]
        assert {e["name"] for e in c["env"]} >= {"NCCL_DEBUG", "NCCL_IB_DISABLE"}
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        assert volumes[mounts["/dev/shm"]["name"]]["emptyDir"] == {"medium": "Memory"}
        launch = mounts["/workspace/launch.sh"]
        assert launch["subPath"] == "launch.sh"
        assert volumes[launch["name"]]["configMap"]["name"] == cm_name
        data = volumes[mounts["/mnt/cluster"]["name"]]
        assert data["persistentVolumeClaim"]["claimName"] == "pvc-data"


@pytest.mark.parametrize("cmd", MANIFESTS)
def test_configmap_launch_script(cmd: str, tmp_path: Path):
    script = launch_script(MANIFESTS[cmd], tmp_path)
    text = script.read_text()
    assert text.startswith("#!/bin/bash\n")
    assert "fsdp_rlhf.cli" in text or "fsdp-rlhf" in text
    for var in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK"):
        assert f"${{{var}" in text, f"launch.sh does not read {var}"
    # As the operator starts the second pod of a 2-node job:
    argv = dry_run(
        script, WORLD_SIZE="2", RANK="1", MASTER_ADDR="job-master-0", MASTER_PORT="23456"
    )
    launcher, sub, flags = split_at_cli(argv)
    assert sub == cmd
    assert launcher[0] == "torchrun"
    assert opt(launcher, "--nnodes") == "2" and opt(launcher, "--node_rank") == "1"
    assert opt(launcher, "--master_addr") == "job-master-0"
    assert opt(launcher, "--master_port") == "23456"
    limits = pytorchjob(load_manifest(MANIFESTS[cmd]))["spec"]["pytorchReplicaSpecs"]["Master"]
    gpus = limits["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
    assert opt(launcher, "--nproc_per_node") == str(gpus)
    if cmd == "ppo":
        expected = aiak_ppo_flags(nnodes=2, gpus=8, tp=1, engines=16) + PPO_PERIODIC
        expected += resume_flags(PPO_PATHS["SAVE_PATH"])
    elif cmd in OFFLINE_FLAGS:
        make, paths = OFFLINE_FLAGS[cmd]
        expected = make() + resume_flags(paths["SAVE_PATH"])
    else:
        expected = aiak_rm_flags() + resume_flags(RM_PATHS["SAVE_PATH"])
    assert flags == expected


@needs_pkill
def test_configmap_launch_script_checkpoints_on_sigterm(fakes, tmp_path: Path):
    """Pod deletion: SIGTERM reaches the ranks through PID 1, which then exits non-zero."""
    bin_dir, out = fakes
    script = launch_script(MANIFESTS["ppo"], tmp_path)
    proc = start(["bash", str(script)], stub_env(bin_dir, out, WORLD_SIZE="1", RANK="0"))
    wait_for(out / "rank_ready", proc)
    proc.send_signal(signal.SIGTERM)
    rc, err = finish(proc, out)
    assert (out / "rank_got_SIGTERM").exists(), err
    assert (out / "torchrun_exit").read_text() == "0"
    assert rc == 143, err


# ---------------------------------------------------------------- Slurm


def sbatch_directives(path: Path) -> list[str]:
    """#SBATCH lines sbatch honours: those before the first command."""
    lines = []
    for line in path.read_text().splitlines()[1:]:
        if line.startswith("#SBATCH"):
            lines.append(line.split("#SBATCH", 1)[1].strip())
        elif line.strip() and not line.startswith("#"):
            break
    return lines


SIGNAL_LEAD_S = {"train-rm": 300, "ppo": 600, "sft": 300, "dpo": 300}


@pytest.mark.parametrize("cmd", SBATCH)
def test_sbatch_directives(cmd: str):
    directives = sbatch_directives(SBATCH[cmd])
    # B: sends the signal to the batch shell, whose trap forwards it to srun and then requeues.
    # The lead time covers finishing a step and writing a checkpoint (a PPO step is longer).
    assert f"--signal=B:USR1@{SIGNAL_LEAD_S[cmd]}" in directives
    assert "--requeue" in directives
    assert "--ntasks-per-node=1" in directives
    assert "--output=logs/%x-%j.out" in directives and "--error=logs/%x-%j.err" in directives
    keys = {d.split("=", 1)[0] for d in directives}
    assert {"--nodes", "--gpus-per-node", "--cpus-per-task", "--job-name"} <= keys


@pytest.mark.parametrize("cmd", SBATCH)
def test_sbatch_renders_torchrun_for_two_nodes(cmd: str, fakes):
    bin_dir, out = fakes
    res = run_script(SBATCH[cmd], slurm_env(bin_dir, out, DRY_RUN="1"), "--seed", "7")
    assert res.returncode == 0, res.stderr
    argv = shlex.split(res.stdout)
    assert argv[0] == "srun"
    assert "--ntasks-per-node=1" in argv[: argv.index("bash")]
    launcher, sub, flags = split_at_cli(argv[argv.index("torchrun") :])
    assert sub == cmd
    assert "-m fsdp_rlhf.cli " + cmd in res.stdout
    assert "--nnodes 2 " in res.stdout and "--rdzv_backend c10d " in res.stdout
    assert opt(launcher, "--nnodes") == "2"
    assert opt(launcher, "--nproc_per_node") == "8"
    assert opt(launcher, "--rdzv_backend") == "c10d"
    assert opt(launcher, "--rdzv_endpoint") == "node-a:20123"  # head node, port from the job id
    assert opt(launcher, "--rdzv_id") == "123"
    paths = {"ppo": PPO_PATHS, **{c: p for c, (_, p) in OFFLINE_FLAGS.items()}}
    save = paths.get(cmd, RM_PATHS)["SAVE_PATH"]
    assert flags[-2:] == ["--seed", "7"]  # extra sbatch arguments come last
    if cmd == "ppo":
        expected = aiak_ppo_flags(nnodes=2, gpus=8, tp=1, engines=16) + PPO_PERIODIC
    elif cmd in OFFLINE_FLAGS:
        expected = OFFLINE_FLAGS[cmd][0]()
    else:
        expected = aiak_rm_flags()
    assert flags[:-2] == expected + resume_flags(save)


def test_sbatch_env_overrides(fakes):
    bin_dir, out = fakes
    env = slurm_env(
        bin_dir,
        out,
        DRY_RUN="1",
        MASTER_PORT="31000",
        SAVE_PATH="/shared/run1",
        SLURM_GPUS_ON_NODE="4",
        VLLM_TENSOR_PARALLEL_SIZE="2",
    )
    res = run_script(SBATCH["ppo"], env)
    assert res.returncode == 0, res.stderr
    argv = shlex.split(res.stdout)
    launcher, _, flags = split_at_cli(argv[argv.index("torchrun") :])
    assert opt(launcher, "--rdzv_endpoint") == "node-a:31000"
    assert opt(launcher, "--nproc_per_node") == "4"
    assert opt(flags, "--vllm_num_engines") == "4"  # 4 GPUs x 2 nodes / TP 2
    assert opt(flags, "--save_path") == "/shared/run1"
    assert opt(flags, "--ckpt_path") == "/shared/run1/checkpoints"


@needs_setsid
def test_sbatch_usr1_checkpoints_then_requeues(fakes):
    """USR1 -> batch trap -> srun -> step (torchrun ignores it, ranks checkpoint) -> requeue."""
    bin_dir, out = fakes
    proc = start(["bash", str(SBATCH["ppo"])], slurm_env(bin_dir, out))
    wait_for(out / "rank_ready", proc)
    proc.send_signal(signal.SIGUSR1)
    rc, err = finish(proc, out)
    assert (out / "rank_got_SIGUSR1").exists(), err
    # torchrun ignored USR1 and saw its rank exit cleanly.
    assert (out / "torchrun_exit").read_text() == "0", err
    assert rc == 0, err
    log = (out / "scontrol.log").read_text().splitlines()
    assert len(log) == 1 and log[0].startswith("requeue 123 |")
    assert "rank_got_SIGUSR1" in log[0] and "torchrun_exit" in log[0]  # after the checkpoint
    assert (out / "srun.args").read_text().startswith("--nodes=2 --ntasks=2 --ntasks-per-node=1")


@needs_setsid
def test_sbatch_finished_run_is_not_requeued(fakes):
    bin_dir, out = fakes
    proc = start(["bash", str(SBATCH["train-rm"])], slurm_env(bin_dir, out, FAKE_RANK_SECONDS="0"))
    rc, err = finish(proc, out)
    assert rc == 0, err
    assert (out / "torchrun_exit").read_text() == "0"
    assert not (out / "scontrol.log").exists()


# ---------------------------------------------------------------- examples/*.sh


def test_cmd_train_rm_flags_match_aiak_script():
    launcher, sub, flags = split_at_cli(dry_run(CMD_SCRIPTS["train-rm"]))
    assert sub == "train-rm"
    assert launcher == shlex.split(
        "torchrun --nproc_per_node 8 --nnodes 1 --node_rank 0"
        " --master_addr 127.0.0.1 --master_port 29500"
    )
    assert flags == aiak_rm_flags() + ckpt_flags(RM_PATHS["SAVE_PATH"])


@pytest.mark.parametrize("cmd", sorted(OFFLINE_FLAGS))
def test_cmd_sft_dpo_flags_match_openrlhf_examples(cmd: str):
    launcher, sub, flags = split_at_cli(dry_run(CMD_SCRIPTS[cmd]))
    assert sub == cmd
    assert launcher == shlex.split(
        "torchrun --nproc_per_node 8 --nnodes 1 --node_rank 0"
        " --master_addr 127.0.0.1 --master_port 29500"
    )
    make, paths = OFFLINE_FLAGS[cmd]
    assert flags == make() + ckpt_flags(paths["SAVE_PATH"])


def test_cmd_ppo_flags_match_aiak_script():
    argv = dry_run(CMD_SCRIPTS["ppo"])
    text = " ".join(argv)
    for snippet in (
        "--micro_rollout_batch_size 16",
        "--rollout_batch_size 1024",
        "--vllm_num_engines 8",
        "--colocate_all",
        "--num_nodes 1 --num_gpus_per_node 8",
    ):
        assert snippet in text
    launcher, sub, flags = split_at_cli(argv)
    assert sub == "ppo"
    assert launcher == shlex.split(
        "torchrun --nproc_per_node 8 --nnodes 1 --node_rank 0"
        " --master_addr 127.0.0.1 --master_port 29500"
    )
    expected = aiak_ppo_flags(nnodes=1, gpus=8, tp=1, engines=8) + PPO_PERIODIC
    assert flags == expected + ckpt_flags(PPO_PATHS["SAVE_PATH"])


def test_cmd_ppo_multinode_env():
    argv = dry_run(
        CMD_SCRIPTS["ppo"],
        "--max_samples",
        "10",
        WORLD_SIZE="2",
        RANK="1",
        MASTER_ADDR="10.0.0.1",
        MASTER_PORT="23456",
        GPUS_PER_NODE="4",
        VLLM_TENSOR_PARALLEL_SIZE="2",
        SAVE_PATH="/x/out",
        AIHC_TENSORBOARD_LOG_PATH="/x/tb",
    )
    launcher, _, flags = split_at_cli(argv)
    assert launcher == shlex.split(
        "torchrun --nproc_per_node 4 --nnodes 2 --node_rank 1"
        " --master_addr 10.0.0.1 --master_port 23456"
    )
    paths = {**PPO_PATHS, "SAVE_PATH": "/x/out", "TENSORBOARD_PATH": "/x/tb"}
    expected = aiak_ppo_flags(nnodes=2, gpus=4, tp=2, engines=4, p=paths) + PPO_PERIODIC
    assert flags == expected + ckpt_flags("/x/out") + ["--max_samples", "10"]


def test_cmd_ppo_rejects_indivisible_tp():
    res = run_script(CMD_SCRIPTS["ppo"], clean_env(DRY_RUN="1", VLLM_TENSOR_PARALLEL_SIZE="3"))
    assert res.returncode == 2
    assert "VLLM_TENSOR_PARALLEL_SIZE" in res.stderr


@pytest.mark.parametrize("cmd", CMD_SCRIPTS)
def test_cmd_runs_torchrun_with_nccl_env(cmd: str, fakes):
    """Without DRY_RUN the script execs torchrun, with the NCCL knobs overridable."""
    bin_dir, out = fakes
    env = stub_env(bin_dir, out, FAKE_TORCHRUN="dump", NCCL_IB_HCA="mlx5_0,mlx5_1")
    res = run_script(CMD_SCRIPTS[cmd], env, "--seed", "1")
    assert res.returncode == 0, res.stderr
    dump = json.loads((out / "torchrun.json").read_text())
    assert dump["env"] == {
        "NCCL_SOCKET_IFNAME": "eth0",
        "GLOO_SOCKET_IFNAME": "eth0",  # gloo crosses nodes too (vLLM CPU groups, prompts)
        "NCCL_IB_HCA": "mlx5_0,mlx5_1",
        "NCCL_IB_GID_INDEX": "3",
        "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "300",
    }
    _, sub, flags = split_at_cli(["torchrun", *dump["argv"]])
    assert sub == cmd and flags[-2:] == ["--seed", "1"]


# ---------------------------------------------------------------- flags vs. the real CLI


def rendered_commands(tmp_path: Path, fakes) -> list[tuple[str, list[str]]]:
    bin_dir, out = fakes
    argvs = [dry_run(CMD_SCRIPTS[c]) for c in CMD_SCRIPTS]
    for c in MANIFESTS:
        argvs.append(dry_run(launch_script(MANIFESTS[c], tmp_path)))
    for c in SBATCH:
        res = run_script(SBATCH[c], slurm_env(bin_dir, out, DRY_RUN="1"))
        assert res.returncode == 0, res.stderr
        argvs.append(shlex.split(res.stdout))
    return [split_at_cli(a)[1:] for a in argvs]


def test_rendered_flags_parse_with_the_cli(tmp_path: Path, fakes):
    """Every launcher's flags are accepted by fsdp-rlhf's own config parser."""
    from fsdp_rlhf.commands import BY_NAME
    from fsdp_rlhf.config_base import build_config

    rendered = rendered_commands(tmp_path, fakes)
    subs = sorted(sub for sub, _ in rendered)
    assert subs == ["dpo"] * 3 + ["ppo"] * 3 + ["sft"] * 3 + ["train-rm"] * 3
    for sub, flags in rendered:
        cfg, _ = build_config(BY_NAME[sub].config_class(), flags)
        assert cfg.ckpt.load_checkpoint == ("--load_checkpoint" in flags)


# ---------------------------------------------------------------- failure handling (issue #19)


def _all_rendered(tmp_path: Path, fakes, **env: str) -> dict[str, list[str]]:
    bin_dir, out = fakes
    argvs = {f"examples/{c}": dry_run(CMD_SCRIPTS[c], **env) for c in CMD_SCRIPTS}
    for c in MANIFESTS:
        argvs[f"k8s/{c}"] = dry_run(launch_script(MANIFESTS[c], tmp_path), **env)
    for c in SBATCH:
        res = run_script(SBATCH[c], slurm_env(bin_dir, out, DRY_RUN="1", **env))
        assert res.returncode == 0, res.stderr
        argvs[f"slurm/{c}"] = shlex.split(res.stdout)
    return {name: split_at_cli(a)[2] for name, a in argvs.items()}


def test_every_launcher_saves_periodically(tmp_path: Path, fakes):
    for name, flags in _all_rendered(tmp_path, fakes).items():
        assert opt(flags, "--save_steps") == "20", name
        assert opt(flags, "--ckpt_path").endswith("/checkpoints"), name
    for name, flags in _all_rendered(tmp_path, fakes, SAVE_STEPS="5").items():
        assert opt(flags, "--save_steps") == "5", name


def test_no_launcher_pins_vllm_sleep_level_1(tmp_path: Path, fakes):
    """Level 1 keeps a CPU copy of the weights per engine; the launchers leave the default."""
    for name, flags in _all_rendered(tmp_path, fakes).items():
        assert "--vllm_sleep_level" not in flags, name


def _script_default(text: str, var: str) -> int:
    import re

    m = re.search(rf"{var}=\${{{var}:-(\d+)}}", text)
    assert m, f"{var} has no default"
    return int(m.group(1))


@pytest.mark.parametrize("cmd", MANIFESTS)
def test_k8s_grace_period_covers_torchrun_shutdown(cmd: str):
    docs = load_manifest(MANIFESTS[cmd])
    (cm,) = configmaps(docs).values()
    shutdown = _script_default(cm["data"]["launch.sh"], "TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
    assert "GLOO_SOCKET_IFNAME" in cm["data"]["launch.sh"]
    for replica in pytorchjob(docs)["spec"]["pytorchReplicaSpecs"].values():
        grace = replica["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace > shutdown >= 300, (grace, shutdown)


@pytest.mark.parametrize("cmd", SBATCH)
def test_sbatch_signal_lead_covers_torchrun_shutdown(cmd: str):
    text = SBATCH[cmd].read_text()
    shutdown = _script_default(text, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
    assert shutdown == SIGNAL_LEAD_S[cmd]
    assert "GLOO_SOCKET_IFNAME" in text
