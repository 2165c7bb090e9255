"""kvmm for Python: the C API of libkvmm (capi/include/kvmm.h) through ctypes, standard library only.

    import kvmm
    client = kvmm.Client()                          # $KVMM_SOCKET or the daemon's default socket
    session = client.attach(layers=30, kv_heads=3, q_heads=9, head_dim=64, max_tokens=8192)
    session.append(layer, k, v)                     # tokens * kv_heads * head_dim floats each
    out = session.attention(layer, q)               # q: q_heads * head_dim floats; an array('f')
    session.detach()

K, V and queries are any sequence of floats or any buffer of float32 (array('f'), a contiguous
numpy float32 array); buffers are read in place. K and V may also be 16-bit: a float16 buffer
(numpy float16) is appended as f16 without a round trip through float32, and
append(layer, k, v, element="bf16") (or "f16") takes 16-bit patterns of that type (a uint16 or
int16 buffer, such as a bfloat16 tensor viewed as int16, or a sequence of ints). A failed call raises kvmm.Error, whose `status`
is the gRPC code number, `name` its name ("INVALID_ARGUMENT") and `message` the library's sentence.

The library is found at $KVMM_LIBRARY, else by the system's search for libkvmm ("kvmm").
A Client may be shared by threads; a Session is used by one thread at a time.
"""

import array
import ctypes
import ctypes.util
import os
import sys

__all__ = ["Client", "Session", "Error", "API_VERSION"]

API_VERSION = 3

OK = 0
ELEMENTS = {"f16": 0, "bf16": 1}
PRIORITIES = {"foreground": 0, "background": 1, "batch": 2}


class Error(Exception):
    """A failed libkvmm call: `status` (the gRPC code), `name` and `message`."""

    def __init__(self, status, name, message):
        super().__init__(f"{name}: {message}")
        self.status = status
        self.name = name
        self.message = message


class _Geometry(ctypes.Structure):
    _fields_ = [
        ("layers", ctypes.c_uint32),
        ("kv_heads", ctypes.c_uint32),
        ("q_heads", ctypes.c_uint32),
        ("head_dim", ctypes.c_uint32),
        ("max_tokens", ctypes.c_uint32),
        ("block_tokens", ctypes.c_uint32),
        ("element", ctypes.c_uint32),
    ]


class _AttachOptions(ctypes.Structure):
    _fields_ = [
        ("model_id", ctypes.c_char_p),
        ("priority", ctypes.c_uint32),
        ("extend_batch", ctypes.c_uint32),
        ("quota_tokens", ctypes.c_uint32),
        ("evict", ctypes.c_uint32),
        ("linger_ms", ctypes.c_uint64),
    ]


class _SessionStats(ctypes.Structure):
    _fields_ = [
        ("tokens", ctypes.c_uint64),
        ("allocated_blocks", ctypes.c_uint32),
        ("quota_tokens", ctypes.c_uint32),
        ("device_bytes", ctypes.c_uint64),
        ("dram_bytes", ctypes.c_uint64),
        ("flash_bytes", ctypes.c_uint64),
        ("device_pages", ctypes.c_uint32),
        ("dram_pages", ctypes.c_uint32),
        ("flash_pages", ctypes.c_uint32),
        ("reserved", ctypes.c_uint32),
        ("faults", ctypes.c_uint64),
        ("pages_moved", ctypes.c_uint64),
        ("dropped_pages", ctypes.c_uint64),
    ]


class _Orphan(ctypes.Structure):
    _fields_ = [
        ("session_id", ctypes.c_uint64),
        ("tokens", ctypes.c_uint64),
        ("expires_in_ms", ctypes.c_uint64),
        ("bytes", ctypes.c_uint64),
        ("geometry", _Geometry),
        ("reserved", ctypes.c_uint32),
    ]


_FLOATS = ctypes.POINTER(ctypes.c_float)
_HALVES = ctypes.POINTER(ctypes.c_uint16)
_lib = None


