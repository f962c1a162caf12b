#!/usr/bin/env python3
"""Flower's own SecAgg+ for one round, in one process, timed like cohort's bench.

    python flower_secagg.py --row CLIENTS VALUES GRAPH DROPOUT REPEATS

prints one JSON object for the row (bench/secagg.sh merges it with cohort's
row of the same settings). GRAPH is `all:T` (the complete graph, what
Flower's SecAggWorkflow runs) or `K:T` (SecAgg+ with K shares, i.e. K - 1
ring neighbours plus the client itself, and threshold T), as in cohort's
`--row`. Needs flwr (tested with 1.42.0) and numpy; cohort never imports it.

How Flower is driven: the real `SecAggPlusWorkflow` stage methods run on the
server side against an in-memory `Grid`, and every message the workflow
sends is delivered to the real `secaggplus_mod` of that client, with the
client's own `Context` kept between stages. Messages cross the "wire" the
way Flower's transport carries them: each is deflated into its content
addressed objects (which are counted as the bytes) and inflated again on
the other side. Nothing of Flower's computation is replaced; the harness
only adds a stub strategy (it hands out the clients and takes the result)
and a stub `fit` that returns the client's update.

What is timed, to match cohort's bench (crates/cohort-core/benches/secagg.rs,
sim.rs): "client ms" is the clients' compute summed and divided by the
number of clients; "server ms" is the server's compute for the round; the
transport (deflate/inflate, cohort's encoding/decoding) is in neither.
  * client: the four stage functions of `secaggplus_mod` (`_setup`,
    `_share_keys`, `_collect_masked_vectors`, `_unmask`); the mod's own
    bookkeeping around them (its state to and from a ConfigRecord, turning
    the fit result into arrays) is reported separately as `client_mod_ms`.
    The stub `fit` is not timed.
  * server: each workflow stage method, minus the time spent inside
    `Grid.send_and_receive` (the clients and the transport).
Best of REPEATS rounds (by client + server time), as cohort's bench; a row
stops repeating once its rounds have taken FLOWER_REPEAT_BUDGET seconds
(default 60), since a Flower round at 100 clients can take a minute.

Correctness: the sum the workflow unmasks (before dequantisation) must equal
the plain sum, modulo `modulus_range`, of the quantised vectors the
contributing clients computed (captured from inside the mod), and the
dequantised result must be the weighted mean of the float inputs within
the quantisation error. A row that fails either check is reported as such.
"""

import argparse
import json
import logging
import os
import random
import subprocess
import sys
import time
from typing import Any

import numpy as np

import importlib

import flwr

# The packages re-export the mod function and the workflow class under the
# modules' own names, so the modules are fetched by name.
mod_module = importlib.import_module("flwr.client.mod.secure_aggregation.secaggplus_mod")
wf_module = importlib.import_module("flwr.server.workflow.secure_aggregation.secaggplus_workflow")
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.common import (
    Code,
    FitIns,
    FitRes,
    Parameters,
    Status,
    ndarrays_to_parameters,
)
from flwr.common.secure_aggregation.secaggplus_constants import (
    RECORD_KEY_CONFIGS,
    Key,
    Stage,
)
from flwr.compat.common import recorddict_compat as compat
from flwr.server.client_proxy import ClientProxy
from flwr.server.compat.legacy_context import LegacyContext
from flwr.server.strategy import Strategy
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
from flwr.server.workflow.constant import Key as WorkflowKey
from flwr.serverapp.grid import Grid
from flwr.supercore.task_identity import TaskIdentity
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects
from flwr.supercore.inflatable.inflatable_utils import inflate_object_from_contents

# Flower's INFO lines (one per stage) are noise in a table.
logging.getLogger("flwr").setLevel(logging.WARNING)

# Cohort's defaults (crates/cohort-core/src/secagg/params.rs), which are
# Flower's defaults too; passed explicitly so that a change on either side
# shows up here.
MAX_WEIGHT = 1000.0
CLIPPING_RANGE = 8.0
QUANTIZATION_RANGE = 1 << 22
MODULUS_RANGE = 1 << 32


def update(length: int, seed: int) -> np.ndarray:
    """The same pseudo-random update in [-1, 1] as cohort's bench."""
    i = np.arange(length, dtype=np.uint64)
    mixed = i * np.uint64(2_654_435_761) ^ np.uint64((seed * 0x9E37_79B9) % (1 << 64))
    bits = (mixed & np.uint64(0xFFFF_FFFF)).astype(np.float32)
    return bits / np.float32(4_294_967_295.0) * np.float32(2.0) - np.float32(1.0)


