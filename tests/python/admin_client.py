"""A second gRPC stack against kvmmd: Python grpcio, with stubs generated from the repo's .proto files.

Usage: admin_client.py PROTO_DIR ADMIN_SOCKET

Generates the kvmm.v1 stubs with grpc_tools.protoc into a temporary directory (kvmm_stubs.py), calls
Admin.Status and Admin.ListSessions over the Unix socket, and prints one JSON object with what it read.
Exits non-zero (with the gRPC code on stderr) if either call fails.
"""

import json
import pathlib
import sys

import grpc

from kvmm_stubs import channel, stubs


def main() -> None:
    proto_dir, socket = pathlib.Path(sys.argv[1]), sys.argv[2]
    with stubs(proto_dir, "admin") as (admin_pb2, admin_grpc), channel(socket) as ch:
        stub = admin_grpc.AdminStub(ch)
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
