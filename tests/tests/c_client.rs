//! A C program keeps its KV cache in a real kvmmd through the C API (`capi/include/kvmm.h`,
//! `libkvmm.so`): `tests/c/session.c`, compiled here with the system C compiler against the header
//! and the library cargo built for this package, with warnings as errors.
//!
//! It attaches, appends K/V in calls that cross a page boundary, and checks every attention output
//! against its own double-precision reference; every kind of bad input is refused with the status
//! and sentence checked here; two threads share one client; a process that dies leaves a lingering
//! session that another finds with `kvmm_orphans` and resumes; and the header's structs have the
//! library's layout.

#![allow(clippy::unwrap_used)]

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use kvmm_proto::v1::{ListSessionsRequest, Priority};
use kvmm_tests::{Daemon, libkvmm, libkvmm_static, number_after, wait_timeout};

/// `tests/c/session.c`, compiled once per test binary beside the library it links (a build output
/// like the library; the tests of this file share it).
fn program() -> &'static Path {
    static PROGRAM: OnceLock<PathBuf> = OnceLock::new();
    PROGRAM.get_or_init(compile)
}

/// Compiles `tests/c/session.c` into the library's directory and returns the program.
fn compile() -> PathBuf {
    let library = libkvmm();
    let lib_dir = library.parent().expect("the library's directory");
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("the workspace root");
    let program = lib_dir.join("kvmm-c-client");
    let cc = std::env::var_os("CC").unwrap_or_else(|| "cc".into());
    let out = Command::new(&cc)
        .args(["-std=c11", "-O1", "-Wall", "-Wextra", "-Werror", "-pthread", "-I"])
        .arg(root.join("capi/include"))
        .arg(root.join("tests/c/session.c"))
        .arg("-L")
        .arg(lib_dir)
        .arg("-lkvmm")
        .arg(format!("-Wl,-rpath,{}", lib_dir.display()))
        .args(["-lm", "-o"])
        .arg(&program)
        .output()
        .unwrap_or_else(|e| panic!("cannot run the C compiler {cc:?}: {e}"));
    assert!(out.status.success(), "the C program does not compile:\n{}", String::from_utf8_lossy(&out.stderr));
    program
}

/// A command running the program with the library it was linked against (its run path): cargo's
/// `LD_LIBRARY_PATH` would put the build directory's copy first, which may be another build's.
fn program_command(program: &Path) -> Command {
    let mut command = Command::new(program);
    command.env_remove("LD_LIBRARY_PATH");
    command
}

/// Runs the program in `mode` to the end and returns its output lines.
fn run(program: &Path, mode: &str, socket: &Path) -> Vec<String> {
    let out = program_command(program).arg(mode).arg(socket).output().expect("run the C program");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{mode} failed ({}):\n{stdout}{}", out.status, String::from_utf8_lossy(&out.stderr));
    stdout.lines().map(str::to_owned).collect()
}

/// The one line that starts with `prefix`.
fn line<'a>(lines: &'a [String], prefix: &str) -> &'a str {
    let found: Vec<_> = lines.iter().filter(|l| l.starts_with(prefix)).collect();
    assert_eq!(found.len(), 1, "one line starting {prefix:?} in:\n{}", lines.join("\n"));
    found[0]
}

