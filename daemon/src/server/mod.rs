//! The servers: taking the three sockets (passed by systemd, else bound here), running the gRPC
//! services and the fd socket, talking to systemd (readiness, status, watchdog), and the orderly
//! shutdown on SIGINT/SIGTERM (stop admitting, stop serving, wipe every session, remove the sockets
//! this process bound), which a second signal or [`STOP_LIMIT`] cuts short.

pub mod admin_service;
pub mod conn;
pub mod inflight;
pub mod session_service;
pub mod status;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvmm_proto::v1::admin_server::AdminServer;
use kvmm_proto::v1::session_server::SessionServer;
use kvmm_shm::activation::PassedFd;
use kvmm_shm::fdpass::SeqpacketListener;
use rustix::net::{SocketType, sockopt};
use tokio::net::UnixListener;
use tokio::signal::unix::{Signal, SignalKind, signal};
use tokio::sync::{mpsc, watch};

use crate::daemon::Daemon;
use crate::error::{Error, Result};
use crate::runtime_dir::{ADMIN_SOCKET, FD_SOCKET, RuntimeDir, SESSION_SOCKET};
use crate::systemd::{Loop, Notifier};
use conn::Acceptor;

/// Runs `work`, a daemon operation that can take milliseconds (zeroing or re-encoding many pages,
/// flash I/O), on Tokio's blocking pool, so that the runtime's two workers keep serving other
/// connections meanwhile. Run inline, such a request also held up the requests of other
/// connections queued on its worker: with the core lock already handed over between pages, another
/// client's `SessionStats` still waited the whole 84–100 ms of an admin `Compress` in two of three
/// rounds (`cargo bench -p kvmm-client --bench stall`, 2026-12-03).
pub(crate) async fn off_workers<T: Send + 'static>(
    what: &str,
    work: impl FnOnce() -> T + Send + 'static,
) -> std::result::Result<T, tonic::Status> {
    tokio::task::spawn_blocking(work).await.map_err(|e| tonic::Status::internal(format!("the {what} task failed: {e}")))
}

/// How long in-flight RPCs get to finish once shutdown starts.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(3);

/// Longest an orderly shutdown may take before kvmmd exits at once (under the unit's
/// `TimeoutStopSec=`, and within the 5 s a stop is promised in).
pub const STOP_LIMIT: Duration = Duration::from_millis(4500);

/// How often the status line is refreshed (sent only when it changed).
const STATUS_EVERY: Duration = Duration::from_secs(2);

/// One of kvmm's three sockets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    Session,
    Fd,
    Admin,
}

impl Role {
    const ALL: [Role; 3] = [Role::Session, Role::Fd, Role::Admin];

    /// File name in the runtime directory.
    fn file(self) -> &'static str {
        match self {
            Role::Session => SESSION_SOCKET,
            Role::Fd => FD_SOCKET,
            Role::Admin => ADMIN_SOCKET,
        }
    }

    /// `FileDescriptorName=` in the socket units.
    fn fd_name(self) -> &'static str {
        match self {
            Role::Session => "session",
            Role::Fd => "fd",
            Role::Admin => "admin",
        }
    }

    fn kind(self) -> SocketType {
        match self {
            Role::Fd => SocketType::SEQPACKET,
            Role::Session | Role::Admin => SocketType::STREAM,
        }
    }

    /// Which socket a passed fd is: its `FileDescriptorName=`, else the file name it is bound to.
    fn of(name: Option<&str>, bound: Option<&Path>) -> Option<Role> {
        let by_name = name.and_then(|n| Role::ALL.into_iter().find(|r| r.fd_name() == n || r.file() == n));
        by_name.or_else(|| {
            let file = bound?.file_name()?.to_str()?;
            Role::ALL.into_iter().find(|r| r.file() == file)
        })
    }
}

/// A socket type as the man pages spell it.
fn type_name(kind: SocketType) -> &'static str {
    match kind {
        SocketType::STREAM => "SOCK_STREAM",
        SocketType::SEQPACKET => "SOCK_SEQPACKET",
        SocketType::DGRAM => "SOCK_DGRAM",
        _ => "other",
    }
}

/// The three listening sockets, and which of them systemd passed.
struct Listeners {
    session: UnixListener,
    admin: UnixListener,
    fd: SeqpacketListener,
    passed: Vec<Role>,
}

/// The path a socket is bound to, if it is a named Unix socket.
fn bound_path(fd: &impl std::os::fd::AsFd) -> Option<PathBuf> {
    let addr = rustix::net::getsockname(fd).ok()?;
    let unix = rustix::net::SocketAddrUnix::try_from(addr).ok()?;
    let path = unix.path()?;
    Some(PathBuf::from(<std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(path.to_bytes())))
}