def _library():
    """Loads libkvmm once and declares every function's signature."""
    global _lib
    if _lib is not None:
        return _lib
    # find_library needs a SONAME and helper programs; dlopen's own search (LD_LIBRARY_PATH, the
    # ldconfig cache, /lib, /usr/lib) finds an installed libkvmm.so without them.
    path = os.environ.get("KVMM_LIBRARY") or ctypes.util.find_library("kvmm") or "libkvmm.so"
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        raise OSError(f"libkvmm not found ({e}): build it (cargo build --release -p kvmm-capi) and set "
                      f"KVMM_LIBRARY to target/release/libkvmm.so, or install it where the system finds "
                      f"libraries (systemd/install.sh)") from None
    p = ctypes.POINTER
    signatures = {
        "kvmm_api_version": (ctypes.c_uint32, []),
        "kvmm_status_name": (ctypes.c_char_p, [ctypes.c_int]),
        "kvmm_last_error": (ctypes.c_char_p, []),
        "kvmm_connect": (ctypes.c_int, [ctypes.c_char_p, p(ctypes.c_void_p)]),
        "kvmm_client_free": (None, [ctypes.c_void_p]),
        "kvmm_attach": (ctypes.c_int, [ctypes.c_void_p, p(_Geometry), p(_AttachOptions), p(ctypes.c_void_p)]),
        "kvmm_resume": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_uint64, p(_Geometry), p(ctypes.c_void_p)]),
        "kvmm_orphans": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_char_p, p(_Orphan), ctypes.c_size_t,
                                        p(ctypes.c_size_t)]),
        "kvmm_discard": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_uint64, p(ctypes.c_uint64)]),
        "kvmm_session_id": (ctypes.c_uint64, [ctypes.c_void_p]),
        "kvmm_session_tokens": (ctypes.c_uint32, [ctypes.c_void_p, ctypes.c_uint32]),
        "kvmm_session_geometry": (ctypes.c_int, [ctypes.c_void_p, p(_Geometry)]),
        "kvmm_append": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_uint32, _FLOATS, _FLOATS, ctypes.c_size_t]),
        "kvmm_append16": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint32, _HALVES, _HALVES,
                                         ctypes.c_size_t]),
        "kvmm_attention": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_uint32, _FLOATS, _FLOATS]),
        "kvmm_truncate": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_uint32]),
        "kvmm_set_scale": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_float]),
        "kvmm_set_page_budget": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t]),
        "kvmm_prefetch": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_uint32,
                                         ctypes.c_uint32, p(ctypes.c_uint32), p(ctypes.c_uint32)]),
        "kvmm_stats": (ctypes.c_int, [ctypes.c_void_p, p(_SessionStats)]),
        "kvmm_last_mass": (ctypes.c_int, [ctypes.c_void_p, _FLOATS, ctypes.c_size_t, p(ctypes.c_size_t)]),
        "kvmm_dropped_blocks": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_uint32, p(ctypes.c_uint32), ctypes.c_size_t,
                                               p(ctypes.c_size_t)]),
        "kvmm_wipe": (ctypes.c_int, [ctypes.c_void_p, p(ctypes.c_uint64)]),
        "kvmm_detach": (ctypes.c_int, [ctypes.c_void_p, p(ctypes.c_uint64)]),
        "kvmm_session_free": (None, [ctypes.c_void_p]),
    }
    for name, (restype, argtypes) in signatures.items():
        function = getattr(lib, name)
        function.restype = restype
        function.argtypes = argtypes
    if lib.kvmm_api_version() < API_VERSION:
        raise OSError(f"{path} has API version {lib.kvmm_api_version()}, this module needs {API_VERSION} or later")
    _lib = lib
    return lib


def _check(status):
    if status != OK:
        lib = _library()
        raise Error(status, lib.kvmm_status_name(status).decode(), lib.kvmm_last_error().decode(errors="replace"))


def _native(format):
    """A buffer's struct format without a prefix that means native order ("<f" of a ctypes array on
    a little-endian machine is "f")."""
    native = "@=<" if sys.byteorder == "little" else "@=>"
    return format[1:] if len(format) == 2 and format[0] in native else format


def _buffer_format(values):
    """The struct format of a buffer's elements, or None for something that is not a buffer."""
    try:
        with memoryview(values) as view:
            return _native(view.format)
    except TypeError:
        return None


