//! How many malloc arenas kvmmd lets glibc keep.
//!
//! glibc gives threads their own malloc arenas, up to eight per CPU. kvmmd's Tokio blocking
//! threads come and go with the load, and a new thread may take a new arena whose high-water mark
//! (a flash batch's buffers, a Fault's scratch) it never returns: a 10-minute soak grew kvmmd's
//! RSS by 2–13% in steps of about 1 MB, all of it in those per-thread heaps, and stayed flat with
//! the arenas capped. kvmmd caps them at [`ARENA_MAX`] before it starts any thread, unless the
//! operator set `MALLOC_ARENA_MAX` in its environment (glibc has read that already, and it wins).
//!
//! Within the arenas, free memory between live chunks stays in RSS until something asks glibc to
//! give it back: the tier thread calls [`trim`] every [`TRIM_INTERVAL`], which returns the free
//! pages of every arena to the kernel (`malloc_trim(0)`).

/// The arenas kvmmd allows: the main one and one more for the worker threads. Its allocations are
/// few and short next to its page copies and kernels, so contention on them is not measurable.
pub const ARENA_MAX: i32 = 2;

/// How often the tier thread gives free heap pages back to the kernel. A trim walks the free
/// chunks of every arena under their locks: well under a millisecond at kvmmd's heap sizes.
pub const TRIM_INTERVAL: std::time::Duration = std::time::Duration::from_secs(10);

/// Allocations from this size up get their own mapping, given back to the kernel when freed.
/// Setting it fixes it: glibc otherwise raises the threshold to the size of each mapped block
/// freed (up to 32 MiB), after which blocks of that size (a flash batch's staging buffers) come
/// from the heap arenas and their pages stay there.
pub const MMAP_THRESHOLD: i32 = 256 << 10;

/// What [`cap_arenas`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ArenaCap {
    /// Capped at [`ARENA_MAX`], mapping threshold fixed at [`MMAP_THRESHOLD`].
    Capped,
    /// `MALLOC_ARENA_MAX` was set; glibc follows it.
    FromEnvironment(String),
    /// Not glibc, or glibc refused the setting: the allocator's own default holds.
    Unchanged,
}

/// Caps glibc's malloc arenas at [`ARENA_MAX`] and fixes the mapping threshold at
/// [`MMAP_THRESHOLD`], unless `MALLOC_ARENA_MAX` is set (then glibc's defaults and environment
/// hold). Call it first thing in `main`, before any thread is started: arenas already handed out
/// stay.
pub fn cap_arenas() -> ArenaCap {
    if let Some(set) = std::env::var_os("MALLOC_ARENA_MAX") {
        return ArenaCap::FromEnvironment(set.to_string_lossy().into_owned());
    }
    set_limits()
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn set_limits() -> ArenaCap {
    // SAFETY: mallopt only stores a tuning value in glibc's malloc parameters (under its own
    // lock); it takes no pointers and is sound to call at any time.
    let capped = unsafe { libc::mallopt(libc::M_ARENA_MAX, ARENA_MAX) } == 1;
    // SAFETY: as above; a tuning value, no pointers.
    let fixed = unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD) } == 1;
    if capped && fixed { ArenaCap::Capped } else { ArenaCap::Unchanged }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn set_limits() -> ArenaCap {
    ArenaCap::Unchanged
}

/// Gives the free pages of every malloc arena back to the kernel; returns whether any memory was
/// released. A no-op (false) off glibc.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub fn trim() -> bool {
    // SAFETY: malloc_trim takes no pointers; it only walks glibc's own free lists under the
    // arenas' locks and may be called from any thread at any time.
    unsafe { libc::malloc_trim(0) == 1 }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub fn trim() -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The test binary runs without `MALLOC_ARENA_MAX` (CI does not set it), so on glibc the cap
    /// must take; elsewhere nothing is changed.
    #[test]
    fn arenas_are_capped_on_glibc_unless_the_environment_says_otherwise() {
        let got = cap_arenas();
        match std::env::var_os("MALLOC_ARENA_MAX") {
            Some(set) => assert_eq!(got, ArenaCap::FromEnvironment(set.to_string_lossy().into_owned())),
            None if cfg!(all(target_os = "linux", target_env = "gnu")) => assert_eq!(got, ArenaCap::Capped),
            None => assert_eq!(got, ArenaCap::Unchanged),
        }
    }
}
