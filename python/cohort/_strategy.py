"""``cohort.Strategy``: a federated strategy written in Python, run by
cohort's round loop in place of the ``[algorithm]`` the config names.

The engine calls a ``Bridge`` around the user's object (from the round
loop's thread, with the GIL taken for the call): it turns the tensors that
cross the boundary into NumPy arrays in the model's order and back, checks
what the user's code returns, and turns the state into what a checkpoint
stores. The Rust side is ``crates/cohort-py/src/strategy.rs``.

Why a state of arrays and scalars only: a checkpoint must give the same
numbers back bit for bit, and reading one must run no code. Arrays are
stored as their bytes (float64 ones as int64 of the same bits, since
cohort's tensor files hold no float64), Python floats as the hex of their
64 bits, so nothing is rounded on the way. Objects, lists and pickles are
refused, naming the key.
"""

import json
import re
import struct
from typing import NamedTuple

import numpy as np

from ._tensors import from_wire, to_wire


class FitResult(NamedTuple):
    """One client's update, as ``Strategy.aggregate_fit`` gets it: cohort's
    client id (from 1; ``cohort.simulate``'s ``cid`` is ``client_id - 1``),
    its parameters (a list of arrays in the model's order), the examples it
    trained on and its local optimizer steps."""

    client_id: int
    parameters: list
    num_examples: int
    local_steps: int


class Strategy:
    """Base class of a strategy in Python, with Flower's method names.

    Subclasses implement ``aggregate_fit`` and, when they keep state across
    rounds, ``get_state`` and ``set_state``; ``configure_fit`` and
    ``evaluate`` are optional. ``parameters`` is always a list of NumPy
    arrays: for ``cohort.simulate`` in the clients' ``get_parameters``
    order, for ``cohort.run`` in the order of the model's tensor names
    (``RunResult.model``'s keys).

    A Python exception raised by any of these methods stops the run (a
    strategy's bug is its author's, unlike a client's, which only drops
    that client) and is raised again from ``cohort.run`` /
    ``cohort.simulate``; the run folder keeps its last checkpoint, so the
    run resumes once the strategy is fixed.
    """

    #: The strategy's name in the run's log and checkpoints (default:
    #: ``"python:<class name>"``). A run resumes only under the same name.
    name = None

    def configure_fit(self, server_round, parameters, client_id, config):
        """What ``client_id`` is asked to do this round: ``config`` holds
        ``learning_rate`` (the round's, after the schedule),
        ``proximal_mu`` (0: off) and ``update_clip_norm`` (``None``: off);
        return it, changed or not. Called for every selected client."""
        return config

    def aggregate_fit(self, server_round, parameters, results):
        """The next global model (a list of arrays in ``parameters``'
        order and dtypes) from ``results``, a list of ``FitResult`` in
        selection order (clients dropped from the round are not in it);
        ``None`` keeps the model. Flower's ``(parameters, metrics)`` pair
        is taken too; the metrics are not recorded."""
        raise NotImplementedError(f"{type(self).__name__} must implement aggregate_fit")

    def evaluate(self, server_round, parameters):
        """``cohort.simulate`` without an ``evaluate_fn`` calls this after
        each round: ``(loss, metrics)`` or ``None``, as Flower's. A
        ``cohort.run`` evaluates the config's model on its test set
        instead."""
        return None

    def get_state(self):
        """What the strategy carries from round to round, as a dict of
        NumPy arrays and scalars (``bool``, ``int``, ``float``, ``str``,
        ``None``, NumPy scalars) under identifier keys. Read after every
        ``aggregate_fit`` and stored with each checkpoint exactly."""
        return {}

    def set_state(self, state):
        """Continues from ``state``, a dict as ``get_state`` returned it
        (the same keys, types, dtypes and bits), when a run resumes."""
        if state:
            raise ValueError(
                f"{type(self).__name__} keeps no state (no get_state), but the checkpoint "
                f"holds {sorted(state)}; implement set_state"
            )


# ------------------------------------------------------------------ state

_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
# Stored as they are; float64 goes as int64 of the same bits.
_ARRAY_DTYPES = ("float32", "float16", "float64", "int64", "int32", "uint8", "bool")
_FORMAT = "cohort.Strategy state 1"
_I64 = (-(1 << 63), (1 << 63) - 1)


