//! The session-table ABI: the bytes the daemon and its clients share for one session.
//!
//! Two memfds per session. Every field is native-endian (kvmm runs on little-endian hosts only) and
//! every struct is `#[repr(C)]` with its size asserted at compile time. The ABI version changes
//! whenever any of this does.
//!
//! ```text
//!  session table (daemon writes; sealed SHRINK | GROW | FUTURE_WRITE | SEAL, clients map it read-only)
//!
//!  byte 0   +-------------------------------- TableHeader, 128 B --------------------------------+
//!           |  0 magic u64 "KVMMTABL"      |  8 abi_version u32 = 3  | 12 header_bytes u32 = 128  |
//!           | 16 session_id u64            | 24 layers u32           | 28 blocks_per_layer u32    |
//!           | 32 kv_heads u32              | 36 q_heads u32          | 40 head_dim u32            |
//!           | 44 block_tokens u32          | 48 element_type u32     | 52 entry_bytes u32 = 32    |
//!           | 56 page_bytes u64                                                                  |
//!           | 64 max_tokens u32            | 68 status u32 (atomic: 0 open, 1 wiped, 2 closed,    |
//!           |                              |    3 revoked)                                        |
//!           | 72..128 reserved (0)                                                               |
//!  byte 128 +----------------------------- DaemonEntry, 32 B each ------------------------------+
//!           |  0 state u64 (atomic) = generation << 32 | flags (ALLOCATED 1, RESIDENT 2, MIGRATING 4,|
//!           |    DROPPED 8)                                                                       |
//!           |  8 offset u64 (atomic): byte offset of the frame in the arena                       |
//!           | 16 len u32 (atomic): bytes of the page in its format                                |
//!           | 20 format_tier u32 (atomic): format code (bits 0..8) | tier << 8 (1 = device)        |
//!           | 24..32 reserved (0)                                                                 |
//!           +------------------ entry of (layer, block) at 128 + 32 × (layer × B + block) -------+
//!
//!  client region (client writes; sealed SHRINK | GROW | SEAL, mapped read-write by both)
//!
//!  byte 0   +------------------------------- header, 64 B -------------------------------------+
//!           |  0 magic u64 "KVMMCLNT"      |  8 abi_version u32 = 3  | 12 header_bytes u32 = 64   |
//!           | 16 entry_bytes u32 = 16      | 20 layers u32           | 24 blocks_per_layer u32    |
//!           | 28..64 reserved (0)                                                                |
//!  byte 64  +----------------------------- ClientEntry, 16 B each ------------------------------+
//!           |  0 pins u32 | 4 tokens u32 | 8 importance u32 (f32 bits) | 12 unpins u32 (all atomic) |
//!           +------------------ entry of (layer, block) at 64 + 16 × (layer × B + block) --------+
//!
//!  B = blocks_per_layer = ceil(max_tokens / block_tokens)
//! ```
//!
//! `unpins` (ABI version 3) counts the client's unpins of the page, wrapping: a page whose `pins`
//! stay above zero while `unpins` stands still holds the same pin, which the daemon reports as stuck
//! once it outlasts the pin lease. A client that pins and unpins all the time moves the count, so
//! a busy page is never taken for a stuck one.
//!
//! Who writes what: the table header is written once, by the daemon, before the memfd is sealed and
//! handed out; afterwards only `status` changes. Daemon entries are written only by the daemon (the
//! protocol in [`crate::protocol`]); client entries only by the client, and the daemon validates and
//! clamps what it reads there ([`ClientEntry::tokens_clamped`], [`ClientEntry::importance_clamped`]).
//! The client region's header is written by the daemon at creation and never read by it again (a
//! client could overwrite it).
//!
//! Read-only memory: the types here are views of shared memory. A client's [`DaemonEntry`] and
//! [`TableHeader`] live in a read-only mapping, so their public methods only load, relaxed (plus an
//! acquire fence where acquire ordering is needed); the daemon's writes go through
//! [`crate::table::EntryWriter`], which only a writable table hands out.

