//! kvmm-client: the library an inference process uses to keep its KV cache in kvmmd.
//!
//! ```no_run
//! use kvmm_client::{Client, Geometry};
//! let client = Client::connect(kvmm_client::default_socket())?;
//! let mut session = client.attach(Geometry::new(30, 3, 9, 64, 8192))?;
//! let kv = vec![0.5f32; 3 * 64];
//! session.append(0, &kv, &kv)?;                 // one token's K and V for layer 0, all KV heads
//! let q = vec![0.1f32; 9 * 64];
//! let mut out = vec![0f32; 9 * 64];
//! session.attention(0, &q, &mut out)?;          // decode attention over the layer's pages
//! # Ok::<(), kvmm_client::Error>(())
//! ```
//!
//! The library is blocking: it owns a small single-threaded tokio runtime for its RPCs, so it must
//! not be called from inside another async runtime's worker (use `spawn_blocking` there). RPCs are
//! rare: `attach`, one `Extend` per batch of pages, and `stats`. Appending and attention happen in
//! shared memory.

pub mod connect;
pub mod error;
pub mod session;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub use connect::default_socket;
pub use error::{Error, Result};
pub use half::{bf16, f16};
pub use kvmm_kernels::{ElementType, RowElement};
pub use kvmm_proto::v1 as proto;
pub use kvmm_shm::Geometry;
pub use session::{AttachOptions, ModelShape, Priority, Session, SessionStats};

use kvmm_proto::v1::session_client::SessionClient;
use tonic::transport::Channel;

/// A connection to kvmmd. Cheap to share: sessions keep it alive.
#[derive(Debug, Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

#[derive(Debug)]
pub(crate) struct Inner {
    /// Runs this client's RPCs; owned here so the API can be blocking.
    pub(crate) runtime: tokio::runtime::Runtime,
    /// The session service over the one connection this client holds.
    pub(crate) rpc: SessionClient<Channel>,
    /// The fd socket beside the session socket.
    pub(crate) fd_socket: PathBuf,
    /// The arena mapping this client's sessions share (see [`Inner::arena`]).
    pub(crate) arena: Mutex<Option<session::SharedArena>>,
}

/// A session of this uid that waits to be resumed, as [`Client::orphans`] lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Orphan {
    /// The id to pass to [`Client::resume`].
    pub session_id: u64,
    /// The model id it was attached with.
    pub model_id: String,
    /// Its geometry.
    pub geometry: Geometry,
    /// Tokens its process published (the minimum over layers).
    pub tokens: u64,
    /// Pages allocated per layer.
    pub allocated_blocks: u32,
    /// How long it outlives its connection.
    pub linger: Duration,
    /// How long ago its connection closed.
    pub orphaned_for: Duration,
    /// How long until kvmmd wipes it, unless it is resumed.
    pub expires_in: Duration,
    /// Bytes its pages hold in every tier.
    pub bytes: u64,
    /// The process that left it.
    pub pid: i32,
    /// That process's name (empty if it could not be read).
    pub process: String,
}

impl Orphan {
    fn from_pb(o: proto::Orphan) -> Result<Orphan> {
        let geometry = o.geometry.as_ref().map(session::geometry_from_pb).ok_or_else(|| {
            Error::Protocol(format!("ListOrphans returned session {} without a geometry", o.session_id))
        })?;
        Ok(Orphan {
            session_id: o.session_id,
            model_id: o.model_id,
            geometry,
            tokens: o.tokens,
            allocated_blocks: o.allocated_blocks,
            linger: Duration::from_millis(o.linger_ms.into()),
            orphaned_for: Duration::from_millis(o.orphaned_ms),
            expires_in: Duration::from_millis(o.expires_in_ms),
            bytes: o.bytes,
            pid: o.pid,
            process: o.process,
        })
    }

    /// Whether a model of `shape` can resume it (the daemon refuses a `Resume` of another shape).
    pub fn fits(&self, shape: &ModelShape) -> bool {
        ModelShape::from(&self.geometry) == *shape
    }
}

impl Client {
    /// Connects to kvmmd's session socket at `socket` (the fd socket is expected beside it).
    pub fn connect(socket: impl AsRef<Path>) -> Result<Client> {
        let socket = socket.as_ref();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|source| Error::Io { what: "cannot start the client's runtime", source })?;
        let channel = runtime.block_on(connect::channel(socket))?;
        Ok(Client {
            inner: Arc::new(Inner {
                runtime,
                rpc: SessionClient::new(channel),
                fd_socket: connect::fd_socket_beside(socket),
                arena: Mutex::new(None),
            }),
        })
    }

    /// Attaches a new session with default options (foreground priority, no model id).
    pub fn attach(&self, geometry: Geometry) -> Result<Session> {
        self.attach_with(geometry, AttachOptions::default())
    }

    /// Attaches a new session: the `Attach` RPC, the fd handshake, and mapping the shared memory.
    pub fn attach_with(&self, geometry: Geometry, options: AttachOptions) -> Result<Session> {
        Session::attach(self.inner.clone(), geometry, options)
    }

    /// Takes over a session of this uid whose connection closed while it lingers
    /// ([`AttachOptions::linger`]): the `Resume` RPC, the fd handshake, and mapping the shared memory.
    /// The session's pages, token counts and attention mass are as its previous process left them;
    /// appending carries on after the last published token, extending by the default batch. With
    /// `shape`, a session attached for a model of another shape is refused
    /// (`FAILED_PRECONDITION`) and left as it was.
    pub fn resume(&self, session_id: u64, shape: Option<ModelShape>) -> Result<Session> {
        Session::resume(self.inner.clone(), session_id, shape)
    }

    /// The sessions of this uid that wait to be resumed (their process exited, crashed or closed its
    /// connection while they linger), newest first; only those attached with `model_id` where one
    /// is given. Another uid's sessions are never listed.
    pub fn orphans(&self, model_id: Option<&str>) -> Result<Vec<Orphan>> {
        let mut rpc = self.inner.rpc.clone();
        let request = proto::ListOrphansRequest { model_id: model_id.unwrap_or_default().to_owned() };
        let listed = self.inner.runtime.block_on(rpc.list_orphans(request))?.into_inner();
        listed.orphans.into_iter().map(Orphan::from_pb).collect()
    }

    /// Ends a session of this uid that waits to be resumed, without resuming it: its pages are
    /// wiped and freed at once instead of at the end of its linger time. Returns the bytes wiped.
    /// (A session this client holds is ended with [`Session::detach`].)
    pub fn discard(&self, session_id: u64) -> Result<u64> {
        session::detach(&self.inner, session_id)
    }

    /// A raw handle on the session service, for callers that need RPCs the `Session` API does not
    /// wrap (and for tests of the protocol itself).
    pub fn rpc(&self) -> SessionClient<Channel> {
        self.inner.rpc.clone()
    }

    /// Runs a future on the client's runtime.
    pub fn block_on<F: std::future::Future>(&self, f: F) -> F::Output {
        self.inner.runtime.block_on(f)
    }
}
