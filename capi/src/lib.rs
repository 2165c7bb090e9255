//! The C API of the kvmm client library: `libkvmm.so` and `libkvmm.a`, declared in `include/kvmm.h`.
//!
//! Each function wraps one call of [`kvmm_client`] for a C caller (a llama.cpp-style engine that
//! keeps its KV cache in kvmmd). The contract the header states, and how it holds here:
//!
//! - **Handles.** `kvmm_client` and `kvmm_session` are boxed [`Client`] and [`Session`] values
//!   behind opaque pointers, made by `kvmm_connect` / `kvmm_attach` / `kvmm_resume` and freed by
//!   `kvmm_client_free` / `kvmm_detach` / `kvmm_session_free`. A client is `Sync` (its RPCs run on
//!   its runtime, which several threads may enter), so one handle serves several threads; a session
//!   is `Send` but takes `&mut` for appends and attention, so the header forbids using one from two
//!   threads at once.
//! - **Errors.** A function that can fail returns a status, the gRPC code of [`kvmm_client::Error::code`]
//!   (0 on success), and leaves the error's sentence, prefixed with the function's name, in a
//!   thread-local buffer that `kvmm_last_error` returns. Arguments are checked before anything
//!   else: a NULL where the header requires a pointer, an enum value out of range, a length that
//!   overflows, text that is not UTF-8 are `INVALID_ARGUMENT` with a sentence naming the argument.
//!   Output parameters are written only on success.
//! - **Panics** never cross the boundary: each body runs under `catch_unwind` and a panic becomes
//!   `INTERNAL` with its message.
//!
//! This crate holds the workspace's FFI `unsafe`: dereferencing the caller's pointers, each under
//! the header's contract for that argument.

use std::cell::RefCell;
use std::ffi::{CStr, CString, c_char, c_int};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::Duration;

use kvmm_client::session::DEFAULT_EXTEND_BATCH;
use kvmm_client::{AttachOptions, Client, ElementType, Geometry, ModelShape, Priority, RowElement, Session, bf16, f16};
use tonic::Code;

/// The API version (`KVMM_API_VERSION` in the header): 2 added `kvmm_append16`, 3 `kvmm_truncate`.
pub const API_VERSION: u32 = 3;

/// `KVMM_OK`.
const OK: c_int = 0;

/// A connection to kvmmd (`kvmm_client` in C).
#[derive(Debug)]
pub struct KvmmClient {
    client: Client,
}

/// One attached session (`kvmm_session` in C).
#[derive(Debug)]
pub struct KvmmSession {
    session: Session,
}

/// `kvmm_geometry`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct CGeometry {
    pub layers: u32,
    pub kv_heads: u32,
    pub q_heads: u32,
    pub head_dim: u32,
    pub max_tokens: u32,
    /// 0: the default.
    pub block_tokens: u32,
    /// `kvmm_element`.
    pub element: u32,
}

/// `kvmm_attach_options`.
#[repr(C)]
#[derive(Debug)]
pub struct CAttachOptions {
    /// NUL-terminated UTF-8, or NULL.
    pub model_id: *const c_char,
    /// `kvmm_priority`.
    pub priority: u32,
    /// 0: the default.
    pub extend_batch: u32,
    pub quota_tokens: u32,
    /// Nonzero: evict past the quota.
    pub evict: u32,
    pub linger_ms: u64,
}

/// `kvmm_session_stats`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct CSessionStats {
    pub tokens: u64,
    pub allocated_blocks: u32,
    pub quota_tokens: u32,
    pub device_bytes: u64,
    pub dram_bytes: u64,
    pub flash_bytes: u64,
    pub device_pages: u32,
    pub dram_pages: u32,
    pub flash_pages: u32,
    pub reserved: u32,
    pub faults: u64,
    pub pages_moved: u64,
    pub dropped_pages: u64,
}

/// `kvmm_orphan`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct COrphan {
    pub session_id: u64,
    pub tokens: u64,
    pub expires_in_ms: u64,
    pub bytes: u64,
    pub geometry: CGeometry,
    pub reserved: u32,
}

