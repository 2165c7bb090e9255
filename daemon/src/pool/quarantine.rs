//! Device frames of wiped sessions that their client still had pinned.
//!
//! Pins do not block an administrator's wipe: the session is destroyed while its client may be in
//! the middle of a pinned access, reading pages for attention or writing new K/V rows into its tail
//! page. Such a frame is zeroed at once, like every frame of the session, but it is not given back
//! to the allocator yet: a row write still under way would otherwise land in a frame just handed
//! to another session of the same uid. It waits here, in the pool's `used` and `frames` and in no
//! page table (admin `Status` counts it among the reserved frames), until the client lets go of
//! its pin or the connection that attached the session closes; then it is freed, which zeroes it
//! again, so a late write leaves nothing behind either.

use std::sync::Arc;

use kvmm_shm::ClientRegion;

use crate::error::Result;
use crate::migrate::tiering::Reserved;
use crate::pool::{Frame, Pool};
use crate::server::conn::ConnId;

/// One frame waiting for its client's pin to go.
#[derive(Debug)]
struct Held {
    uid: u32,
    frame: Frame,
    /// The connection that attached the destroyed session.
    conn: ConnId,
    /// The destroyed session's client region, kept mapped to watch the page's pin count.
    region: Arc<ClientRegion>,
    layer: u32,
    block: u32,
}

impl Held {
    /// Whether the client still announces a pin on the page (or the region cannot say).
    fn pinned(&self) -> bool {
        self.region.entry(self.layer, self.block).map_or(true, |e| e.pins() != 0)
    }
}

/// The frames held back, in the order they were held.
#[derive(Debug, Default)]
pub struct Quarantine {
    held: Vec<Held>,
}

impl Quarantine {
    /// Holds `frame`, page (`layer`, `block`) of a session of `uid` attached through `conn`, whose
    /// client region is `region`. The caller has zeroed it.
    pub fn hold(&mut self, uid: u32, frame: Frame, conn: ConnId, region: Arc<ClientRegion>, layer: u32, block: u32) {
        self.held.push(Held { uid, frame, conn, region, layer, block });
    }

    /// The frames held and their footprint.
    pub fn totals(&self) -> Reserved {
        let mut r = Reserved::default();
        for h in &self.held {
            r.add(h.frame);
        }
        r
    }

    /// Frees (zeroing) every held frame whose pin is gone, and every frame of a session attached
    /// through `closed`, whatever its pin count says (a client killed inside a pinned access never
    /// unpins). Returns how many were freed.
    pub fn release(&mut self, pool: &mut Pool, closed: Option<ConnId>) -> Result<usize> {
        if self.held.is_empty() {
            return Ok(0);
        }
        let (go, stay): (Vec<Held>, Vec<Held>) =
            std::mem::take(&mut self.held).into_iter().partition(|h| Some(h.conn) == closed || !h.pinned());
        self.held = stay;
        // The client's last write to a frame happens before its unpin (a Release decrement), and
        // the zeroing in `free_frame` must come after it.
        std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
        let freed = go.len();
        let mut first_error = None;
        for h in go {
            if let Err(e) = pool.free_frame(h.uid, h.frame) {
                first_error.get_or_insert(e);
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(freed),
        }
    }
}
