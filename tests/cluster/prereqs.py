"""First step of ``make test-cluster``: can this machine host the test cluster?

Exit 0: ready (Slurm and munge installed with apt-get first when they are missing); exit
:data:`SKIP` with one line saying why when it cannot (not Linux, not root, no ``ip netns``,
no apt-get to install Slurm with); any other code: it should have worked and did not.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

SKIP = 10
TOOLS = ("ip", "unshare", "nsenter", "runuser", "getent")
SLURM = ("slurmctld", "slurmd", "sbatch", "munged")
# The daemons and clients; their dependencies bring the plugins (select/cons_tres, ...).
PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")


def _which(tool: str) -> bool:
    return shutil.which(tool) is not None or os.path.exists(f"/usr/sbin/{tool}")


def skip(why: str) -> None:
    print(f"test-cluster: SKIPPED: {why}", flush=True)
    sys.exit(SKIP)


def _apt(*args: str) -> bool:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    proc = subprocess.run(["apt-get", *args], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stderr.strip()[-1500:], file=sys.stderr)
    return proc.returncode == 0


def install_slurm() -> None:
    install = ("install", "-y", "-q", "--no-install-recommends", *PACKAGES)
    print(f"test-cluster: installing {' '.join(PACKAGES)} (apt-get)", flush=True)
    if not _apt(*install) and not (_apt("update", "-q") and _apt(*install)):
        print("test-cluster: apt-get could not install Slurm and munge", file=sys.stderr)
        sys.exit(1)


def main() -> None:
    if not sys.platform.startswith("linux"):
        skip(f"needs Linux network namespaces (this is {sys.platform})")
    if os.geteuid() != 0:
        skip("needs root (network namespaces, Slurm and munge daemons); run it as root")
    missing = [t for t in TOOLS if not _which(t)]
    if missing:
        skip(f"missing {', '.join(missing)} (iproute2, util-linux)")
    probe = "frlc-probe"
    add = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    if add.returncode != 0:
        skip(f"no ip netns here ({add.stderr.strip()})")
    if not all(_which(t) for t in SLURM):
        if shutil.which("apt-get") is None:
            skip("Slurm/munge not installed and no apt-get to install them with")
        install_slurm()
        if not all(_which(t) for t in SLURM):
            print("test-cluster: Slurm installed but its commands are missing", file=sys.stderr)
            sys.exit(1)
    if subprocess.run(["getent", "passwd", "munge"], capture_output=True).returncode != 0:
        print("test-cluster: no 'munge' user (the munge package creates it)", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
