"""A cohort own-data client in Python written against the protocol by hand:
grpcio, numpy and safetensors only (client.py is the same on cohort.connect).

    python3 grpc_client.py --server HOST:PORT --data mine.safetensors [--client-id K]

It generates the gRPC stubs from cohort's .proto into a temporary folder
(nothing generated is kept), registers as an own-data client with the sample
counts of its safetensors file, and answers each task: evaluate the global
model on its held-out data when the run asks (clients.do_test), train LeNet-5
with numpy (train.py, on lenet5.py) for the run's local epochs, report the
update. Models travel in PyTorch's layout (linear weights [out, in]); a
global model in any other is refused. See README.md and docs/PROTOCOL.md.
"""

import argparse
import os
import queue
import socket
import sys
import tempfile
import time
import tomllib

import numpy as np
import safetensors.numpy

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_PROTO = os.path.join(HERE, "..", "..", "crates", "cohort-runtime", "proto", "cohort.proto")
# The protocol version this client speaks (cohort's PROTOCOL_VERSION).
PROTOCOL_VERSION = 5
CHUNK_BYTES = 1 << 20

sys.path.insert(0, HERE)
import lenet5  # noqa: E402  (beside this file)
import train  # noqa: E402
from own_data import load_data  # noqa: E402


def generate_stubs(proto, folder):
    """Runs protoc (from grpcio-tools) on cohort.proto into `folder` and
    imports the generated modules."""
    from grpc_tools import protoc
    import importlib.resources

    include = str(importlib.resources.files("grpc_tools") / "_proto")
    proto = os.path.abspath(proto)
    status = protoc.main([
        "protoc", f"-I{os.path.dirname(proto)}", f"-I{include}",
        f"--python_out={folder}", f"--grpc_python_out={folder}", proto,
    ])
    if status != 0:
        raise SystemExit(f"error: protoc failed on {proto} (status {status})")
    sys.path.insert(0, folder)
    import cohort_pb2
    import cohort_pb2_grpc
    return cohort_pb2, cohort_pb2_grpc


def global_model(payload, round_):
    """The global model of a task as float32 arrays, refused (the client
    exits) unless it is LeNet-5 in PyTorch's layout: the only layout cohort's
    protocol carries, so another means a server this client cannot follow."""
    params = {name: value.astype(np.float32) for name, value in safetensors.numpy.load(payload).items()}
    try:
        lenet5.check(params)
    except ValueError as error:
        raise SystemExit(f"error: the global model of round {round_} is refused: {error}; "
                         f"cohort's protocol {PROTOCOL_VERSION} carries models in PyTorch's layout "
                         "only (docs/PROTOCOL.md, Tensor layout)")
    return params


class Session:
    """One Join stream: messages to send go through a queue the request
    iterator drains; the server's messages come from the response iterator."""

    def __init__(self, pb, stub, register):
        self.pb = pb
        self.outbox = queue.Queue()
        self.outbox.put(pb.ClientMessage(register=register))
        self.inbound = stub.Join(iter(self.outbox.get, None))

    def send(self, **kind):
        self.outbox.put(self.pb.ClientMessage(**kind))

    def close(self):
        self.outbox.put(None)

    def receive(self, size, what):
        data = bytearray()
        while len(data) < size:
            message = next(self.inbound)
            if message.WhichOneof("kind") != "chunk" or len(data) + len(message.chunk.data) > size:
                raise SystemExit(f"error: the {what} payload is malformed")
            data += message.chunk.data
        return bytes(data)


def answer(session, settings, data, task, global_bytes):
    """Evaluates, trains and reports one task; a failure becomes TaskFailed."""
    pb = session.pb
    (images, labels), test = data
    started = time.perf_counter()
    params = global_model(global_bytes, task.round)
    processing = time.perf_counter() - started
    test_samples = test_correct = 0
    if settings["do_test"] and test is not None:
        test_samples = len(test[1])
        test_correct = train.count_correct(params, *test)
    training = time.perf_counter()
    optimizer = train.Sgd(task.learning_rate, settings["momentum"], settings["weight_decay"])
    rng = np.random.default_rng([task.client_id, task.round])
    loss, steps = train.train(params, images, labels, settings["epochs"], settings["batch_size"], optimizer, rng)
    training = time.perf_counter() - training
    packing = time.perf_counter()
    update = safetensors.numpy.save(params)
    processing += time.perf_counter() - packing
    session.send(report=pb.Report(
        client_id=task.client_id, round=task.round, num_samples=len(labels), loss=loss,
        training_time=training, processing_time=processing, payload_bytes=len(update),
        local_steps=steps, test_samples=test_samples, test_correct=test_correct))
    for start in range(0, len(update), CHUNK_BYTES):
        session.send(chunk=pb.Chunk(data=update[start:start + CHUNK_BYTES]))
    print(f"round {task.round}: client {task.client_id} trained {len(labels)} samples, loss {loss:.4f}"
          + (f", held-out accuracy {test_correct}/{test_samples}" if test_samples else ""), flush=True)


