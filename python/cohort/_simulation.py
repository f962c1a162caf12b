"""``cohort.simulate``: Flower-style ``NumPyClient``s on cohort's round loop.

The engine (Rust) selects, schedules, aggregates, records and checkpoints;
each client's ``fit`` runs in one of ``trainer.max_concurrency`` worker
processes, each its own interpreter, so clients train in parallel without
sharing a GIL.

Why fork: Flower users define ``client_fn`` in their ``__main__`` script,
which a spawned interpreter cannot import by reference, and a lambda or a
closure does not pickle at all. A fork of this interpreter has
``client_fn`` as it is, whatever it is. The workers are forked at the start
of ``simulate``, before the engine starts any thread (a fork copies only
the forking thread, so a fork after that would copy locks held by threads
that do not exist in the child), and they talk to the engine over pipes.
Where there is no fork (Windows), ``simulate`` refuses to start.

What crosses the pipes (both ways): a JSON header and the arrays as plain
safetensors (raw little-endian bytes with their dtypes and shapes), never
pickle, so the engine runs nothing a worker sends. The contract is in
``crates/cohort-runtime/src/piped.rs``.
"""

import json
import math
import multiprocessing
import os
import signal
import socket
import time
import traceback

import numpy as np

# safetensors' dtype names and NumPy's. float64 is not among the dtypes a
# cohort model holds: clients' float64 arrays are narrowed to float32, as
# cohort.aggregate does.
_ST_DTYPES = {
    "F32": "<f4",
    "F16": "<f2",
    "I64": "<i8",
    "I32": "<i4",
    "U8": "u1",
    "BOOL": "?",
}
_ST_NAMES = {np.dtype(v).str: k for k, v in _ST_DTYPES.items()}


class ClientFailure(Exception):
    """What a client did wrong, in the words ``clients.csv`` records."""


# ---------------------------------------------------------------- the wire


def _read_exact(stream, count):
    data = stream.read(count)
    if data is None or len(data) != count:
        raise EOFError(f"the pipe ended after {0 if data is None else len(data)} of {count} bytes")
    return data


def read_message(stream):
    """One message, or ``None`` when the other side closed the pipe."""
    length = stream.read(8)
    if not length:
        return None
    if len(length) != 8:
        raise EOFError("the pipe ended inside a message")
    header = json.loads(_read_exact(stream, int.from_bytes(length, "little")))
    tensors = _read_exact(stream, int.from_bytes(_read_exact(stream, 8), "little"))
    return header, tensors


def _scalar(value):
    """Metrics' values as JSON: NumPy scalars as Python's, anything else as text."""
    if isinstance(value, np.generic):
        return value.item()
    return str(value)


def write_message(stream, header, tensors=b""):
    text = json.dumps(header, default=_scalar, allow_nan=False).encode()
    stream.write(len(text).to_bytes(8, "little"))
    stream.write(text)
    stream.write(len(tensors).to_bytes(8, "little"))
    stream.write(tensors)
    stream.flush()