/// Why a call failed: a status and a sentence.
#[derive(Debug)]
struct Failure {
    code: Code,
    message: String,
}

impl From<kvmm_client::Error> for Failure {
    fn from(e: kvmm_client::Error) -> Failure {
        Failure { code: e.code(), message: e.to_string() }
    }
}

/// An `INVALID_ARGUMENT` failure.
fn invalid(message: impl Into<String>) -> Failure {
    Failure { code: Code::InvalidArgument, message: message.into() }
}

thread_local! {
    /// The sentence of this thread's last failed call.
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// Runs `body` as the C function `name`: its failure or panic becomes a status and this thread's
/// last error.
fn call(name: &str, body: impl FnOnce() -> Result<(), Failure>) -> c_int {
    let failure = match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => return OK,
        Ok(Err(f)) => f,
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "no message".to_owned());
            Failure { code: Code::Internal, message: format!("internal error in libkvmm ({what}); please report it") }
        }
    };
    let sentence = format!("{name}: {}", failure.message).replace('\0', " ");
    LAST_ERROR.with(|e| *e.borrow_mut() = CString::new(sentence).unwrap_or_default());
    failure.code as c_int
}

/// `&T` from a pointer the header requires.
///
/// # Safety
///
/// `p` is NULL or points to a valid `T` that nothing mutates for `'a`.
unsafe fn required<'a, T>(p: *const T, what: &str) -> Result<&'a T, Failure> {
    // SAFETY: non-NULL pointers are valid per the contract.
    unsafe { p.as_ref() }.ok_or_else(|| invalid(format!("`{what}` is NULL")))
}

/// `&mut T` from a pointer the header requires.
///
/// # Safety
///
/// `p` is NULL or points to a valid `T` that nothing else uses for `'a`.
unsafe fn required_mut<'a, T>(p: *mut T, what: &str) -> Result<&'a mut T, Failure> {
    // SAFETY: non-NULL pointers are valid and unaliased per the contract.
    unsafe { p.as_mut() }.ok_or_else(|| invalid(format!("`{what}` is NULL")))
}

/// Checks an output pointer before the call does anything.
fn output<T>(p: *mut T, what: &str) -> Result<*mut T, Failure> {
    if p.is_null() { Err(invalid(format!("`{what}` is NULL: pass where to write the result"))) } else { Ok(p) }
}

/// Hands `value` to the caller as a new handle at `out` (freed by the matching `_free` or detach).
///
/// # Safety
///
/// `out` is non-NULL and writable.
unsafe fn hand_out<T>(out: *mut *mut T, value: T) {
    // SAFETY: per the contract.
    unsafe { out.write(Box::into_raw(Box::new(value))) };
}

/// Writes `value` to an output pointer that may be NULL.
///
/// # Safety
///
/// `p` is NULL or valid for writing a `T`.
unsafe fn write_optional<T>(p: *mut T, value: T) {
    if !p.is_null() {
        // SAFETY: non-NULL and writable per the contract.
        unsafe { p.write(value) };
    }
}

/// A NUL-terminated UTF-8 argument, `None` for NULL.
///
/// # Safety
///
/// `p` is NULL or points to a NUL-terminated string that lives for `'a`.
unsafe fn text<'a>(p: *const c_char, what: &str) -> Result<Option<&'a str>, Failure> {
    if p.is_null() {
        return Ok(None);
    }
    // SAFETY: a NUL-terminated string per the contract.
    let s = unsafe { CStr::from_ptr(p) };
    s.to_str().map(Some).map_err(|_| invalid(format!("`{what}` is not valid UTF-8")))
}

/// `len` values at `p`, which must not be NULL.
///
/// # Safety
///
/// `p` is NULL or valid for reading `len` values of `T`, unmodified for `'a`.
unsafe fn elements<'a, T>(p: *const T, len: usize, what: &str) -> Result<&'a [T], Failure> {
    if p.is_null() {
        return Err(invalid(format!("`{what}` is NULL")));
    }
    // SAFETY: `len` readable elements per the contract; a typed pointer from C is aligned.
    Ok(unsafe { std::slice::from_raw_parts(p, len) })
}

