//! What a sealed page is bound to: the AAD codec ([`PageAad`]) and the GCM nonce ([`SealNonce`]).
//!
//! The AAD (additional authenticated data) names the page a ciphertext belongs to: session, layer,
//! block, the tier and write counter of the slot it was written to, and its plaintext length. GCM
//! authenticates it with the ciphertext, so a page cannot be opened as another page, from another
//! session, tier or write, or at another length: the tag check fails.
//!
//! AAD bytes (32, little-endian, version 1):
//!
//! ```text
//!  0         1        2             4                      12           16           20                     28          32
//!  +---------+--------+-------------+----------------------+------------+------------+----------------------+-----------+
//!  | version | tier   | reserved    | session              | layer      | block      | counter              | len       |
//!  | u8 = 1  | u8     | 2 bytes = 0 | u64                  | u32        | u32        | u64                  | u32       |
//!  +---------+--------+-------------+----------------------+------------+------------+----------------------+-----------+
//! ```
//!
//! Nonce bytes (12, the GCM standard size):
//!
//! ```text
//!  0        1                     5                                         12
//!  +--------+---------------------+-----------------------------------------+
//!  | tier   | slot                | counter, low 7 bytes                    |
//!  | u8     | u32 LE              | u56 LE                                  |
//!  +--------+---------------------+-----------------------------------------+
//! ```
//!
//! Invariant: a [`SealNonce`]'s counter is at most [`MAX_COUNTER`] (2^56 − 1), so the 7 bytes hold it
//! exactly and distinct `(tier, slot, counter)` triples give distinct nonces. Uniqueness of the
//! triples themselves is [`super::SlotCounters`]'s job.
//!
//! Tier codes are the daemon's (`kvmm.v1.Tier` and `PageLocation`'s tier byte): 1 is the device tier
//! (never sealed), [`TIER_DRAM`] = 2 and [`TIER_FLASH`] = 3.

use super::SealError;

/// Tier code of the daemon's DRAM pool (`kvmm.v1.Tier.TIER_DRAM`).
pub const TIER_DRAM: u8 = 2;
/// Tier code of the flash file (`kvmm.v1.Tier.TIER_FLASH`).
pub const TIER_FLASH: u8 = 3;

/// Version byte of the AAD layout this build writes and accepts.
pub const AAD_VERSION: u8 = 1;
/// Length of an encoded [`PageAad`].
pub const AAD_LEN: usize = 32;
/// Length of an encoded [`SealNonce`].
pub const NONCE_LEN: usize = 12;
/// The largest write counter a nonce can carry: 2^56 − 1.
pub const MAX_COUNTER: u64 = (1 << 56) - 1;

/// The page a sealed buffer belongs to, authenticated with it (see the module doc for the bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PageAad {
    /// The session that owns the page (and whose key seals it).
    pub session: u64,
    /// The page's layer.
    pub layer: u32,
    /// The page's block within the layer.
    pub block: u32,
    /// The tier the sealed bytes are written to ([`TIER_DRAM`] or [`TIER_FLASH`]).
    pub tier: u8,
    /// The slot's write counter for this write; equal to the nonce's.
    pub counter: u64,
    /// Plaintext (and ciphertext) length in bytes.
    pub len: u32,
}

impl PageAad {
    /// The 32 AAD bytes.
    pub fn encode(&self) -> [u8; AAD_LEN] {
        let mut out = [0u8; AAD_LEN];
        out[0] = AAD_VERSION;
        out[1] = self.tier;
        // Bytes 2..4 stay zero (reserved).
        out[4..12].copy_from_slice(&self.session.to_le_bytes());
        out[12..16].copy_from_slice(&self.layer.to_le_bytes());
        out[16..20].copy_from_slice(&self.block.to_le_bytes());
        out[20..28].copy_from_slice(&self.counter.to_le_bytes());
        out[28..32].copy_from_slice(&self.len.to_le_bytes());
        out
    }

    /// Parses AAD bytes written by [`PageAad::encode`].
    ///
    /// # Errors
    ///
    /// [`SealError::Codec`] for a length other than [`AAD_LEN`], a version other than
    /// [`AAD_VERSION`], or non-zero reserved bytes.
    pub fn decode(bytes: &[u8]) -> Result<PageAad, SealError> {
        let bytes: &[u8; AAD_LEN] = bytes
            .try_into()
            .map_err(|_| SealError::codec(format!("it is {} bytes long, not {AAD_LEN}", bytes.len())))?;
        if bytes[0] != AAD_VERSION {
            return Err(SealError::codec(format!(
                "its version byte is {}, but this build reads version {AAD_VERSION}",
                bytes[0]
            )));
        }
        if bytes[2..4] != [0, 0] {
            return Err(SealError::codec(format!("its reserved bytes are {:?}, not zero", &bytes[2..4])));
        }
        Ok(PageAad {
            tier: bytes[1],
            session: u64::from_le_bytes(array(&bytes[4..12])),
            layer: u32::from_le_bytes(array(&bytes[12..16])),
            block: u32::from_le_bytes(array(&bytes[16..20])),
            counter: u64::from_le_bytes(array(&bytes[20..28])),
            len: u32::from_le_bytes(array(&bytes[28..32])),
        })
    }
}

