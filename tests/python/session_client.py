"""A second gRPC stack on the session socket: Python grpcio attaches, receives the memfds, writes K/V.

Usage: session_client.py PROTO_DIR RUNTIME_DIR leave
       session_client.py PROTO_DIR RUNTIME_DIR take DIGEST,DIGEST,...

Generates the kvmm.v1 stubs with grpc_tools.protoc (kvmm_stubs.py), then, over kvmm.sock and kvmm-fd.sock in
RUNTIME_DIR:

- `leave`: asks for a linger above the daemon's limit (and records the refusal), attaches a lingering
  session of model "py-chat" (2 layers, 2 KV heads, 4 query heads, head_dim 64, 32 tokens a page),
  extends it by 2 pages a layer, redeems the fd token on the SOCK_SEQPACKET fd socket (the 48-byte
  request frame, 3 memfds back by SCM_RIGHTS), checks each memfd's size and the session table's
  header and entries against the ABI (kvmm-shm's layout.rs), then writes K/V rows into every page in
  place (a full page and 8 rows of the next in each layer, finite f16 values) in kvmm-kernels' page
  layout (each page's header checked first, keys channel-major, values token-major, key bounds
  widened) and publishes the token counts in the client region. It prints each page's SHA-256 and
  closes its channel without Detach: the session is orphaned.
- `take`: lists its uid's orphans of "py-chat" (ListOrphans), resumes the newest one with its shape,
  redeems the new fd token, hashes every page where the table now places it (header checked again)
  and compares the digests with those `leave` printed, reads the token counts back, then detaches.

Prints one JSON object with what it saw. Exits non-zero (the gRPC code or the mismatch on stderr) on
any failure.

The pin protocol's atomics and fences (kvmm-shm's protocol.rs) have no Python equivalent; a
production Python client would take pins through a small C extension. Here the pins are plain
stores, which is sound only because nothing moves a page of the test's daemon meanwhile (its
sessions sit far below the device budget, so the tier thread demotes nothing): the stores still
follow the protocol's order (announce, check the state, write, publish, release), so the daemon's
view is the one a real client leaves.
"""

import hashlib
import json
import mmap
import os
import pathlib
import socket
import struct
import sys

import grpc

from kvmm_stubs import channel, stubs

MODEL = "py-chat"
GEOMETRY = dict(layers=2, kv_heads=2, q_heads=4, head_dim=64, block_tokens=32, element_type=1, max_tokens=256)
LINGER_MS = 30_000
PAGES = [32, 8]  # tokens written into blocks 0 and 1 of every layer: 40 in all

# kvmm-shm's layout.rs (ABI version 3) and fdpass/frame.rs (frame version 1).
TABLE_MAGIC, CLIENT_MAGIC, ABI_VERSION = b"KVMMTABL", b"KVMMCLNT", 3
TABLE_HEADER, DAEMON_ENTRY, CLIENT_HEADER, CLIENT_ENTRY = 128, 32, 64, 16
ALLOCATED, RESIDENT, MIGRATING = 1, 2, 4
TIER_DEVICE = 1
# kvmm-kernels' format/header.rs and format/layout.rs.
PAGE_HEADER, F16, HEADER_VERSION = 64, 1, 1