/// The element type a `kvmm_element` names; `what` names the argument in the error.
fn element(e: u32, what: &str) -> Result<ElementType, Failure> {
    match e {
        0 => Ok(ElementType::F16),
        1 => Ok(ElementType::Bf16),
        e => Err(invalid(format!("{what} is {e}: use KVMM_ELEMENT_F16 (0) or KVMM_ELEMENT_BF16 (1)"))),
    }
}

/// The geometry a `kvmm_geometry` describes.
fn geometry(g: &CGeometry) -> Result<Geometry, Failure> {
    let element_type = element(g.element, "geometry.element")?;
    let mut geometry = Geometry::new(g.layers, g.kv_heads, g.q_heads, g.head_dim, g.max_tokens);
    geometry.element_type = element_type;
    if g.block_tokens != 0 {
        geometry.block_tokens = g.block_tokens;
    }
    Ok(geometry)
}

/// The `kvmm_geometry` of a geometry.
fn c_geometry(g: &Geometry) -> CGeometry {
    CGeometry {
        layers: g.layers,
        kv_heads: g.kv_heads,
        q_heads: g.q_heads,
        head_dim: g.head_dim,
        max_tokens: g.max_tokens,
        block_tokens: g.block_tokens,
        element: match g.element_type {
            ElementType::F16 => 0,
            ElementType::Bf16 => 1,
        },
    }
}

/// The attach options a `kvmm_attach_options` describes.
///
/// # Safety
///
/// `o.model_id` is NULL or a NUL-terminated string.
unsafe fn attach_options(o: &CAttachOptions) -> Result<AttachOptions, Failure> {
    let priority = match o.priority {
        0 => Priority::Foreground,
        1 => Priority::Background,
        2 => Priority::Batch,
        p => {
            return Err(invalid(format!(
                "options.priority is {p}: use KVMM_PRIORITY_FOREGROUND (0), _BACKGROUND (1) or _BATCH (2)"
            )));
        }
    };
    // SAFETY: per this function's contract.
    let model_id = unsafe { text(o.model_id, "options.model_id") }?.unwrap_or_default().to_owned();
    Ok(AttachOptions {
        model_id,
        priority,
        extend_batch: if o.extend_batch == 0 { DEFAULT_EXTEND_BATCH } else { o.extend_batch },
        quota_tokens: o.quota_tokens,
        evict: o.evict != 0,
        linger: Duration::from_millis(o.linger_ms),
    })
}

/// Floats per token row (`kv_heads × head_dim`) and per query (`q_heads × head_dim`) of a session.
fn row_lengths(s: &Session) -> (usize, usize) {
    let g = s.geometry();
    ((g.kv_heads * g.head_dim) as usize, (g.q_heads * g.head_dim) as usize)
}

/// See `kvmm.h`.
#[unsafe(no_mangle)]
pub extern "C" fn kvmm_api_version() -> u32 {
    API_VERSION
}

/// See `kvmm.h`.
#[unsafe(no_mangle)]
pub extern "C" fn kvmm_status_name(status: c_int) -> *const c_char {
    let name: &'static CStr = match status {
        0 => c"OK",
        1 => c"CANCELLED",
        3 => c"INVALID_ARGUMENT",
        4 => c"DEADLINE_EXCEEDED",
        5 => c"NOT_FOUND",
        6 => c"ALREADY_EXISTS",
        7 => c"PERMISSION_DENIED",
        8 => c"RESOURCE_EXHAUSTED",
        9 => c"FAILED_PRECONDITION",
        10 => c"ABORTED",
        11 => c"OUT_OF_RANGE",
        12 => c"UNIMPLEMENTED",
        13 => c"INTERNAL",
        14 => c"UNAVAILABLE",
        15 => c"DATA_LOSS",
        16 => c"UNAUTHENTICATED",
        _ => c"UNKNOWN",
    };
    name.as_ptr()
}

/// See `kvmm.h`.
#[unsafe(no_mangle)]
pub extern "C" fn kvmm_last_error() -> *const c_char {
    // The buffer lives as long as the thread and is replaced only by the next failing call on it.
    LAST_ERROR.with(|e| e.borrow().as_ptr())
}