/// Adopts the sockets systemd passed and binds the rest in `dir`. Passed sockets keep the mode and
/// group their socket units gave them; sockets bound here get kvmm's own (clients of any uid on
/// the session and fd sockets, root and the admin group on the admin socket).
fn take_listeners(daemon: &Daemon, dir: &mut RuntimeDir, passed: Vec<PassedFd>) -> Result<Listeners> {
    let (mut session, mut admin, mut fd) = (None, None, None);
    let mut roles = Vec::new();
    for (i, p) in passed.into_iter().enumerate() {
        let raw = kvmm_shm::activation::LISTEN_FDS_START + i as i32;
        let bound = bound_path(&p.fd);
        let shown = format!(
            "the socket systemd passed as fd {raw} (name {}, bound to {})",
            p.name.as_deref().unwrap_or("none"),
            bound.as_deref().map_or("no path".to_owned(), |b| b.display().to_string())
        );
        let role = Role::of(p.name.as_deref(), bound.as_deref()).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "{shown} is none of kvmm's sockets; name it session, fd or admin (FileDescriptorName=) or bind \
                 it to kvmm.sock, kvmm-fd.sock or kvmm-admin.sock"
            ))
        })?;
        if roles.contains(&role) {
            return Err(Error::InvalidArgument(format!("{shown} is a second {} socket", role.fd_name())));
        }
        let kind =
            sockopt::socket_type(&p.fd).map_err(|e| Error::io(format!("cannot read the type of {shown}"), e.into()))?;
        let listening =
            sockopt::socket_acceptconn(&p.fd).map_err(|e| Error::io(format!("cannot inspect {shown}"), e.into()))?;
        if kind != role.kind() || !listening {
            let want = if role == Role::Fd { "ListenSequentialPacket=" } else { "ListenStream=" };
            return Err(Error::InvalidArgument(format!(
                "{shown} must be a listening {} socket (the unit's {want}); it is a {}{} socket",
                type_name(role.kind()),
                if listening { "listening " } else { "non-listening " },
                type_name(kind)
            )));
        }
        match role {
            Role::Session | Role::Admin => {
                let std = std::os::unix::net::UnixListener::from(p.fd);
                std.set_nonblocking(true).map_err(|e| Error::io(format!("cannot make {shown} non-blocking"), e))?;
                let l = UnixListener::from_std(std).map_err(|e| Error::io(format!("cannot serve {shown}"), e))?;
                if role == Role::Session { session = Some(l) } else { admin = Some(l) }
            }
            Role::Fd => fd = Some(SeqpacketListener::from_fd(p.fd)?),
        }
        tracing::info!(socket = role.file(), fd = raw, "using the socket systemd passed");
        roles.push(role);
    }
    let mut bind_stream = |role: Role| -> Result<UnixListener> {
        let path = dir.claim_socket(role.file());
        UnixListener::bind(&path).map_err(|e| Error::io(format!("cannot bind {}", path.display()), e))
    };
    let session = match session {
        Some(l) => l,
        None => bind_stream(Role::Session)?,
    };
    let admin = match admin {
        Some(l) => l,
        None => bind_stream(Role::Admin)?,
    };
    let fd = match fd {
        Some(l) => l,
        None => SeqpacketListener::bind(&dir.claim_socket(FD_SOCKET))?,
    };
    // Clients of any uid may attach; each only ever sees its own uid's arena. The admin socket is
    // further restricted by peer credentials on every request.
    for (role, mode) in [(Role::Session, 0o666), (Role::Fd, 0o666), (Role::Admin, 0o660)] {
        if !roles.contains(&role) {
            dir.set_mode(role.file(), mode)?;
        }
    }
    if let Some(gid) = daemon.config.admin_gid
        && !roles.contains(&Role::Admin)
    {
        rustix::fs::chown(dir.join(ADMIN_SOCKET).as_path(), None, Some(rustix::fs::Gid::from_raw(gid)))
            .map_err(|e| Error::io("cannot give the admin socket to the admin group", e.into()))?;
    }
    Ok(Listeners { session, admin, fd, passed: roles })
}