def _elements(values, what, ctype, formats, typecode, kind, hint):
    """(pointer, count, keep-alive) for a contiguous buffer whose format is one of `formats` (read
    in place) or a sequence (converted to array(typecode)); `kind` names the elements and `hint`
    says how to convert a buffer of another format."""
    size = ctypes.sizeof(ctype)
    try:
        view = memoryview(values)
    except TypeError:
        view = None
    if view is not None:
        if _native(view.format) not in formats:
            found = view.format
            view.release()
            raise TypeError(f"{what} is a buffer of format {found!r}, not {kind} "
                            f"({' or '.join(map(repr, formats))}): {hint}")
        if not view.c_contiguous:
            view.release()
            raise TypeError(f"{what} is a buffer that is not contiguous: pass a contiguous copy "
                            f"(numpy: numpy.ascontiguousarray)")
        count = view.nbytes // size
        if view.readonly:
            holder = (ctype * count).from_buffer_copy(view)
        else:
            holder = (ctype * count).from_buffer(view.cast("B"))
        return ctypes.cast(holder, ctypes.POINTER(ctype)), count, holder
    try:
        converted = array.array(typecode, values)
    except (TypeError, OverflowError) as e:
        raise TypeError(f"{what} must be a {kind} buffer or a sequence of {kind} values, not "
                        f"{type(values).__name__} ({e})")
    holder = (ctype * len(converted)).from_buffer(converted)
    return ctypes.cast(holder, ctypes.POINTER(ctype)), len(converted), (holder, converted)


def _floats(values, what):
    """(pointer, count, keep-alive) for a contiguous float32 buffer (read in place) or a sequence of
    floats (converted)."""
    return _elements(values, what, ctypes.c_float, ("f",), "f", "float32",
                     "convert it (numpy: .astype(numpy.float32))")


def _halves(values, what):
    """(pointer, count, keep-alive) for a contiguous buffer of 16-bit values (float16, uint16 or
    int16, read in place) or a sequence of 16-bit patterns (converted)."""
    return _elements(values, what, ctypes.c_uint16, ("e", "H", "h"), "H", "16-bit",
                     "pass the 16-bit patterns (numpy: .view(numpy.uint16))")


def _geometry(layers, kv_heads, q_heads, head_dim, max_tokens, block_tokens=0, element="f16"):
    if element not in ELEMENTS:
        raise ValueError(f"element must be one of {sorted(ELEMENTS)}, not {element!r}")
    return _Geometry(layers, kv_heads, q_heads, head_dim, max_tokens, block_tokens, ELEMENTS[element])


class Client:
    """A connection to kvmmd; its sessions keep it alive after close()."""

    def __init__(self, socket=None):
        lib = _library()
        handle = ctypes.c_void_p()
        _check(lib.kvmm_connect(os.fsencode(socket) if socket is not None else None, ctypes.byref(handle)))
        self._lib, self._handle = lib, handle

    def close(self):
        if self._handle:
            self._lib.kvmm_client_free(self._handle)
            self._handle = ctypes.c_void_p()

    def __enter__(self):
        return self

    def __exit__(self, *_):
        self.close()

    def __del__(self):
        if getattr(self, "_handle", None):
            self.close()

    def attach(self, layers, kv_heads, q_heads, head_dim, max_tokens, block_tokens=0, element="f16", model_id=None,
               priority="foreground", extend_batch=0, quota_tokens=0, evict=False, linger_ms=0):
        """Attaches a new session of this geometry (zero block_tokens or extend_batch: the defaults)."""
        if priority not in PRIORITIES:
            raise ValueError(f"priority must be one of {sorted(PRIORITIES)}, not {priority!r}")
        g = _geometry(layers, kv_heads, q_heads, head_dim, max_tokens, block_tokens, element)
        options = _AttachOptions(model_id.encode() if model_id is not None else None, PRIORITIES[priority],
                                 extend_batch, quota_tokens, 1 if evict else 0, linger_ms)
        handle = ctypes.c_void_p()
        _check(self._lib.kvmm_attach(self._handle, ctypes.byref(g), ctypes.byref(options), ctypes.byref(handle)))
        return Session(self._lib, handle)

    def resume(self, session_id, shape=None):
        """Takes over a lingering session of this user; `shape` (layers, kv_heads, q_heads, head_dim)
        refuses one of another model."""
        g = ctypes.byref(_geometry(*shape, max_tokens=0)) if shape is not None else None
        handle = ctypes.c_void_p()
        _check(self._lib.kvmm_resume(self._handle, session_id, g, ctypes.byref(handle)))
        return Session(self._lib, handle)

    def orphans(self, model_id=None):
        """The sessions of this user that wait to be resumed, newest first, as dicts."""
        encoded = model_id.encode() if model_id is not None else None
        count = ctypes.c_size_t()
        _check(self._lib.kvmm_orphans(self._handle, encoded, None, 0, ctypes.byref(count)))
        entries = (_Orphan * max(count.value, 1))()
        _check(self._lib.kvmm_orphans(self._handle, encoded, entries, count.value, ctypes.byref(count)))
        return [{
            "session_id": o.session_id,
            "tokens": o.tokens,
            "expires_in_ms": o.expires_in_ms,
            "bytes": o.bytes,
            "shape": (o.geometry.layers, o.geometry.kv_heads, o.geometry.q_heads, o.geometry.head_dim),
        } for o in entries[:min(count.value, len(entries))]]

    def discard(self, session_id):
        """Ends a lingering session without resuming it; returns the bytes wiped."""
        wiped = ctypes.c_uint64()
        _check(self._lib.kvmm_discard(self._handle, session_id, ctypes.byref(wiped)))
        return wiped.value