/// See `kvmm.h`.
///
/// # Safety
///
/// `socket_path` is NULL or a NUL-terminated string; `client` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvmm_connect(socket_path: *const c_char, client: *mut *mut KvmmClient) -> c_int {
    call("kvmm_connect", || {
        let client = output(client, "client")?;
        // SAFETY: per this function's contract.
        let path = unsafe { text(socket_path, "socket_path") }?.map(std::path::PathBuf::from);
        let connected = Client::connect(path.unwrap_or_else(kvmm_client::default_socket))?;
        // SAFETY: checked non-NULL; writable per the contract.
        unsafe { hand_out(client, KvmmClient { client: connected }) };
        Ok(())
    })
}

/// See `kvmm.h`.
///
/// # Safety
///
/// `client` is NULL or a handle from `kvmm_connect` not freed yet, which no other thread uses.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvmm_client_free(client: *mut KvmmClient) {
    if !client.is_null() {
        // SAFETY: a handle from `kvmm_connect` (a leaked box), freed once per the contract.
        drop(unsafe { Box::from_raw(client) });
    }
}

/// See `kvmm.h`.
///
/// # Safety
///
/// `client` is NULL or a live handle; `geometry` NULL or valid; `options` NULL or valid with a
/// NULL or NUL-terminated `model_id`; `session` NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvmm_attach(
    client: *const KvmmClient,
    geometry: *const CGeometry,
    options: *const CAttachOptions,
    session: *mut *mut KvmmSession,
) -> c_int {
    call("kvmm_attach", || {
        let session = output(session, "session")?;
        // SAFETY: per this function's contract.
        let (client, g) = unsafe { (required(client, "client")?, required(geometry, "geometry")?) };
        // SAFETY: as above.
        let options = match unsafe { options.as_ref() } {
            // SAFETY: `model_id` per this function's contract.
            Some(o) => unsafe { attach_options(o) }?,
            None => AttachOptions::default(),
        };
        let attached = client.client.attach_with(self::geometry(g)?, options)?;
        // SAFETY: checked non-NULL; writable per the contract.
        unsafe { hand_out(session, KvmmSession { session: attached }) };
        Ok(())
    })
}

/// See `kvmm.h`.
///
/// # Safety
///
/// `client` is NULL or a live handle; `shape` NULL or valid; `session` NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvmm_resume(
    client: *const KvmmClient,
    session_id: u64,
    shape: *const CGeometry,
    session: *mut *mut KvmmSession,
) -> c_int {
    call("kvmm_resume", || {
        let session = output(session, "session")?;
        // SAFETY: per this function's contract.
        let client = unsafe { required(client, "client") }?;
        // SAFETY: as above.
        let shape = unsafe { shape.as_ref() }.map(|g| ModelShape {
            layers: g.layers,
            kv_heads: g.kv_heads,
            q_heads: g.q_heads,
            head_dim: g.head_dim,
        });
        let resumed = client.client.resume(session_id, shape)?;
        // SAFETY: checked non-NULL; writable per the contract.
        unsafe { hand_out(session, KvmmSession { session: resumed }) };
        Ok(())
    })
}

/// See `kvmm.h`.
///
/// # Safety
///
/// `client` is NULL or a live handle; `model_id` NULL or NUL-terminated; `orphans` valid for
/// writing `capacity` entries (or NULL with `capacity` 0); `count` NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvmm_orphans(
    client: *const KvmmClient,
    model_id: *const c_char,
    orphans: *mut COrphan,
    capacity: usize,
    count: *mut usize,
) -> c_int {
    call("kvmm_orphans", || {
        let count = output(count, "count")?;
        list(orphans, capacity, "orphans")?;
        // SAFETY: per this function's contract.
        let (client, model_id) = unsafe { (required(client, "client")?, text(model_id, "model_id")?) };
        let listed = client.client.orphans(model_id)?;
        for (i, o) in listed.iter().take(capacity).enumerate() {
            let entry = COrphan {
                session_id: o.session_id,
                tokens: o.tokens,
                expires_in_ms: u64::try_from(o.expires_in.as_millis()).unwrap_or(u64::MAX),
                bytes: o.bytes,
                geometry: c_geometry(&o.geometry),
                reserved: 0,
            };
            // SAFETY: `i < capacity` entries are writable per the contract.
            unsafe { orphans.add(i).write(entry) };
        }
        // SAFETY: checked non-NULL; writable per the contract.
        unsafe { count.write(listed.len()) };
        Ok(())
    })
}

