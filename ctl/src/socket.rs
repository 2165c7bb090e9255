//! Which admin socket kvmmctl dials: `--socket PATH`, else `$KVMM_ADMIN_SOCKET`, else
//! `kvmm-admin.sock` in kvmmd's default runtime directory (ARCHITECTURE.md, "Sockets"):
//! `$RUNTIME_DIRECTORY`, else `/run/kvmm` as root, else `$XDG_RUNTIME_DIR/kvmm`.
//!
//! One departure from the daemon's rule: an operator in kvmmd's admin group is usually not root, so
//! when the per-user socket does not exist but the system daemon's does, the system one is used.
//! `kvmm_client::connect::default_socket` does not fit here: it names the session socket and reads
//! `$KVMM_SOCKET`.

use std::path::{Path, PathBuf};

use kvmm_client::connect::ADMIN_SOCKET;

/// The system daemon's runtime directory.
const SYSTEM_RUNTIME_DIR: &str = "/run/kvmm";

/// What the choice depends on, read once from the process (or built by tests).
#[derive(Clone, Debug, Default)]
pub struct SocketEnv {
    /// `$KVMM_ADMIN_SOCKET`.
    pub admin_socket: Option<PathBuf>,
    /// The first directory of `$RUNTIME_DIRECTORY` (systemd may pass several, colon-separated).
    pub runtime_directory: Option<PathBuf>,
    /// `$XDG_RUNTIME_DIR`.
    pub xdg_runtime_dir: Option<PathBuf>,
    /// Whether the effective uid is 0.
    pub root: bool,
}

impl SocketEnv {
    /// Reads the environment of this process; empty variables count as unset.
    pub fn from_process() -> SocketEnv {
        let var = |name: &str| std::env::var_os(name).map(PathBuf::from).filter(|p| !p.as_os_str().is_empty());
        SocketEnv {
            admin_socket: var("KVMM_ADMIN_SOCKET"),
            runtime_directory: std::env::var_os("RUNTIME_DIRECTORY")
                .and_then(|v| v.to_str().and_then(|s| s.split(':').next()).map(PathBuf::from))
                .filter(|p| !p.as_os_str().is_empty()),
            xdg_runtime_dir: var("XDG_RUNTIME_DIR"),
            root: rustix::process::geteuid().is_root(),
        }
    }
}

/// The admin socket to dial. `exists` is asked only about the per-user socket, to decide whether to
/// fall back to the system daemon's.
pub fn admin_socket(flag: Option<&Path>, env: &SocketEnv, exists: impl Fn(&Path) -> bool) -> PathBuf {
    if let Some(p) = flag {
        return p.to_owned();
    }
    if let Some(p) = &env.admin_socket {
        return p.clone();
    }
    if let Some(dir) = &env.runtime_directory {
        return dir.join(ADMIN_SOCKET);
    }
    let system = Path::new(SYSTEM_RUNTIME_DIR).join(ADMIN_SOCKET);
    if env.root {
        return system;
    }
    match &env.xdg_runtime_dir {
        Some(dir) => {
            let user = dir.join("kvmm").join(ADMIN_SOCKET);
            if !exists(&user) && exists(&system) { system } else { user }
        }
        None => system,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(admin: Option<&str>, runtime: Option<&str>, xdg: Option<&str>, root: bool) -> SocketEnv {
        SocketEnv {
            admin_socket: admin.map(PathBuf::from),
            runtime_directory: runtime.map(PathBuf::from),
            xdg_runtime_dir: xdg.map(PathBuf::from),
            root,
        }
    }

    fn pick(flag: Option<&str>, e: &SocketEnv, existing: &[&str]) -> PathBuf {
        admin_socket(flag.map(Path::new), e, |p| existing.iter().any(|x| Path::new(x) == p))
    }

    #[test]
    fn the_flag_wins_over_every_variable() {
        let e = env(Some("/a/admin.sock"), Some("/srv"), Some("/run/user/1000"), true);
        assert_eq!(pick(Some("/x/y.sock"), &e, &[]), Path::new("/x/y.sock"));
    }

    #[test]
    fn kvmm_admin_socket_wins_over_the_runtime_directory() {
        let e = env(Some("/a/admin.sock"), Some("/srv"), None, false);
        assert_eq!(pick(None, &e, &[]), Path::new("/a/admin.sock"));
    }

    #[test]
    fn systemds_runtime_directory_comes_next() {
        let e = env(None, Some("/run/kvmm-test"), Some("/run/user/1000"), true);
        assert_eq!(pick(None, &e, &[]), Path::new("/run/kvmm-test/kvmm-admin.sock"));
    }

    #[test]
    fn root_uses_run_kvmm() {
        let e = env(None, None, Some("/run/user/0"), true);
        assert_eq!(pick(None, &e, &["/run/user/0/kvmm/kvmm-admin.sock"]), Path::new("/run/kvmm/kvmm-admin.sock"));
    }

    #[test]
    fn a_user_uses_their_runtime_dir_unless_only_the_system_daemon_runs() {
        let e = env(None, None, Some("/run/user/1000"), false);
        let user = Path::new("/run/user/1000/kvmm/kvmm-admin.sock");
        assert_eq!(pick(None, &e, &[]), user, "neither exists: the daemon's own rule");
        assert_eq!(pick(None, &e, &["/run/user/1000/kvmm/kvmm-admin.sock", "/run/kvmm/kvmm-admin.sock"]), user);
        assert_eq!(pick(None, &e, &["/run/kvmm/kvmm-admin.sock"]), Path::new("/run/kvmm/kvmm-admin.sock"));
        let no_xdg = env(None, None, None, false);
        assert_eq!(pick(None, &no_xdg, &[]), Path::new("/run/kvmm/kvmm-admin.sock"));
    }
}
