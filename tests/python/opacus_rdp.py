#!/usr/bin/env python3
"""Opacus's RDP accountant on a fixed set of settings, as JSON on stdout.

The reference for `crates/cohort-core/tests/privacy_opacus.rs`, which compares
cohort's accountant (`cohort_core::strategy::privacy`) with these numbers.

Opacus's package `__init__` imports PyTorch, so the package is never imported:
this script loads the one file it needs, `opacus/accountants/analysis/rdp.py`
(numpy and scipy only), straight from the installed distribution, and reads
Opacus's default orders (`RDPAccountant.DEFAULT_ALPHAS`) from the source of
`opacus/accountants/rdp.py` without executing that module. Needs:

    python3 -m pip install numpy scipy
    python3 -m pip install --no-deps opacus

Usage: opacus_rdp.py [--check]   (--check: only verify the requirements)
Exit status 2 names the missing requirement on stderr.
"""

import ast
import importlib.metadata
import importlib.util
import json
import math
import sys
import warnings

# (q, noise multiplier, steps); delta is DELTA everywhere. The grid covers the
# integer-order and fractional-order series of the sampled Gaussian mechanism,
# both regimes of its fractional series (z0 below and above the first terms),
# the plain Gaussian (q = 1) and Opacus's special cases (q = 0, sigma = 0).
SETTINGS = [
    (0.01, 0.5, 30),
    (0.01, 1.0, 1000),
    (0.01, 1.5, 1),
    (0.01, 4.0, 1000),
    (0.1, 0.5, 1),
    (0.1, 1.0, 30),
    (0.1, 1.5, 1000),
    (0.1, 4.0, 30),
    (0.5, 0.5, 1000),
    (0.5, 1.0, 1),
    (0.5, 1.5, 30),
    (0.5, 4.0, 1000),
    (1.0, 0.5, 30),
    (1.0, 1.0, 1000),
    (1.0, 4.0, 1),
    (0.0, 1.0, 30),
    (0.1, 0.0, 30),
]
DELTA = 1e-5


def fail(message):
    print(message, file=sys.stderr)
    sys.exit(2)


def opacus_file(relative):
    try:
        dist = importlib.metadata.distribution("opacus")
    except importlib.metadata.PackageNotFoundError:
        fail("opacus is not installed (python3 -m pip install --no-deps opacus)")
    path = dist.locate_file(relative)
    if not path.is_file():
        fail(f"the opacus {dist.version} distribution has no {relative}")
    return dist.version, str(path)


def load_rdp_module():
    for module in ("numpy", "scipy"):
        if importlib.util.find_spec(module) is None:
            fail(f"{module} is not installed (python3 -m pip install numpy scipy)")
    version, path = opacus_file("opacus/accountants/analysis/rdp.py")
    spec = importlib.util.spec_from_file_location("opacus_rdp_analysis", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return version, module


def default_alphas():
    """`RDPAccountant.DEFAULT_ALPHAS`, evaluated from its source expression:
    importing `opacus/accountants/rdp.py` would import the package (torch)."""
    _, path = opacus_file("opacus/accountants/rdp.py")
    with open(path, encoding="utf-8") as source:
        tree = ast.parse(source.read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "DEFAULT_ALPHAS" for t in node.targets
        ):
            expression = compile(ast.Expression(node.value), path, "eval")
            return [float(a) for a in eval(expression, {"__builtins__": {"range": range, "list": list}})]
    fail(f"no DEFAULT_ALPHAS assignment in {path}")


def number(x):
    """JSON has no infinity or NaN: those travel as strings ("inf", "nan")."""
    x = float(x)
    return x if math.isfinite(x) else str(x)


def main():
    version, rdp = load_rdp_module()
    orders = default_alphas()
    if sys.argv[1:] == ["--check"]:
        return
    cases = []
    for q, sigma, steps in SETTINGS:
        per_order = rdp.compute_rdp(q=q, noise_multiplier=sigma, steps=steps, orders=orders)
        with warnings.catch_warnings():
            # Opacus warns when the best order is at an end of the list.
            warnings.simplefilter("ignore")
            epsilon, order = rdp.get_privacy_spent(orders=orders, rdp=per_order, delta=DELTA)
        cases.append(
            {
                "q": q,
                "noise_multiplier": sigma,
                "steps": steps,
                "delta": DELTA,
                "epsilon": number(epsilon),
                "order": number(order),
                "rdp": [number(r) for r in per_order],
            }
        )
    json.dump({"opacus": version, "orders": orders, "cases": cases}, sys.stdout)
    print()


if __name__ == "__main__":
    main()