def weight(seed: int) -> int:
    """The client's weight (number of examples), as in cohort's bench."""
    return 10 + seed % 900


def dropouts(ids: list[int], percent: int) -> dict[int, str]:
    """Cohort's drop pattern: every step-th client, alternating between
    dropping after sharing keys and after sending the masked input. The
    value is the first stage the client no longer answers."""
    count = len(ids) * percent // 100
    step = len(ids) // max(count, 1)
    return {
        ids[i * step]: (Stage.COLLECT_MASKED_VECTORS if i % 2 == 0 else Stage.UNMASK)
        for i in range(count)
    }


class Clock:
    """Where the time goes: per-client stage functions, the whole mod call,
    and the server. `current` is the client whose mod is running."""

    def __init__(self) -> None:
        self.current: int | None = None
        self.core: dict[int, float] = {}
        self.mod: dict[int, float] = {}
        self.core_cpu = 0.0  # the same, process CPU time, all clients
        self.excluded = 0.0  # harness work inside a timed region
        self.excluded_cpu = 0.0


CLOCK = Clock()
# Σ of the quantised vectors (weight entry first) the clients masked.
EXPECTED: dict[str, Any] = {"sum": None}
CAPTURED: dict[str, Any] = {}


def _timed_stage(function):
    """Wraps a stage function of the mod so its time is charged to the
    client running it, minus harness work done inside it."""

    def wrapper(*args, **kwargs):
        excluded_before, excluded_cpu_before = CLOCK.excluded, CLOCK.excluded_cpu
        started, started_cpu = time.perf_counter(), time.process_time()
        out = function(*args, **kwargs)
        elapsed = time.perf_counter() - started - (CLOCK.excluded - excluded_before)
        CLOCK.core[CLOCK.current] = CLOCK.core.get(CLOCK.current, 0.0) + elapsed
        CLOCK.core_cpu += (time.process_time() - started_cpu
                           - (CLOCK.excluded_cpu - excluded_cpu_before))
        return out

    return wrapper


def _capturing_factor_combine(original):
    """`factor_combine` is where the client's quantised vector (with its
    quantised weight in front) is complete and not yet masked: add it to the
    expected sum, off the clock."""

    def wrapper(factor, parameters):
        out = original(factor, parameters)
        started, started_cpu = time.perf_counter(), time.process_time()
        flat = np.concatenate([np.asarray(a, dtype=np.int64).ravel() for a in out])
        EXPECTED["sum"] = flat if EXPECTED["sum"] is None else EXPECTED["sum"] + flat
        CLOCK.excluded += time.perf_counter() - started
        CLOCK.excluded_cpu += time.process_time() - started_cpu
        return out

    return wrapper


def _capturing_factor_extract(original):
    """`factor_extract` receives the unmasked sum (mod M): keep it."""

    def wrapper(parameters):
        CAPTURED["unmasked"] = [np.asarray(a).copy() for a in parameters]
        return original(parameters)

    return wrapper


for _name in ("_setup", "_share_keys", "_collect_masked_vectors", "_unmask"):
    setattr(mod_module, _name, _timed_stage(getattr(mod_module, _name)))
mod_module.factor_combine = _capturing_factor_combine(mod_module.factor_combine)
wf_module.factor_extract = _capturing_factor_extract(wf_module.factor_extract)


def transport(message: Message, counter: list[int]) -> Message:
    """Carries a message as Flower's transport does: its object tree is
    deflated to bytes (counted) and inflated on the other side."""
    contents = {oid: obj.deflate() for oid, obj in get_all_nested_objects(message).items()}
    counter[0] += sum(len(c) for c in contents.values())
    return inflate_object_from_contents(message.object_id, contents)


class Proxy(ClientProxy):
    """Only its node id is used by the workflow."""

    def __init__(self, node_id: int) -> None:
        super().__init__(str(node_id))
        self.node_id = node_id

    def get_properties(self, ins, timeout, group_id):  # pragma: no cover
        raise NotImplementedError

    def get_parameters(self, ins, timeout, group_id):  # pragma: no cover
        raise NotImplementedError

    def fit(self, ins, timeout, group_id):  # pragma: no cover
        raise NotImplementedError

    def evaluate(self, ins, timeout, group_id):  # pragma: no cover
        raise NotImplementedError

    def reconnect(self, ins, timeout, group_id):  # pragma: no cover
        raise NotImplementedError