#[test]
fn a_c_program_appends_and_attends_through_libkvmm_and_bad_input_gets_a_status_and_a_sentence() {
    let program = program();
    let daemon = Daemon::start(&[]);
    let mut child = program_command(program)
        .args(["session", "-"])
        .env("KVMM_SOCKET", daemon.socket())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("start the C program");
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut lines = Vec::new();
    while !lines.last().is_some_and(|l: &String| l.starts_with("ready ") || l.starts_with("FAIL")) {
        let mut l = String::new();
        if stdout.read_line(&mut l).unwrap() == 0 {
            break;
        }
        lines.push(l.trim_end().to_owned());
    }
    let id: u64 = line(&lines, "ready ").trim_start_matches("ready ").parse().unwrap();

    // While the program waits: kvmmd shows its session as it attached it, with the tokens it
    // appended, owned by its process.
    let sessions = daemon.admin(async |mut a| a.list_sessions(ListSessionsRequest {}).await.unwrap().into_inner());
    let s = sessions.sessions.iter().find(|s| s.session_id == id).expect("the C program's session is listed");
    assert_eq!((s.model_id.as_str(), s.priority(), s.tokens), ("c-client", Priority::Background, 100));
    assert_eq!(s.pid, child.id() as i32);
    assert_eq!(s.executable, "kvmm-c-client");
    assert_eq!(sessions.sessions.len(), 1, "the two threads' sessions are gone");
    child.stdin.take().unwrap().write_all(b"\n").unwrap();
    for l in stdout.lines() {
        lines.push(l.unwrap());
    }
    let status = wait_timeout(&mut child, Duration::from_secs(10)).expect("the C program exits");
    let output = lines.join("\n");
    assert!(status.success(), "the C program failed:\n{output}");
    println!("{output}");

    // Values f16 holds exactly, so the reference sees what the pages hold: float rounding only.
    let prefixes = [
        "attention worst",
        "budget of every page worst",
        "thread 0 worst",
        "thread 1 worst",
        "evicted ",
        "append16 ",
        "truncated ",
    ];
    for prefix in prefixes {
        let worst = number_after(line(&lines, prefix), "worst");
        assert!(worst < 1e-5, "{prefix}: relative error {worst}");
    }
    let mass = line(&lines, "mass pages ");
    assert_eq!(number_after(mass, "pages"), 4.0, "{mass}");
    assert!((number_after(mass, "sum") - 1.0).abs() < 1e-5, "{mass}");
    // 400 tokens (13 pages) a layer under a quota of 224 tokens (7 pages): 6 pages dropped, never
    // the first (the sink) or the last 128 tokens, and attention read exactly the rest.
    let evicted = line(&lines, "evicted ");
    assert_eq!(number_after(evicted, "dropped"), 6.0, "{evicted}");
    assert!(number_after(evicted, "first") >= 1.0, "the sink page was dropped: {evicted}");
    assert_eq!(number_after(evicted, "kept"), 400.0 - 6.0 * 32.0, "{evicted}");
    // f16 and bf16 rows through kvmm_append16 into sessions of either element type: the pages and so
    // the outputs are those of f32 rows of the same values.
    let append16 = line(&lines, "append16 ");
    assert!(append16.starts_with("append16 same outputs 4 of 4,"), "{append16}");
    // 100 tokens, 20 drafts taken back, 10 more: attention read exactly the 110 kept (above).
    assert_eq!(number_after(line(&lines, "truncated "), "tokens"), 110.0);
    let wiped = line(&lines, "wiped ");
    assert!(number_after(wiped, "device") > 0.0, "{wiped}");
    let stats = line(&lines, "stats ");
    assert_eq!(number_after(stats, "tokens"), 100.0, "{stats}");
    assert_eq!(number_after(stats, "device_pages"), 8.0, "2 layers × 4 pages: {stats}");
    assert_eq!(number_after(stats, "resident"), 8.0, "{stats}");
    assert!(number_after(line(&lines, "detached "), "detached") > 0.0);

    // Each refusal: its status and a sentence that says what to do.
    let expected = [
        ("kvmm_connect UNAVAILABLE", "cannot connect to kvmmd at /nonexistent/kvmm.sock"),
        ("kvmm_attach INVALID_ARGUMENT", "head_dim (20) must be a multiple of 16"),
        ("kvmm_attach INVALID_ARGUMENT", "geometry.element is 7: use KVMM_ELEMENT_F16 (0)"),
        ("kvmm_append INVALID_ARGUMENT", "layer 2 is out of range: this session has layers 0..2"),
        ("kvmm_append INVALID_ARGUMENT", "`v` is NULL"),
        ("kvmm_append INVALID_ARGUMENT", "`tokens` is 0"),
        ("kvmm_append INVALID_ARGUMENT", "past this session's max_tokens 512"),
        ("kvmm_attention INVALID_ARGUMENT", "`q` is NULL"),
        ("kvmm_set_page_budget INVALID_ARGUMENT", "a page budget of 2 is too small"),
        ("kvmm_set_scale INVALID_ARGUMENT", "finite and positive, not NaN"),
        ("kvmm_prefetch INVALID_ARGUMENT", "empty range: layers 1..1"),
        ("kvmm_resume NOT_FOUND", "session 999999 does not exist"),
        ("kvmm_orphans INVALID_ARGUMENT", "`orphans` is NULL with a capacity of 1"),
        ("kvmm_last_mass INVALID_ARGUMENT", "`mass` is NULL with a capacity of 4"),
        ("kvmm_attach INVALID_ARGUMENT", "eviction drops pages only over a quota: set quota_tokens as well as evict"),
        ("kvmm_append FAILED_PRECONDITION", "was wiped by this process; its data is gone: attach a new session"),
        ("kvmm_append16 INVALID_ARGUMENT", "element is 7: use KVMM_ELEMENT_F16 (0) or KVMM_ELEMENT_BF16 (1)"),
        ("kvmm_append16 INVALID_ARGUMENT", "`k` is NULL"),
        ("kvmm_truncate INVALID_ARGUMENT", "`session` is NULL"),
    ];
    let refusals: Vec<&String> = lines.iter().filter(|l| l.starts_with("refused ")).collect();
    assert_eq!(refusals.len(), expected.len(), "{output}");
    for (got, (status, sentence)) in refusals.iter().zip(expected) {
        let function = status.split(' ').next().unwrap();
        assert!(got.starts_with(&format!("refused {status}: {function}: ")), "{got}");
        assert!(got.contains(sentence), "{got} should say {sentence:?}");
    }
    daemon.wait_drained();
}