/// Serves on the sockets in `dir` (those in `passed` came from systemd) until SIGINT or SIGTERM;
/// then shuts down in order.
pub async fn run(daemon: Arc<Daemon>, mut dir: RuntimeDir, passed: Vec<PassedFd>) -> Result<()> {
    let notifier = Arc::new(Notifier::from_env());
    // Before any socket exists: from then on SIGHUP and SIGTERM are kvmmd's to handle (they wait
    // until serving starts), never the default action's.
    let mut signals = Signals::new()?;
    let Listeners { session: session_listener, admin: admin_listener, fd: fd_listener, passed } =
        take_listeners(&daemon, &mut dir, passed)?;

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
                // Destroying a connection's sessions zeroes their frames: off the async workers.
                let daemon = daemon.clone();
                if let Err(e) = off_workers("connection cleanup", move || daemon.connection_closed(conn)).await {
                    tracing::error!(error = %e, "destroying a closed connection's sessions failed");
                }
            }
        })
    };
    let inflight = inflight::InFlight::default();
    let session_server = tokio::spawn(
        tonic::transport::Server::builder()
            .layer(inflight.clone())
            .add_service(SessionServer::new(session_service::SessionService::new(daemon.clone())))
            .serve_with_incoming_shutdown(acceptor.incoming(session_listener), stopped()),
    );
    let admin_server = tokio::spawn(
        tonic::transport::Server::builder()
            .layer(inflight.clone())
            .add_service(AdminServer::new(admin_service::AdminService::new(daemon.clone())))
            .serve_with_incoming_shutdown(acceptor.incoming(admin_listener), stopped()),
    );
    let fd_server = {
        let daemon = daemon.clone();
        tokio::task::spawn_blocking(move || crate::fdpass::serve(daemon, fd_listener))
    };
    let mut background = vec![
        tokio::spawn(crate::prefault::prefault_task(daemon.clone())),
        tokio::spawn(crate::migrate::pin_watch_task(daemon.clone())),
    ];
    if let Some(interval) = daemon.config.compaction_interval {
        background.push(tokio::spawn(crate::migrate::compaction_task(daemon.clone(), interval)));
    }
    if daemon.config.tiers.any() {
        crate::migrate::start(&daemon)?;
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

    // Ready: the sockets are taken, the tiers are set up (Daemon::new preallocated the flash file,
    // probed the I/O engine and registered its buffers) and every watched loop has gone round once.
    let watched = watched_loops(&daemon);
    let deadline = Instant::now() + Duration::from_secs(10);
    while daemon.heartbeats.stalled(&watched, Duration::MAX, Instant::now()).is_some() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    if let Some((stalled, _)) = daemon.heartbeats.stalled(&watched, Duration::MAX, Instant::now()) {
        return Err(Error::FailedPrecondition(format!("the {} did not start within 10 s", stalled.name())));
    }
    let passed_note = if passed.is_empty() {
        "bound here".to_owned()
    } else {
        let names: Vec<&str> = passed.iter().map(|r| r.fd_name()).collect();
        format!("{} passed by systemd", names.join(", "))
    };
    tracing::info!(
        dir = %dir.path().display(),
        sockets = %passed_note,
        budget = daemon.config.device_budget,
        pid = std::process::id(),
        "kvmmd ready"
    );
    notifier.ready(&status_line(&daemon));
    background.push(tokio::spawn(status_task(daemon.clone(), notifier.clone())));
    if let Some(interval) = crate::systemd::watchdog_from_env() {
        tracing::info!(interval = ?interval, loops = ?watched, "feeding the systemd watchdog while the watched loops run");
        background.push(tokio::spawn(watchdog_task(daemon.clone(), notifier.clone(), interval, watched)));
    }

    signals.serve(&daemon, &notifier).await;

    tracing::info!("shutting down: no new work is admitted");
    notifier.notify("STOPPING=1\nSTATUS=stopping: wiping every session");
    daemon.begin_shutdown();
    daemon.wake_tiers();
    let _ = stop_tx.send(true);
    let orderly = async {
        // The calls under way finish (new ones are refused UNAVAILABLE); idle connections are
        // closed rather than waited for.
        let drained = tokio::time::timeout(DRAIN_TIMEOUT, async {
            while inflight.now() > 0 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await;
        if drained.is_err() {
            tracing::warn!(
                calls = inflight.now(),
                "calls in flight did not finish within {DRAIN_TIMEOUT:?}; closing anyway"
            );
        }
        session_server.abort();
        admin_server.abort();
        // The fd server polls the stop flag; it ends within its poll interval.
        let _ = tokio::time::timeout(Duration::from_millis(500), fd_server).await;
        for task in background {
            task.abort();
        }
        reaper.abort();
        let daemon = daemon.clone();
        tokio::task::spawn_blocking(move || daemon.wipe_all()).await.unwrap_or_default()
    };
    tokio::select! {
        wiped = orderly => tracing::info!(bytes = wiped, "all sessions wiped; removing sockets"),
        () = signals.next_stop() => {
            tracing::warn!("a second stop signal: exiting at once, without wiping");
            std::process::exit(1);
        }
        () = tokio::time::sleep(STOP_LIMIT) => {
            tracing::error!("the orderly shutdown did not finish within {STOP_LIMIT:?}; exiting at once");
            std::process::exit(1);
        }
    }
    drop(dir);
    Ok(())
}

/// The loops the watchdog watches: the policy loop always, the tier mover when tiers exist, the
/// flash drain with a flash tier.
fn watched_loops(daemon: &Daemon) -> Vec<Loop> {
    match (daemon.config.tiers.any(), daemon.flash.is_some()) {
        (true, true) => vec![Loop::Tiers, Loop::Flash, Loop::Policy],
        (true, false) => vec![Loop::Tiers, Loop::Policy],
        _ => vec![Loop::Policy],
    }
}

/// Pings systemd every half interval while every watched loop beats; logs (once per stall) why
/// it stops, so the journal says what systemd is about to restart kvmmd for.
async fn watchdog_task(daemon: Arc<Daemon>, notifier: Arc<Notifier>, interval: Duration, watched: Vec<Loop>) {
    let limit = crate::systemd::stall_limit(interval);
    let mut stalled_before = false;
    loop {
        match daemon.heartbeats.stalled(&watched, limit, Instant::now()) {
            None => {
                notifier.notify("WATCHDOG=1");
                stalled_before = false;
            }
            Some((which, age)) if !stalled_before => {
                tracing::error!(loop_ = which.name(), last_beat = ?age, "a watched loop stopped; no longer feeding the watchdog");
                notifier.status(&format!("unhealthy: the {} has not run for {age:?}", which.name()));
                stalled_before = true;
            }
            Some(_) => {}
        }
        tokio::time::sleep(interval / 2).await;
    }
}

/// Sends the status line when it changes.
async fn status_task(daemon: Arc<Daemon>, notifier: Arc<Notifier>) {
    let mut last = String::new();
    loop {
        tokio::time::sleep(STATUS_EVERY).await;
        let line = status_line(&daemon);
        if line != last {
            notifier.status(&line);
            last = line;
        }
    }
}

/// One line for `systemctl status`: sessions, tier use, the mode.
pub fn status_line(daemon: &Daemon) -> String {
    let s = daemon.status();
    let (_, policy) = daemon.policy_now();
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    let mut line = format!(
        "{} sessions of {} uids; device {:.0}/{:.0} MiB",
        s.sessions,
        s.trust_domains,
        mib(s.used),
        mib(s.budget)
    );
    for (name, tier) in [("dram", &s.dram), ("flash", &s.flash)] {
        if let Some(t) = tier {
            line.push_str(&format!(", {name} {:.0}/{:.0} MiB", mib(t.used), mib(t.budget)));
        }
    }
    line.push_str(&format!("; mode {}", policy.mode));
    if daemon.is_draining() {
        line.push_str("; draining");
    }
    line
}

/// The signals kvmmd acts on.
struct Signals {
    term: Signal,
    int: Signal,
    hup: Signal,
}

impl Signals {
    fn new() -> Result<Signals> {
        let on = |kind: SignalKind, name: &str| signal(kind).map_err(|e| Error::io(format!("cannot handle {name}"), e));
        Ok(Signals {
            term: on(SignalKind::terminate(), "SIGTERM")?,
            int: on(SignalKind::interrupt(), "SIGINT")?,
            hup: on(SignalKind::hangup(), "SIGHUP")?,
        })
    }

    /// Serves until SIGTERM or SIGINT; SIGHUP meanwhile reloads the policy between `RELOADING=1`
    /// and `READY=1`.
    async fn serve(&mut self, daemon: &Arc<Daemon>, notifier: &Notifier) {
        loop {
            tokio::select! {
                _ = self.term.recv() => { tracing::info!("SIGTERM received"); return }
                _ = self.int.recv() => { tracing::info!("SIGINT received"); return }
                _ = self.hup.recv() => {
                    tracing::info!("SIGHUP received: reloading the policy");
                    notifier.reloading();
                    let reloading = daemon.clone();
                    let outcome = tokio::task::spawn_blocking(move || reloading.reload_policy()).await;
                    match outcome {
                        Ok(Ok(())) => {}
                        Ok(Err(e)) => tracing::error!(error = %e, "policy reload refused; the running policy stays"),
                        Err(e) => tracing::error!(error = %e, "the policy reload panicked; the running policy stays"),
                    }
                    notifier.ready(&status_line(daemon));
                }
            }
        }
    }

    /// The next SIGTERM or SIGINT.
    async fn next_stop(&mut self) {
        tokio::select! {
            _ = self.term.recv() => {}
            _ = self.int.recv() => {}
        }
    }
}