class SampleAll(Strategy):
    """Samples every client with no global model (the model download is not
    part of secure aggregation) and keeps the aggregate it is given."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids
        self.aggregate: list[np.ndarray] | None = None

    def initialize_parameters(self, client_manager):
        return None

    def configure_fit(self, server_round, parameters, client_manager):
        empty = Parameters(tensors=[], tensor_type="numpy.ndarray")
        return [(Proxy(nid), FitIns(empty, {})) for nid in self.ids]

    def aggregate_fit(self, server_round, results, failures):
        # Every result carries the unmasked aggregate; FedAvg would average
        # n copies of it, which is no part of secure aggregation.
        parameters = results[0][1].parameters
        self.aggregate = flwr.common.parameters_to_ndarrays(parameters)
        return parameters, {}

    def configure_evaluate(self, server_round, parameters, client_manager):
        return []

    def aggregate_evaluate(self, server_round, results, failures):
        return None, {}

    def evaluate(self, server_round, parameters):
        return None


class InMemoryGrid(Grid):
    """Delivers each message to its client's `secaggplus_mod` at once."""

    def __init__(self, values: int, gone: dict[int, str]) -> None:
        self.values = values
        self.gone = gone
        self.contexts: dict[int, Context] = {}
        self.inside = 0.0  # seconds spent in send_and_receive
        self.inside_cpu = 0.0
        self.up = [0]
        self.down = [0]
        self.delivered = 0
        self.clients = 0
        self.server_so_far = lambda: (0.0, 0.0)

    # The abstract parts of Grid the workflow does not use.
    def set_run(self, run):
        pass

    @property
    def run(self):
        raise NotImplementedError

    def create_message(self, *args, **kwargs):
        raise NotImplementedError

    def get_node_ids(self):
        return list(self.contexts)

    def push_messages(self, messages):
        raise NotImplementedError

    def pull_messages(self, message_ids):
        raise NotImplementedError

    def _fit(self, node_id: int):
        """The client's `fit`: returns its update (not timed)."""

        def call_next(msg: Message, ctxt: Context) -> Message:
            started, started_cpu = time.perf_counter(), time.process_time()
            seed = node_id - 1
            parameters = ndarrays_to_parameters([update(self.values, seed)])
            res = FitRes(Status(Code.OK, ""), parameters, weight(seed), {})
            reply = Message(compat.fitres_to_recorddict(res, keep_input=False), reply_to=msg)
            CLOCK.excluded += time.perf_counter() - started
            CLOCK.excluded_cpu += time.process_time() - started_cpu
            return reply

        return call_next

    def send_and_receive(self, messages, *, timeout=None):
        entered, entered_cpu = time.perf_counter(), time.process_time()
        replies = []
        for message in messages:
            nid = message.metadata.dst_node_id
            stage = message.content.config_records[RECORD_KEY_CONFIGS][Key.STAGE]
            # A client that is gone receives nothing and answers nothing; the
            # workflow sees a missing reply, as after a timeout.
            if nid in self.gone and Stage.all().index(stage) >= Stage.all().index(self.gone[nid]):
                continue
            inbound = transport(message, self.down)
            ctxt = self.contexts.setdefault(
                nid, Context(run_id=1, node_id=nid, node_config={}, state=RecordDict(), run_config={})
            )
            CLOCK.current = nid
            excluded_before = CLOCK.excluded
            started = time.perf_counter()
            reply = mod_module.secaggplus_mod(inbound, ctxt, self._fit(nid))
            elapsed = time.perf_counter() - started - (CLOCK.excluded - excluded_before)
            CLOCK.mod[nid] = CLOCK.mod.get(nid, 0.0) + elapsed
            CLOCK.current = None
            replies.append(transport(reply, self.up))
            self.delivered += 1
            if self.delivered % 100 == 0:
                progress(stage, self.clients, self.server_so_far())
        self.inside += time.perf_counter() - entered
        self.inside_cpu += time.process_time() - entered_cpu
        return replies


def progress(where: str, clients: int, server: tuple[float, float]) -> None:
    """A line of what a round has cost so far, so that a row cut off by its
    time limit still says at least how long its clients and server took."""
    print(json.dumps({
        "progress": str(where),
        "client_ms": sum(CLOCK.core.values()) / clients * 1e3,
        "client_cpu_ms": CLOCK.core_cpu / clients * 1e3,
        "server_ms": server[0] * 1e3,
        "server_cpu_ms": server[1] * 1e3,
    }), flush=True)