/// See `kvmm.h`.
///
/// # Safety
///
/// `client` is NULL or a live handle; `wiped_bytes` NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvmm_discard(client: *const KvmmClient, session_id: u64, wiped_bytes: *mut u64) -> c_int {
    call("kvmm_discard", || {
        // SAFETY: per this function's contract.
        let client = unsafe { required(client, "client") }?;
        let wiped = client.client.discard(session_id)?;
        // SAFETY: as above.
        unsafe { write_optional(wiped_bytes, wiped) };
        Ok(())
    })
}

/// See `kvmm.h`.
///
/// # Safety
///
/// `session` is NULL or a live handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvmm_session_id(session: *const KvmmSession) -> u64 {
    // SAFETY: per this function's contract.
    unsafe { session.as_ref() }.map_or(0, |s| s.session.id())
}

/// See `kvmm.h`.
///
/// # Safety
///
/// `session` is NULL or a live handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvmm_session_tokens(session: *const KvmmSession, layer: u32) -> u32 {
    // SAFETY: per this function's contract.
    unsafe { session.as_ref() }.map_or(0, |s| s.session.tokens(layer))
}

/// See `kvmm.h`.
///
/// # Safety
///
/// `session` is NULL or a live handle; `geometry` NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvmm_session_geometry(session: *const KvmmSession, geometry: *mut CGeometry) -> c_int {
    call("kvmm_session_geometry", || {
        let geometry = output(geometry, "geometry")?;
        // SAFETY: per this function's contract.
        let s = unsafe { required(session, "session") }?;
        // SAFETY: checked non-NULL; writable per the contract.
        unsafe { geometry.write(c_geometry(s.session.geometry())) };
        Ok(())
    })
}

/// See `kvmm.h`.
///
/// # Safety
///
/// `session` is NULL or a live handle no other thread uses; `k` and `v` NULL or valid for
/// `tokens × kv_heads × head_dim` floats.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvmm_append(
    session: *mut KvmmSession,
    layer: u32,
    k: *const f32,
    v: *const f32,
    tokens: usize,
) -> c_int {
    call("kvmm_append", || {
        // SAFETY: per this function's contract.
        let s = unsafe { required_mut(session, "session") }?;
        // SAFETY: per this function's contract.
        unsafe { append_rows(s, layer, k, v, tokens, "floats") }
    })
}

/// See `kvmm.h`.
///
/// # Safety
///
/// `session` is NULL or a live handle no other thread uses; `k` and `v` NULL or valid for
/// `tokens × kv_heads × head_dim` 16-bit values.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvmm_append16(
    session: *mut KvmmSession,
    layer: u32,
    element_type: u32,
    k: *const u16,
    v: *const u16,
    tokens: usize,
) -> c_int {
    call("kvmm_append16", || {
        // SAFETY: per this function's contract.
        let s = unsafe { required_mut(session, "session") }?;
        // `f16` and `bf16` are `repr(transparent)` over `u16`: the caller's bits are read as they are.
        match element(element_type, "element")? {
            // SAFETY: per this function's contract, with the cast above.
            ElementType::F16 => unsafe { append_rows(s, layer, k.cast::<f16>(), v.cast::<f16>(), tokens, "values") },
            // SAFETY: per this function's contract, with the cast above.
            ElementType::Bf16 => unsafe { append_rows(s, layer, k.cast::<bf16>(), v.cast::<bf16>(), tokens, "values") },
        }
    })
}

