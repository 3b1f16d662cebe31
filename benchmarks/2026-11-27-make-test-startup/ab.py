"""Interleaved repeats of shell commands: median wall seconds and median CPU seconds (user+sys of
the command and its children) of each, and the 1-minute load average seen at each start."""

import json
import os
import resource
import statistics
import subprocess
import sys
import time

cmds = json.loads(sys.argv[1])
n = int(sys.argv[2])
wall = {k: [] for k in cmds}
cpu = {k: [] for k in cmds}
loads = []
for _i in range(n):
    for k, c in cmds.items():
        loads.append(os.getloadavg()[0])
        r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        t = time.perf_counter()
        subprocess.run(c, shell=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        t1 = time.perf_counter()
        r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        wall[k].append(t1 - t)
        cpu[k].append(r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime)
out = {
    k: {
        "wall_median_s": round(statistics.median(wall[k]), 2),
        "wall_min_s": round(min(wall[k]), 2),
        "wall_max_s": round(max(wall[k]), 2),
        "cpu_median_s": round(statistics.median(cpu[k]), 2),
        "n": n,
    }
    for k in cmds
}
out["_load1_median"] = round(statistics.median(loads), 2)
print(json.dumps(out, indent=1))