class Session:
    """One attached session. Detach it (or use it as a context manager); dropping it detaches too.
    `geometry` is a dict of the session's shape."""

    def __init__(self, lib, handle):
        self._lib, self._handle = lib, handle
        self.id = lib.kvmm_session_id(handle)
        g = _Geometry()
        _check(lib.kvmm_session_geometry(handle, ctypes.byref(g)))
        self.geometry = {name: getattr(g, name) for name, _ in _Geometry._fields_}
        self.geometry["element"] = [e for e, n in ELEMENTS.items() if n == g.element][0]
        self._row = g.kv_heads * g.head_dim
        self._query = g.q_heads * g.head_dim

    def _live(self):
        if not self._handle:
            raise Error(9, "FAILED_PRECONDITION", f"session {self.id} was detached; attach a new one")
        return self._handle

    def tokens(self, layer):
        """Tokens appended to a layer."""
        return self._lib.kvmm_session_tokens(self._live(), layer)

    def append(self, layer, k, v, element=None):
        """Appends whole tokens' K and V rows (kv_heads * head_dim values per token each): floats,
        or with `element` ("f16" or "bf16") 16-bit patterns of that type. A float16 buffer is f16
        without saying so. 16-bit rows of the session's own element type are stored bit for bit."""
        if element is None and _buffer_format(k) == "e":
            element = "f16"
        if element is None:
            (kp, kn, keep_k), (vp, vn, keep_v) = _floats(k, "k"), _floats(v, "v")
            unit = "floats"
        elif element in ELEMENTS:
            (kp, kn, keep_k), (vp, vn, keep_v) = _halves(k, "k"), _halves(v, "v")
            unit = f"{element} values"
        else:
            raise ValueError(f"element must be one of {sorted(ELEMENTS)} or None (floats), not {element!r}")
        if kn != vn or kn == 0 or kn % self._row:
            raise ValueError(f"k and v must hold the same whole number of tokens of kv_heads * head_dim = "
                             f"{self._row} {unit}; got {kn} and {vn}")
        if element is None:
            _check(self._lib.kvmm_append(self._live(), layer, kp, vp, kn // self._row))
        else:
            _check(self._lib.kvmm_append16(self._live(), layer, ELEMENTS[element], kp, vp, kn // self._row))
        del keep_k, keep_v

    def attention(self, layer, q, out=None):
        """Decode attention for one query of q_heads * head_dim floats; returns `out`, a writable
        float32 buffer of as many floats (a new array('f') unless given)."""
        qp, qn, keep = _floats(q, "q")
        if qn != self._query:
            raise ValueError(f"q must hold q_heads * head_dim = {self._query} floats; got {qn}")
        if out is None:
            out = array.array("f", bytes(4 * self._query))
        view = memoryview(out)
        if _native(view.format) != "f" or view.readonly or not view.c_contiguous or view.nbytes != 4 * self._query:
            raise ValueError(f"out must be a writable, contiguous float32 buffer of {self._query} floats")
        holder = (ctypes.c_float * self._query).from_buffer(view.cast("B"))
        _check(self._lib.kvmm_attention(self._live(), layer, qp, ctypes.cast(holder, _FLOATS)))
        del keep, holder
        view.release()
        return out

    def truncate(self, tokens):
        """Takes tokens back: every layer keeps its first `tokens` tokens (fewer if it holds fewer)
        and the next append continues from there (rejected draft tokens, an answer to regenerate)."""
        if not isinstance(tokens, int) or not 0 <= tokens < 2**32:
            raise ValueError(f"tokens must be an int from 0 to 2**32 - 1, not {tokens!r}")
        _check(self._lib.kvmm_truncate(self._live(), tokens))

    def set_scale(self, scale):
        """Sets the softmax scale (default 1 / sqrt(head_dim))."""
        _check(self._lib.kvmm_set_scale(self._live(), scale))

    def set_page_budget(self, pages):
        """Reads at most `pages` pages a call (at least 3); None or 0 reads every page."""
        _check(self._lib.kvmm_set_page_budget(self._live(), pages or 0))

    def prefetch(self, layers, blocks):
        """Hints that range `layers` x range `blocks` will be read; returns (resident, scheduled)."""
        resident, scheduled = ctypes.c_uint32(), ctypes.c_uint32()
        _check(self._lib.kvmm_prefetch(self._live(), layers.start, layers.stop, blocks.start, blocks.stop,
                                       ctypes.byref(resident), ctypes.byref(scheduled)))
        return resident.value, scheduled.value

    def stats(self):
        """kvmmd's statistics of the session, as a dict."""
        s = _SessionStats()
        _check(self._lib.kvmm_stats(self._live(), ctypes.byref(s)))
        return {name: getattr(s, name) for name, _ in _SessionStats._fields_ if name != "reserved"}

    def last_mass(self):
        """The attention mass of each page the last attention() read, in block order (an array('f'))."""
        count = ctypes.c_size_t()
        _check(self._lib.kvmm_last_mass(self._live(), None, 0, ctypes.byref(count)))
        mass = array.array("f", bytes(4 * count.value))
        if count.value:
            holder = (ctypes.c_float * count.value).from_buffer(mass)
            _check(self._lib.kvmm_last_mass(self._live(), ctypes.cast(holder, _FLOATS), count.value,
                                            ctypes.byref(count)))
            del holder
        return mass

    def dropped_blocks(self, layer):
        """The blocks of a layer that eviction dropped, ascending."""
        count = ctypes.c_size_t()
        _check(self._lib.kvmm_dropped_blocks(self._live(), layer, None, 0, ctypes.byref(count)))
        blocks = (ctypes.c_uint32 * max(count.value, 1))()
        _check(self._lib.kvmm_dropped_blocks(self._live(), layer, blocks, count.value, ctypes.byref(count)))
        return list(blocks[:count.value])

    def wipe(self):
        """Wipes the session now (every tier; its key destroyed); returns the bytes wiped per tier as
        (device, dram, flash). Later calls raise kvmm.Error (FAILED_PRECONDITION)."""
        wiped = (ctypes.c_uint64 * 3)()
        _check(self._lib.kvmm_wipe(self._live(), wiped))
        return tuple(wiped)

    def detach(self):
        """Ends the session (kvmmd wipes its pages); returns the bytes wiped."""
        wiped = ctypes.c_uint64()
        handle, self._handle = self._live(), ctypes.c_void_p()
        _check(self._lib.kvmm_detach(handle, ctypes.byref(wiped)))
        return wiped.value

    def __enter__(self):
        return self

    def __exit__(self, *_):
        if self._handle:
            self.detach()

    def __del__(self):
        if getattr(self, "_handle", None):
            self._lib.kvmm_session_free(self._handle)
            self._handle = ctypes.c_void_p()
