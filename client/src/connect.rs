//! Connecting to kvmmd: the socket paths and a tonic channel over a Unix stream socket.

use std::path::{Path, PathBuf};

use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint, Uri};

use crate::error::{Error, Result};

/// File name of the session socket.
pub const SESSION_SOCKET: &str = "kvmm.sock";
/// File name of the fd-passing socket, next to the session socket.
pub const FD_SOCKET: &str = "kvmm-fd.sock";
/// File name of the admin socket.
pub const ADMIN_SOCKET: &str = "kvmm-admin.sock";

/// The session socket kvmmd uses by default: `$KVMM_SOCKET`, else `/run/kvmm/kvmm.sock` if it
/// exists, else `$XDG_RUNTIME_DIR/kvmm/kvmm.sock`.
pub fn default_socket() -> PathBuf {
    if let Some(p) = std::env::var_os("KVMM_SOCKET").filter(|p| !p.is_empty()) {
        return PathBuf::from(p);
    }
    let system = Path::new("/run/kvmm").join(SESSION_SOCKET);
    if system.exists() {
        return system;
    }
    match std::env::var_os("XDG_RUNTIME_DIR").filter(|p| !p.is_empty()) {
        Some(dir) => PathBuf::from(dir).join("kvmm").join(SESSION_SOCKET),
        None => system,
    }
}

/// The fd socket beside a session socket.
pub fn fd_socket_beside(session_socket: &Path) -> PathBuf {
    session_socket.with_file_name(FD_SOCKET)
}

/// Opens a gRPC channel over the Unix socket at `path` (one HTTP/2 connection; the daemon ties the
/// sessions attached through it to it).
pub async fn channel(path: &Path) -> Result<Channel> {
    let target = path.to_owned();
    // The URI is required by the API but unused: the connector below dials the socket.
    let endpoint = Endpoint::try_from("http://kvmmd.local").map_err(|e| Error::Protocol(format!("endpoint: {e}")))?;
    endpoint
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let target = target.clone();
            async move { UnixStream::connect(target).await.map(TokioIo::new) }
        }))
        .await
        .map_err(|e| Error::Connect { path: path.display().to_string(), source: Box::new(e) })
}