def one_round(clients: int, values: int, num_shares: int, threshold: int, percent: int, seed: int):
    """One round; returns a dict of the row's figures."""
    # The server's identity, which Flower's runtime sets for a ServerApp.
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    random.seed(seed)  # the workflow shuffles the clients for its ring graph
    np.random.seed(seed)  # the clients' stochastic rounding
    CLOCK.__init__()  # type: ignore[misc]
    EXPECTED["sum"] = None
    CAPTURED.clear()

    ids = list(range(1, clients + 1))  # node ids; client i uses cohort's seed i - 1
    gone = dropouts(ids, percent)
    grid = InMemoryGrid(values, gone)
    grid.clients = clients
    strategy = SampleAll(ids)
    base = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={})
    context = LegacyContext(base, strategy=strategy)
    context.state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord({WorkflowKey.CURRENT_ROUND: 1})
    context.state.array_records[MAIN_PARAMS_RECORD] = ArrayRecord()
    workflow = wf_module.SecAggPlusWorkflow(
        num_shares=num_shares,
        reconstruction_threshold=threshold,
        max_weight=MAX_WEIGHT,
        clipping_range=CLIPPING_RANGE,
        quantization_range=QUANTIZATION_RANGE,
        modulus_range=MODULUS_RANGE,
    )
    state = wf_module.WorkflowState()
    server = server_cpu = 0.0
    stages = (
        workflow.setup_stage,
        workflow.share_keys_stage,
        workflow.collect_masked_vectors_stage,
        workflow.unmask_stage,
    )
    for stage in stages:
        inside_before, inside_cpu_before = grid.inside, grid.inside_cpu
        started, started_cpu = time.perf_counter(), time.process_time()
        # Server time of the stages before this one (within a stage it is
        # not known until the stage ends).
        grid.server_so_far = lambda done=(server, server_cpu): done
        ok = stage(grid, context, state)
        server += time.perf_counter() - started - (grid.inside - inside_before)
        server_cpu += time.process_time() - started_cpu - (grid.inside_cpu - inside_cpu_before)
        progress(stage.__name__, clients, (server, server_cpu))
        if not ok:
            return {"aborted": f"{stage.__name__} halted (too few neighbours left)"}

    # Who is in the sum: everyone that sent a masked input.
    contributors = [nid for nid in ids if gone.get(nid) != Stage.COLLECT_MASKED_VECTORS]
    mask = MODULUS_RANGE - 1
    expected = EXPECTED["sum"] & mask
    unmasked = np.concatenate([a.ravel() for a in CAPTURED["unmasked"]]).astype(np.int64) & mask
    exact = bool(np.array_equal(expected, unmasked))
    # The weighted mean of the float inputs, against Flower's result.
    total = sum(weight(n - 1) for n in contributors)
    mean = sum(update(values, n - 1).astype(np.float64) * weight(n - 1) for n in contributors) / total
    result = strategy.aggregate[0].astype(np.float64)
    # Each client's stochastic rounding is off by less than one step; the sum
    # is divided by the total quantised weight.
    step = 2 * CLIPPING_RANGE / QUANTIZATION_RANGE
    q_weight = sum(round(weight(n - 1) / MAX_WEIGHT * QUANTIZATION_RANGE) for n in contributors)
    # (Plus a little for the quantised weights and float rounding.)
    bound = 1.5 * len(contributors) * step / (q_weight / QUANTIZATION_RANGE) + 1e-6
    return {
        "client_ms": sum(CLOCK.core.values()) / clients * 1e3,
        "client_mod_ms": sum(CLOCK.mod.values()) / clients * 1e3,
        "client_cpu_ms": CLOCK.core_cpu / clients * 1e3,
        "server_ms": server * 1e3,
        "server_cpu_ms": server_cpu * 1e3,
        "up_mb": grid.up[0] / 1e6,
        "down_mb": grid.down[0] / 1e6,
        "in_sum": len(contributors),
        "exact_sum": exact,
        "max_mean_error": float(np.max(np.abs(result - mean))),
        "error_bound": bound,
    }


def measure(clients: int, values: int, graph: str, percent: int, repeats: int) -> dict:
    """Best of `repeats` rounds of one row (fewer once the repeat budget is spent)."""
    k, t = graph.split(":")
    # The complete graph: num_shares equal to the number of clients gives
    # every client all others as neighbours (what SecAggWorkflow's
    # num_shares=1.0 resolves to).
    num_shares = clients if k == "all" else int(k)
    threshold = int(t)
    budget = float(os.environ.get("FLOWER_REPEAT_BUDGET", "60"))
    best: dict | None = None
    spent = 0.0
    for repeat in range(repeats):
        started = time.perf_counter()
        row = one_round(clients, values, num_shares, threshold, percent, seed=repeat)
        spent += time.perf_counter() - started
        if "aborted" in row:
            return row
        if not (row["exact_sum"] and row["max_mean_error"] <= row["error_bound"]):
            return {**row, "aborted": "wrong sum"}
        if best is None or row["client_ms"] + row["server_ms"] < best["client_ms"] + best["server_ms"]:
            best = row
        best["repeats"] = repeat + 1
        if spent > budget:
            break
    assert best is not None, "REPEATS > 0"
    return best