def run_settings(config_toml):
    """What of the run's config (the Welcome message) this client needs."""
    config = tomllib.loads(config_toml)
    trainer = config.get("trainer", {})
    optimizer = config.get("parameters", {}).get("optimizer", {})
    problems = []
    if trainer.get("optimizer", "sgd") != "sgd":
        problems.append(f"trainer.optimizer = {trainer['optimizer']!r} (this client trains with sgd)")
    if trainer.get("model_name", "lenet5") != "lenet5":
        problems.append(f"trainer.model_name = {trainer['model_name']!r} (this client trains lenet5)")
    for key in ("clients.outbound_processors", "clients.inbound_processors"):
        section, name = key.split(".")
        steps = config.get(section, {}).get(name)
        if steps not in (None, ["safetensor_encode"], ["safetensor_decode"]):
            problems.append(f"{key} = {steps} (this client reads and writes plain safetensors)")
    if "secure_aggregation" in config:
        # It does not speak the stages: its update would go out in the clear.
        problems.append("[secure_aggregation] (this client has no secure-aggregation stages)")
    if problems:
        raise SystemExit("error: this example client cannot take part in the run: " + "; ".join(problems))
    return {
        "epochs": int(trainer.get("epochs", 1)),
        "batch_size": int(trainer.get("batch_size", 32)),
        "momentum": float(optimizer.get("momentum", 0.0)),
        "weight_decay": float(optimizer.get("weight_decay", 0.0)),
        "do_test": bool(config.get("clients", {}).get("do_test", False)),
    }


def serve(pb, pb_grpc, args):
    import grpc

    data = load_data(args.data)
    (_, labels), test = data
    channel = grpc.insecure_channel(args.server)
    grpc.channel_ready_future(channel).result(timeout=args.connect_timeout)
    register = pb.Register(
        token=args.token or os.environ.get("COHORT_TOKEN", ""),
        name=f"python:{socket.gethostname()}:{os.getpid()}", protocol=PROTOCOL_VERSION,
        own_data=pb.OwnData(client_id=args.client_id, train_samples=len(labels),
                            test_samples=0 if test is None else len(test[1])))
    session = Session(pb, pb_grpc.FederationStub(channel), register)
    try:
        welcome = next(session.inbound).welcome
        settings = run_settings(welcome.config_toml)
        print(f"registered as own-data client {welcome.client_id} ({len(labels)} samples)", flush=True)
        for message in session.inbound:
            task = message.task
            if message.WhichOneof("kind") != "task":
                raise SystemExit("error: the server sent a message out of order")
            global_bytes = session.receive(task.payload_bytes, "global model")
            if task.correction_bytes or task.proximal_mu or task.HasField("update_clip_norm"):
                session.receive(task.correction_bytes, "gradient correction")
                session.send(failed=pb.TaskFailed(client_id=task.client_id, round=task.round,
                             reason="this example client trains plain FedAvg only"))
                continue
            answer(session, settings, data, task, global_bytes)
    except grpc.RpcError as error:
        raise SystemExit(f"error: the server refused this client or the connection broke: {error.details()}")
    finally:
        session.close()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", required=True, help="HOST:PORT of `cohort run`")
    parser.add_argument("--data", required=True, help="safetensors file of images and labels")
    parser.add_argument("--client-id", type=int, default=0, help="own-data client to claim [default: lowest free]")
    parser.add_argument("--token", help="server.auth_token, if the server sets one [env: COHORT_TOKEN]")
    parser.add_argument("--proto", default=DEFAULT_PROTO, help="cohort.proto [default: the repository's]")
    parser.add_argument("--connect-timeout", type=float, default=60.0, help="seconds to wait for the server")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="cohort-stubs-") as folder:
        pb, pb_grpc = generate_stubs(args.proto, folder)
        serve(pb, pb_grpc, args)


if __name__ == "__main__":
    main()