/// Appends `tokens` tokens' rows of `E` (`unit` names one in errors) after checking the lengths.
///
/// # Safety
///
/// `k` and `v` are NULL or valid for `tokens × kv_heads × head_dim` values of `E`.
unsafe fn append_rows<E: RowElement>(
    s: &mut KvmmSession,
    layer: u32,
    k: *const E,
    v: *const E,
    tokens: usize,
    unit: &str,
) -> Result<(), Failure> {
    let (row, _) = row_lengths(&s.session);
    let len = tokens
        .checked_mul(row)
        .filter(|&n| n <= isize::MAX as usize / size_of::<E>())
        .ok_or_else(|| invalid(format!("{tokens} tokens of {row} {unit} each is more than any buffer can hold")))?;
    if tokens == 0 {
        return Err(invalid("`tokens` is 0: append at least one token"));
    }
    // SAFETY: `len` values each, per this function's contract.
    let (k, v) = unsafe { (elements(k, len, "k")?, elements(v, len, "v")?) };
    Ok(s.session.append(layer, k, v)?)
}

/// See `kvmm.h`.
///
/// # Safety
///
/// `session` is NULL or a live handle no other thread uses; `q` NULL or valid for `q_heads ×
/// head_dim` floats and `out` NULL or valid for writing as many, not overlapping `q`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvmm_attention(session: *mut KvmmSession, layer: u32, q: *const f32, out: *mut f32) -> c_int {
    call("kvmm_attention", || {
        // SAFETY: per this function's contract.
        let s = unsafe { required_mut(session, "session") }?;
        let (_, n) = row_lengths(&s.session);
        // SAFETY: as above.
        let q = unsafe { elements(q, n, "q") }?;
        let out = output(out, "out")?;
        // SAFETY: `n` writable floats that do not overlap `q`, per the contract.
        let out = unsafe { std::slice::from_raw_parts_mut(out, n) };
        Ok(s.session.attention(layer, q, out)?)
    })
}

/// Writes up to `capacity` of `values` to `out` and their number to `count`.
///
/// # Safety
///
/// `out` valid for writing `capacity` values (or NULL with `capacity` 0); `count` checked non-NULL
/// and writable.
unsafe fn write_list<T: Copy>(values: &[T], out: *mut T, capacity: usize, count: *mut usize) {
    let n = values.len().min(capacity);
    if n > 0 {
        // SAFETY: `n ≤ capacity` values are writable at `out`, per the contract; `values` is
        // this library's memory, so the two do not overlap.
        unsafe { std::ptr::copy_nonoverlapping(values.as_ptr(), out, n) };
    }
    // SAFETY: per the contract.
    unsafe { count.write(values.len()) };
}

/// Rejects a NULL list with a nonzero capacity.
fn list<T>(out: *mut T, capacity: usize, what: &str) -> Result<(), Failure> {
    if out.is_null() && capacity > 0 {
        return Err(invalid(format!("`{what}` is NULL with a capacity of {capacity}")));
    }
    Ok(())
}

/// See `kvmm.h`.
///
/// # Safety
///
/// `session` is NULL or a live handle; `mass` valid for writing `capacity` floats (or NULL with
/// `capacity` 0); `count` NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvmm_last_mass(
    session: *const KvmmSession,
    mass: *mut f32,
    capacity: usize,
    count: *mut usize,
) -> c_int {
    call("kvmm_last_mass", || {
        let count = output(count, "count")?;
        list(mass, capacity, "mass")?;
        // SAFETY: per this function's contract.
        let s = unsafe { required(session, "session") }?;
        // SAFETY: as above.
        unsafe { write_list(s.session.last_mass(), mass, capacity, count) };
        Ok(())
    })
}

/// See `kvmm.h`.
///
/// # Safety
///
/// `session` is NULL or a live handle; `blocks` valid for writing `capacity` values (or NULL with
/// `capacity` 0); `count` NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvmm_dropped_blocks(
    session: *const KvmmSession,
    layer: u32,
    blocks: *mut u32,
    capacity: usize,
    count: *mut usize,
) -> c_int {
    call("kvmm_dropped_blocks", || {
        let count = output(count, "count")?;
        list(blocks, capacity, "blocks")?;
        // SAFETY: per this function's contract.
        let s = unsafe { required(session, "session") }?;
        let dropped = s.session.dropped_blocks(layer)?;
        // SAFETY: as above.
        unsafe { write_list(&dropped, blocks, capacity, count) };
        Ok(())
    })
}

