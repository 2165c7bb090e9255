//! The registry of live sessions, keyed by id, with ownership checks.

use std::collections::{BTreeMap, HashMap, VecDeque};

use super::Session;
use crate::error::{Error, Result};
use crate::server::conn::ConnId;

/// Every live session.
#[derive(Debug, Default)]
pub struct Registry {
    sessions: BTreeMap<u64, Session>,
    /// The next id to hand out; ids are never reused during one daemon run.
    next_id: u64,
    /// Sessions an operator wiped or kvmmd revoked, with their owner's uid, so that their client
    /// hears why on its next call; the oldest are forgotten past [`WIPED_REMEMBERED`].
    wiped: HashMap<u64, (u32, WipedBy)>,
    wiped_order: VecDeque<u64>,
}

/// Wiped sessions remembered for their clients' next call.
pub const WIPED_REMEMBERED: usize = 4096;

/// Who wiped a session.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WipedBy {
    /// An operator (admin `Wipe`).
    Operator,
    /// A process of its uid (the session service's `Wipe`).
    Owner,
    /// kvmmd: one of its pages stayed pinned past the pin lease (`revoke_stuck_pins`).
    PinLease,
    /// kvmmd: its connection closed and no process resumed it within its linger time.
    LingerExpired,
}

/// The error a wiped session's client gets.
fn gone(id: u64, by: WipedBy) -> Error {
    match by {
        WipedBy::Operator => Error::Wiped(id),
        WipedBy::Owner => Error::WipedByOwner(id),
        WipedBy::PinLease => Error::Revoked(id),
        WipedBy::LingerExpired => Error::Expired(id),
    }
}

impl Registry {
    /// Reserves a fresh session id.
    pub fn next_id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    /// Adds a session.
    pub fn insert(&mut self, session: Session) {
        self.sessions.insert(session.id, session);
    }

    /// Remembers that session `id` of `uid` was wiped, and by whom.
    pub fn remember_wiped(&mut self, id: u64, uid: u32, by: WipedBy) {
        if self.wiped_order.len() >= WIPED_REMEMBERED
            && let Some(old) = self.wiped_order.pop_front()
        {
            self.wiped.remove(&old);
        }
        self.wiped.insert(id, (uid, by));
        self.wiped_order.push_back(id);
    }

    /// Why session `id` is gone if it was wiped (and is still remembered): `Error::Wiped` or
    /// `Error::Revoked`.
    pub fn wiped(&self, id: u64) -> Option<Error> {
        self.wiped.get(&id).map(|&(_, by)| gone(id, by))
    }

    /// Why session `id` is not there, for `uid`.
    fn missing(&self, id: u64, uid: u32) -> Error {
        match self.wiped.get(&id) {
            Some(&(owner, _)) if owner != uid => Error::ForeignSession { session: id, owner, caller: uid },
            Some(&(_, by)) => gone(id, by),
            None => Error::UnknownSession(id),
        }
    }

    /// The session `id` if `uid` may use it, from any connection (the fd socket, whose requests
    /// carry a one-time token instead).
    pub fn get_owned(&self, id: u64, uid: u32) -> Result<&Session> {
        let s = self.sessions.get(&id).ok_or_else(|| self.missing(id, uid))?;
        if s.owner.uid != uid {
            return Err(Error::ForeignSession { session: id, owner: s.owner.uid, caller: uid });
        }
        Ok(s)
    }

    /// The session `id` if the caller (`uid` on connection `conn`) may use it: its owner, through
    /// the connection that attached it. A session dies with its connection, so a call from another
    /// connection comes from a stale handle (one kept across a reconnect, perhaps to a restarted
    /// kvmmd whose new session has the same id) and must not touch it.
    pub fn get(&self, id: u64, uid: u32, conn: ConnId) -> Result<&Session> {
        let s = self.get_owned(id, uid)?;
        if s.orphaned.is_some() {
            return Err(Error::Orphaned(id));
        }
        if s.owner.conn != conn {
            return Err(Error::OtherConnection(id));
        }
        Ok(s)
    }

    /// The session `id` if the caller may end it (`Detach`, its owner's `Wipe`): as [`Registry::get`],
    /// and also an orphaned session of the caller's uid from any connection (a process that will not
    /// resume what an earlier one left).
    pub fn get_to_end(&self, id: u64, uid: u32, conn: ConnId) -> Result<&Session> {
        let s = self.get_owned(id, uid)?;
        if s.orphaned.is_none() && s.owner.conn != conn {
            return Err(Error::OtherConnection(id));
        }
        Ok(s)
    }

    /// The orphaned sessions of `uid`, newest orphan first.
    pub fn orphans_of_uid(&self, uid: u32) -> Vec<&Session> {
        let mut out: Vec<&Session> =
            self.sessions.values().filter(|s| s.owner.uid == uid && s.orphaned.is_some()).collect();
        out.sort_by_key(|s| std::cmp::Reverse(s.orphaned));
        out
    }

    /// Mutable access to session `id` under the rule of [`Registry::get`].
    pub fn get_mut(&mut self, id: u64, uid: u32, conn: ConnId) -> Result<&mut Session> {
        self.get(id, uid, conn)?;
        self.sessions.get_mut(&id).ok_or(Error::UnknownSession(id))
    }

    /// Any session by id, without an ownership check (daemon-internal and admin work).
    pub fn get_unchecked(&self, id: u64) -> Option<&Session> {
        self.sessions.get(&id)
    }

    /// Any session by id, without an ownership check (daemon-internal work).
    pub fn get_mut_unchecked(&mut self, id: u64) -> Option<&mut Session> {
        self.sessions.get_mut(&id)
    }

    /// Removes a session.
    pub fn remove(&mut self, id: u64) -> Option<Session> {
        self.sessions.remove(&id)
    }

    /// Ids of the sessions attached through connection `conn`.
    pub fn ids_of_conn(&self, conn: ConnId) -> Vec<u64> {
        self.sessions.values().filter(|s| s.owner.conn == conn).map(|s| s.id).collect()
    }

    /// Ids of the sessions whose connection closed and whose linger time has run out at `now`.
    pub fn ids_expired(&self, now: std::time::Instant) -> Vec<u64> {
        self.sessions
            .values()
            .filter(|s| s.orphaned.is_some_and(|since| now.saturating_duration_since(since) >= s.linger))
            .map(|s| s.id)
            .collect()
    }

    /// Ids of the sessions of `uid`.
    pub fn ids_of_uid(&self, uid: u32) -> Vec<u64> {
        self.sessions.values().filter(|s| s.owner.uid == uid).map(|s| s.id).collect()
    }

    /// Every session id.
    pub fn ids(&self) -> Vec<u64> {
        self.sessions.keys().copied().collect()
    }

    /// Every session.
    pub fn iter(&self) -> impl Iterator<Item = &Session> {
        self.sessions.values()
    }

    /// Number of live sessions.
    pub fn len(&self) -> usize {
        self.sessions.len()
    }

    /// Whether no session is live.
    pub fn is_empty(&self) -> bool {
        self.sessions.is_empty()
    }
}
