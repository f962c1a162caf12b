"""The memory floor of examples/flower_quickstart/'s client code in one
process, whatever the framework around it: imports the client module
(torch), builds client "0", runs one fit and one evaluate_fn, and prints
the process's PSS peak (sampled every 5 ms from /proc/self/smaps_rollup)
at each step and overall, in MiB. docs/BENCHMARKS.md compares it with
0.3x Flower's tree.

    COHORT_DATA_DIR=../shared/data python bench/quickstart_floor.py
"""

import os
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples",
                                "flower_quickstart"))


def pss_mib():
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no Pss line in /proc/self/smaps_rollup")


peak = [0.0]


def sample():
    while True:
        peak[0] = max(peak[0], pss_mib())
        time.sleep(0.005)


threading.Thread(target=sample, daemon=True).start()


def step(name):
    # One more sample after the step, so its end is in the peak.
    time.sleep(0.02)
    print(f"{name:32} now {pss_mib():7.0f}  peak so far {peak[0]:7.0f}", flush=True)


import client  # noqa: E402 - after the sampler, so the import is measured

step("import the client module")
c = client.client_fn("0")
step('client_fn("0")')
parameters = c.get_parameters({})
c.fit(parameters, {"seed": 1})
step("one fit")
client.evaluate_fn(1, parameters, {})
step("one evaluate_fn")
