"""``cohort.simulate``: Flower-style ``NumPyClient``s on cohort's round loop.

The engine (Rust) selects, schedules, aggregates, records and checkpoints;
each client's ``fit`` runs in one of ``trainer.max_concurrency`` worker
processes, each its own interpreter, so clients train in parallel without
sharing a GIL.

Why fork: Flower users define ``client_fn`` in their ``__main__`` script,
which a spawned interpreter cannot import by reference, and a lambda or a
closure does not pickle at all. A fork of this interpreter has
``client_fn`` as it is, whatever it is. One process, the template, is
forked at the start of ``simulate``, before the engine starts any thread (a
fork copies only the forking thread, so a fork after that would copy locks
held by threads that do not exist in the child); it builds client ``"0"``
for the initial parameters and then forks the workers, so that what the
client code keeps at module level is shared by them, not built once per
worker. The workers talk to the engine over pipes.
Where there is no fork (Windows), ``simulate`` refuses to start.

What crosses the pipes (both ways): a JSON header and the arrays as plain
safetensors (raw little-endian bytes with their dtypes and shapes), never
pickle, so the engine runs nothing a worker sends. The contract is in
``crates/cohort-runtime/src/piped.rs``.
"""

import gc
import importlib
import json
import math
import multiprocessing
import os
import signal
import socket
import sys
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


def _read_exact(stream, count, at_start=False):
    """``count`` bytes, over as many reads as it takes (a socket's reads
    may return fewer); ``b""`` when the stream ends before the first byte
    of a message (``at_start``)."""
    chunks, got = [], 0
    while got < count:
        data = stream.read(count - got)
        if not data:
            if at_start and got == 0:
                return b""
            raise EOFError(f"the pipe ended inside a message, after {got} of {count} bytes")
        chunks.append(data)
        got += len(data)
    return b"".join(chunks)


def read_message(stream):
    """One message, or ``None`` when the other side closed the pipe."""
    length = _read_exact(stream, 8, at_start=True)
    if not length:
        return None
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


def _fork_worker(client_fn, control, children):
    """Forks one worker and sends its pipe ends and process id over
    ``control``, the template's socket to the engine's process."""
    requests_r, requests_w = os.pipe()
    answers_r, answers_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            control.close()
            _serve(client_fn, requests_r, answers_w, [requests_w, answers_r])
        finally:
            os._exit(0)
    children.append(pid)
    os.close(requests_r)
    os.close(answers_w)
    socket.send_fds(control, [pid.to_bytes(8, "little")], [answers_r, requests_w])
    os.close(answers_r)
    os.close(requests_w)


# What a library the client code has imported loads lazily, on a first use
# that every worker makes: the template imports it before it forks the
# workers, so they share one copy of those modules' objects instead of each
# building its own in its first fit. Only where the client code (or the
# caller) has imported the library already: cohort depends on none of them.
_LAZY_IMPORTS = {
    # torch.optim's optimizers are wrapped in torch._disable_dynamo, which
    # imports torch._dynamo (and with it sympy, mpmath and triton's Python
    # side: about 900 modules, 80 MiB) when the first optimizer is built.
    "torch": ("torch._dynamo",),
}


def _import_lazy_modules():
    """Imports ``_LAZY_IMPORTS``' modules of the libraries already in
    ``sys.modules``; one that fails to import is left to fail (or not) where
    the client code would have imported it."""
    for library, modules in _LAZY_IMPORTS.items():
        if library not in sys.modules:
            continue
        for name in modules:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - the client's own import would fail alike
                pass