def cut_off_at(stdout) -> dict:
    """What a row's last progress line says it had cost when its time limit
    cut it off: lower bounds of Flower's figures (CPU time, which other work
    on the machine does not inflate)."""
    text = stdout.decode() if isinstance(stdout, bytes) else (stdout or "")
    lines = [line for line in text.splitlines() if '"progress"' in line]
    if not lines:
        return {}
    last = json.loads(lines[-1])
    return {"at_least": last}


def merged_row(args, cohort_line: str, limit: float) -> str:
    """Runs the Flower row in a child process with a time limit and prints
    one markdown row with cohort's figures, Flower's and their ratios."""
    cells = [c.strip() for c in cohort_line.strip().strip("|").split("|")]
    head = " | ".join(cells[:4])
    command = [sys.executable, __file__, "--row", *args.row]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=limit, check=False)
        lines = [line for line in done.stdout.splitlines()
                 if line.startswith("{") and '"progress"' not in line]
        flower = json.loads(lines[-1]) if lines else {"aborted": "failed: " + done.stderr.strip()[-200:]}
    except subprocess.TimeoutExpired as cut:
        flower = {"aborted": f"> {limit:.0f} s", **cut_off_at(cut.stdout)}
    cohort_ok = len(cells) == 9 and not cells[4].startswith("aborted")
    if not cohort_ok:
        # cohort refused or aborted the round: its reason, then Flower's figures.
        reason = " ".join(cells[4:]).strip()
        if "aborted" in flower:
            return f"| {head} | {reason} | {flower['aborted']} | | | | | | | |"
        return (f"| {head} | {reason} | {flower['client_ms']:.1f} ({flower['client_cpu_ms']:.1f}) | "
                f"| | {flower['server_ms']:.1f} ({flower['server_cpu_ms']:.1f}) | "
                f"| / {flower['up_mb']:.2f} | / {flower['down_mb']:.2f} | / {flower['in_sum']} |")
    if "aborted" in flower and "at_least" in flower:
        # Cut off: Flower's CPU time so far, a lower bound of each figure.
        least = flower["at_least"]
        client, server = float(cells[4]), float(cells[5])
        return (
            f"| {head} | {client:.1f} | {flower['aborted']}: ≥ {least['client_cpu_ms']:.1f} CPU "
            f"by {least['progress']} | ≥ {least['client_cpu_ms'] / client:.0f}× "
            f"| {server:.1f} | ≥ {least['server_cpu_ms']:.1f} CPU | "
            f"≥ {least['server_cpu_ms'] / server:.0f}× "
            f"| {cells[6]} / | {cells[7]} / | {cells[8]} / |"
        )
    if "aborted" in flower:
        return (f"| {head} | {cells[4]} | {flower['aborted']} | | {cells[5]} | | "
                f"| {cells[6]} / | {cells[7]} / | {cells[8]} / |")
    client, server = float(cells[4]), float(cells[5])
    return (
        f"| {head} | {client:.1f} | {flower['client_ms']:.1f} ({flower['client_cpu_ms']:.1f}) "
        f"| {flower['client_ms'] / client:.0f}× "
        f"| {server:.1f} | {flower['server_ms']:.1f} ({flower['server_cpu_ms']:.1f}) "
        f"| {flower['server_ms'] / server:.0f}× "
        f"| {cells[6]} / {flower['up_mb']:.2f} | {cells[7]} / {flower['down_mb']:.2f} "
        f"| {cells[8]} / {flower['in_sum']} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--row", nargs=5, required=True,
                        metavar=("CLIENTS", "VALUES", "GRAPH", "DROPOUT", "REPEATS"))
    parser.add_argument("--cohort", metavar="LINE",
                        help="cohort's markdown row for the same settings: print both, merged")
    parser.add_argument("--limit", type=float,
                        default=float(os.environ.get("FLOWER_ROW_LIMIT", "600")),
                        help="seconds one Flower row may take with --cohort (default 600)")
    args = parser.parse_args()
    if args.cohort is not None:
        print(merged_row(args, args.cohort, args.limit), flush=True)
        return
    clients, values, graph, percent, repeats = args.row
    row = measure(int(clients), int(values), graph, int(percent), int(repeats))
    print(json.dumps({"clients": int(clients), "values": int(values), "graph": graph,
                      "dropout": int(percent), **row}))


if __name__ == "__main__":
    sys.exit(main())