def _refused(owner, key, what):
    return TypeError(
        f"{owner}.get_state(): key {key!r} is {what}; a cohort.Strategy state holds NumPy "
        "arrays and scalars (bool, int, float, str, None, NumPy scalars) only, so that a "
        "checkpoint stores it exactly and reading one runs no code: no objects, lists, "
        "dicts or pickles"
    )


def _scalar(owner, key, value):
    """A Python scalar as JSON that gives it back exactly."""
    if value is None:
        return {"none": True}
    if isinstance(value, bool):
        return {"bool": value}
    if isinstance(value, int):
        if not _I64[0] <= value <= _I64[1]:
            raise ValueError(f"{owner}.get_state(): key {key!r} = {value} does not fit 64 bits; "
                             "store it as a NumPy array or a str")
        return {"int": value}
    if isinstance(value, float):
        return {"float": struct.pack("<d", value).hex()}
    if isinstance(value, str):
        return {"str": value}
    return None


def _array(owner, key, value):
    """A NumPy array or scalar as a tensor on the wire and its description."""
    array = np.asarray(value)
    if array.dtype.name not in _ARRAY_DTYPES:
        raise _refused(owner, key, f"an array of dtype {array.dtype} (stored: "
                       f"{', '.join(_ARRAY_DTYPES)})")
    if array.dtype.name in ("float32", "float16") and not np.isfinite(array).all():
        # A checkpoint whose strategy tensors are not finite is not resumed.
        raise ValueError(f"{owner}.get_state(): array {key!r} holds values that are not "
                         "finite; a checkpoint of it could not be resumed (use float64 for "
                         "markers such as inf)")
    info = {"dtype": array.dtype.name, "scalar": isinstance(value, np.generic)}
    if array.dtype.name == "float64":
        bits = np.ascontiguousarray(array, dtype="<f8").view("<i8")
        return (key, "int64", list(array.shape), bits.tobytes()), info
    little = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
    return (key, array.dtype.name, list(array.shape), little.tobytes()), info


def encode_state(state, owner):
    """``get_state()``'s dict as ``(scalars JSON, tensors)``; an empty dict
    is no state at all."""
    if not isinstance(state, dict):
        raise TypeError(f"{owner}.get_state() returned {type(state).__name__}; expected a "
                        "dict of NumPy arrays and scalars")
    if not state:
        return "null", []
    values, arrays, tensors = {}, {}, []
    for key, value in state.items():
        if not isinstance(key, str) or not _KEY.match(key):
            raise ValueError(f"{owner}.get_state(): key {key!r} is not an identifier "
                             "(letters, digits and _, not first a digit)")
        if isinstance(value, (np.ndarray, np.generic)):
            tensor, arrays[key] = _array(owner, key, value)
            tensors.append(tensor)
            continue
        encoded = _scalar(owner, key, value)
        if encoded is None:
            raise _refused(owner, key, f"a {type(value).__module__}.{type(value).__qualname__}")
        values[key] = encoded
    return json.dumps({"format": _FORMAT, "values": values, "arrays": arrays}), tensors


def _decoded_scalar(key, encoded):
    (kind, value), = encoded.items()
    if kind == "float":
        return struct.unpack("<d", bytes.fromhex(value))[0]
    if kind in ("bool", "int", "str"):
        return value
    if kind == "none":
        return None
    raise ValueError(f"the checkpoint's state key {key!r} is of unknown kind {kind!r}")


def decode_state(scalars_json, tensors):
    """What ``encode_state`` made, back as the dict it came from."""
    meta = json.loads(scalars_json)
    if meta is None and not tensors:
        return {}
    if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
        raise ValueError("the checkpoint's strategy state was not written by a cohort.Strategy")
    named = {name: (dtype, shape, data) for name, dtype, shape, data in tensors}
    state = {key: _decoded_scalar(key, encoded) for key, encoded in meta["values"].items()}
    for key, info in meta["arrays"].items():
        if key not in named:
            raise ValueError(f"the checkpoint's strategy state lacks the array {key!r}")
        dtype, shape, data = named.pop(key)
        if info["dtype"] == "float64":
            array = np.frombuffer(data, dtype="<f8").reshape(shape).astype(np.float64, copy=True)
        else:
            array = from_wire(dtype, shape, data)
        state[key] = array[()] if info["scalar"] else array
    if named:
        raise ValueError(f"the checkpoint's strategy state holds unexpected arrays {sorted(named)}")
    return state


