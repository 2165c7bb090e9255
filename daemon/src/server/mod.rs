//! The servers: binding the three sockets, running the gRPC services and the fd socket, and the
//! orderly shutdown on SIGINT/SIGTERM (stop admitting, stop serving, wipe every session, remove the
//! sockets).

pub mod admin_service;
pub mod conn;
pub mod session_service;
pub mod status;

use std::sync::Arc;
use std::time::Duration;

use kvmm_proto::v1::admin_server::AdminServer;
use kvmm_proto::v1::session_server::SessionServer;
use kvmm_shm::fdpass::SeqpacketListener;
use tokio::net::UnixListener;
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::{mpsc, watch};

use crate::daemon::Daemon;
use crate::error::{Error, Result};
use crate::runtime_dir::{ADMIN_SOCKET, FD_SOCKET, RuntimeDir, SESSION_SOCKET};
use conn::Acceptor;

/// How long in-flight RPCs get to finish once shutdown starts.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(3);

/// Binds the sockets in `dir` and serves until SIGINT or SIGTERM; then shuts down in order.
pub async fn run(daemon: Arc<Daemon>, dir: RuntimeDir) -> Result<()> {
    let bind = |name: &str| {
        UnixListener::bind(dir.join(name))
            .map_err(|e| Error::io(format!("cannot bind {}", dir.join(name).display()), e))
    };
    let session_listener = bind(SESSION_SOCKET)?;
    let admin_listener = bind(ADMIN_SOCKET)?;
    let fd_listener = SeqpacketListener::bind(&dir.join(FD_SOCKET))?;
    // Clients of any uid may attach; each only ever sees its own uid's arena. The admin socket is
    // further restricted by peer credentials on every request.
    dir.set_mode(SESSION_SOCKET, 0o666)?;
    dir.set_mode(FD_SOCKET, 0o666)?;
    dir.set_mode(ADMIN_SOCKET, 0o660)?;
    if let Some(gid) = daemon.config.admin_gid {
        rustix::fs::chown(dir.join(ADMIN_SOCKET).as_path(), None, Some(rustix::fs::Gid::from_raw(gid)))
            .map_err(|e| Error::io("cannot give the admin socket to the admin group", e.into()))?;
    }

    let (closed_tx, mut closed_rx) = mpsc::unbounded_channel();
    let acceptor = Acceptor::new(closed_tx);
    let (stop_tx, stop_rx) = watch::channel(false);
    let stopped = move || {
        let mut rx = stop_rx.clone();
        async move {
            let _ = rx.wait_for(|s| *s).await;
        }
    };

    let reaper = {
        let daemon = daemon.clone();
        tokio::spawn(async move {
            while let Some(conn) = closed_rx.recv().await {
                daemon.connection_closed(conn);
            }
        })
    };
    let session_server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(SessionServer::new(session_service::SessionService::new(daemon.clone())))
            .serve_with_incoming_shutdown(acceptor.incoming(session_listener), stopped()),
    );
    let admin_server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(AdminServer::new(admin_service::AdminService::new(daemon.clone())))
            .serve_with_incoming_shutdown(acceptor.incoming(admin_listener), stopped()),
    );
    let fd_server = {
        let daemon = daemon.clone();
        tokio::task::spawn_blocking(move || crate::fdpass::serve(daemon, fd_listener))
    };
    let mut background = vec![tokio::spawn(crate::prefault::prefault_task(daemon.clone()))];
    if let Some(interval) = daemon.config.compaction_interval {
        background.push(tokio::spawn(crate::migrate::compaction_task(daemon.clone(), interval)));
    }
    if daemon.config.tiers.any() {
        let daemon = daemon.clone();
        std::thread::Builder::new()
            .name("kvmm-tiers".into())
            .spawn(move || crate::migrate::tier_task(daemon))
            .map_err(|e| Error::io("cannot start the tier thread", e))?;
    }
    {
        let daemon = daemon.clone();
        std::thread::Builder::new()
            .name("kvmm-policy".into())
            .spawn(move || crate::policy::live::policy_task(daemon))
            .map_err(|e| Error::io("cannot start the policy thread", e))?;
    }
    if daemon.config.debug_move_churn {
        tracing::warn!("debug move churn is on: pages are moved continuously (a test mode)");
        background.push(tokio::spawn(crate::migrate::churn_task(daemon.clone())));
    }

    tracing::info!(
        dir = %dir.path().display(),
        budget = daemon.config.device_budget,
        pid = std::process::id(),
        "kvmmd ready"
    );
    wait_for_signal(&daemon).await?;

    tracing::info!("shutting down: no new work is admitted");
    daemon.begin_shutdown();
    daemon.wake_tiers();
    let _ = stop_tx.send(true);
    let drained = tokio::time::timeout(DRAIN_TIMEOUT, async {
        let _ = session_server.await;
        let _ = admin_server.await;
        let _ = fd_server.await;
    })
    .await;
    if drained.is_err() {
        tracing::warn!("in-flight requests did not finish within {DRAIN_TIMEOUT:?}; closing anyway");
    }
    for task in background {
        task.abort();
    }
    reaper.abort();
    let wiped = daemon.wipe_all();
    tracing::info!(bytes = wiped, "all sessions wiped; removing sockets");
    drop(dir);
    Ok(())
}

/// Waits for SIGTERM or SIGINT; SIGHUP meanwhile reloads the policy.
async fn wait_for_signal(daemon: &Arc<Daemon>) -> Result<()> {
    let mut term = signal(SignalKind::terminate()).map_err(|e| Error::io("cannot handle SIGTERM", e))?;
    let mut int = signal(SignalKind::interrupt()).map_err(|e| Error::io("cannot handle SIGINT", e))?;
    let mut hup = signal(SignalKind::hangup()).map_err(|e| Error::io("cannot handle SIGHUP", e))?;
    loop {
        tokio::select! {
            _ = term.recv() => { tracing::info!("SIGTERM received"); return Ok(()) }
            _ = int.recv() => { tracing::info!("SIGINT received"); return Ok(()) }
            _ = hup.recv() => {
                tracing::info!("SIGHUP received: reloading the policy");
                if let Err(e) = daemon.reload_policy() {
                    tracing::error!(error = %e, "policy reload refused; the running policy stays");
                }
            }
        }
    }
}