/// Copies a slice whose length the caller has fixed into an array.
fn array<const N: usize>(bytes: &[u8]) -> [u8; N] {
    bytes.try_into().expect("the caller slices exactly N bytes out of a fixed-size array")
}

/// The GCM nonce of one write: tier, slot and the slot's write counter (see the module doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SealNonce {
    /// Tier code of the slot.
    tier: u8,
    /// Slot index within the tier.
    slot: u32,
    /// The slot's write counter; at most [`MAX_COUNTER`].
    counter: u64,
}

impl SealNonce {
    /// The nonce of write `counter` to `slot` of `tier`.
    ///
    /// Sealing must only use nonces from [`super::SlotCounters::next`]; this constructor exists to
    /// rebuild the nonce of a stored page for opening it.
    ///
    /// # Errors
    ///
    /// [`SealError::CounterTooLarge`] when `counter` exceeds [`MAX_COUNTER`].
    pub fn new(tier: u8, slot: u32, counter: u64) -> Result<SealNonce, SealError> {
        if counter > MAX_COUNTER {
            return Err(SealError::CounterTooLarge { counter });
        }
        Ok(SealNonce { tier, slot, counter })
    }

    /// Tier code.
    pub fn tier(&self) -> u8 {
        self.tier
    }

    /// Slot index.
    pub fn slot(&self) -> u32 {
        self.slot
    }

    /// Write counter.
    pub fn counter(&self) -> u64 {
        self.counter
    }

    /// The 12 nonce bytes.
    pub fn to_bytes(&self) -> [u8; NONCE_LEN] {
        let mut out = [0u8; NONCE_LEN];
        out[0] = self.tier;
        out[1..5].copy_from_slice(&self.slot.to_le_bytes());
        out[5..12].copy_from_slice(&self.counter.to_le_bytes()[..7]);
        out
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn sample() -> PageAad {
        PageAad {
            session: 0x0102_0304_0506_0708,
            layer: 0x1112_1314,
            block: 0x2122_2324,
            tier: TIER_FLASH,
            counter: 0x3132_3334_3536_3738,
            len: 0x4142_4344,
        }
    }

    #[test]
    fn aad_bytes_follow_the_documented_layout() {
        let bytes = sample().encode();
        assert_eq!(
            bytes,
            [
                1, 3, 0, 0, // version, tier, reserved
                8, 7, 6, 5, 4, 3, 2, 1, // session
                0x14, 0x13, 0x12, 0x11, // layer
                0x24, 0x23, 0x22, 0x21, // block
                0x38, 0x37, 0x36, 0x35, 0x34, 0x33, 0x32, 0x31, // counter
                0x44, 0x43, 0x42, 0x41, // len
            ]
        );
    }

    #[test]
    fn aad_decode_rejects_wrong_length_version_and_reserved_bytes() {
        let good = sample().encode();
        assert!(matches!(PageAad::decode(&good[..31]), Err(SealError::Codec { .. })));
        assert!(matches!(PageAad::decode(&[good.as_slice(), &[0]].concat()), Err(SealError::Codec { .. })));
        assert!(matches!(PageAad::decode(&[]), Err(SealError::Codec { .. })));
        let mut bad = good;
        bad[0] = 2;
        let err = PageAad::decode(&bad).err();
        assert!(err.as_ref().is_some_and(|e| e.to_string().contains("version byte is 2")), "{err:?}");
        let mut bad = good;
        bad[3] = 1;
        assert!(matches!(PageAad::decode(&bad), Err(SealError::Codec { .. })));
    }

    #[test]
    fn nonce_bytes_follow_the_documented_layout() -> Result<(), SealError> {
        let n = SealNonce::new(TIER_DRAM, 0x0A0B_0C0D, 0x00F1_F2F3_F4F5_F6F7)?;
        assert_eq!(n.to_bytes(), [2, 0x0D, 0x0C, 0x0B, 0x0A, 0xF7, 0xF6, 0xF5, 0xF4, 0xF3, 0xF2, 0xF1]);
        Ok(())
    }

    #[test]
    fn nonce_counter_must_fit_56_bits() {
        assert!(SealNonce::new(TIER_FLASH, 0, MAX_COUNTER).is_ok());
        assert!(matches!(SealNonce::new(TIER_FLASH, 0, MAX_COUNTER + 1), Err(SealError::CounterTooLarge { .. })));
        assert!(SealNonce::new(TIER_FLASH, 0, u64::MAX).is_err());
    }

    proptest! {
        #[test]
        fn aad_round_trips(session: u64, layer: u32, block: u32, tier: u8, counter: u64, len: u32) {
            let aad = PageAad { session, layer, block, tier, counter, len };
            prop_assert_eq!(PageAad::decode(&aad.encode()).ok(), Some(aad));
        }

        #[test]
        fn distinct_nonce_triples_give_distinct_bytes(
            a in (any::<u8>(), any::<u32>(), 0..=MAX_COUNTER),
            b in (any::<u8>(), any::<u32>(), 0..=MAX_COUNTER),
        ) {
            let na = SealNonce::new(a.0, a.1, a.2).expect("counter in range");
            let nb = SealNonce::new(b.0, b.1, b.2).expect("counter in range");
            prop_assert_eq!(a == b, na.to_bytes() == nb.to_bytes());
        }

        #[test]
        fn aad_decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = PageAad::decode(&bytes);
        }
    }
}
