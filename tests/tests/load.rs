//! The load generator against a real kvmmd: a short run of `kvmm-load` (4 processes for 3 s) must
//! call every operation, meet no error but `RESOURCE_EXHAUSTED`, hear from every worker, and exit 0.
//! The long run (32 processes for 60 s) is a measurement, in the README.

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kvmm_tests::load::{Operation, Summary};
use kvmm_tests::{Daemon, wait_timeout, workspace_bin};

#[test]
fn four_processes_for_three_seconds_call_everything_without_unexpected_errors() {
    let daemon = Daemon::start(&[]);
    let started = Instant::now();
    let mut load = Command::new(workspace_bin("kvmm-load"))
        .arg("--socket")
        .arg(daemon.socket())
        .args(["--processes", "4", "--seconds", "3", "--json"])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn kvmm-load");
    // 3 s of load plus its own 10 s hard cap on workers, with room for a slow start.
    let status = wait_timeout(&mut load, Duration::from_secs(30)).unwrap_or_else(|| {
        let _ = load.kill();
        panic!("kvmm-load did not exit within 30 s; kvmmd log:\n{}", daemon.log())
    });
    let mut json = String::new();
    load.stdout.take().unwrap().read_to_string(&mut json).unwrap();
    println!("kvmm-load ran for {:.1} s:\n{json}", started.elapsed().as_secs_f64());
    let summary: Summary = serde_json::from_str(&json).expect("kvmm-load --json prints a summary");

    assert!(status.success(), "kvmm-load exited with {status}; kvmmd log:\n{}", daemon.log());
    assert!(summary.passed);
    assert_eq!(summary.unexpected_errors, 0, "{:?}", summary.errors);
    assert!(summary.failed_workers.is_empty(), "{:?}", summary.failed_workers);
    assert_eq!(summary.workers_reported, 4);
    for op in Operation::ALL {
        let o = summary.operation(op).expect("every operation is listed");
        assert!(o.count > 0, "{} was never called successfully: {o:?}", op.name());
        assert!(o.p50_us > 0.0 && o.p50_us <= o.p99_us && o.p99_us <= o.p999_us && o.p999_us <= o.max_us, "{o:?}");
    }
    // Every session was detached: nothing is left attached once the workers are gone.
    let (status, _) = daemon.wait_status(Duration::from_secs(5), |s| s.sessions == 0);
    assert_eq!(status.sessions, 0, "sessions left attached after the load: {status:?}");
}
