//! The [`Tier`] seam: a place that holds pages outside the device tier, with its own byte budget
//! and counters. The DRAM pool ([`crate::dram::DramPool`]) and the flash file
//! ([`crate::flash::FlashFile`]) implement it; the daemon's device arenas live behind the same
//! stats.
//!
//! Contract (every tier MUST keep it; the mover and the shared tier tests rely on it):
//! - `put` stores each page under a fresh slot and returns one result per page, in order; a page
//!   whose `put` failed holds nothing, and `used` grows by exactly the slots of the pages that landed;
//! - `get` fills each `out` with exactly the bytes `put` was given for that page, or fails that page
//!   alone; on an authentication failure `out` is zeroed and the error is [`TierError::DataLoss`]:
//!   wrong bytes are never returned;
//! - `free` returns a slot (its nonce counter stays spent); `discard` also destroys its bytes in the
//!   tier (zeroed memory, punched file blocks);
//! - a sealing tier binds each slot's bytes to the page, session key, slot and write (see `seal`),
//!   so bytes moved between slots, pages or sessions fail `get`.

use std::fmt;

use crate::io::IoError;
use crate::seal::{SealError, SessionKey};

/// Which tier (the codes of `kvmm.v1.Tier` and of the session table).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TierKind {
    /// The arenas clients map.
    Device = 1,
    /// The daemon's private memory pool.
    Dram = 2,
    /// The flash file.
    Flash = 3,
}

impl TierKind {
    /// The name used in stats, logs and errors.
    pub fn name(self) -> &'static str {
        match self {
            TierKind::Device => "device",
            TierKind::Dram => "dram",
            TierKind::Flash => "flash",
        }
    }
}

impl fmt::Display for TierKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Which page a slot holds: the page fields of the seal's AAD.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PageId {
    pub session: u64,
    pub layer: u32,
    pub block: u32,
}

/// One page to store. `key` seals it; a tier that always seals refuses a page without one.
#[derive(Debug)]
pub struct PageWrite<'a> {
    pub key: Option<&'a SessionKey>,
    pub page: PageId,
    pub bytes: &'a [u8],
}

/// One page to load into `out` (exactly the stored length), from `slot`, opened with `key` if it
/// was sealed.
#[derive(Debug)]
pub struct PageRead<'a, S> {
    pub key: Option<&'a SessionKey>,
    pub page: PageId,
    pub slot: S,
    pub out: &'a mut [u8],
}

/// Counters of one tier.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TierStats {
    /// The byte budget.
    pub budget: u64,
    /// Bytes of live slots (as allocated, with alignment).
    pub used: u64,
    /// Live slots.
    pub pages: u64,
    /// Pages stored and loaded since start, and their payload bytes.
    pub pages_in: u64,
    pub pages_out: u64,
    pub bytes_in: u64,
    pub bytes_out: u64,
    /// I/O requests issued (after coalescing); zero for memory tiers.
    pub write_requests: u64,
    pub read_requests: u64,
    /// Loads refused because the slot failed authentication.
    pub auth_failures: u64,
    /// Pages whose I/O failed.
    pub io_failures: u64,
}

/// A tier below the device; see the module doc for the contract.
pub trait Tier: Send + fmt::Debug {
    /// What the caller keeps to find a page again.
    type Slot: Copy + fmt::Debug + PartialEq;

    /// Which tier this is.
    fn kind(&self) -> TierKind;

    /// Counters.
    fn stats(&self) -> TierStats;

    /// Stores `pages`; one result per page, in order.
    fn put(&mut self, pages: &[PageWrite<'_>]) -> Vec<Result<Self::Slot, TierError>>;

    /// Loads pages into their `out` buffers; one result per page, in order.
    fn get(&mut self, reads: &mut [PageRead<'_, Self::Slot>]) -> Vec<Result<(), TierError>>;

    /// Returns a slot to the free space.
    fn free(&mut self, slot: Self::Slot);

    /// Returns a slot and destroys its bytes in the tier.
    fn discard(&mut self, slot: Self::Slot) -> Result<(), TierError>;
}

/// Errors of the tiers below the device.
#[derive(Debug, thiserror::Error)]
pub enum TierError {
    /// The tier could not be set up.
    #[error("could not set up the {tier} tier at {at}: {what}")]
    Create { tier: TierKind, at: String, what: String },
    /// No free extent is large enough.
    #[error(
        "the {tier} tier is full: a page needs {need} bytes and {free} of {budget} are free; raise the {tier} budget"
    )]
    Full { tier: TierKind, need: u64, free: u64, budget: u64 },
    /// The slot's bytes are not the page's (changed, swapped or replayed); nothing was returned.
    #[error(
        "page {block} of layer {layer} of session {session} in the {tier} tier failed authentication ({why}); its data is lost and was not returned"
    )]
    DataLoss { tier: TierKind, session: u64, layer: u32, block: u32, why: &'static str },
    /// The transfer failed.
    #[error(transparent)]
    Io(#[from] IoError),
    /// Sealing refused (a spent slot, a page too long, no key memory).
    #[error(transparent)]
    Seal(#[from] SealError),
    /// A sealing tier was given a page without a key.
    #[error(
        "the {tier} tier seals every page, but page {block} of layer {layer} of session {session} came without a key"
    )]
    NoKey { tier: TierKind, session: u64, layer: u32, block: u32 },
    /// The read buffer does not match the stored page.
    #[error("the read buffer holds {got} bytes but the slot holds a {len}-byte page")]
    BufferLength { got: usize, len: u32 },
}

impl TierError {
    /// Whether this is an authentication failure (`DATA_LOSS` to the client).
    pub fn is_data_loss(&self) -> bool {
        matches!(self, TierError::DataLoss { .. })
    }
}