#[test]
fn a_c_process_that_dies_leaves_a_lingering_session_that_another_finds_and_resumes() {
    let program = program();
    let daemon = Daemon::start(&[]);
    let left = run(program, "leave", &daemon.socket());
    let left = line(&left, "left ");
    assert!(number_after(left, "worst") < 1e-5, "{left}");
    let words: Vec<&str> = left.split_whitespace().collect();
    let (id, checksum) = (words[1], words[2]);
    // kvmmd orphans the two sessions once it has cleaned up the closed connection, after the exit.
    daemon.wait_status(Duration::from_secs(10), |s| s.orphaned_sessions == 2);

    let resumed = run(program, "resume", &daemon.socket());
    // The other session it left (of another model) is discarded, its bytes wiped.
    assert!(number_after(line(&resumed, "discarded "), "bytes") > 0.0, "{resumed:?}");
    let refusal = line(&resumed, "refused ");
    assert!(refusal.starts_with("refused kvmm_resume FAILED_PRECONDITION: "), "{refusal}");
    assert!(refusal.contains("it was attached for another model; it is left as it was"), "{refusal}");
    // The same attention over the pages the first process left, bit for bit.
    assert_eq!(line(&resumed, "resumed "), format!("resumed {id} {checksum}"));
    daemon.wait_drained();
}