use std::fmt;
use std::mem::offset_of;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering, fence};

use kvmm_kernels::Format;

use crate::error::ShmError;
use crate::geometry::Geometry;
use crate::protocol::{self, PinOutcome};
use crate::state::{PageFlags, unpack_state};

const _: () = assert!(cfg!(target_endian = "little"), "the kvmm shared-memory ABI is little-endian");

/// Version of everything in this file; bumped on any change.
pub const ABI_VERSION: u32 = 3;
/// `magic` of a session table: `"KVMMTABL"` read as a little-endian u64.
pub const TABLE_MAGIC: u64 = u64::from_le_bytes(*b"KVMMTABL");
/// `magic` of a client region: `"KVMMCLNT"` read as a little-endian u64.
pub const CLIENT_MAGIC: u64 = u64::from_le_bytes(*b"KVMMCLNT");
/// Size of [`TableHeader`].
pub const TABLE_HEADER_BYTES: u32 = 128;
/// Size of [`DaemonEntry`].
pub const DAEMON_ENTRY_BYTES: u32 = 32;
/// Size of the client region's header.
pub const CLIENT_HEADER_BYTES: u32 = 64;
/// Size of [`ClientEntry`].
pub const CLIENT_ENTRY_BYTES: u32 = 16;

/// Byte size of the session-table memfd: header plus one [`DaemonEntry`] per page.
pub fn table_bytes(geometry: &Geometry) -> u64 {
    // Saturating, so that an unvalidated geometry cannot overflow; `validate` bounds real ones to
    // at most 2 GiB.
    u64::from(TABLE_HEADER_BYTES).saturating_add(geometry.pages().saturating_mul(u64::from(DAEMON_ENTRY_BYTES)))
}

/// Byte size of the client-region memfd: header plus one [`ClientEntry`] per page.
pub fn client_region_bytes(geometry: &Geometry) -> u64 {
    u64::from(CLIENT_HEADER_BYTES).saturating_add(geometry.pages().saturating_mul(u64::from(CLIENT_ENTRY_BYTES)))
}

/// Index of page `(layer, block)` among all entries (row-major: layer, then block), or an error
/// naming the limits.
pub(crate) fn entry_index(
    region: &'static str,
    geometry: &Geometry,
    layer: u32,
    block: u32,
) -> Result<usize, ShmError> {
    let blocks_per_layer = geometry.blocks_per_layer();
    if layer >= geometry.layers || block >= blocks_per_layer {
        return Err(ShmError::EntryOutOfRange { region, layer, block, layers: geometry.layers, blocks_per_layer });
    }
    Ok(layer as usize * blocks_per_layer as usize + block as usize)
}

/// Checks `layer` and returns the index of its first entry.
pub(crate) fn layer_start(region: &'static str, geometry: &Geometry, layer: u32) -> Result<usize, ShmError> {
    entry_index(region, geometry, layer, 0)
}

/// The session table's 128-byte header. Written once by the daemon before the table is sealed and
/// handed out; only `status` changes afterwards.
#[repr(C)]
pub struct TableHeader {
    /// [`TABLE_MAGIC`].
    pub magic: u64,
    /// [`ABI_VERSION`].
    pub abi_version: u32,
    /// [`TABLE_HEADER_BYTES`]; entries start here.
    pub header_bytes: u32,
    /// The session this table belongs to.
    pub session_id: u64,
    /// Geometry: layers.
    pub layers: u32,
    /// Geometry: `ceil(max_tokens / block_tokens)`.
    pub blocks_per_layer: u32,
    /// Geometry: KV heads.
    pub kv_heads: u32,
    /// Geometry: query heads.
    pub q_heads: u32,
    /// Geometry: elements per head.
    pub head_dim: u32,
    /// Geometry: tokens per page.
    pub block_tokens: u32,
    /// Geometry: element type code (1 = f16, 2 = bf16).
    pub element_type: u32,
    /// [`DAEMON_ENTRY_BYTES`].
    pub entry_bytes: u32,
    /// Bytes of one uncompressed page.
    pub page_bytes: u64,
    /// Geometry: largest context.
    pub max_tokens: u32,
    /// [`TableStatus`] code; written by the daemon (`Release`), read by clients.
    pub(crate) status: AtomicU32,
    /// Zero; room for later versions.
    pub(crate) _reserved: [u32; 14],
}

