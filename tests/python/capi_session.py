"""A Python process keeps its KV cache in kvmmd through capi/python/kvmm.py (ctypes over libkvmm.so),
driven by tests/tests/python_capi.rs. Standard library only.

    capi_session.py session SOCKET   attach, append (a list and an array('f')), attention checked against
                                     a double-precision reference, bad input, stats, detach
    capi_session.py leave SOCKET     attach a lingering session, append, print the attention's checksum,
                                     exit without detaching
    capi_session.py resume SOCKET    find it with orphans(), refuse it under another shape, resume it,
                                     print the same attention's checksum, detach

Each mode prints one JSON object.
"""

import array
import ctypes
import hashlib
import json
import math
import os
import struct
import sys

import kvmm

LAYERS, KV_HEADS, Q_HEADS, HEAD_DIM, MAX_TOKENS = 2, 3, 9, 64, 256
ROW, QROW = KV_HEADS * HEAD_DIM, Q_HEADS * HEAD_DIM


def values(count, seed):
    """Floats that f16 holds exactly (multiples of 1/64 in [-2, 2]), so the reference sees the pages."""
    state = seed * 2654435761 + 1
    out = []
    for _ in range(count):
        state = (state * 6364136223846793005 + 1442695040888963407) % (1 << 64)
        out.append(((state >> 33) % 257 - 128) / 64.0)
    return out


def reference(k, v, tokens, q):
    """Decode attention in double precision (token-major K/V, GQA)."""
    scale, group, out = 1.0 / math.sqrt(HEAD_DIM), Q_HEADS // KV_HEADS, []
    for h in range(Q_HEADS):
        kv = h // group
        qh = q[h * HEAD_DIM:(h + 1) * HEAD_DIM]
        scores = []
        for t in range(tokens):
            base = (t * KV_HEADS + kv) * HEAD_DIM
            scores.append(scale * sum(a * b for a, b in zip(qh, k[base:base + HEAD_DIM])))
        top = max(scores)
        weights = [math.exp(s - top) for s in scores]
        total = sum(weights)
        for d in range(HEAD_DIM):
            out.append(sum(w * v[(t * KV_HEADS + kv) * HEAD_DIM + d] for t, w in enumerate(weights)) / total)
    return out


def worst_error(got, want):
    """The worst error relative to each head's largest output."""
    worst = 0.0
    for h in range(Q_HEADS):
        w = want[h * HEAD_DIM:(h + 1) * HEAD_DIM]
        largest = max(abs(x) for x in w) or 1.0
        worst = max(worst, max(abs(a - b) for a, b in zip(got[h * HEAD_DIM:(h + 1) * HEAD_DIM], w)) / largest)
    return worst


def refused(call, name):
    """Runs `call`, which must raise kvmm.Error with status `name`; returns its message."""
    try:
        call()
    except kvmm.Error as e:
        assert e.name == name, f"{e.name} instead of {name}: {e.message}"
        assert e.status == {"INVALID_ARGUMENT": 3, "NOT_FOUND": 5, "FAILED_PRECONDITION": 9}[name]
        return e.message
    raise AssertionError(f"expected {name}")


def f16_bits(xs):
    return list(struct.unpack(f"<{len(xs)}H", struct.pack(f"<{len(xs)}e", *xs)))


def bf16_bits(xs):
    """The top halves of the floats: exact for values bfloat16 holds, as values() makes."""
    return [b >> 16 for b in struct.unpack(f"<{len(xs)}I", struct.pack(f"<{len(xs)}f", *xs))]


def sixteen_bit(client):
    """Rows appended as 16-bit patterns give the attention output f32 rows of the same values give,
    bit for bit, in sessions of either element type; returns the count of equal outputs and the
    refusals of bad 16-bit input."""
    k, v = values(40 * ROW, 60), values(40 * ROW, 61)
    q = values(QROW, 62)
    ways = [
        ("f16", array.array("H", f16_bits(k)), array.array("H", f16_bits(v))),    # read in place
        ("bf16", bf16_bits(k), bf16_bits(v)),                                      # lists of ints
        ("f16", (ctypes.c_uint16 * len(k))(*f16_bits(k)), (ctypes.c_uint16 * len(v))(*f16_bits(v))),  # '<H'
    ]
    same, errors = 0, []
    for element in ("f16", "bf16"):
        with client.attach(LAYERS, KV_HEADS, Q_HEADS, HEAD_DIM, MAX_TOKENS, element=element) as s:
            s.append(0, k, v)
            want = s.attention(0, q).tobytes()
        for way, kk, vv in ways:
            with client.attach(LAYERS, KV_HEADS, Q_HEADS, HEAD_DIM, MAX_TOKENS, element=element) as s:
                s.append(0, kk, vv, element=way)
                same += s.attention(0, q).tobytes() == want
    with client.attach(LAYERS, KV_HEADS, Q_HEADS, HEAD_DIM, MAX_TOKENS) as s:
        for bad in (lambda: s.append(0, [0] * ROW, [0] * ROW, element="f32"),
                    lambda: s.append(0, array.array("f", [0.0] * ROW), array.array("f", [0.0] * ROW), element="bf16"),
                    lambda: s.append(0, [70000] * ROW, [0] * ROW, element="f16")):
            try:
                bad()
                raise AssertionError("bad 16-bit input was accepted")
            except (TypeError, ValueError) as e:
                errors.append(f"{type(e).__name__}: {e}")
    return same, errors


