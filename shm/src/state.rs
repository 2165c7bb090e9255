//! The daemon-written state word of a page: `generation << 32 | flags`.
//!
//! ```text
//!  63                              32 31           4    3         2           1          0
//!  +---------------------------------+--------------+---------+-----------+----------+-----------+
//!  | generation (u32, wraps)         | reserved (0) | DROPPED | MIGRATING | RESIDENT | ALLOCATED |
//!  +---------------------------------+--------------+---------+-----------+----------+-----------+
//! ```
//!
//! - `ALLOCATED`: the page exists (it has been written or handed out as a tail page).
//! - `RESIDENT`: the page is in the device tier: the entry's location names a frame of the arena
//!   that clients may read after pinning. Implies `ALLOCATED`.
//! - `MIGRATING`: the daemon has claimed the page to move, demote or free it; clients must not
//!   start using it.
//! - `DROPPED`: the page was evicted from a session that opted into lossy eviction: its bytes are
//!   gone and readers skip it (it is never `ALLOCATED` or `RESIDENT` again).
//! - `generation`: bumped every time the daemon publishes a new location or frees the page, so a
//!   client can tell that a page changed since it last looked.
//!
//! Only the daemon writes this word (clients map the table read-only).

use std::fmt;
use std::ops::BitOr;

/// The flag bits of a page's state word.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct PageFlags(u32);

impl PageFlags {
    /// No flags: the page does not exist (never allocated, or freed).
    pub const NONE: PageFlags = PageFlags(0);
    /// The page exists.
    pub const ALLOCATED: PageFlags = PageFlags(1);
    /// The page is in the device tier, at the entry's location.
    pub const RESIDENT: PageFlags = PageFlags(2);
    /// The daemon is moving, demoting or freeing the page.
    pub const MIGRATING: PageFlags = PageFlags(4);
    /// The page was dropped by opt-in eviction; its bytes are gone and attention skips it.
    pub const DROPPED: PageFlags = PageFlags(8);

    /// The raw bits.
    pub const fn bits(self) -> u32 {
        self.0
    }

    /// Flags from raw bits (unknown bits are kept).
    pub const fn from_bits(bits: u32) -> PageFlags {
        PageFlags(bits)
    }

    /// True when every flag in `other` is set in `self`.
    pub const fn contains(self, other: PageFlags) -> bool {
        self.0 & other.0 == other.0
    }

    /// `self` with the flags of `other` added.
    pub const fn union(self, other: PageFlags) -> PageFlags {
        PageFlags(self.0 | other.0)
    }

    /// `self` with the flags of `other` removed.
    pub const fn difference(self, other: PageFlags) -> PageFlags {
        PageFlags(self.0 & !other.0)
    }

    /// True when no flag is set.
    pub const fn is_empty(self) -> bool {
        self.0 == 0
    }
}

impl BitOr for PageFlags {
    type Output = PageFlags;

    fn bitor(self, rhs: PageFlags) -> PageFlags {
        self.union(rhs)
    }
}

impl fmt::Debug for PageFlags {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut first = true;
        let mut rest = self.0;
        for (flag, name) in [
            (PageFlags::ALLOCATED, "ALLOCATED"),
            (PageFlags::RESIDENT, "RESIDENT"),
            (PageFlags::MIGRATING, "MIGRATING"),
            (PageFlags::DROPPED, "DROPPED"),
        ] {
            if self.contains(flag) {
                f.write_str(if first { "" } else { " | " })?;
                f.write_str(name)?;
                first = false;
                rest &= !flag.0;
            }
        }
        if rest != 0 {
            f.write_str(if first { "" } else { " | " })?;
            write!(f, "{rest:#x}")?;
            first = false;
        }
        if first {
            f.write_str("NONE")?;
        }
        Ok(())
    }
}

/// Packs a generation and flags into a state word.
pub const fn pack_state(generation: u32, flags: PageFlags) -> u64 {
    ((generation as u64) << 32) | flags.0 as u64
}

/// Splits a state word into its generation and flags.
pub const fn unpack_state(state: u64) -> (u32, PageFlags) {
    ((state >> 32) as u32, PageFlags(state as u32))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_words_round_trip() {
        let flags = PageFlags::ALLOCATED | PageFlags::RESIDENT;
        let word = pack_state(0xdead_beef, flags);
        assert_eq!(word, 0xdead_beef_0000_0003);
        assert_eq!(unpack_state(word), (0xdead_beef, flags));
    }

    #[test]
    fn flags_print_by_name() {
        assert_eq!(format!("{:?}", PageFlags::ALLOCATED | PageFlags::MIGRATING), "ALLOCATED | MIGRATING");
        assert_eq!(format!("{:?}", PageFlags::NONE), "NONE");
        assert_eq!(format!("{:?}", PageFlags::from_bits(0x12)), "RESIDENT | 0x10");
        assert_eq!((PageFlags::RESIDENT | PageFlags::MIGRATING).difference(PageFlags::MIGRATING), PageFlags::RESIDENT);
    }
}