def encode_tensors(named):
    """``(name, array)`` pairs as plain safetensors."""
    header, chunks, offset = {}, [], 0
    for name, array in named:
        data = array.tobytes()
        header[name] = {
            "dtype": _ST_NAMES[array.dtype.str],
            "shape": list(array.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        chunks.append(data)
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + b"".join(chunks)


def decode_tensors(data):
    """Plain safetensors as a dict of writable arrays."""
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + length])
    base = 8 + length
    arrays = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        if info["dtype"] == "BF16":
            # NumPy has no bfloat16: its bits are a float32's upper half.
            raw = np.frombuffer(data, dtype="<u2", count=(end - start) // 2, offset=base + start)
            flat = (raw.astype("<u4") << 16).view("<f4")
        else:
            dtype = np.dtype(_ST_DTYPES[info["dtype"]])
            count = (end - start) // dtype.itemsize
            flat = np.frombuffer(data, dtype=dtype, count=count, offset=base + start)
        arrays[name] = flat.reshape(info["shape"]).astype(flat.dtype.newbyteorder("="))
    return arrays


def wire_array(what, index, value):
    """A client's array as the engine takes it: C-ordered little-endian,
    float64 narrowed to float32."""
    try:
        array = np.asarray(value)
    except Exception as error:  # noqa: BLE001 - the client's object, any failure
        raise ClientFailure(f"{what} returned array {index}, which NumPy cannot read: {error}")
    if array.dtype == np.float64:
        array = array.astype(np.float32)
    little = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
    if little.dtype.str not in _ST_NAMES:
        known = "float32, float64, float16, int64, int32, uint8, bool"
        raise ClientFailure(f"{what} returned array {index} of dtype {array.dtype}; expected one of {known}")
    return little


# ------------------------------------------------------------- the worker


def _raised(what, error):
    """``fit raised ValueError: boom (client.py:12 in fit)``."""
    frames = traceback.extract_tb(error.__traceback__)
    where = ""
    if frames:
        last = frames[-1]
        where = f" ({os.path.basename(last.filename)}:{last.lineno} in {last.name})"
    return ClientFailure(f"{what} raised {type(error).__name__}: {error}{where}")


def _call(what, function, *args):
    try:
        return function(*args)
    except Exception as error:  # noqa: BLE001 - any client exception drops the client
        raise _raised(what, error) from None


def _count(what, value):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ClientFailure(f"{what} returned num_examples = {value!r}; expected an integer >= 0")
    return int(value)


def _metrics(what, value):
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ClientFailure(f"{what} returned metrics of type {type(value).__name__}; expected a dict")
    plain = {str(k): v.item() if isinstance(v, np.generic) else v for k, v in value.items()}
    # JSON has no NaN: a metric that is not finite is left out.
    return {k: v for k, v in plain.items() if not (isinstance(v, float) and not math.isfinite(v))}


def _triple(what, result, shape):
    if not (isinstance(result, (tuple, list)) and len(result) == 3):
        raise ClientFailure(f"{what} returned {type(result).__name__}; expected {shape}")
    return result


def _arrays(what, params, expected):
    if isinstance(params, (str, bytes, dict)) or not hasattr(params, "__len__"):
        raise ClientFailure(f"{what} returned parameters of type {type(params).__name__}; expected a list of arrays")
    if expected is not None and len(params) != expected:
        raise ClientFailure(f"{what} returned {len(params)} arrays; the global model has {expected}")
    return [wire_array(what, i, a) for i, a in enumerate(params)]


def _evaluate(client, params, config):
    result = _triple("evaluate", _call("evaluate", client.evaluate, params, dict(config)),
                     "(loss, num_examples, metrics)")
    loss, count, metrics = result
    metrics = _metrics("evaluate", metrics)
    accuracy = metrics.get("accuracy")
    return {
        "loss": float(loss) if isinstance(loss, (int, float, np.number)) and math.isfinite(loss) else None,
        "num_examples": _count("evaluate", count),
        "metrics": {"accuracy": float(accuracy)} if isinstance(accuracy, (int, float, np.number)) else {},
    }


def _fit(client_fn, header, tensors):
    names = header["names"]
    named = decode_tensors(tensors)
    params = [named[n] for n in names]
    config = header.get("config", {})
    client = _call("client_fn", client_fn, header["cid"])
    evaluation = None
    if header.get("evaluate"):
        evaluation = _evaluate(client, [p.copy() for p in params], config)
    started = time.perf_counter()
    result = _call("fit", client.fit, params, dict(config))
    seconds = time.perf_counter() - started
    new_params, count, metrics = _triple("fit", result, "(parameters, num_examples, metrics)")
    arrays = _arrays("fit", new_params, len(names))
    answer = {
        "ok": True,
        "num_examples": _count("fit", count),
        "metrics": _metrics("fit", metrics),
        "fit_seconds": seconds,
        "evaluation": evaluation,
    }
    return answer, encode_tensors(zip(names, arrays))


def _get_parameters(client_fn, header):
    client = _call("client_fn", client_fn, header["cid"])
    params = _call("get_parameters", client.get_parameters, dict(header.get("config", {})))
    arrays = _arrays("get_parameters", params, None)
    return {"ok": True, "count": len(arrays)}, encode_tensors((str(i), a) for i, a in enumerate(arrays))


def _answer(client_fn, header, tensors):
    try:
        if header.get("op") == "get_parameters":
            return _get_parameters(client_fn, header)
        return _fit(client_fn, header, tensors)
    except ClientFailure as failure:
        return {"ok": False, "error": str(failure)}, b""
    except Exception as error:  # noqa: BLE001 - whatever fails, the worker goes on
        return {"ok": False, "error": str(_raised("the worker", error))}, b""


def _serve(client_fn, requests_fd, answers_fd, inherited):
    """A worker's life: answer each request until the engine closes the pipe."""
    # Ctrl-C reaches the whole process group; the engine decides what it
    # stops, and closes the pipes when it is done.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for fd in inherited:
        os.close(fd)
    with os.fdopen(requests_fd, "rb") as requests, os.fdopen(answers_fd, "wb") as answers:
        while True:
            try:
                message = read_message(requests)
            except (EOFError, OSError, ValueError):
                return
            if message is None:
                return
            answer, tensors = _answer(client_fn, *message)
            try:
                json.dumps(answer, default=_scalar, allow_nan=False)
            except (TypeError, ValueError) as error:
                answer, tensors = {"ok": False, "error": f"the answer is not JSON: {error}"}, b""
            try:
                write_message(answers, answer, tensors)
            except OSError:
                return


def _spawner(client_fn, control_fd, inherited):
    """Forks a fresh worker whenever the engine asks (one whose client
    overran ``server.payload_timeout`` was killed), and sends its pipe ends
    and process id back over the control socket. It is forked with the
    workers, before the engine starts a thread, so that a replacement is
    as clean a fork as the first workers are: the engine's process never
    forks once its threads run."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The kernel reaps the workers this process forks.
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    for fd in inherited:
        os.close(fd)
    control = socket.socket(fileno=control_fd)
    while control.recv(1):
        requests_r, requests_w = os.pipe()
        answers_r, answers_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                control.close()
                _serve(client_fn, requests_r, answers_w, [requests_w, answers_r])
            finally:
                os._exit(0)
        os.close(requests_r)
        os.close(answers_w)
        socket.send_fds(control, [pid.to_bytes(8, "little")], [answers_r, requests_w])
        os.close(answers_r)
        os.close(requests_w)


# ------------------------------------------------------------- the engine


class Workers:
    """The worker processes, forked now, and the engine's ends of their pipes."""

    def __init__(self, client_fn, count):
        if "fork" not in multiprocessing.get_all_start_methods():
            raise RuntimeError(
                "cohort.simulate forks its worker processes (so that a client_fn defined in "
                "__main__, a lambda or a closure works as it is), and this platform has no fork"
            )
        context = multiprocessing.get_context("fork")
        self.ends = []
        self.processes = []
        self.handed_over = False
        self.control = None
        self.spawner = None
        self.pids = []
        try:
            self.control, spawner_end = socket.socketpair()
            self.spawner = context.Process(
                target=_spawner, args=(client_fn, spawner_end.fileno(), [self.control.fileno()]),
                name="cohort-client-spawner", daemon=True,
            )
            self.spawner.start()
            spawner_end.close()
            for index in range(count):
                requests_r, requests_w = os.pipe()
                answers_r, answers_w = os.pipe()
                inherited = [fd for pair in self.ends for fd in pair] + [
                    requests_w, answers_r, self.control.fileno()]
                process = context.Process(
                    target=_serve,
                    args=(client_fn, requests_r, answers_w, inherited),
                    name=f"cohort-client-worker{index}",
                    daemon=True,
                )
                self.ends.append((answers_r, requests_w))
                process.start()
                self.processes.append(process)
                self.pids.append(process.pid)
                os.close(requests_r)
                os.close(answers_w)
        except BaseException:
            self.close()
            raise

    def initial_parameters(self):
        """``client_fn("0").get_parameters({})``, asked of the first worker
        (client code runs in the workers only, never in this process)."""
        answers_fd, requests_fd = self.ends[0]
        with os.fdopen(requests_fd, "wb", closefd=False) as requests, \
                os.fdopen(answers_fd, "rb", closefd=False) as answers:
            write_message(requests, {"op": "get_parameters", "cid": "0", "config": {}})
            message = read_message(answers)
        if message is None:
            raise RuntimeError("the worker process exited before it gave the initial parameters")
        header, tensors = message
        if not header.get("ok"):
            raise RuntimeError(
                f"cannot get the initial parameters from client_fn('0').get_parameters({{}}): "
                f"{header.get('error')}; pass initial_parameters= instead"
            )
        named = decode_tensors(tensors)
        return [named[str(i)] for i in range(header["count"])]

    def stop(self, index):
        """Kills worker ``index`` (its client overran its time)."""
        try:
            os.kill(self.pids[index], signal.SIGKILL)
        except ProcessLookupError:
            pass

    def spawn(self, index):
        """A fresh worker in place of worker ``index``, from the spawner:
        its pipe ends ``(from the worker, to the worker)``, the engine's to
        close."""
        self.control.sendall(b"w")
        message, fds, _, _ = socket.recv_fds(self.control, 8, 2)
        if len(message) != 8 or len(fds) != 2:
            for fd in fds:
                os.close(fd)
            raise RuntimeError("the worker spawner has exited")
        self.pids[index] = int.from_bytes(message, "little")
        return fds[0], fds[1]

    def hand_over(self):
        """The pipe ends, now the engine's to close."""
        self.handed_over = True
        return list(self.ends)

    def close(self):
        if not self.handed_over:
            for pair in self.ends:
                for fd in pair:
                    os.close(fd)
            self.handed_over = True
        if self.control is not None:
            # The spawner exits when its socket closes; so do its workers
            # once the engine has closed their pipes.
            self.control.close()
            self.control = None
        # Each worker exits once the engine has closed its pipes; one still
        # training a client the engine no longer waits for is stopped.
        deadline = time.monotonic() + 5.0
        processes = self.processes + ([self.spawner] if self.spawner is not None else [])
        for process in processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
        for process in processes:
            if process.is_alive():
                process.terminate()
                process.join(timeout=1.0)