# ----------------------------------------------------------------- bridge

_INSTRUCTIONS = ("learning_rate", "proximal_mu", "update_clip_norm")


def _number(owner, key, value, allow_zero):
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{owner}.configure_fit returned {key} = {value!r}; expected a number")
    value = float(value)
    if not np.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{owner}.configure_fit returned {key} = {value}; expected a finite "
                         f"number {bound}")
    return value


class Bridge:
    """What the engine calls: tensors in, tensors out, each checked.

    ``names``: the order of the user's list of arrays (``cohort.simulate``:
    the clients'); ``None``: the order the engine sends (the model's names).
    """

    def __init__(self, strategy, names=None):
        if not isinstance(strategy, Strategy):
            raise TypeError(f"strategy must be a cohort.Strategy, a name or a dict, not "
                            f"{type(strategy).__name__}")
        owner = type(strategy).__name__
        if type(strategy).aggregate_fit is Strategy.aggregate_fit:
            raise TypeError(f"{owner} does not implement aggregate_fit")
        self.strategy = strategy
        self.owner = owner
        self.names = None if names is None else list(names)
        self.name = str(strategy.name or f"python:{type(strategy).__name__}")
        self.configures = type(strategy).configure_fit is not Strategy.configure_fit
        self.evaluates = type(strategy).evaluate is not Strategy.evaluate

    def _parameters(self, tensors):
        arrays = {name: from_wire(dtype, shape, data) for name, dtype, shape, data in tensors}
        order = self.names if self.names is not None else [t[0] for t in tensors]
        return [arrays[name] for name in order]

    def _tensors(self, arrays, reference):
        """The user's arrays in the engine's order, named as ``reference``."""
        order = self.names if self.names is not None else [t[0] for t in reference]
        if isinstance(arrays, (str, bytes, dict, np.ndarray)) or not hasattr(arrays, "__len__"):
            raise TypeError(f"{self.owner}.aggregate_fit returned {type(arrays).__name__}; "
                            "expected a list of arrays (or None to keep the model)")
        if len(arrays) != len(order):
            raise ValueError(f"{self.owner}.aggregate_fit returned {len(arrays)} arrays; the "
                             f"model has {len(order)}")
        by_name = dict(zip(order, arrays))
        return [to_wire(name, by_name[name]) for name, *_ in reference]

    def get_state(self):
        return encode_state(self.strategy.get_state(), self.owner)

    def set_state(self, scalars_json, tensors):
        self.strategy.set_state(decode_state(scalars_json, tensors))

    def configure(self, server_round, client_id, learning_rate, tensors):
        config = {"learning_rate": learning_rate, "proximal_mu": 0.0, "update_clip_norm": None}
        given = self.strategy.configure_fit(server_round, self._parameters(tensors), client_id,
                                            dict(config))
        if not isinstance(given, dict):
            raise TypeError(f"{self.owner}.configure_fit returned {type(given).__name__}; "
                            f"expected a dict with {', '.join(_INSTRUCTIONS)}")
        unknown = sorted(set(given) - set(_INSTRUCTIONS))
        if unknown:
            raise ValueError(f"{self.owner}.configure_fit returned unknown key(s) "
                             f"{', '.join(map(repr, unknown))}; a client is told only "
                             f"{', '.join(_INSTRUCTIONS)}")
        config.update(given)
        clip = config["update_clip_norm"]
        return (
            _number(self.owner, "learning_rate", config["learning_rate"], allow_zero=False),
            _number(self.owner, "proximal_mu", config["proximal_mu"], allow_zero=True),
            None if clip is None else _number(self.owner, "update_clip_norm", clip, False),
        )

    def aggregate(self, server_round, tensors, updates):
        results = [
            FitResult(client_id, self._parameters(update), num_examples, local_steps)
            for client_id, num_examples, local_steps, update in updates
        ]
        out = self.strategy.aggregate_fit(server_round, self._parameters(tensors), results)
        if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict):
            out = out[0]  # Flower's (parameters, metrics)
        model = None if out is None else self._tensors(out, tensors)
        return model, self.get_state()