const _: () = assert!(size_of::<TableHeader>() == TABLE_HEADER_BYTES as usize);
const _: () = assert!(offset_of!(TableHeader, abi_version) == 8);
const _: () = assert!(offset_of!(TableHeader, session_id) == 16);
const _: () = assert!(offset_of!(TableHeader, layers) == 24);
const _: () = assert!(offset_of!(TableHeader, element_type) == 48);
const _: () = assert!(offset_of!(TableHeader, entry_bytes) == 52);
const _: () = assert!(offset_of!(TableHeader, page_bytes) == 56);
const _: () = assert!(offset_of!(TableHeader, max_tokens) == 64);
const _: () = assert!(offset_of!(TableHeader, status) == 68);

impl TableHeader {
    /// The session's status. A relaxed load followed by an acquire fence (valid on the client's
    /// read-only mapping); an unknown code is a layout error.
    pub fn status(&self) -> Result<TableStatus, ShmError> {
        let code = self.status.load(Ordering::Relaxed);
        fence(Ordering::Acquire);
        TableStatus::from_code(code).ok_or_else(|| ShmError::layout("session table", "status", "0, 1, 2 or 3", code))
    }
}

impl fmt::Debug for TableHeader {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TableHeader")
            .field("magic", &format_args!("{:#x}", self.magic))
            .field("abi_version", &self.abi_version)
            .field("session_id", &self.session_id)
            .field("layers", &self.layers)
            .field("blocks_per_layer", &self.blocks_per_layer)
            .field("kv_heads", &self.kv_heads)
            .field("q_heads", &self.q_heads)
            .field("head_dim", &self.head_dim)
            .field("block_tokens", &self.block_tokens)
            .field("element_type", &self.element_type)
            .field("page_bytes", &self.page_bytes)
            .field("max_tokens", &self.max_tokens)
            .field("status", &self.status.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

/// A session's lifecycle as published in the table header.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum TableStatus {
    /// The session is live.
    Open = 0,
    /// The session was wiped: its pages are zeroed and gone; stop using them.
    Wiped = 1,
    /// The session was closed (detached, or its connection ended).
    Closed = 2,
    /// The daemon revoked the session (ABI version 3): one of its pages stayed pinned past the pin
    /// lease. Like `Wiped`: its pages are zeroed and gone; stop using them.
    Revoked = 3,
}

impl TableStatus {
    /// The status with code `code`.
    pub fn from_code(code: u32) -> Option<TableStatus> {
        match code {
            0 => Some(TableStatus::Open),
            1 => Some(TableStatus::Wiped),
            2 => Some(TableStatus::Closed),
            3 => Some(TableStatus::Revoked),
            _ => None,
        }
    }

    /// The code stored in the header.
    pub fn code(self) -> u32 {
        self as u32
    }

    /// Whether the session's pages were zeroed under its client (`Wiped` or `Revoked`).
    pub fn is_wiped(self) -> bool {
        matches!(self, TableStatus::Wiped | TableStatus::Revoked)
    }
}

/// Where a resident page lives. Read from a [`DaemonEntry`] only while the page is pinned.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct PageLocation {
    /// Byte offset of the frame in the arena.
    pub offset: u64,
    /// Bytes of the page in its format.
    pub len: u32,
    /// Format code ([`kvmm_kernels::Format`]'s ABI code; 0 = none).
    pub format: u8,
    /// Tier code ([`PageLocation::TIER_DEVICE`] for arena pages; 0 = none).
    pub tier: u8,
}

