"""What the Python clients of the test suite share: kvmm.v1 stubs generated from the repo's .proto
files at run time, and a gRPC channel over a Unix socket that kvmmd's HTTP/2 stack accepts."""

import contextlib
import importlib
import pathlib
import sys
import tempfile
from collections.abc import Iterator
from types import ModuleType

import grpc
from grpc_tools import protoc


@contextlib.contextmanager
def stubs(proto_dir: pathlib.Path, service: str) -> Iterator[tuple[ModuleType, ModuleType]]:
    """Generates the kvmm.v1 stubs into a temporary directory and yields `service`'s message and
    gRPC modules (e.g. `session_pb2`, `session_pb2_grpc` for "session")."""
    protos = [str(p.relative_to(proto_dir)) for p in sorted((proto_dir / "kvmm" / "v1").glob("*.proto"))]
    include = pathlib.Path(protoc.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory() as out:
        args = ["protoc", f"-I{proto_dir}", f"-I{include}", f"--python_out={out}", f"--grpc_python_out={out}", *protos]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed on {protos}")
        sys.path.insert(0, out)
        yield importlib.import_module(f"kvmm.v1.{service}_pb2"), importlib.import_module(f"kvmm.v1.{service}_pb2_grpc")


def channel(socket: pathlib.Path | str) -> grpc.Channel:
    """A channel to kvmmd's Unix socket `socket`. gRPC's default :authority for a Unix socket is the
    (percent-encoded) path, which is not a valid HTTP authority, and the daemon's HTTP/2 stack
    refuses the stream: name a plain host."""
    return grpc.insecure_channel(f"unix:{socket}", options=[("grpc.default_authority", "localhost")])