/// See `kvmm.h`.
///
/// # Safety
///
/// `session` is NULL or a live handle no other thread uses; `wiped_bytes` NULL or writable for 3
/// values.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvmm_wipe(session: *mut KvmmSession, wiped_bytes: *mut u64) -> c_int {
    call("kvmm_wipe", || {
        // SAFETY: per this function's contract.
        let s = unsafe { required_mut(session, "session") }?;
        let wiped = s.session.wipe()?;
        if !wiped_bytes.is_null() {
            // SAFETY: 3 writable values per the contract.
            unsafe { std::ptr::copy_nonoverlapping(wiped.as_ptr(), wiped_bytes, 3) };
        }
        Ok(())
    })
}

/// See `kvmm.h`.
///
/// # Safety
///
/// `session` is NULL or a live handle no other thread uses.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvmm_truncate(session: *mut KvmmSession, tokens: u32) -> c_int {
    call("kvmm_truncate", || {
        // SAFETY: per this function's contract.
        let s = unsafe { required_mut(session, "session") }?;
        Ok(s.session.truncate(tokens)?)
    })
}

/// See `kvmm.h`.
///
/// # Safety
///
/// `session` is NULL or a live handle no other thread uses.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvmm_set_scale(session: *mut KvmmSession, scale: f32) -> c_int {
    call("kvmm_set_scale", || {
        // SAFETY: per this function's contract.
        let s = unsafe { required_mut(session, "session") }?;
        if !(scale.is_finite() && scale > 0.0) {
            return Err(invalid(format!("the softmax scale must be finite and positive, not {scale}")));
        }
        s.session.set_scale(scale);
        Ok(())
    })
}

/// See `kvmm.h`.
///
/// # Safety
///
/// `session` is NULL or a live handle no other thread uses.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvmm_set_page_budget(session: *mut KvmmSession, pages: usize) -> c_int {
    call("kvmm_set_page_budget", || {
        // SAFETY: per this function's contract.
        let s = unsafe { required_mut(session, "session") }?;
        Ok(s.session.set_page_budget((pages != 0).then_some(pages))?)
    })
}

/// See `kvmm.h`.
///
/// # Safety
///
/// `session` is NULL or a live handle; `resident` and `scheduled` NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvmm_prefetch(
    session: *const KvmmSession,
    first_layer: u32,
    end_layer: u32,
    first_block: u32,
    end_block: u32,
    resident: *mut u32,
    scheduled: *mut u32,
) -> c_int {
    call("kvmm_prefetch", || {
        // SAFETY: per this function's contract.
        let s = unsafe { required(session, "session") }?;
        if first_layer >= end_layer || first_block >= end_block {
            return Err(invalid(format!(
                "empty range: layers {first_layer}..{end_layer}, blocks {first_block}..{end_block} (the ends are excluded)"
            )));
        }
        let (now, started) = s.session.prefetch(first_layer..end_layer, first_block..end_block)?;
        // SAFETY: as above.
        unsafe {
            write_optional(resident, now);
            write_optional(scheduled, started);
        }
        Ok(())
    })
}

/// See `kvmm.h`.
///
/// # Safety
///
/// `session` is NULL or a live handle; `stats` NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvmm_stats(session: *const KvmmSession, stats: *mut CSessionStats) -> c_int {
    call("kvmm_stats", || {
        let stats = output(stats, "stats")?;
        // SAFETY: per this function's contract.
        let s = unsafe { required(session, "session") }?.session.stats()?;
        let c = CSessionStats {
            tokens: s.tokens,
            allocated_blocks: s.allocated_blocks,
            quota_tokens: s.quota_tokens,
            device_bytes: s.device_bytes,
            dram_bytes: s.dram_bytes,
            flash_bytes: s.flash_bytes,
            device_pages: s.pages[0],
            dram_pages: s.pages[1],
            flash_pages: s.pages[2],
            reserved: 0,
            faults: s.faults,
            pages_moved: s.pages_moved,
            dropped_pages: s.dropped_pages,
        };
        // SAFETY: checked non-NULL; writable per the contract.
        unsafe { stats.write(c) };
        Ok(())
    })
}