#[test]
fn the_headers_structs_have_the_librarys_layout() {
    use kvmm::{CAttachOptions, CGeometry, COrphan, CSessionStats};
    use std::mem::{offset_of, size_of};
    let program = program();
    let out = program_command(program).args(["layout", "-"]).output().unwrap();
    assert!(out.status.success());
    let c = String::from_utf8(out.stdout).unwrap();
    let rust = [
        ("kvmm_geometry size", size_of::<CGeometry>()),
        ("kvmm_geometry layers", offset_of!(CGeometry, layers)),
        ("kvmm_geometry kv_heads", offset_of!(CGeometry, kv_heads)),
        ("kvmm_geometry q_heads", offset_of!(CGeometry, q_heads)),
        ("kvmm_geometry head_dim", offset_of!(CGeometry, head_dim)),
        ("kvmm_geometry max_tokens", offset_of!(CGeometry, max_tokens)),
        ("kvmm_geometry block_tokens", offset_of!(CGeometry, block_tokens)),
        ("kvmm_geometry element", offset_of!(CGeometry, element)),
        ("kvmm_attach_options size", size_of::<CAttachOptions>()),
        ("kvmm_attach_options model_id", offset_of!(CAttachOptions, model_id)),
        ("kvmm_attach_options priority", offset_of!(CAttachOptions, priority)),
        ("kvmm_attach_options extend_batch", offset_of!(CAttachOptions, extend_batch)),
        ("kvmm_attach_options quota_tokens", offset_of!(CAttachOptions, quota_tokens)),
        ("kvmm_attach_options evict", offset_of!(CAttachOptions, evict)),
        ("kvmm_attach_options linger_ms", offset_of!(CAttachOptions, linger_ms)),
        ("kvmm_session_stats size", size_of::<CSessionStats>()),
        ("kvmm_session_stats tokens", offset_of!(CSessionStats, tokens)),
        ("kvmm_session_stats allocated_blocks", offset_of!(CSessionStats, allocated_blocks)),
        ("kvmm_session_stats quota_tokens", offset_of!(CSessionStats, quota_tokens)),
        ("kvmm_session_stats device_bytes", offset_of!(CSessionStats, device_bytes)),
        ("kvmm_session_stats dram_bytes", offset_of!(CSessionStats, dram_bytes)),
        ("kvmm_session_stats flash_bytes", offset_of!(CSessionStats, flash_bytes)),
        ("kvmm_session_stats device_pages", offset_of!(CSessionStats, device_pages)),
        ("kvmm_session_stats dram_pages", offset_of!(CSessionStats, dram_pages)),
        ("kvmm_session_stats flash_pages", offset_of!(CSessionStats, flash_pages)),
        ("kvmm_session_stats reserved", offset_of!(CSessionStats, reserved)),
        ("kvmm_session_stats faults", offset_of!(CSessionStats, faults)),
        ("kvmm_session_stats pages_moved", offset_of!(CSessionStats, pages_moved)),
        ("kvmm_session_stats dropped_pages", offset_of!(CSessionStats, dropped_pages)),
        ("kvmm_orphan size", size_of::<COrphan>()),
        ("kvmm_orphan session_id", offset_of!(COrphan, session_id)),
        ("kvmm_orphan tokens", offset_of!(COrphan, tokens)),
        ("kvmm_orphan expires_in_ms", offset_of!(COrphan, expires_in_ms)),
        ("kvmm_orphan bytes", offset_of!(COrphan, bytes)),
        ("kvmm_orphan geometry", offset_of!(COrphan, geometry)),
        ("kvmm_orphan reserved", offset_of!(COrphan, reserved)),
    ];
    let c: Vec<&str> = c.lines().collect();
    assert_eq!(c.len(), rust.len(), "every struct and field of the header is compared:\n{}", c.join("\n"));
    for (line, (what, rust)) in c.iter().zip(rust) {
        assert_eq!(*line, format!("{what} {rust}"), "C and Rust disagree on {what}");
    }
}

#[test]
fn the_library_exports_every_function_the_header_declares() {
    let header = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../capi/include/kvmm.h")).unwrap();
    // Declarations start a line: a return type, then `kvmm_name(`.
    let declared: std::collections::BTreeSet<String> = header
        .lines()
        .filter(|l| !l.starts_with([' ', '#', '/', '}']) && !l.starts_with("typedef"))
        .filter_map(|l| l.split('(').next()?.split_whitespace().last().map(|n| n.trim_start_matches('*').to_owned()))
        .filter(|n| n.starts_with("kvmm_"))
        .collect();
    assert!(declared.len() >= 20, "{declared:?}");
    // The shared library's dynamic symbols, and the static library's global functions (`T`).
    for (library, nm_args) in [(libkvmm(), ["-D", "--defined-only"]), (libkvmm_static(), ["-g", "--defined-only"])] {
        let out = Command::new("nm").args(nm_args).arg(&library).output().unwrap();
        assert!(out.status.success(), "nm: {}", String::from_utf8_lossy(&out.stderr));
        let exported: std::collections::BTreeSet<String> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| match l.split_whitespace().collect::<Vec<_>>()[..] {
                [_, "T", name] if name.starts_with("kvmm_") => Some(name.to_owned()),
                _ => None,
            })
            .collect();
        assert_eq!(declared, exported, "the header and {}'s exported functions differ", library.display());
    }
}
