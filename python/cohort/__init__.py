"""cohort: federated learning with a Rust engine, from Python.

``cohort.run`` runs a config (a file or a dict of the same structure) as
``cohort run`` does; ``cohort.simulate`` runs Flower-style ``NumPyClient``s
(duck-typed: no flwr needed) in worker processes on cohort's round loop;
``cohort.partition`` splits labels among clients as a
run's ``[data]`` sampler does; ``cohort.aggregate`` applies one built-in
strategy to NumPy arrays. Configs are validated by cohort itself: every
problem is raised at once as a ``cohort.ConfigError``.
"""

import json
import os

import numpy as np

from . import _cohort
from ._errors import CohortError, ConfigError
from ._results import Rows, RunResult
from ._simulation import Workers, wire_array
from ._strategy import Bridge, FitResult, Strategy
from ._tensors import dict_from_wire, params_to_wire, to_wire

__version__ = _cohort.__version__
__all__ = [
    "CohortError",
    "ConfigError",
    "FitResult",
    "Rows",
    "RunResult",
    "aggregate",
    "check",
    "connect",
    "partition",
    "run",
    "simulate",
    "Strategy",
]


def _plain(value):
    """NumPy scalars and arrays as the JSON values they stand for."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    raise TypeError(f"{value!r} ({type(value).__name__}) has no config value")


def _json(value):
    return json.dumps(value, default=_plain)


def _source(config):
    """A config as the extension takes it: a path, or a dict as JSON."""
    if isinstance(config, (str, os.PathLike)):
        return os.fspath(config), None
    if isinstance(config, dict):
        return None, _json(config)
    raise TypeError(f"config must be a path or a dict, not {type(config).__name__}")


def check(config, overrides=None):
    """Validates ``config`` (a path or a dict) with ``overrides``
    (``{"trainer.rounds": 3}``; ``None`` as a value unsets a key) and returns
    the merged config as TOML text; raises ``ConfigError`` otherwise."""
    path, table = _source(config)
    return _cohort.check(path, table, _json(overrides or {}))


def run(config, overrides=None, run_dir=None, on_round=None, *, data_dir=None, resume=False,
        strategy=None):
    """Runs a federation as ``cohort run`` does, in this process.

    ``config``: a config file's path, or a dict with the file's structure
    (``{"clients": {"total_clients": 10}, ...}``). ``overrides``: dotted keys
    written over it as ``--set`` does (``None`` unsets a key). ``run_dir``:
    the run folder (default: a new one where ``cohort run`` would make it);
    with ``resume=True``, the folder of a stopped run to continue.
    ``on_round(row)`` is called with each round's row (a dict) once it is
    recorded. ``data_dir``: where data sets live (default:
    ``$COHORT_DATA_DIR``, else the config's ``data.data_path``).
    ``strategy``: a built-in's ``[algorithm]`` type (``"fedavgm"``), a dict
    with ``type`` and its options (``{"type": "fedavgm", "momentum":
    0.5}``), or a ``cohort.Strategy`` instance, which replaces the config's
    ``[algorithm]`` (its state is checkpointed, and a run resumes with it).

    The engine runs with the GIL released. Ctrl-C (or an exception from
    ``on_round``) stops the run once the round in progress is recorded and
    checkpointed, so ``run(config, run_dir=..., resume=True)`` continues it,
    and the exception is raised here. Returns a ``RunResult``.
    """
    path, table = _source(config)
    if data_dir is None:
        data_dir = os.environ.get("COHORT_DATA_DIR") or None
    keys, bridge = _strategy_parts(strategy, overrides)
    callback = None
    if on_round is not None:
        def callback(row_json):
            on_round(json.loads(row_json))
    report, tensors = _cohort.run(
        path,
        table,
        _json(keys),
        None if run_dir is None else os.fspath(run_dir),
        None if data_dir is None else os.fspath(data_dir),
        bool(resume),
        callback,
        bridge,
    )
    return _result(report, tensors)


def _result(report, tensors, names=None):
    report = json.loads(report)
    model = dict_from_wire(tensors)
    return RunResult(
        run_dir=report["run_dir"],
        model_path=report["model_path"],
        reached_target=report["reached_target"],
        rounds=Rows(report["rounds"]),
        clients=Rows(report["clients"]),
        model=model,
        parameters=[] if names is None else [model[n] for n in names],
    )


def _strategy_overrides(strategy):
    """``"fedavgm"`` or ``{"type": "fedavgm", "momentum": 0.9}`` as
    ``[algorithm]`` overrides; a ``cohort.Strategy`` sets none."""
    if strategy is None or isinstance(strategy, Strategy):
        return {}
    if isinstance(strategy, str):
        return {"algorithm.type": strategy}
    if isinstance(strategy, dict) and "type" in strategy:
        return {f"algorithm.{key}": value for key, value in strategy.items()}
    raise TypeError(
        "strategy must be a name (\"fedavg\"), a dict with a \"type\" and the [algorithm] "
        f"options, or a cohort.Strategy instance, not {type(strategy).__name__}"
    )


def _strategy_parts(strategy, overrides, names=None):
    """The overrides with a built-in strategy's ``[algorithm]`` keys, and
    the bridge to a ``cohort.Strategy`` (or ``None``)."""
    keys = dict(overrides or {})
    keys.update(_strategy_overrides(strategy))
    bridge = Bridge(strategy, names) if isinstance(strategy, Strategy) else None
    return keys, bridge


def _evaluate_callback(evaluate_fn, names):
    """``evaluate_fn(server_round, parameters, config) -> (loss, metrics)``
    as the engine calls it: the round and tensors in, ``(loss, accuracy or
    None)`` out."""
    if evaluate_fn is None:
        return None

    def callback(server_round, tensors):
        named = dict_from_wire(tensors)
        result = evaluate_fn(server_round, [named[n] for n in names], {})
        if result is None:
            return float("nan"), None
        loss, metrics = result
        accuracy = (metrics or {}).get("accuracy")
        return float(loss), None if accuracy is None else float(accuracy)

    return callback


def simulate(client_fn, num_clients, config=None, strategy=None, *, num_rounds=None,
             clients_per_round=None, max_concurrency=None, initial_parameters=None,
             parameter_names=None, evaluate_fn=None, run_dir=None, resume=False,
             on_round=None, overrides=None):
    """Runs Flower-style clients on cohort's engine, as Flower's
    ``start_simulation`` does.

    ``client_fn(cid)`` (``cid`` is ``"0"`` to ``str(num_clients - 1)``)
    returns an object with ``NumPyClient``'s methods: ``get_parameters(config)``,
    ``fit(parameters, config) -> (parameters, num_examples, metrics)`` and
    ``evaluate(parameters, config) -> (loss, num_examples, metrics)``, with
    ``parameters`` a list of NumPy arrays. flwr is not needed.

    ``config``: a cohort config (a path or a dict; no ``trainer.model_name``
    or ``[data]`` is read; ``None``: the defaults with a learning rate of
    0.01), over which ``num_clients``
    (``clients.total_clients``), ``clients_per_round`` (``clients.per_round``),
    ``num_rounds`` (``trainer.rounds``), ``max_concurrency``
    (``trainer.max_concurrency``: worker processes) and ``overrides`` (dotted
    keys) are written. ``strategy``: an ``[algorithm]`` type, a dict with
    ``type`` and its options, or a ``cohort.Strategy`` instance (whose
    ``evaluate`` is called after each round when no ``evaluate_fn`` is
    given). ``fit`` gets ``config`` with ``server_round``,
    ``cid``, ``seed`` (one per client and round, from cohort's seed streams),
    ``local_epochs``, ``batch_size``, ``learning_rate`` (the round's, after
    the schedule) and ``proximal_mu`` under FedProx.

    The model is ``initial_parameters`` (a list of arrays), else what
    ``client_fn("0").get_parameters({})`` returns; its arrays are named
    ``"0"``, ``"1"``, ... in the run's files, or by ``parameter_names``.
    Client code never runs in this process: ``client_fn("0")`` is built for
    the initial parameters in a process forked from this one, which then
    forks the workers, so that what client code keeps at module level (a
    data set loaded once, as Flower's examples keep theirs) is shared by the
    workers copy-on-write instead of loaded by each; with
    ``initial_parameters`` given, each worker loads its own. Before it forks
    the workers, that process also imports what an imported library loads
    lazily on a first use every worker makes (with torch, ``torch._dynamo``,
    which the first ``torch.optim`` optimizer imports), so the workers share
    it too.
    ``evaluate_fn(server_round, parameters, config) -> (loss, metrics)`` is
    called in this process after each round (``metrics["accuracy"]`` is
    ``results.csv``'s accuracy). With ``clients.do_test = true`` each
    selected client first evaluates the model it receives
    (``client.evaluate``); their accuracies make ``federated_accuracy``.

    A client that raises or returns something else (wrong number, shape or
    dtype of arrays), or whose ``fit`` does not return within
    ``server.payload_timeout`` seconds (its worker process is then killed
    and replaced), is dropped from its round with the reason in
    ``clients.csv``; the run goes on as ``clients.min_per_round`` says.
    Ctrl-C stops after the round in progress, resumably
    (``resume=True`` with the same ``run_dir``), as for ``cohort.run``.
    Returns a ``RunResult`` whose ``parameters`` are the final model as a
    list, in ``get_parameters``' order.
    """
    if not callable(client_fn):
        raise TypeError(f"client_fn must be callable, not {type(client_fn).__name__}")
    # A config needs a learning rate; with none given, fit is told 0.01.
    default = {"parameters": {"optimizer": {"learning_rate": 0.01}}}
    path, table = _source(default if config is None else config)
    keys = dict(overrides or {})
    keys["clients.total_clients"] = num_clients
    for key, value in (("clients.per_round", clients_per_round), ("trainer.rounds", num_rounds),
                       ("trainer.max_concurrency", max_concurrency)):
        if value is not None:
            keys[key] = value
    keys.update(_strategy_overrides(strategy))
    # Checked before any worker is forked.
    bridge = Bridge(strategy) if isinstance(strategy, Strategy) else None
    keys_json = _json(keys)
    resolved = json.loads(_cohort.resolved(path, table, keys_json))
    workers = Workers(client_fn, int(resolved["trainer"]["max_concurrency"]),
                      initial_parameters=initial_parameters is None)
    try:
        if initial_parameters is None:
            params = workers.initial_parameters()
        else:
            params = [wire_array("initial_parameters", i, a) for i, a in enumerate(initial_parameters)]
        names = [str(i) for i in range(len(params))] if parameter_names is None else list(parameter_names)
        if len(names) != len(params):
            raise ValueError(f"{len(names)} parameter_names for {len(params)} arrays")
        callback = None
        if on_round is not None:
            def callback(row_json):
                on_round(json.loads(row_json))
        initial = [to_wire(name, array) for name, array in zip(names, params)]
        if bridge is not None:
            bridge.names = names
        if evaluate_fn is None and bridge is not None and bridge.evaluates:
            def evaluate_fn(server_round, parameters, config):
                return strategy.evaluate(server_round, parameters)
        report, tensors = _cohort.simulate(
            path, table, keys_json, None if run_dir is None else os.fspath(run_dir), bool(resume),
            workers.hand_over(), initial, _evaluate_callback(evaluate_fn, names), callback,
            bridge, workers,
        )
    finally:
        workers.close()
    return _result(report, tensors, names)


def connect(server_address, client_fn, *, num_examples, num_test_examples=0, client_id=None,
            parameter_names=None, token=None, root_certificates=None, tls_domain=None,
            connect_timeout=60.0, max_payload_bytes=1 << 30, require_secure_aggregation=False):
    """Joins a network-mode run (``cohort run`` with
    ``clients.comm_simulation = false``) at ``server_address``
    (``"HOST:PORT"``) as one of its ``clients.own_data_clients``, and
    answers its tasks until the run ends, as ``cohort client --data`` does.

    The client is ``client_fn(cid)`` with ``cid = str(client_id - 1)``, the
    client id the server grants (``client_id``: the one to claim; ``None``:
    the lowest free one): a ``NumPyClient`` as ``cohort.simulate`` takes it,
    its ``fit`` run in a worker process forked now, with the same
    ``config`` keys. It declares ``num_examples`` training and
    ``num_test_examples`` held-out samples at registration; the server
    drops an update that reports more (or other held-out counts when
    ``clients.do_test``). ``parameters`` are the server's model in the
    order of its tensor names, or in ``parameter_names``' order.

    ``token``: ``server.auth_token``; ``root_certificates``: the path of
    the PEM certificate that signed the server's (TLS), ``tls_domain`` the
    name it must carry. The protocol is cohort's Rust client's, so nothing
    of it is Python: under ``[secure_aggregation]`` the update is masked
    there and never leaves unmasked. ``require_secure_aggregation=True``
    (``cohort client --require-secure-aggregation``) refuses a run whose
    config has no ``[secure_aggregation]`` before anything is trained. Returns ``{"tasks": ..., "failed": ...}``; raises
    ``cohort.CohortError`` when the server cannot be reached or refuses
    the client. Ctrl-C stops it while it waits for the server (not in the
    middle of a ``fit``) and is raised here.
    """
    if not callable(client_fn):
        raise TypeError(f"client_fn must be callable, not {type(client_fn).__name__}")
    names = None if parameter_names is None else [str(n) for n in parameter_names]
    workers = Workers(client_fn, 1)
    try:
        tasks, failed = _cohort.connect(
            str(server_address), workers.hand_over()[0], names, int(num_examples),
            int(num_test_examples), None if client_id is None else int(client_id), token,
            None if root_certificates is None else os.fspath(root_certificates), tls_domain,
            float(connect_timeout), int(max_payload_bytes), bool(require_secure_aggregation),
        )
    finally:
        workers.close()
    return {"tasks": tasks, "failed": failed}


def _indices(name, values):
    a = np.asarray(values)
    if a.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {a.shape}")
    if a.size and not np.issubdtype(a.dtype, np.integer):
        raise TypeError(f"{name} must be integers, got dtype {a.dtype}")
    if a.size and (a.min() < 0 or a.max() > np.iinfo(np.uint32).max):
        raise ValueError(f"{name} must be in 0..=4294967295, got {a.min()}..={a.max()}")
    return a.astype("<u4").tobytes()


# partition()'s keywords, and the `[data]` keys they set.
_PARTITION_KEYS = {
    "alpha": "concentration",
    "seed": "random_seed",
    "min_size": "min_partition_size",
    "shards_per_client": "shards_per_client",
    "partition_size": "partition_size",
    "partition_sizes": "partition_sizes",
}


def partition(labels, method="iid", num_clients=10, *, users=None, num_classes=None, **options):
    """Splits samples among ``num_clients`` clients as a run's ``[data]``
    sampler does: returns one index array per client (client 1 first).

    ``method``: ``iid``, ``iid_cyclic``, ``dirichlet``, ``shards``,
    ``quantity_skew`` or ``natural`` (which needs ``users``, each sample's
    writer). Options, with the ``[data]`` key each sets (docs/CONFIG.md has
    their defaults and rules): ``alpha`` (``concentration``), ``seed``
    (``random_seed``), ``min_size`` (``min_partition_size``),
    ``shards_per_client``, ``partition_size``, ``partition_sizes``.
    ``num_classes`` (``parameters.model.num_classes``): the classes the
    Dirichlet draw spans, at least the labels' own. The same labels, method,
    options and seed give the same partitions as ``cohort partitions``.
    """
    unknown = sorted(set(options) - set(_PARTITION_KEYS))
    if unknown:
        raise TypeError(
            f"partition() got unknown option(s) {', '.join(unknown)}; "
            f"known: {', '.join(sorted(_PARTITION_KEYS))}"
        )
    data = {"sampler": method}
    data.update({_PARTITION_KEYS[k]: v for k, v in options.items() if v is not None})
    table = {
        "clients": {"total_clients": num_clients, "per_round": 1},
        "data": data,
        # A config needs one; partitioning never reads it.
        "parameters": {"optimizer": {"learning_rate": 0.01}},
    }
    if num_classes is not None:
        table["parameters"]["model"] = {"num_classes": num_classes}
    user_bytes = None if users is None else _indices("users", users)
    parts = _cohort.partition(_json(table), _indices("labels", labels), user_bytes)
    return [np.frombuffer(p, dtype="<u4").astype(np.int64) for p in parts]


def aggregate(name, global_model, updates, *, learning_rate=0.01, local_steps=1,
              details=False, **options):
    """Applies the built-in strategy ``name`` (``fedavg``, ``fedavgm``,
    ``fedadam``, ``fedyogi``, ``fedadagrad``, ``fedprox``, ``median``,
    ``trimmed_mean``, ``krum``, ``multi_krum``, ``dp_fedavg``, ...), with
    fresh state and its ``[algorithm]`` ``options``, to ``updates`` from
    ``global_model``, as ``cohort aggregate`` does.

    ``global_model``: a dict of named arrays (PyTorch layout) or a list of
    arrays (Flower's parameters). ``updates``: ``(model, num_examples)``
    pairs, each model of the same form. ``learning_rate``: the clients'
    rate (``parameters.optimizer.learning_rate``), for the strategies that
    read it (SCAFFOLD's correction); ``local_steps``: the steps each update
    reports.
    Returns the next global model in the form given; with ``details=True``,
    ``(model, {"selected": ..., "epsilon": ..., "delta": ...})``.
    """
    wire_global, restore = params_to_wire(global_model)
    wire_updates = []
    for index, pair in enumerate(updates):
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
            raise TypeError(f"update {index} must be a (model, num_examples) pair")
        model, samples = pair
        wire_updates.append((params_to_wire(model)[0], int(samples)))
    count = max(len(wire_updates), 1)
    table = {
        "algorithm": {"type": name, **options},
        "clients": {"total_clients": count, "per_round": count},
        "parameters": {"optimizer": {"learning_rate": learning_rate}},
    }
    tensors, selected, privacy = _cohort.aggregate(
        _json(table), wire_global, wire_updates, int(local_steps)
    )
    model = restore(tensors)
    if not details:
        return model
    epsilon, delta = privacy if privacy is not None else (None, None)
    return model, {"selected": selected, "epsilon": epsilon, "delta": delta}