/// See `kvmm.h`.
///
/// # Safety
///
/// `session` is NULL or a live handle no other thread uses, not used again; `wiped_bytes` NULL or
/// writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvmm_detach(session: *mut KvmmSession, wiped_bytes: *mut u64) -> c_int {
    call("kvmm_detach", || {
        if session.is_null() {
            return Err(invalid("`session` is NULL"));
        }
        // SAFETY: a handle from `kvmm_attach` or `kvmm_resume` (a leaked box), freed once per the
        // contract.
        let s = unsafe { Box::from_raw(session) };
        let wiped = s.session.detach()?;
        // SAFETY: per this function's contract.
        unsafe { write_optional(wiped_bytes, wiped) };
        Ok(())
    })
}

/// See `kvmm.h`.
///
/// # Safety
///
/// `session` is NULL or a live handle no other thread uses, not used again.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvmm_session_free(session: *mut KvmmSession) {
    if !session.is_null() {
        // SAFETY: a leaked box from `kvmm_attach` or `kvmm_resume`, freed once per the contract;
        // dropping the session detaches it.
        let _ = catch_unwind(AssertUnwindSafe(|| drop(unsafe { Box::from_raw(session) })));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The header's promises about handles, checked by the compiler.
    #[test]
    fn a_client_is_shared_between_threads_and_a_session_moves_between_them() {
        fn sync<T: Send + Sync>() {}
        fn send<T: Send>() {}
        sync::<KvmmClient>();
        send::<KvmmSession>();
    }

    #[test]
    fn a_null_argument_is_an_invalid_argument_with_a_sentence_naming_it() {
        let mut client = std::ptr::null_mut();
        // SAFETY: a valid string and a writable pointer.
        let status = unsafe { kvmm_connect(c"/nonexistent/kvmm.sock".as_ptr(), &mut client) };
        assert_eq!(status, Code::Unavailable as c_int);
        assert!(client.is_null(), "no handle on failure");
        // SAFETY: the library's own NUL-terminated buffer.
        let message = unsafe { CStr::from_ptr(kvmm_last_error()) }.to_str().unwrap_or_default().to_owned();
        assert!(message.starts_with("kvmm_connect: cannot connect to kvmmd at /nonexistent/kvmm.sock"), "{message}");

        let geometry =
            CGeometry { layers: 1, kv_heads: 1, q_heads: 1, head_dim: 16, max_tokens: 32, ..CGeometry::default() };
        let mut session = std::ptr::null_mut();
        // SAFETY: NULL client (checked), valid geometry, NULL options, writable output.
        let status = unsafe { kvmm_attach(std::ptr::null(), &geometry, std::ptr::null(), &mut session) };
        assert_eq!(status, Code::InvalidArgument as c_int);
        // SAFETY: as above.
        let message = unsafe { CStr::from_ptr(kvmm_last_error()) }.to_str().unwrap_or_default().to_owned();
        assert_eq!(message, "kvmm_attach: `client` is NULL");
        // SAFETY: NULL is allowed.
        unsafe { kvmm_session_free(std::ptr::null_mut()) };
        // SAFETY: NULL session (checked).
        assert_eq!(unsafe { kvmm_detach(std::ptr::null_mut(), std::ptr::null_mut()) }, Code::InvalidArgument as c_int);
    }

    #[test]
    fn every_status_has_the_name_the_header_gives_it() {
        // SAFETY: the library's static NUL-terminated names.
        let name = |s| unsafe { CStr::from_ptr(kvmm_status_name(s)) }.to_str().unwrap_or_default().to_owned();
        assert_eq!(name(0), "OK");
        assert_eq!(name(3), "INVALID_ARGUMENT");
        assert_eq!(name(8), "RESOURCE_EXHAUSTED");
        assert_eq!(name(14), "UNAVAILABLE");
        assert_eq!(name(2), "UNKNOWN");
        assert_eq!(name(-1), "UNKNOWN");
        assert_eq!(name(16), kvmm_client::error::code_name(Code::Unauthenticated));
        for code in 0..=16 {
            assert_eq!(name(code), kvmm_client::error::code_name(Code::from_i32(code)));
        }
    }
}