def fetch_memfds(fd_socket: str, session_id: int, token: bytes) -> list[int]:
    """Redeems a one-time fd token: the arena, session-table and client-region memfds."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.settimeout(10)
        s.connect(fd_socket)
        s.send(struct.pack("<IHHQ", int.from_bytes(b"KVFD", "little"), 1, 0, session_id) + token)
        reply, fds, _, _ = socket.recv_fds(s, 2048, 8)
    magic, version, kind = struct.unpack_from("<IHB", reply)
    if (magic, version) != (int.from_bytes(b"KVFR", "little"), 1):
        raise SystemExit(f"not an fd reply of version 1: {reply[:8]!r}")
    if kind != 1:
        code, length = struct.unpack_from("<II", reply, 8)
        raise SystemExit(f"fd socket refused: code {code}: {reply[16:16 + length].decode()}")
    sizes = struct.unpack_from("<QQQ", reply, 8)
    if len(fds) != 3:
        raise SystemExit(f"a grant came with {len(fds)} fds, not 3")
    for fd, size in zip(fds, sizes):
        if os.fstat(fd).st_size != size:
            raise SystemExit(f"memfd {fd} holds {os.fstat(fd).st_size} bytes, the reply says {size}")
    return fds


class Session:
    """The memfds of one session, mapped: the table read-only, the client region and arena read-write."""

    def __init__(self, attached, fds: list[int]):
        arena, table, region = fds
        self.id, self.page_bytes, self.blocks = attached.session_id, attached.page_bytes, attached.blocks_per_layer
        self.arena = mmap.mmap(arena, attached.arena_bytes)
        self.table = mmap.mmap(table, attached.table_bytes, prot=mmap.PROT_READ)
        self.region = mmap.mmap(region, attached.client_region_bytes)
        for fd in fds:
            os.close(fd)
        magic, abi, header, session_id, layers, blocks = struct.unpack_from("<8sIIQII", self.table)
        if (magic, abi, header, session_id, blocks) != (TABLE_MAGIC, ABI_VERSION, TABLE_HEADER, self.id, self.blocks):
            raise SystemExit(f"session table header: {(magic, abi, header, session_id, layers, blocks)}")
        magic, abi, header, entry, layers, blocks = struct.unpack_from("<8sIIIII", self.region)
        if (magic, abi, header, entry, blocks) != (CLIENT_MAGIC, ABI_VERSION, CLIENT_HEADER, CLIENT_ENTRY, self.blocks):
            raise SystemExit(f"client region header: {(magic, abi, header, entry, layers, blocks)}")
        self.status = struct.unpack_from("<I", self.table, 68)[0]

    def page(self, layer: int, block: int) -> tuple[int, int, int]:
        """The (flags, arena offset, length) the table gives a page; it must be a resident device page."""
        at = TABLE_HEADER + DAEMON_ENTRY * (layer * self.blocks + block)
        state, offset, length, format_tier = struct.unpack_from("<QQII", self.table, at)
        flags = state & 0xFFFF_FFFF
        if flags & (ALLOCATED | RESIDENT) != ALLOCATED | RESIDENT or format_tier >> 8 != TIER_DEVICE:
            raise SystemExit(f"page ({layer}, {block}) is not resident on the device: flags {flags:#x}")
        if length != self.page_bytes or offset + length > len(self.arena):
            raise SystemExit(f"page ({layer}, {block}) at {offset}+{length} in an arena of {len(self.arena)}")
        return flags, offset, length

    def client(self, layer: int, block: int) -> int:
        return CLIENT_HEADER + CLIENT_ENTRY * (layer * self.blocks + block)

    def write(self, layer: int, block: int, tokens: int) -> str:
        """Pins the page (announce, then check the state), checks its header, writes rows 0..tokens,
        publishes the count, unpins. Returns the SHA-256 of the whole page as left."""
        at = self.client(layer, block)
        pins = struct.unpack_from("<I", self.region, at)[0]
        struct.pack_into("<I", self.region, at, pins + 1)
        flags, offset, length = self.page(layer, block)
        if flags & MIGRATING:
            raise SystemExit(f"page ({layer}, {block}) is migrating in a daemon that moves nothing")
        page = memoryview(self.arena)[offset:offset + length]
        check_header(page, f"page ({layer}, {block})")
        write_rows(page, layer, block, tokens)
        digest = hashlib.sha256(page).hexdigest()
        page.release()
        struct.pack_into("<I", self.region, at + 4, tokens)
        struct.pack_into("<I", self.region, at, pins)
        return digest

    def digest(self, layer: int, block: int) -> str:
        """The SHA-256 of a page as the table now places it, after checking its header."""
        _, offset, length = self.page(layer, block)
        page = memoryview(self.arena)[offset:offset + length]
        check_header(page, f"page ({layer}, {block})")
        digest = hashlib.sha256(page).hexdigest()
        page.release()
        return digest

    def tokens(self, layer: int, block: int) -> int:
        return struct.unpack_from("<I", self.region, self.client(layer, block) + 4)[0]


def value(layer: int, block: int, token: int, head: int, channel: int, salt: int) -> float:
    """A K or V element: finite, exact in f16 (a multiple of 1/64), different in every page and row."""
    return ((token * 7 + head * 31 + channel * 3 + layer * 13 + block * 29 + salt) % 200 - 100) / 64.0


def write_rows(page: memoryview, layer: int, block: int, tokens: int) -> None:
    """Writes K/V rows 0..tokens of a 16-bit page in kvmm-kernels' layout (format/layout.rs): keys
    channel-major, values token-major, and the per-channel key bounds widened to cover them."""
    h_n, d_n, b_n = GEOMETRY["kv_heads"], GEOMETRY["head_dim"], GEOMETRY["block_tokens"]
    k_offset, v_offset, _ = page_layout()
    for h in range(h_n):
        for d in range(d_n):
            keys = [value(layer, block, t, h, d, 0) for t in range(tokens)]
            struct.pack_into(f"<{tokens}e", page, k_offset + 2 * (h * d_n + d) * b_n, *keys)
            at = PAGE_HEADER + 4 * (h * d_n + d)
            low, high = struct.unpack_from("<ee", page, at)
            struct.pack_into("<ee", page, at, min(low, *keys), max(high, *keys))
        for t in range(tokens):
            row = [value(layer, block, t, h, d, 101) for d in range(d_n)]
            struct.pack_into(f"<{d_n}e", page, v_offset + 2 * (h * b_n + t) * d_n, *row)


def page_layout() -> tuple[int, int, int]:
    """(k_offset, v_offset, page_bytes) of a 16-bit page of GEOMETRY (format/layout.rs)."""
    h, d, b = GEOMETRY["kv_heads"], GEOMETRY["head_dim"], GEOMETRY["block_tokens"]
    k_offset = PAGE_HEADER + round64(4 * h * d)
    v_offset = k_offset + round64(2 * h * d * b)
    return k_offset, v_offset, v_offset + round64(2 * h * b * d)


def round64(n: int) -> int:
    return (n + 63) // 64 * 64


def check_header(page: memoryview, where: str) -> None:
    """The page header kvmmd wrote (format/header.rs): an f16 page of GEOMETRY, no tokens counted."""
    fields = struct.unpack_from("<BBBBHHHHIIII", page)
    k_offset, v_offset, page_bytes = page_layout()
    want = (F16, HEADER_VERSION, 16, 16, GEOMETRY["kv_heads"], GEOMETRY["head_dim"], GEOMETRY["block_tokens"], 0,
            page_bytes, PAGE_HEADER, k_offset, v_offset)
    if fields != want:
        raise SystemExit(f"{where}: page header {fields}, expected {want}")


def leave(stub, pb, fd_socket: str) -> dict:
    try:
        stub.Attach(pb.AttachRequest(geometry=pb.Geometry(**GEOMETRY), model_id=MODEL, linger_ms=86_400_001))
        raise SystemExit("a linger above the daemon's limit was accepted")
    except grpc.RpcError as e:
        refused = {"code": e.code().name, "message": e.details()}
    attached = stub.Attach(pb.AttachRequest(geometry=pb.Geometry(**GEOMETRY), model_id=MODEL, linger_ms=LINGER_MS))
    extended = stub.Extend(pb.ExtendRequest(session_id=attached.session_id, blocks=2))
    s = Session(attached, fetch_memfds(fd_socket, attached.session_id, attached.fd_token))
    digests = [
        s.write(layer, block, tokens) for layer in range(GEOMETRY["layers"]) for block, tokens in enumerate(PAGES)
    ]
    stats = stub.SessionStats(pb.SessionStatsRequest(session_id=s.id))
    return {
        "refused": refused,
        "session": s.id,
        "linger_ms": attached.linger_ms,
        "allocated_blocks": extended.allocated_blocks,
        "page_bytes": s.page_bytes,
        "table_status": s.status,
        "tokens": stats.tokens,
        "device_bytes": stats.device_bytes,
        "digests": digests,
    }


def take(stub, pb, fd_socket: str, digests: list[str]) -> dict:
    orphans = stub.ListOrphans(pb.ListOrphansRequest(model_id=MODEL)).orphans
    if not orphans:
        raise SystemExit(f"no orphan of {MODEL} to resume")
    newest = orphans[0]
    resumed = stub.Resume(pb.ResumeRequest(session_id=newest.session_id, geometry=pb.Geometry(**GEOMETRY)))
    s = Session(resumed, fetch_memfds(fd_socket, resumed.session_id, resumed.fd_token))
    found = [s.digest(layer, block) for layer in range(GEOMETRY["layers"]) for block in range(len(PAGES))]
    counts = [s.tokens(layer, block) for layer in range(GEOMETRY["layers"]) for block in range(len(PAGES))]
    detached = stub.Detach(pb.DetachRequest(session_id=s.id))
    return {
        "orphans": [
            {"session": o.session_id, "tokens": o.tokens, "allocated_blocks": o.allocated_blocks, "bytes": o.bytes,
             "pid": o.pid, "linger_ms": o.linger_ms}
            for o in orphans
        ],
        "resumed": s.id,
        "allocated_blocks": resumed.allocated_blocks,
        "kv_intact": found == digests,
        "token_counts": counts,
        "bytes_wiped": detached.bytes_wiped,
    }


def main() -> None:
    proto_dir, runtime_dir, mode = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3]
    fd_socket = str(runtime_dir / "kvmm-fd.sock")
    with stubs(proto_dir, "session") as (pb, pb_grpc), channel(runtime_dir / "kvmm.sock") as ch:
        stub = pb_grpc.SessionStub(ch)
        try:
            if mode == "leave":
                seen = leave(stub, pb, fd_socket)
            else:
                seen = take(stub, pb, fd_socket, sys.argv[4].split(","))
        except grpc.RpcError as e:
            print(f"{e.code().name}: {e.details()}", file=sys.stderr)
            raise SystemExit(1)
    # `leave` has closed its channel without Detach: the session outlives the connection.
    print(json.dumps(seen))


if __name__ == "__main__":
    main()