impl PageLocation {
    /// Tier code of the device tier (the arena clients map).
    pub const TIER_DEVICE: u8 = 1;

    /// A device-tier location of `len` bytes at `offset` in `format`.
    pub fn device(offset: u64, len: u32, format: Format) -> PageLocation {
        PageLocation { offset, len, format: format.as_u8(), tier: PageLocation::TIER_DEVICE }
    }

    /// The format, if this build knows its code.
    pub fn format(&self) -> Option<Format> {
        Format::from_u8(self.format)
    }

    /// `format | tier << 8`, as stored.
    pub fn format_tier(&self) -> u32 {
        u32::from(self.format) | u32::from(self.tier) << 8
    }
}

/// One page's entry in the session table (32 bytes). Written only by the daemon; see the module
/// doc for why the public methods only load.
#[repr(C, align(32))]
pub struct DaemonEntry {
    /// `generation << 32 | flags` ([`crate::state`]).
    pub(crate) state: AtomicU64,
    /// Arena byte offset of the frame.
    offset: AtomicU64,
    /// Bytes of the page.
    len: AtomicU32,
    /// Format code | tier << 8.
    format_tier: AtomicU32,
    /// Zero.
    _reserved: [AtomicU32; 2],
}

const _: () = assert!(size_of::<DaemonEntry>() == DAEMON_ENTRY_BYTES as usize);
const _: () = assert!(align_of::<DaemonEntry>() == 32);
const _: () = assert!(offset_of!(DaemonEntry, offset) == 8);
const _: () = assert!(offset_of!(DaemonEntry, len) == 16);
const _: () = assert!(offset_of!(DaemonEntry, format_tier) == 20);

impl DaemonEntry {
    /// The page's generation and flags. `Relaxed` is a plain relaxed load; `Acquire` (and
    /// `Release`/`AcqRel`, which a load cannot have) is a relaxed load followed by an acquire fence,
    /// which is valid on the client's read-only mapping; `SeqCst` is followed by a `SeqCst` fence.
    pub fn load_state(&self, order: Ordering) -> (u32, PageFlags) {
        let word = self.state.load(Ordering::Relaxed);
        match order {
            Ordering::Relaxed => {}
            Ordering::SeqCst => fence(Ordering::SeqCst),
            _ => fence(Ordering::Acquire),
        }
        unpack_state(word)
    }

    /// The page's location (relaxed loads). Meaningful only while the page is pinned and was
    /// `RESIDENT` when pinned: then it is the location published with the state the pin observed.
    pub fn location(&self) -> PageLocation {
        let format_tier = self.format_tier.load(Ordering::Relaxed);
        PageLocation {
            offset: self.offset.load(Ordering::Relaxed),
            len: self.len.load(Ordering::Relaxed),
            format: (format_tier & 0xff) as u8,
            tier: ((format_tier >> 8) & 0xff) as u8,
        }
    }

    /// Writes the location words (relaxed). Daemon only, writable mapping only; a later `Release`
    /// store of the state word publishes them.
    pub(crate) fn store_location(&self, location: PageLocation) {
        self.offset.store(location.offset, Ordering::Relaxed);
        self.len.store(location.len, Ordering::Relaxed);
        self.format_tier.store(location.format_tier(), Ordering::Relaxed);
    }
}

impl fmt::Debug for DaemonEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (generation, flags) = self.load_state(Ordering::Relaxed);
        f.debug_struct("DaemonEntry")
            .field("generation", &generation)
            .field("flags", &flags)
            .field("location", &self.location())
            .finish()
    }
}