def truncating(client):
    """70 tokens, 10 drafts taken back, 5 more: the attention output equals, bit for bit, that of a
    session that never held the drafts. Returns [tokens after the cut, equal, a bad count's error]."""
    k, v = values(75 * ROW, 70), values(75 * ROW, 71)
    q = values(QROW, 72)
    with client.attach(LAYERS, KV_HEADS, Q_HEADS, HEAD_DIM, MAX_TOKENS) as cut, \
            client.attach(LAYERS, KV_HEADS, Q_HEADS, HEAD_DIM, MAX_TOKENS) as straight:
        cut.append(0, k[:70 * ROW], v[:70 * ROW])
        cut.append(0, values(10 * ROW, 73), values(10 * ROW, 74))
        cut.truncate(70)
        tokens = cut.tokens(0)
        cut.append(0, k[70 * ROW:], v[70 * ROW:])
        straight.append(0, k, v)
        equal = cut.attention(0, q).tobytes() == straight.attention(0, q).tobytes()
        try:
            cut.truncate(-1)
            raise AssertionError("a negative count was accepted")
        except ValueError as e:
            error = str(e)
    return [tokens, equal, error]


def session_mode(socket):
    result = {}
    client = kvmm.Client(socket)
    result["bad_geometry"] = refused(lambda: client.attach(LAYERS, KV_HEADS, Q_HEADS, 20, MAX_TOKENS), "INVALID_ARGUMENT")
    session = client.attach(LAYERS, KV_HEADS, Q_HEADS, HEAD_DIM, MAX_TOKENS, model_id="py-capi", priority="batch")
    result["id"] = session.id
    result["geometry"] = session.geometry
    worst = 0.0
    for layer in range(LAYERS):
        k, v = values(70 * ROW, 2 * layer), values(70 * ROW, 2 * layer + 1)
        if layer == 0:
            session.append(layer, k[:ROW], v[:ROW])             # lists, one token
            session.append(layer, k[ROW:], v[ROW:])             # 69 more, across a page boundary
        else:
            session.append(layer, array.array("f", k), array.array("f", v))
        q = [x / 2 for x in values(QROW, 100 + layer)]
        out = session.attention(layer, q)
        worst = max(worst, worst_error(out, reference(k, v, 70, q)))
    result["worst"] = worst
    result["tokens"] = [session.tokens(layer) for layer in range(LAYERS)]
    result["out_of_range"] = refused(lambda: session.attention(LAYERS, [0.0] * QROW), "INVALID_ARGUMENT")
    result["budget"] = refused(lambda: session.set_page_budget(2), "INVALID_ARGUMENT")
    result["unknown"] = refused(lambda: client.resume(987654), "NOT_FOUND")
    for bad in (lambda: session.append(0, [0.0] * (ROW - 1), [0.0] * (ROW - 1)), lambda: session.attention(0, [0.0] * 5)):
        try:
            bad()
            raise AssertionError("a wrong length was accepted")
        except ValueError as e:
            result.setdefault("value_errors", []).append(str(e))
    try:
        session.append(0, array.array("d", [0.0] * ROW), array.array("d", [0.0] * ROW))
        raise AssertionError("a float64 buffer was accepted")
    except TypeError as e:
        result["type_error"] = str(e)
    mass = session.last_mass()
    result["mass"] = [len(mass), sum(mass)]
    result["dropped"] = session.dropped_blocks(0)
    result["resident"] = session.prefetch(range(0, LAYERS), range(0, 3))[0]
    stats = session.stats()
    result["stats"] = {"tokens": stats["tokens"], "device_pages": stats["device_pages"]}
    result["wiped"] = session.detach()
    result["sixteen_same"], result["sixteen_errors"] = sixteen_bit(client)
    result["truncated"] = truncating(client)
    other = client.attach(LAYERS, KV_HEADS, Q_HEADS, HEAD_DIM, MAX_TOKENS)
    other.append(0, values(ROW, 3), values(ROW, 4))
    result["wiped_tiers"] = other.wipe()
    result["after_wipe"] = refused(lambda: other.append(0, values(ROW, 3), values(ROW, 4)), "FAILED_PRECONDITION")
    result["detached"] = refused(lambda: session.tokens(0), "FAILED_PRECONDITION")
    client.close()
    print(json.dumps(result))


def checksum(out):
    return hashlib.sha256(out.tobytes()).hexdigest()[:16]


def leave_mode(socket):
    client = kvmm.Client(socket)
    session = client.attach(LAYERS, KV_HEADS, Q_HEADS, HEAD_DIM, MAX_TOKENS, model_id="py-linger", linger_ms=30000)
    for layer in range(LAYERS):
        session.append(layer, values(45 * ROW, 10 + layer), values(45 * ROW, 20 + layer))
    out = session.attention(1, values(QROW, 7))
    print(json.dumps({"id": session.id, "checksum": checksum(out)}), flush=True)
    os._exit(0)  # as a crash would: the session outlives the process, lingering


def resume_mode(socket):
    client = kvmm.Client(socket)
    found = client.orphans("py-linger")
    assert len(found) == 1 and found[0]["tokens"] == 45, found
    assert found[0]["shape"] == (LAYERS, KV_HEADS, Q_HEADS, HEAD_DIM), found
    sid = found[0]["session_id"]
    refusal = refused(lambda: client.resume(sid, (LAYERS, KV_HEADS, Q_HEADS, 128)), "FAILED_PRECONDITION")
    with client.resume(sid, (LAYERS, KV_HEADS, Q_HEADS, HEAD_DIM)) as session:
        tokens = [session.tokens(layer) for layer in range(LAYERS)]
        out = session.attention(1, values(QROW, 7))
    print(json.dumps({"id": sid, "checksum": checksum(out), "tokens": tokens, "refusal": refusal}))


if __name__ == "__main__":
    mode, socket = sys.argv[1], sys.argv[2]
    {"session": session_mode, "leave": leave_mode, "resume": resume_mode}[mode](socket)
