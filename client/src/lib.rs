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
use std::sync::Arc;

pub use connect::default_socket;
pub use error::{Error, Result};
pub use kvmm_kernels::ElementType;
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
