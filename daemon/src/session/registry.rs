//! The registry of live sessions, keyed by id, with ownership checks.

use std::collections::BTreeMap;

use super::Session;
use crate::error::{Error, Result};
use crate::server::conn::ConnId;

/// Every live session.
#[derive(Debug, Default)]
pub struct Registry {
    sessions: BTreeMap<u64, Session>,
    /// The next id to hand out; ids are never reused during one daemon run.
    next_id: u64,
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

    /// The session `id` if `uid` may use it.
    pub fn get(&self, id: u64, uid: u32) -> Result<&Session> {
        let s = self.sessions.get(&id).ok_or(Error::UnknownSession(id))?;
        if s.owner.uid != uid {
            return Err(Error::ForeignSession { session: id, owner: s.owner.uid, caller: uid });
        }
        Ok(s)
    }

    /// Mutable access to session `id` if `uid` may use it.
    pub fn get_mut(&mut self, id: u64, uid: u32) -> Result<&mut Session> {
        let s = self.sessions.get_mut(&id).ok_or(Error::UnknownSession(id))?;
        if s.owner.uid != uid {
            return Err(Error::ForeignSession { session: id, owner: s.owner.uid, caller: uid });
        }
        Ok(s)
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
