"""cohort: federated learning with a Rust engine, from Python.

``cohort.run`` runs a config (a file or a dict of the same structure) as
``cohort run`` does; ``cohort.partition`` splits labels among clients as a
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
from ._tensors import dict_from_wire, params_to_wire

__version__ = _cohort.__version__
__all__ = [
    "CohortError",
    "ConfigError",
    "Rows",
    "RunResult",
    "aggregate",
    "check",
    "partition",
    "run",
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


def run(config, overrides=None, run_dir=None, on_round=None, *, data_dir=None, resume=False):
    """Runs a federation as ``cohort run`` does, in this process.

    ``config``: a config file's path, or a dict with the file's structure
    (``{"clients": {"total_clients": 10}, ...}``). ``overrides``: dotted keys
    written over it as ``--set`` does (``None`` unsets a key). ``run_dir``:
    the run folder (default: a new one where ``cohort run`` would make it);
    with ``resume=True``, the folder of a stopped run to continue.
    ``on_round(row)`` is called with each round's row (a dict) once it is
    recorded. ``data_dir``: where data sets live (default:
    ``$COHORT_DATA_DIR``, else the config's ``data.data_path``).

    The engine runs with the GIL released. Ctrl-C (or an exception from
    ``on_round``) stops the run once the round in progress is recorded and
    checkpointed, so ``run(config, run_dir=..., resume=True)`` continues it,
    and the exception is raised here. Returns a ``RunResult``.
    """
    path, table = _source(config)
    if data_dir is None:
        data_dir = os.environ.get("COHORT_DATA_DIR") or None
    callback = None
    if on_round is not None:
        def callback(row_json):
            on_round(json.loads(row_json))
    report, tensors = _cohort.run(
        path,
        table,
        _json(overrides or {}),
        None if run_dir is None else os.fspath(run_dir),
        None if data_dir is None else os.fspath(data_dir),
        bool(resume),
        callback,
    )
    report = json.loads(report)
    return RunResult(
        run_dir=report["run_dir"],
        model_path=report["model_path"],
        reached_target=report["reached_target"],
        rounds=Rows(report["rounds"]),
        clients=Rows(report["clients"]),
        model=dict_from_wire(tensors),
    )


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
