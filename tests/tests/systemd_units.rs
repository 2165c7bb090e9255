//! The systemd deployment, staged by `systemd/install.sh --destdir` into temporary roots: the
//! installed units pass `systemd-analyze verify` without a word and `systemd-analyze security` rates
//! the service's exposure at 2.0 or below; sysusers creates the user and groups the units name; the
//! installed `/etc/kvmm/kvmmd.toml` is the example with `admin_group` turned on, and the example
//! documents exactly the keys kvmmd's configuration structs accept; uninstall removes every file but
//! the operator's configuration (and that too with `--purge`), both actions run twice harmlessly,
//! `--prefix`/`--sysconfdir` move the paths the units name, the installed C API (both libraries,
//! header, `kvmm.pc` and `kvmm-static.pc`) builds and runs a C client through `pkg-config`, linked
//! either way (the static one against a real kvmmd with no `libkvmm.so`), and the Python binding lands
//! where the `python3` of the prefix imports from and finds the installed library.
//!
//! Nothing here touches the host's systemd: every run stages into a temporary directory. The checks
//! that need `systemd-analyze` skip, with a message, where it is not installed.

#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use kvmm_tests::{Daemon, libkvmm, libkvmm_static, number_after, workspace_bin};

/// The most `systemd-analyze security` may rate kvmmd.service (0 is best, 10 worst).
const MAX_EXPOSURE: f64 = 2.0;

/// The units install.sh puts in `$prefix/lib/systemd/system`.
const UNITS: [&str; 4] = ["kvmmd.service", "kvmmd.socket", "kvmmd-fd.socket", "kvmmd-admin.socket"];

/// What one command run left.
#[derive(Debug)]
struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

impl Run {
    fn ok(self, what: &str) -> Run {
        assert_eq!(self.code, 0, "{what} failed ({}):\nstdout:\n{}\nstderr:\n{}", self.code, self.stdout, self.stderr);
        self
    }

    fn both(&self) -> String {
        format!("{}{}", self.stdout, self.stderr)
    }
}

fn run(cmd: &mut Command) -> Run {
    let out = cmd.stdin(Stdio::null()).output().unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_owned()
}

/// Runs `systemd/install.sh` with `args`.
fn install_sh(args: &[&str]) -> Run {
    run(Command::new("bash").arg(repo().join("systemd/install.sh")).args(args).env_remove("KVMM_BIN_DIR"))
}

