//! [`SlotCounters`]: the per-slot write counters of one tier, the source of every sealing nonce.
//!
//! AES-GCM loses both confidentiality and authenticity if one nonce seals two plaintexts under one
//! key. A nonce is `(tier, slot, counter)` ([`SealNonce`]); this file makes the triples unique:
//!
//! - each slot's counter only ever grows: [`SlotCounters::next`] increments it before handing out the
//!   nonce, so a slot freed and written again (what a flash allocator does all the time) gets a new
//!   counter, never an old one;
//! - counters are never reset or restored while the struct lives, and the daemon keeps exactly one
//!   `SlotCounters` per tier for its whole life. Session keys never outlive the daemon (they exist
//!   only in its locked memory), so every nonce is unique under every key that can ever see it;
//! - a slot whose counter reached [`MAX_COUNTER`] (2^56 − 1) is exhausted: `next` refuses it with
//!   [`SealError::SlotExhausted`] and the caller must retire it. [`SlotCounters::retire`] does the same
//!   on purpose (a slot on a failing flash block, say).
//!
//! Invariant: `counters[s]` is the counter of the last nonce handed out for slot `s` (0 before the
//! first), and never decreases. Counter 0 is never handed out.

use super::SealError;
use super::aad::{MAX_COUNTER, SealNonce};

/// The write counters of every slot of one tier.
#[derive(Debug)]
pub struct SlotCounters {
    /// Tier code the nonces carry.
    tier: u8,
    /// Last counter handed out per slot (index = slot); grows only. Written by `next` and `retire`.
    counters: Vec<u64>,
}

impl SlotCounters {
    /// Counters for `slots` slots of `tier`, all at zero (no write yet).
    ///
    /// Create one per tier per daemon life: a second `SlotCounters` for the same tier would hand out
    /// the first one's nonces again under keys that are still alive.
    pub fn new(tier: u8, slots: u32) -> SlotCounters {
        SlotCounters { tier, counters: vec![0; slots as usize] }
    }

    /// Tier code.
    pub fn tier(&self) -> u8 {
        self.tier
    }

    /// Number of slots.
    pub fn slots(&self) -> u32 {
        u32::try_from(self.counters.len()).expect("built from a u32 slot count")
    }

    /// Advances `slot`'s counter and returns the nonce for the write about to happen to it.
    ///
    /// Use the nonce for exactly one seal. If the write then fails, the nonce is simply spent; never
    /// reuse it for a retry.
    ///
    /// # Errors
    ///
    /// [`SealError::SlotOutOfRange`] for a slot past the end; [`SealError::SlotExhausted`] for a slot
    /// whose counter reached [`MAX_COUNTER`] or that was retired.
    pub fn next(&mut self, slot: u32) -> Result<SealNonce, SealError> {
        let tier = self.tier;
        let slots = self.slots();
        let counter = self.counters.get_mut(slot as usize).ok_or(SealError::SlotOutOfRange { tier, slot, slots })?;
        if *counter >= MAX_COUNTER {
            return Err(SealError::SlotExhausted { tier, slot });
        }
        *counter += 1;
        SealNonce::new(tier, slot, *counter)
    }

    /// The counter of the last nonce handed out for `slot` (0 before the first write), or `None` for a
    /// slot past the end.
    pub fn counter(&self, slot: u32) -> Option<u64> {
        self.counters.get(slot as usize).copied()
    }

    /// Marks `slot` as never usable again: every later [`SlotCounters::next`] for it fails with
    /// [`SealError::SlotExhausted`].
    ///
    /// # Errors
    ///
    /// [`SealError::SlotOutOfRange`] for a slot past the end.
    pub fn retire(&mut self, slot: u32) -> Result<(), SealError> {
        let (tier, slots) = (self.tier, self.slots());
        let counter = self.counters.get_mut(slot as usize).ok_or(SealError::SlotOutOfRange { tier, slot, slots })?;
        *counter = MAX_COUNTER;
        Ok(())
    }

    /// True when `slot` can take no more writes (exhausted or retired). False for a slot past the end.
    pub fn is_exhausted(&self, slot: u32) -> bool {
        self.counter(slot).is_some_and(|c| c >= MAX_COUNTER)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use proptest::prelude::*;

    use super::*;
    use crate::seal::aad::TIER_FLASH;

    #[test]
    fn first_write_to_a_slot_gets_counter_one_and_counters_grow_per_slot() -> Result<(), SealError> {
        let mut c = SlotCounters::new(TIER_FLASH, 4);
        assert_eq!(c.next(2)?.counter(), 1);
        assert_eq!(c.next(2)?.counter(), 2);
        let n = c.next(3)?;
        assert_eq!((n.tier(), n.slot(), n.counter()), (TIER_FLASH, 3, 1));
        assert_eq!(c.counter(2), Some(2));
        assert_eq!(c.counter(0), Some(0));
        assert_eq!(c.counter(4), None);
        Ok(())
    }

    #[test]
    fn slot_past_the_end_is_refused() {
        let mut c = SlotCounters::new(TIER_FLASH, 4);
        assert!(matches!(c.next(4), Err(SealError::SlotOutOfRange { slot: 4, slots: 4, .. })));
        assert!(matches!(c.retire(u32::MAX), Err(SealError::SlotOutOfRange { .. })));
    }

    #[test]
    fn slot_at_the_last_counter_is_exhausted_after_its_final_write() -> Result<(), SealError> {
        let mut c = SlotCounters::new(TIER_FLASH, 2);
        c.counters[1] = MAX_COUNTER - 1;
        assert_eq!(c.next(1)?.counter(), MAX_COUNTER);
        assert!(c.is_exhausted(1));
        let err = c.next(1).err();
        assert!(matches!(err, Some(SealError::SlotExhausted { slot: 1, .. })), "{err:?}");
        assert_eq!(c.counter(1), Some(MAX_COUNTER), "a refused write does not move the counter");
        assert_eq!(c.next(0)?.counter(), 1, "other slots are unaffected");
        Ok(())
    }

    #[test]
    fn retired_slot_refuses_every_later_write() -> Result<(), SealError> {
        let mut c = SlotCounters::new(TIER_FLASH, 2);
        c.next(0)?;
        c.retire(0)?;
        assert!(c.is_exhausted(0));
        assert!(matches!(c.next(0), Err(SealError::SlotExhausted { .. })));
        assert!(!c.is_exhausted(1));
        Ok(())
    }

    proptest! {
        /// A flash allocator frees slots and writes them again in any order; no sequence of writes may
        /// produce one nonce twice.
        #[test]
        fn reused_slots_never_repeat_a_nonce(
            slots in 1u32..16,
            writes in proptest::collection::vec(any::<u32>(), 0..2000),
            retire_every in 0usize..50,
        ) {
            let mut c = SlotCounters::new(TIER_FLASH, slots);
            let mut seen = HashSet::new();
            for (i, w) in writes.into_iter().enumerate() {
                let slot = w % slots;
                if retire_every != 0 && i % retire_every == retire_every - 1 && slot % 2 == 1 {
                    c.retire(slot).expect("slot in range");
                }
                let before = c.counter(slot).expect("slot in range");
                match c.next(slot) {
                    Ok(n) => {
                        prop_assert!(n.counter() > before, "counters only grow");
                        prop_assert!(seen.insert(n.to_bytes()), "nonce {:?} handed out twice", n);
                    }
                    Err(SealError::SlotExhausted { .. }) => prop_assert!(c.is_exhausted(slot)),
                    Err(e) => prop_assert!(false, "unexpected error {e:?}"),
                }
            }
        }
    }
}