/// One page's entry in the client region (16 bytes). Written by the client; read, validated and
/// clamped by the daemon.
#[repr(C, align(16))]
pub struct ClientEntry {
    /// Pins held by the client's threads ([`crate::protocol`]).
    pub(crate) pins: AtomicU32,
    /// Tokens written into the page (a tail page fills up; full pages hold `block_tokens`).
    tokens: AtomicU32,
    /// Attention mass the client's kernels accumulated for the page (f32 bits).
    importance: AtomicU32,
    /// Unpins the client made, wrapping (module doc): the daemon tells a pin held from one taken
    /// again by whether this moved.
    unpins: AtomicU32,
}

const _: () = assert!(size_of::<ClientEntry>() == CLIENT_ENTRY_BYTES as usize);
const _: () = assert!(align_of::<ClientEntry>() == 16);
const _: () = assert!(offset_of!(ClientEntry, tokens) == 4);
const _: () = assert!(offset_of!(ClientEntry, importance) == 8);
const _: () = assert!(offset_of!(ClientEntry, unpins) == 12);

impl ClientEntry {
    /// Pins currently announced (relaxed; for reporting stuck pins).
    pub fn pins(&self) -> u32 {
        self.pins.load(Ordering::Relaxed)
    }

    /// Pins `page` (announce, fence, check); see [`crate::protocol::pin`]. A pin that fails was
    /// taken back, which counts as an unpin.
    pub fn pin(&self, page: &DaemonEntry) -> PinOutcome {
        self.counted(protocol::pin(&self.pins, &page.state))
    }

    /// Announces a pin without the fence, for batches; see [`crate::protocol::pin_announce`].
    pub fn pin_announce(&self) {
        protocol::pin_announce(&self.pins);
    }

    /// Checks `page` after [`crate::protocol::pin_fence`]; see [`crate::protocol::pin_check`]. A
    /// pin that fails was taken back, which counts as an unpin.
    pub fn pin_check(&self, page: &DaemonEntry) -> PinOutcome {
        self.counted(protocol::pin_check(&self.pins, &page.state))
    }

    /// Releases a pin; see [`crate::protocol::unpin`]. Counts it in `unpins` first.
    pub fn unpin(&self) {
        self.count_unpin();
        protocol::unpin(&self.pins);
    }

    /// Counts a pin the protocol took back (any outcome but `Pinned`).
    fn counted(&self, outcome: PinOutcome) -> PinOutcome {
        if !outcome.is_pinned() {
            self.count_unpin();
        }
        outcome
    }

    /// Moves `unpins` on: a plain load and store, not a locked add (two threads unpinning at once
    /// may count one, which still moves the count).
    fn count_unpin(&self) {
        self.unpins.store(self.unpins.load(Ordering::Relaxed).wrapping_add(1), Ordering::Relaxed);
    }

    /// Unpins counted so far (relaxed, wrapping; for telling a stuck pin from a busy page).
    pub fn unpins(&self) -> u32 {
        self.unpins.load(Ordering::Relaxed)
    }

    /// Tokens in the page (`Acquire`: the rows the count covers are visible). Unclamped: the
    /// daemon uses [`ClientEntry::tokens_clamped`].
    pub fn tokens(&self) -> u32 {
        self.tokens.load(Ordering::Acquire)
    }

    /// Daemon: the token count, clamped to `block_tokens` (a client may write anything here).
    pub fn tokens_clamped(&self, block_tokens: u32) -> u32 {
        self.tokens().min(block_tokens)
    }

    /// Client: publishes that the page holds `tokens` tokens (`Release`: write the rows first).
    pub fn publish_tokens(&self, tokens: u32) {
        self.tokens.store(tokens, Ordering::Release);
    }

    /// The importance the client recorded (relaxed; any f32, including NaN).
    pub fn importance(&self) -> f32 {
        f32::from_bits(self.importance.load(Ordering::Relaxed))
    }

