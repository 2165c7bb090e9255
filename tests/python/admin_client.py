"""A second gRPC stack against kvmmd: Python grpcio, with stubs generated from the repo's .proto files.

Usage: admin_client.py PROTO_DIR ADMIN_SOCKET

Generates the kvmm.v1 stubs with grpc_tools.protoc into a temporary directory, calls Admin.Status and
Admin.ListSessions over the Unix socket, and prints one JSON object with what it read. Exits non-zero
(with the gRPC code on stderr) if either call fails.
"""

import importlib
import json
import pathlib
import sys
import tempfile

import grpc
from grpc_tools import protoc


def generate(proto_dir: pathlib.Path, out: pathlib.Path) -> None:
    protos = [str(p.relative_to(proto_dir)) for p in sorted((proto_dir / "kvmm" / "v1").glob("*.proto"))]
    include = pathlib.Path(protoc.__file__).parent / "_proto"
    args = ["protoc", f"-I{proto_dir}", f"-I{include}", f"--python_out={out}", f"--grpc_python_out={out}", *protos]
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc failed on {protos}")


def main() -> None:
    proto_dir, socket = pathlib.Path(sys.argv[1]), sys.argv[2]
    with tempfile.TemporaryDirectory() as out:
        generate(proto_dir, pathlib.Path(out))
        sys.path.insert(0, out)
        admin_pb2 = importlib.import_module("kvmm.v1.admin_pb2")
        admin_grpc = importlib.import_module("kvmm.v1.admin_pb2_grpc")
        # gRPC's default :authority for a Unix socket is the (percent-encoded) path, which is not a
        # valid HTTP authority; the daemon's HTTP/2 stack refuses the stream. Name a plain host.
        options = [("grpc.default_authority", "localhost")]
        with grpc.insecure_channel(f"unix:{socket}", options=options) as channel:
            stub = admin_grpc.AdminStub(channel)
            try:
                status = stub.Status(admin_pb2.StatusRequest(), timeout=10)
                listed = stub.ListSessions(admin_pb2.ListSessionsRequest(), timeout=10)
            except grpc.RpcError as e:
                print(f"{e.code().name}: {e.details()}", file=sys.stderr)
                raise SystemExit(1)
    print(json.dumps({
        "sessions": status.sessions,
        "mode": status.policy.mode,
        "tiers": {t.tier: t.budget_bytes for t in status.tiers},
        "listed": [
            {"id": s.session_id, "tokens": s.tokens, "layers": s.geometry.layers, "executable": s.executable}
            for s in listed.sessions
        ],
    }))


if __name__ == "__main__":
    main()
