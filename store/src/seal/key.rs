//! [`SessionKey`]: one session's AES-256-GCM key, living only in locked memory.
//!
//! [`SessionKey::generate`] reads 32 random bytes from the kernel (`getrandom(2)`) straight into a
//! [`LockedBox`], builds ring's AES-256-GCM key (its AES key schedule and GHASH table, a plain Rust
//! value) inside a second `LockedBox`, and drops the first, which wipes the raw key bytes. The key
//! is never written anywhere else, never leaves the process, and is wiped when the session's
//! `SessionKey` is dropped (the box wipes its whole mapping, whatever the value's own `Drop` does).
//!
//! Limits of what Rust can promise: building the cipher may leave copies of round keys in the stack
//! frames of the key-expansion code (a returned value may be moved through the stack) and in CPU
//! registers. After building it, `generate` overwrites the stack below its own frame
//! ([`scrub_stack`]), which covers those frames; registers are overwritten by the next cipher work.
//!
//! Invariant: a `SessionKey` holds a cipher built from 32 bytes of kernel randomness that no other
//! `SessionKey` shares, and no copy of the raw key bytes exists once `generate` returns.

use std::fmt;
use std::mem::MaybeUninit;

use ring::aead::{AES_256_GCM, LessSafeKey, UnboundKey};
use zeroize::Zeroize;

use super::SealError;
use super::locked::LockedBox;

/// Length of an AES-256 key.
const KEY_LEN: usize = 32;

/// Bytes of stack [`scrub_stack`] overwrites: generously more than the key expansion uses.
const SCRUB_BYTES: usize = 16 * 1024;

/// One session's sealing key: an AES-256-GCM cipher in locked, non-dumpable memory.
pub struct SessionKey {
    /// The cipher (AES-256 key schedule and GHASH table); wiped when the key is dropped.
    cipher: LockedBox<LessSafeKey>,
}

impl SessionKey {
    /// A fresh random key.
    ///
    /// # Errors
    ///
    /// [`SealError::Random`] when the kernel gives no randomness; [`SealError::KeyMemory`] or
    /// [`SealError::KeyMapping`] when the locked memory cannot be had.
    pub fn generate() -> Result<SessionKey, SealError> {
        let raw = LockedBox::new_with(|slot: &mut MaybeUninit<[u8; KEY_LEN]>| {
            let bytes = slot.write([0; KEY_LEN]);
            fill_random(bytes)?;
            Ok(bytes)
        })?;
        let key = SessionKey::from_locked_bytes(&raw);
        drop(raw);
        scrub_stack();
        key
    }

    /// A key from bytes already in locked memory (tests use fixed bytes; production uses
    /// [`SessionKey::generate`]).
    fn from_locked_bytes(raw: &LockedBox<[u8; KEY_LEN]>) -> Result<SessionKey, SealError> {
        let cipher = LockedBox::new_with(|slot| build_cipher(raw, slot))?;
        Ok(SessionKey { cipher })
    }

    /// The cipher, for sealing and opening.
    pub(crate) fn cipher(&self) -> &LessSafeKey {
        &self.cipher
    }
}

/// Builds the cipher into `slot`. Not inlined, so its temporaries live in a frame below the caller's
/// that [`scrub_stack`] covers afterwards.
#[inline(never)]
fn build_cipher<'a>(
    raw: &LockedBox<[u8; KEY_LEN]>,
    slot: &'a mut MaybeUninit<LessSafeKey>,
) -> Result<&'a mut LessSafeKey, SealError> {
    let key = UnboundKey::new(&AES_256_GCM, &raw[..]).expect("a 32-byte array is an AES-256 key");
    Ok(slot.write(LessSafeKey::new(key)))
}

/// Fills `bytes` from the kernel's random number generator (`getrandom(2)`, blocking until it is
/// seeded), retrying interrupted and short reads.
fn fill_random(bytes: &mut [u8]) -> Result<(), SealError> {
    let mut filled = 0;
    while filled < bytes.len() {
        match rustix::rand::getrandom(&mut bytes[filled..], rustix::rand::GetRandomFlags::empty()) {
            Ok(0) => return Err(SealError::Random { source: std::io::Error::from(rustix::io::Errno::IO) }),
            Ok(n) => filled += n,
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(SealError::Random { source: e.into() }),
        }
    }
    Ok(())
}

/// Overwrites [`SCRUB_BYTES`] of the stack below the caller's frame, where the frames of functions
/// it has just called (the key expansion) were. Best effort: see the module doc.
#[inline(never)]
fn scrub_stack() {
    let mut area = [MaybeUninit::<u8>::uninit(); SCRUB_BYTES];
    area.zeroize();
    std::hint::black_box(&area);
}

impl fmt::Debug for SessionKey {
    /// Never prints key material.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SessionKey(..)")
    }
}

#[cfg(test)]
impl SessionKey {
    /// A key with fixed bytes, for known-answer tests.
    pub(crate) fn from_bytes_for_test(bytes: [u8; KEY_LEN]) -> Result<SessionKey, SealError> {
        let raw = LockedBox::new(bytes)?;
        SessionKey::from_locked_bytes(&raw)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_output_shows_no_key_material() -> Result<(), SealError> {
        let key = SessionKey::generate()?;
        assert_eq!(format!("{key:?}"), "SessionKey(..)");
        assert_eq!(format!("{key:#?}"), "SessionKey(..)");
        Ok(())
    }

    #[test]
    fn session_key_is_send_and_sync_for_engine_threads() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<SessionKey>();
    }

    #[test]
    fn random_bytes_fill_the_whole_buffer() -> Result<(), SealError> {
        let mut a = [0u8; 600];
        let mut b = [0u8; 600];
        fill_random(&mut a)?;
        fill_random(&mut b)?;
        assert_ne!(a, b);
        assert!(a[560..].iter().any(|&x| x != 0), "the tail was filled too");
        Ok(())
    }
}