    /// Daemon: the importance as a finite, non-negative number (NaN, infinities and negatives read
    /// as 0).
    pub fn importance_clamped(&self) -> f32 {
        let value = self.importance();
        if value.is_finite() && value > 0.0 { value } else { 0.0 }
    }

    /// Client: records the page's importance (relaxed).
    pub fn set_importance(&self, importance: f32) {
        self.importance.store(importance.to_bits(), Ordering::Relaxed);
    }
}

impl fmt::Debug for ClientEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientEntry")
            .field("pins", &self.pins())
            .field("tokens", &self.tokens.load(Ordering::Relaxed))
            .field("importance", &self.importance())
            .finish()
    }
}

/// Client: pins a batch of pages (typically one layer) with one fence: announces every pin, fences
/// once, then checks each page. `outcomes` receives one [`PinOutcome`] per page, in order; pages
/// whose outcome is not `Pinned` are already unpinned. Release the rest with [`unpin_batch`].
pub fn pin_batch(
    clients: &[ClientEntry],
    pages: &[DaemonEntry],
    outcomes: &mut Vec<PinOutcome>,
) -> Result<(), ShmError> {
    if clients.len() != pages.len() {
        return Err(ShmError::LengthMismatch { what: "pin_batch", left: clients.len(), right: pages.len() });
    }
    outcomes.clear();
    for client in clients {
        client.pin_announce();
    }
    protocol::pin_fence();
    outcomes.extend(clients.iter().zip(pages).map(|(client, page)| client.pin_check(page)));
    Ok(())
}

/// Client: releases the pins that [`pin_batch`] took (the `Pinned` outcomes).
pub fn unpin_batch(clients: &[ClientEntry], outcomes: &[PinOutcome]) {
    for (client, outcome) in clients.iter().zip(outcomes) {
        if outcome.is_pinned() {
            client.unpin();
        }
    }
}

/// The client region's header, as encoded at byte 0 of the client-region memfd.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ClientHeader {
    pub(crate) magic: u64,
    pub(crate) abi_version: u32,
    pub(crate) header_bytes: u32,
    pub(crate) entry_bytes: u32,
    pub(crate) layers: u32,
    pub(crate) blocks_per_layer: u32,
}

impl ClientHeader {
    /// The header this build writes for `geometry`.
    pub(crate) fn for_geometry(geometry: &Geometry) -> ClientHeader {
        ClientHeader {
            magic: CLIENT_MAGIC,
            abi_version: ABI_VERSION,
            header_bytes: CLIENT_HEADER_BYTES,
            entry_bytes: CLIENT_ENTRY_BYTES,
            layers: geometry.layers,
            blocks_per_layer: geometry.blocks_per_layer(),
        }
    }

    pub(crate) fn encode(&self) -> [u8; CLIENT_HEADER_BYTES as usize] {
        let mut out = [0u8; CLIENT_HEADER_BYTES as usize];
        out[0..8].copy_from_slice(&self.magic.to_le_bytes());
        out[8..12].copy_from_slice(&self.abi_version.to_le_bytes());
        out[12..16].copy_from_slice(&self.header_bytes.to_le_bytes());
        out[16..20].copy_from_slice(&self.entry_bytes.to_le_bytes());
        out[20..24].copy_from_slice(&self.layers.to_le_bytes());
        out[24..28].copy_from_slice(&self.blocks_per_layer.to_le_bytes());
        out
    }

    pub(crate) fn decode(bytes: &[u8; CLIENT_HEADER_BYTES as usize]) -> ClientHeader {
        let u32_at = |at: usize| u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]]);
        let mut magic = [0u8; 8];
        magic.copy_from_slice(&bytes[0..8]);
        ClientHeader {
            magic: u64::from_le_bytes(magic),
            abi_version: u32_at(8),
            header_bytes: u32_at(12),
            entry_bytes: u32_at(16),
            layers: u32_at(20),
            blocks_per_layer: u32_at(24),
        }
    }
}