def _template(client_fn, count, initial, control_fd, inherited):
    """The one process the engine's process forks: it forks every worker.

    With ``initial``, it first asks ``client_fn("0").get_parameters({})``
    for the initial model, so that whatever the client code loads and keeps
    at module level (a data set, a cache, as Flower's examples do) is in
    this process's memory before the workers exist, and each worker, a fork
    of it, shares those pages copy-on-write instead of building its own
    copy. It then imports what the client code's libraries would import
    lazily in each worker's first ``fit`` (``_LAZY_IMPORTS``: with torch,
    ``torch._dynamo``, which the first optimizer imports), so the workers
    share those modules too. ``gc.freeze()`` then moves every object to the
    permanent generation, so that the workers' garbage collections never
    write to the pages they share (a collection writes to every object it
    visits).

    It stays to fork a replacement whenever the engine asks (a worker whose
    client overran ``server.payload_timeout`` was killed): the engine's
    process never forks once its threads run, and a replacement is a fork of
    the same warmed process as the first workers."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The kernel reaps the workers this process forks.
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    for fd in inherited:
        os.close(fd)
    control = socket.socket(fileno=control_fd)
    children = []
    try:
        if initial:
            header, tensors = _answer(client_fn, {"op": "get_parameters", "cid": "0", "config": {}}, b"")
            with control.makefile("wb") as stream:
                write_message(stream, header, tensors)
            if not header.get("ok"):
                return
        _import_lazy_modules()
        gc.freeze()
        for _ in range(count):
            _fork_worker(client_fn, control, children)
        while control.recv(1):
            _fork_worker(client_fn, control, children)
    except OSError:
        # The engine's process closed its end: nothing more to fork.
        pass
    finally:
        # Each worker exits once the engine has closed its pipes; one still
        # training a client the engine no longer waits for is stopped.
        deadline = time.monotonic() + 5.0
        while children and time.monotonic() < deadline:
            children = [pid for pid in children if _alive(pid)]
            time.sleep(0.05)
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# ------------------------------------------------------------- the engine


class Workers:
    """The worker processes and the engine's ends of their pipes.

    This process forks one child, the template (``_template``), which forks
    the workers; with ``initial_parameters=True`` the template first gets
    the initial model from ``client_fn("0")``, so the workers share what
    building that client loaded. This process runs no client code."""

    def __init__(self, client_fn, count, initial_parameters=False):
        if "fork" not in multiprocessing.get_all_start_methods():
            raise RuntimeError(
                "cohort.simulate forks its worker processes (so that a client_fn defined in "
                "__main__, a lambda or a closure works as it is), and this platform has no fork"
            )
        context = multiprocessing.get_context("fork")
        self.ends = []
        self.handed_over = False
        self.control = None
        self.template = None
        self.pids = []
        self.initial = None
        # The template is a fork of this process: each page of objects is
        # shared by the two until one of them writes to it, and a garbage
        # collection writes to every object it visits. Frozen before the
        # fork, the objects that exist now are visited by neither process's
        # collections (the template's, while it builds client "0" and
        # imports, are the ones that run); this process's are unfrozen when
        # the run ends, unless something else had frozen objects already.
        self.unfreeze = gc.get_freeze_count() == 0
        gc.freeze()
        try:
            self.control, template_end = socket.socketpair()
            self.template = context.Process(
                target=_template,
                args=(client_fn, count, initial_parameters, template_end.fileno(),
                      [self.control.fileno()]),
                name="cohort-client-template", daemon=True,
            )
            self.template.start()
            template_end.close()
            if initial_parameters:
                # Unbuffered: a buffer would read past the message into
                # the workers' messages, whose descriptors it would lose.
                with self.control.makefile("rb", buffering=0) as stream:
                    message = read_message(stream)
                if message is None:
                    raise RuntimeError(
                        "the worker template process exited before it gave the initial parameters"
                    )
                self.initial = message
                if not message[0].get("ok"):
                    return
            for _ in range(count):
                self.ends.append(self._receive())
        except BaseException:
            self.close()
            raise

    def _receive(self):
        """A new worker's pipe ends ``(from the worker, to the worker)``
        from the template, and its process id."""
        message, fds, _, _ = socket.recv_fds(self.control, 8, 2)
        if len(message) != 8 or len(fds) != 2:
            for fd in fds:
                os.close(fd)
            raise RuntimeError("the worker template process has exited")
        self.pids.append(int.from_bytes(message, "little"))
        return fds[0], fds[1]

    def initial_parameters(self):
        """What ``client_fn("0").get_parameters({})`` returned in the
        template (client code runs in the template and the workers, never
        in this process)."""
        header, tensors = self.initial
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
        """A fresh worker in place of worker ``index``, from the template:
        its pipe ends ``(from the worker, to the worker)``, the engine's to
        close."""
        self.control.sendall(b"w")
        ends = self._receive()
        self.pids[index] = self.pids.pop()
        return ends

    def hand_over(self):
        """The pipe ends, now the engine's to close."""
        self.handed_over = True
        return list(self.ends)

    def close(self):
        if self.unfreeze:
            gc.unfreeze()
            self.unfreeze = False
        if not self.handed_over:
            for pair in self.ends:
                for fd in pair:
                    os.close(fd)
            self.handed_over = True
        if self.control is not None:
            # The template exits when its socket closes, once its workers
            # have (they exit when the engine has closed their pipes).
            self.control.close()
            self.control = None
        if self.template is not None:
            self.template.join(timeout=7.0)
            if self.template.is_alive():
                self.template.terminate()
                self.template.join(timeout=1.0)