/// A directory holding `kvmmd`, `kvmmctl`, `libkvmm.so` and `libkvmm.a` as install.sh's
/// `--bindir-from` wants them.
fn bin_dir(real: bool) -> tempfile::TempDir {
    let dir = tempfile::Builder::new().prefix("kvmm-bin-").tempdir().unwrap();
    for name in ["kvmmd", "kvmmctl", "libkvmm.so", "libkvmm.a"] {
        let path = dir.path().join(name);
        if real {
            let built = match name {
                "libkvmm.so" => libkvmm(),
                "libkvmm.a" => libkvmm_static(),
                _ => workspace_bin(name),
            };
            std::os::unix::fs::symlink(built, &path).unwrap();
        } else {
            // Enough for verify (it checks that ExecStart names an executable) and for uninstall.
            std::fs::write(&path, "#!/bin/sh\nexit 0\n").unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
    }
    dir
}

/// Stages the deployment into `root` with the binaries of `bins` and `extra` arguments.
fn install_into(root: &Path, bins: &Path, extra: &[&str]) -> Run {
    let mut args = vec!["install", "--no-build", "--destdir", root.to_str().unwrap(), "--bindir-from"];
    args.push(bins.to_str().unwrap());
    args.extend_from_slice(extra);
    install_sh(&args).ok("install.sh install")
}

fn uninstall_from(root: &Path, extra: &[&str]) -> Run {
    let mut args = vec!["uninstall", "--destdir", root.to_str().unwrap()];
    args.extend_from_slice(extra);
    install_sh(&args).ok("install.sh uninstall")
}

/// Every regular file and link under `root`, relative to it, with its permission bits.
fn files(root: &Path) -> BTreeMap<String, u32> {
    fn walk(root: &Path, dir: &Path, out: &mut BTreeMap<String, u32>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let entry = entry.unwrap();
            let meta = std::fs::symlink_metadata(entry.path()).unwrap();
            if meta.is_dir() {
                walk(root, &entry.path(), out);
            } else {
                let rel = entry.path().strip_prefix(root).unwrap().to_str().unwrap().to_owned();
                out.insert(rel, meta.permissions().mode() & 0o7777);
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(root, root, &mut out);
    out
}

fn names(files: &BTreeMap<String, u32>) -> BTreeSet<&str> {
    files.keys().map(String::as_str).collect()
}

fn have_systemd_analyze() -> bool {
    let found = Command::new("systemd-analyze")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !found {
        println!("SKIPPED: systemd-analyze is not installed (Debian: apt-get install systemd)");
    }
    found
}

/// The major version `systemctl --version` reports, as install.sh reads it.
fn host_systemd_version() -> Option<u32> {
    let out = run(Command::new("systemctl").arg("--version"));
    let first = out.stdout.lines().next()?.split_whitespace().nth(1)?.to_owned();
    first.chars().take_while(char::is_ascii_digit).collect::<String>().parse().ok()
}

/// Gives `root` what `systemd-analyze verify --root` resolves besides our units: the standard targets
/// (the units' `WantedBy=`, `After=` of the default dependencies) and `/bin/kill` (ExecReload).
fn add_verify_dependencies(root: &Path) {
    let units = root.join("usr/lib/systemd/system");
    std::fs::create_dir_all(&units).unwrap();
    let mut targets = 0;
    for entry in std::fs::read_dir("/usr/lib/systemd/system").unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "target") && path.is_file() {
            std::fs::copy(&path, units.join(path.file_name().unwrap())).unwrap();
            targets += 1;
        }
    }
    assert!(targets > 0, "the host has no /usr/lib/systemd/system/*.target to give verify");
    std::fs::create_dir_all(root.join("bin")).unwrap();
    let kill = root.join("bin/kill");
    if std::fs::copy("/bin/kill", &kill).is_err() {
        // A host without procps: verify only checks that ExecReload names an executable.
        std::fs::write(&kill, "#!/bin/sh\nexit 0\n").unwrap();
        std::fs::set_permissions(&kill, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
}

/// `systemd-analyze verify --root=ROOT` of the four units: exit code and everything it printed.
fn verify(root: &Path) -> (i32, String) {
    let out = run(Command::new("systemd-analyze").arg("verify").arg(format!("--root={}", root.display())).args(UNITS));
    (out.code, out.both())
}

#[test]
fn installed_units_verify_silently_score_low_exposure_and_name_users_sysusers_creates() {
    if !have_systemd_analyze() {
        return;
    }
    let root = tempfile::Builder::new().prefix("kvmm-destdir-").tempdir().unwrap();
    let bins = bin_dir(true);
    add_verify_dependencies(root.path());
    let out = install_into(root.path(), bins.path(), &[]);
    let installed = files(root.path());
    for unit in UNITS {
        assert!(installed.contains_key(&format!("usr/lib/systemd/system/{unit}")), "{unit} not installed");
    }
    assert_eq!(
        std::fs::read(root.path().join("usr/bin/kvmmd")).unwrap(),
        std::fs::read(workspace_bin("kvmmd")).unwrap(),
        "install.sh did not install the kvmmd it was pointed at"
    );

    // The drop-in is for systemd 254+ only (systemd 252's verify warns about its keys).
    let dropin = installed.contains_key("usr/lib/systemd/system/kvmmd.service.d/50-systemd-254.conf");
    let version = host_systemd_version();
    assert_eq!(dropin, version.is_some_and(|v| v >= 254), "systemd {version:?}, drop-in installed: {dropin}\n{out:?}");
    println!("systemd {version:?}: drop-in installed: {dropin}");

    let (code, said) = verify(root.path());
    assert!(code == 0 && said.is_empty(), "systemd-analyze verify exited {code} and said:\n{said}");

    // The check bites: the same root with one misspelled key, and without the binary.
    let bad = tempfile::Builder::new().prefix("kvmm-destdir-bad-").tempdir().unwrap();
    add_verify_dependencies(bad.path());
    install_into(bad.path(), bin_dir(false).path(), &["--systemd-version", "252"]);
    let service = bad.path().join("usr/lib/systemd/system/kvmmd.service");
    let text = std::fs::read_to_string(&service).unwrap();
    assert!(text.contains("\nProtectSystem=strict\n"));
    std::fs::write(&service, text.replace("\nProtectSystem=strict\n", "\nProtectSytem=strict\n")).unwrap();
    let (_, said) = verify(bad.path());
    assert!(said.contains("Unknown key 'ProtectSytem'"), "verify did not notice a misspelled key:\n{said}");
    std::fs::remove_file(bad.path().join("usr/bin/kvmmd")).unwrap();
    let (_, said) = verify(bad.path());
    assert!(said.contains("/usr/bin/kvmmd is not executable"), "verify did not notice a missing kvmmd:\n{said}");

    let service = root.path().join("usr/lib/systemd/system/kvmmd.service");
    let out = run(Command::new("systemd-analyze").args(["security", "--no-pager", "--offline=true"]).arg(&service))
        .ok("systemd-analyze security");
    let line = out
        .both()
        .lines()
        .find(|l| l.contains("Overall exposure level for kvmmd.service:"))
        .unwrap_or_else(|| panic!("no overall exposure in:\n{}", out.both()))
        .to_owned();
    let score: f64 = line.rsplit_once(':').unwrap().1.split_whitespace().next().unwrap().parse().unwrap();
    println!("systemd-analyze security: overall exposure of kvmmd.service {score} (at most {MAX_EXPOSURE})");
    assert!(score <= MAX_EXPOSURE, "{line}");

    let sysusers = root.path().join("usr/lib/sysusers.d/kvmm.conf");
    let out = run(Command::new("systemd-sysusers")
        .arg("--dry-run")
        .arg(format!("--root={}", root.path().display()))
        .arg(&sysusers))
    .ok("systemd-sysusers --dry-run");
    let created = |kind: &str| -> BTreeSet<String> {
        let prefix = format!("Creating {kind} '");
        out.both()
            .lines()
            .filter_map(|l| l.strip_prefix(&prefix)?.split_once('\'').map(|(name, _)| name.to_owned()))
            .collect()
    };
    assert_eq!(created("user"), BTreeSet::from(["kvmm".to_owned()]), "{}", out.both());
    let groups = created("group");
    for group in ["kvmm", "kvmm-clients", "kvmm-admin"] {
        assert!(groups.contains(group), "sysusers does not create group {group}:\n{}", out.both());
    }
    // The users and groups the units name are the ones sysusers creates.
    let units: String = UNITS
        .iter()
        .map(|u| std::fs::read_to_string(root.path().join("usr/lib/systemd/system").join(u)).unwrap())
        .collect();
    for line in units.lines() {
        for key in ["User=", "Group=", "SocketGroup="] {
            if let Some(name) = line.strip_prefix(key) {
                let known = if key == "User=" { created("user") } else { groups.clone() };
                assert!(known.contains(name), "{line} names an account sysusers does not create");
            }
        }
    }
}

/// `(table, key)` for every key the configuration structs of daemon/src/config.rs accept: the
/// `Deserialize` structs reached from `FileConfig`, a field whose type is another such struct being a
/// table (`[tiers]`, `[[policy.floor]]`) rather than a key. A plain text scan of the source.
fn config_keys() -> BTreeSet<(String, String)> {
    let source = std::fs::read_to_string(repo().join("daemon/src/config.rs")).unwrap();
    let mut structs: BTreeMap<String, Vec<(String, String)>> = BTreeMap::new();
    let mut lines = source.lines();
    let mut derives_deserialize = false;
    while let Some(line) = lines.next() {
        let line = line.trim();
        if line.starts_with("#[derive(") {
            derives_deserialize = line.contains("Deserialize");
            continue;
        }
        let Some(rest) = line.strip_prefix("pub struct ") else { continue };
        if !std::mem::take(&mut derives_deserialize) {
            continue;
        }
        let name = rest.trim_end_matches(" {").to_owned();
        let mut fields = Vec::new();
        for field in lines.by_ref() {
            let field = field.trim();
            if field == "}" {
                break;
            }
            if let Some((key, ty)) = field.strip_prefix("pub ").and_then(|f| f.split_once(": ")) {
                fields.push((key.to_owned(), ty.trim_end_matches(',').to_owned()));
            }
        }
        structs.insert(name, fields);
    }
    assert!(structs.contains_key("FileConfig"), "no `pub struct FileConfig` deriving Deserialize in config.rs");

    let mut keys = BTreeSet::new();
    let mut todo = vec![("FileConfig".to_owned(), String::new())];
    while let Some((name, table)) = todo.pop() {
        for (key, ty) in &structs[&name] {
            let inner = ty.split(['<', '>']).find(|part| structs.contains_key(*part));
            match inner {
                Some(inner) => {
                    let sub = if table.is_empty() { key.clone() } else { format!("{table}.{key}") };
                    todo.push((inner.to_owned(), sub));
                }
                None => {
                    keys.insert((table.clone(), key.clone()));
                }
            }
        }
    }
    keys
}

/// `(table, key)` for every key the example shows, commented out (`# key = ...`) or not, and the
/// table headers it shows (`[tiers]`, `# [[policy.floor]]`) deciding the table.
fn example_keys(example: &str) -> BTreeSet<(String, String)> {
    let mut table = String::new();
    let mut keys = BTreeSet::new();
    for line in example.lines() {
        let line = line.strip_prefix("# ").unwrap_or(line).trim_end();
        if let Some(header) = line.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
            table = header.trim_start_matches('[').trim_end_matches(']').to_owned();
        } else if let Some((key, _)) = line.split_once(" = ")
            && !key.is_empty()
            && key.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        {
            keys.insert((table.clone(), key.to_owned()));
        }
    }
    keys
}

#[test]
fn installed_config_is_the_example_with_admin_group_on_and_the_example_documents_every_key() {
    let root = tempfile::Builder::new().prefix("kvmm-destdir-").tempdir().unwrap();
    install_into(root.path(), bin_dir(false).path(), &[]);
    let example = std::fs::read_to_string(repo().join("systemd/kvmmd.toml.example")).unwrap();
    assert_eq!(std::fs::read_to_string(root.path().join("usr/share/doc/kvmm/kvmmd.toml.example")).unwrap(), example);
    let config = std::fs::read_to_string(root.path().join("etc/kvmm/kvmmd.toml")).unwrap();

    // kvmmd has no dry run, so the installed file is checked for its shape: the example (whose
    // every key parses once uncommented: config.rs's the_example_file_parses_with_every_key_uncommented)
    // with exactly one line turned on, at the top level, and nothing else live.
    let changed: Vec<(&str, &str)> = example.lines().zip(config.lines()).filter(|(a, b)| a != b).collect();
    assert_eq!(changed, [("# admin_group = \"kvmm-admin\"", "admin_group = \"kvmm-admin\"")]);
    assert_eq!(example.lines().count(), config.lines().count());
    let mut in_table = false;
    for line in config.lines() {
        let line = line.trim();
        if line.starts_with('[') && line.ends_with(']') {
            in_table = true;
        } else if line == "admin_group = \"kvmm-admin\"" {
            assert!(!in_table, "admin_group is inside a table, where kvmmd rejects it");
        } else {
            assert!(line.is_empty() || line.starts_with('#'), "a live line in the installed config: {line}");
        }
    }

    let accepted = config_keys();
    // Not vacuous: the scan found the top-level keys and the nested tables.
    for probe in
        [("", "admin_group"), ("tiers", "flash_budget"), ("compaction", "interval_ms"), ("policy.floor", "layers")]
    {
        assert!(accepted.contains(&(probe.0.to_owned(), probe.1.to_owned())), "config.rs scan missed {probe:?}");
    }
    let documented = example_keys(&example);
    let missing: Vec<_> = accepted.difference(&documented).collect();
    let unknown: Vec<_> = documented.difference(&accepted).collect();
    assert!(missing.is_empty(), "keys config.rs accepts that kvmmd.toml.example does not show: {missing:?}");
    assert!(unknown.is_empty(), "keys kvmmd.toml.example shows that config.rs does not accept: {unknown:?}");
    println!("kvmmd.toml.example documents all {} keys of config.rs", accepted.len());
}

#[test]
fn uninstall_leaves_only_the_config_until_purge_and_reinstall_keeps_an_edited_config() {
    let root = tempfile::Builder::new().prefix("kvmm-destdir-").tempdir().unwrap();
    let bins = bin_dir(false);
    let config = root.path().join("etc/kvmm/kvmmd.toml");
    let installed = BTreeMap::from(
        [
            ("usr/bin/kvmmd", 0o755),
            ("usr/bin/kvmmctl", 0o755),
            ("usr/lib/libkvmm.so", 0o755),
            ("usr/lib/libkvmm.a", 0o644),
            ("usr/include/kvmm.h", 0o644),
            ("usr/lib/pkgconfig/kvmm.pc", 0o644),
            ("usr/lib/pkgconfig/kvmm-static.pc", 0o644),
            ("usr/lib/python3/dist-packages/kvmm.py", 0o644),
            ("usr/lib/systemd/system/kvmmd.service", 0o644),
            ("usr/lib/systemd/system/kvmmd.socket", 0o644),
            ("usr/lib/systemd/system/kvmmd-fd.socket", 0o644),
            ("usr/lib/systemd/system/kvmmd-admin.socket", 0o644),
            ("usr/lib/systemd/system/kvmmd.service.d/50-systemd-254.conf", 0o644),
            ("usr/lib/sysusers.d/kvmm.conf", 0o644),
            ("usr/share/doc/kvmm/kvmmd.toml.example", 0o644),
            ("usr/share/doc/kvmm/README.md", 0o644),
            ("etc/kvmm/kvmmd.toml", 0o644),
        ]
        .map(|(p, m)| (p.to_owned(), m)),
    );

    // Where Debian's python3 imports from; named, so the list does not depend on this host's python3.
    let python = ["--python-dir", "/usr/lib/python3/dist-packages"];
    let out = install_into(root.path(), bins.path(), &["--systemd-version", "254", python[0], python[1]]);
    assert!(out.stdout.contains("systemd 254 (--systemd-version): installed the drop-in"), "{}", out.stdout);
    assert_eq!(files(root.path()), installed);

    let edited = format!("{}device_budget = \"1GiB\"\n", std::fs::read_to_string(&config).unwrap());
    std::fs::write(&config, &edited).unwrap();
    let out = install_into(root.path(), bins.path(), &["--systemd-version", "254", python[0], python[1]]);
    assert!(out.stdout.contains("kept the existing"), "{}", out.stdout);
    assert_eq!(std::fs::read_to_string(&config).unwrap(), edited, "a second install overwrote the config");
    assert_eq!(files(root.path()), installed);

    let only_config = BTreeSet::from(["etc/kvmm/kvmmd.toml"]);
    // A compiled copy Python left beside the module goes with it.
    let cache = root.path().join("usr/lib/python3/dist-packages/__pycache__");
    std::fs::create_dir_all(&cache).unwrap();
    std::fs::write(cache.join("kvmm.cpython-311.pyc"), b"bytecode").unwrap();
    let out = uninstall_from(root.path(), &python);
    assert!(out.stdout.contains(&format!("left {}", config.display())), "{}", out.stdout);
    assert!(!cache.exists(), "uninstall left {}", cache.display());
    assert!(out.stdout.contains("left the user kvmm"), "{}", out.stdout);
    assert_eq!(names(&files(root.path())), only_config);
    assert_eq!(std::fs::read_to_string(&config).unwrap(), edited);
    uninstall_from(root.path(), &[]);
    assert_eq!(names(&files(root.path())), only_config, "a second uninstall changed something");

    let flash = root.path().join("var/lib/kvmm/kvmm.flash");
    std::fs::create_dir_all(flash.parent().unwrap()).unwrap();
    std::fs::write(&flash, b"sealed pages").unwrap();
    let out = uninstall_from(root.path(), &[]);
    assert!(out.stdout.contains("var/lib/kvmm (the flash file; --purge removes it)"), "{}", out.stdout);
    uninstall_from(root.path(), &["--purge"]);
    assert_eq!(files(root.path()), BTreeMap::new(), "--purge left files");
    assert!(!root.path().join("etc/kvmm").exists() && !root.path().join("var/lib/kvmm").exists());
    uninstall_from(root.path(), &["--purge"]);
}

#[test]
fn prefix_and_sysconfdir_move_every_path_the_units_name() {
    let root = tempfile::Builder::new().prefix("kvmm-destdir-").tempdir().unwrap();
    let out = install_into(
        root.path(),
        bin_dir(false).path(),
        &["--prefix", "/usr/local", "--sysconfdir", "/etc/opt", "--systemd-version", "253"],
    );
    assert!(out.stdout.contains("systemd 253 (--systemd-version) is older than 254"), "{}", out.stdout);
    let unitdir = root.path().join("usr/local/lib/systemd/system");
    let service = std::fs::read_to_string(unitdir.join("kvmmd.service")).unwrap();
    assert!(service.contains("\nExecStart=/usr/local/bin/kvmmd --config /etc/opt/kvmm/kvmmd.toml\n"), "{service}");
    for unit in UNITS {
        let text = std::fs::read_to_string(unitdir.join(unit)).unwrap();
        assert!(text.contains("Documentation=file:///usr/local/share/doc/kvmm/README.md"), "{unit}:\n{text}");
        assert!(!text.contains("/usr/bin/") && !text.contains("/usr/share/"), "{unit} names a /usr path:\n{text}");
    }
    assert!(root.path().join("etc/opt/kvmm/kvmmd.toml").is_file());
    assert!(root.path().join("usr/local/lib/sysusers.d/kvmm.conf").is_file());
    assert!(!unitdir.join("kvmmd.service.d").exists(), "drop-in installed for systemd 253");

    if have_systemd_analyze() {
        add_verify_dependencies(root.path());
        let (code, said) = verify(root.path());
        assert!(code == 0 && said.is_empty(), "systemd-analyze verify exited {code} and said:\n{said}");
    }
    uninstall_from(root.path(), &["--prefix", "/usr/local", "--sysconfdir", "/etc/opt"]);
    let left: BTreeSet<String> = files(root.path()).into_keys().filter(|f| f.starts_with("usr/local")).collect();
    assert!(left.is_empty(), "uninstall left {left:?}");
}

#[test]
fn the_installed_c_api_builds_a_client_through_pkg_config() {
    let root = tempfile::Builder::new().prefix("kvmm-destdir-").tempdir().unwrap();
    let out = install_into(root.path(), bin_dir(true).path(), &["--systemd-version", "254"]);
    assert!(out.stdout.contains("installed the C API"), "{}", out.stdout);
    let usr = root.path().join("usr");
    assert_eq!(std::fs::read(usr.join("lib/libkvmm.so")).unwrap(), std::fs::read(libkvmm()).unwrap());
    assert_eq!(
        std::fs::read(usr.join("include/kvmm.h")).unwrap(),
        std::fs::read(repo().join("capi/include/kvmm.h")).unwrap()
    );
    assert_eq!(std::fs::read(usr.join("lib/libkvmm.a")).unwrap(), std::fs::read(libkvmm_static()).unwrap());
    let version = format!("Version: {}\n", env!("CARGO_PKG_VERSION"));
    for (pc, libs) in [("kvmm.pc", "-lkvmm\n"), ("kvmm-static.pc", "-l:libkvmm.a -lgcc_s")] {
        let text = std::fs::read_to_string(usr.join("lib/pkgconfig").join(pc)).unwrap();
        let libs = format!("Libs: -L${{libdir}} {libs}");
        for line in ["prefix=/usr\n", &libs, "Cflags: -I${includedir}\n", &version] {
            assert!(text.contains(line), "{pc} lacks {line:?}:\n{text}");
        }
    }

    let found = Command::new("pkg-config").arg("--version").output().is_ok_and(|o| o.status.success());
    if !found {
        println!(
            "SKIPPED the build through pkg-config: pkg-config is not installed (Debian: apt-get install pkg-config)"
        );
        return;
    }
    let flags = pkg_config(root.path(), "kvmm");
    assert!(flags.contains(&"-lkvmm".to_owned()), "{flags:?}");
    let program = root.path().join("kvmm-c-client");
    compile_session_c(&flags, &usr, &program);
    // It runs with the installed library (through its run path: cargo's LD_LIBRARY_PATH, which
    // names the build's copy, removed), and the struct layouts it prints are the header's.
    let out =
        run(Command::new(&program).args(["layout", "-"]).env_remove("LD_LIBRARY_PATH")).ok("the installed client");
    assert!(out.stdout.starts_with("kvmm_geometry size 28\n"), "{}", out.stdout);
    let ldd = run(Command::new("ldd").arg(&program).env_remove("LD_LIBRARY_PATH")).ok("ldd");
    assert!(ldd.stdout.contains(&format!("{}", usr.join("lib/libkvmm.so").display())), "{}", ldd.stdout);

    // The same program linked with libkvmm.a through kvmm-static.pc needs no libkvmm.so at all: it
    // runs with the installed shared library gone, and keeps a session in a real kvmmd across a
    // process exit.
    let flags = pkg_config(root.path(), "kvmm-static");
    assert!(flags.contains(&"-l:libkvmm.a".to_owned()), "{flags:?}");
    let program = root.path().join("kvmm-c-client-static");
    compile_session_c(&flags, &usr, &program);
    std::fs::remove_file(usr.join("lib/libkvmm.so")).unwrap();
    let needed = run(Command::new("readelf").args(["-d"]).arg(&program)).ok("readelf -d");
    assert!(needed.stdout.contains("(NEEDED)"), "{}", needed.stdout);
    assert!(!needed.stdout.contains("libkvmm"), "the static client still needs a libkvmm:\n{}", needed.stdout);
    let out = run(Command::new(&program).args(["layout", "-"]).env_remove("LD_LIBRARY_PATH")).ok("the static client");
    assert!(out.stdout.starts_with("kvmm_geometry size 28\n"), "{}", out.stdout);

    let daemon = Daemon::start(&[]);
    let socket = daemon.socket();
    let left = run(Command::new(&program).arg("leave").arg(&socket).env_remove("LD_LIBRARY_PATH")).ok("leave");
    let left = left.stdout.lines().find(|l| l.starts_with("left ")).unwrap_or_else(|| panic!("{}", left.stdout));
    assert!(number_after(left, "worst") < 1e-5, "{left}");
    let words: Vec<&str> = left.split_whitespace().collect();
    daemon.wait_status(Duration::from_secs(10), |s| s.orphaned_sessions == 2);
    let resumed = run(Command::new(&program).arg("resume").arg(&socket).env_remove("LD_LIBRARY_PATH")).ok("resume");
    // The same attention over the pages the first process left, bit for bit.
    let expected = format!("resumed {} {}", words[1], words[2]);
    assert!(resumed.stdout.lines().any(|l| l == expected), "{expected:?} not in:\n{}", resumed.stdout);
    daemon.wait_drained();
}

/// What `pkg-config --cflags --libs NAME` gives a packager's build with the staged tree under
/// `root` as its sysroot.
fn pkg_config(root: &Path, name: &str) -> Vec<String> {
    let flags = run(Command::new("pkg-config")
        .args(["--cflags", "--libs", name])
        .env("PKG_CONFIG_SYSROOT_DIR", root)
        .env("PKG_CONFIG_LIBDIR", root.join("usr/lib/pkgconfig")))
    .ok(&format!("pkg-config --cflags --libs {name}"));
    flags.stdout.split_whitespace().map(str::to_owned).collect()
}

/// Compiles `tests/c/session.c` into `program` with `flags`, with a run path to `usr/lib`.
fn compile_session_c(flags: &[String], usr: &Path, program: &Path) {
    run(Command::new("cc")
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-pthread"])
        .arg(repo().join("tests/c/session.c"))
        .args(flags)
        .arg(format!("-Wl,-rpath,{}", usr.join("lib").display()))
        .args(["-lm", "-o"])
        .arg(program))
    .ok(&format!("cc with pkg-config's flags {flags:?}"));
}

/// `python3`'s answer to `code`, or None where there is no python3.
fn python3(code: &str, env: &[(&str, &Path)]) -> Option<String> {
    let mut cmd = Command::new("python3");
    cmd.args(["-c", code]).env("PYTHONDONTWRITEBYTECODE", "1").env_remove("KVMM_LIBRARY");
    for (key, value) in env {
        cmd.env(key, value);
    }
    let out = cmd.output().ok()?;
    assert!(out.status.success(), "python3 -c {code:?}: {}", String::from_utf8_lossy(&out.stderr));
    Some(String::from_utf8(out.stdout).unwrap().trim().to_owned())
}

#[test]
fn the_installed_python_module_is_where_python3_imports_from_and_finds_the_installed_library() {
    let Some(prefix) = python3("import sys; print(sys.prefix)", &[]) else {
        println!("SKIPPED: no python3 on PATH");
        return;
    };
    // Installed under python3's own prefix, the module goes to the first directory it imports
    // packages from (found by install.sh, not named).
    let site = python3("import site; print(site.getsitepackages()[0])", &[]).unwrap();
    let root = tempfile::Builder::new().prefix("kvmm-destdir-").tempdir().unwrap();
    let out = install_into(root.path(), bin_dir(true).path(), &["--prefix", &prefix, "--systemd-version", "254"]);
    let staged = |path: &str| root.path().join(path.trim_start_matches('/'));
    assert!(out.stdout.contains(&format!("installed the Python binding: {}", staged(&site).join("kvmm.py").display())));
    assert_eq!(
        std::fs::read(staged(&site).join("kvmm.py")).unwrap(),
        std::fs::read(repo().join("capi/python/kvmm.py")).unwrap()
    );
    // It imports from there and loads the installed library through the system's search (here the
    // staged lib directory on LD_LIBRARY_PATH, as ldconfig's cache would name it once installed).
    let lib = staged(&prefix).join("lib");
    let said = python3(
        "import kvmm; v = kvmm._library().kvmm_api_version(); \
         maps = [l.split()[-1] for l in open('/proc/self/maps') if l.rstrip().endswith('/libkvmm.so')]; \
         print(kvmm.__file__, maps[0], v)",
        &[("PYTHONPATH", &staged(&site)), ("LD_LIBRARY_PATH", &lib)],
    )
    .unwrap();
    assert_eq!(
        said,
        format!(
            "{} {} {}",
            staged(&site).join("kvmm.py").display(),
            lib.join("libkvmm.so").display(),
            kvmm::API_VERSION
        ),
        "the staged module and library"
    );

    // `none` leaves it out, and so does a prefix python3 does not import from.
    let bare = tempfile::Builder::new().prefix("kvmm-destdir-").tempdir().unwrap();
    let out = install_into(bare.path(), bin_dir(false).path(), &["--prefix", "/opt/kvmm-test", "--python-dir", "none"]);
    assert!(out.stdout.contains("left out the Python binding"), "{}", out.stdout);
    let out = install_into(bare.path(), bin_dir(false).path(), &["--prefix", "/opt/kvmm-test"]);
    assert!(out.stdout.contains("no python3 here imports packages from under /opt/kvmm-test/lib/"), "{}", out.stdout);
    assert!(!files(bare.path()).keys().any(|f| f.ends_with(".py")), "{:?}", files(bare.path()));

    uninstall_from(root.path(), &["--prefix", &prefix]);
    assert!(!staged(&site).join("kvmm.py").exists(), "uninstall left the module");
}