/// Renders a magic number as its 8 ASCII bytes when printable, else as hex.
pub(crate) fn render_magic(magic: u64) -> String {
    let bytes = magic.to_le_bytes();
    if bytes.iter().all(|b| b.is_ascii_graphic()) {
        format!("{:?}", String::from_utf8_lossy(&bytes))
    } else {
        format!("{magic:#018x}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn magics_spell_their_names() {
        assert_eq!(&TABLE_MAGIC.to_le_bytes(), b"KVMMTABL");
        assert_eq!(render_magic(CLIENT_MAGIC), "\"KVMMCLNT\"");
        assert_eq!(render_magic(0), "0x0000000000000000");
    }

    #[test]
    fn client_header_round_trips() {
        let h = ClientHeader {
            magic: CLIENT_MAGIC,
            abi_version: 1,
            header_bytes: 64,
            entry_bytes: 16,
            layers: 3,
            blocks_per_layer: 77,
        };
        assert_eq!(ClientHeader::decode(&h.encode()), h);
    }

    #[test]
    fn location_packs_format_and_tier() {
        let loc = PageLocation::device(4096, 32768, Format::Bf16);
        assert_eq!(loc.format_tier(), 2 | 1 << 8);
        assert_eq!(loc.format(), Some(Format::Bf16));
    }

    #[test]
    fn every_table_status_round_trips_and_only_wiped_and_revoked_are_wiped() {
        for status in [TableStatus::Open, TableStatus::Wiped, TableStatus::Closed, TableStatus::Revoked] {
            assert_eq!(TableStatus::from_code(status.code()), Some(status));
            assert_eq!(status.is_wiped(), matches!(status, TableStatus::Wiped | TableStatus::Revoked));
        }
        assert_eq!(TableStatus::from_code(4), None);
    }

    #[test]
    fn client_fields_are_clamped_for_the_daemon() {
        let e = ClientEntry {
            pins: AtomicU32::new(0),
            tokens: AtomicU32::new(0),
            importance: AtomicU32::new(0),
            unpins: AtomicU32::new(0),
        };
        e.publish_tokens(1_000_000);
        assert_eq!(e.tokens_clamped(32), 32);
        for bad in [f32::NAN, f32::INFINITY, -1.0] {
            e.set_importance(bad);
            assert_eq!(e.importance_clamped(), 0.0);
        }
        e.set_importance(0.25);
        assert_eq!(e.importance_clamped(), 0.25);
    }

    #[test]
    fn an_unpin_or_a_failed_pin_moves_the_unpin_count_and_a_pin_does_not() {
        let page = DaemonEntry {
            state: AtomicU64::new(crate::state::pack_state(1, PageFlags::ALLOCATED | PageFlags::RESIDENT)),
            offset: AtomicU64::new(0),
            len: AtomicU32::new(0),
            format_tier: AtomicU32::new(0),
            _reserved: [AtomicU32::new(0), AtomicU32::new(0)],
        };
        let e = ClientEntry {
            pins: AtomicU32::new(0),
            tokens: AtomicU32::new(0),
            importance: AtomicU32::new(0),
            unpins: AtomicU32::new(u32::MAX),
        };
        assert!(e.pin(&page).is_pinned());
        assert!(e.pin(&page).is_pinned());
        assert_eq!((e.pins(), e.unpins()), (2, u32::MAX), "pins alone leave the count");
        e.unpin();
        assert_eq!((e.pins(), e.unpins()), (1, 0), "an unpin counts, wrapping");
        e.unpin();
        assert_eq!((e.pins(), e.unpins()), (0, 1));
        page.state.store(crate::state::pack_state(1, PageFlags::ALLOCATED), Ordering::Relaxed);
        assert!(!e.pin(&page).is_pinned(), "a page that is not resident does not pin");
        assert_eq!((e.pins(), e.unpins()), (0, 2), "the pin taken back counts as an unpin");
    }
}
