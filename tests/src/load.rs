//! The report of `kvmm-load`: what each worker process measured, how the parent merges the workers,
//! and the verdict.
//!
//! A worker keeps one latency histogram per [`Operation`] (nanoseconds, 3 significant digits) and
//! counts the failed operations by operation and gRPC code. At the end it prints one JSON line, a
//! [`WorkerReport`]: each histogram as its recorded buckets (`[value_ns, count]`, the value being
//! the highest value equivalent to the bucket), so the parent rebuilds exactly the same buckets and
//! the merged percentiles are those of one histogram over every process, not an average of
//! per-process percentiles.
//!
//! The run passes when every worker reported and no operation failed with a code other than those
//! in [`ALLOWED_CODES`]: a daemon whose budget is full refuses `Attach` and `Extend` with
//! `RESOURCE_EXHAUSTED` by design; anything else is a bug or a broken daemon.
//!
//! Nothing here does I/O or reads a clock; the binary measures and this module only adds up.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

/// One kind of operation a worker times.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Operation {
    /// `Client::connect`: a new HTTP/2 connection over the session socket.
    Connect,
    /// `Client::attach`: the `Attach` RPC, the fd handshake and mapping the three memfds.
    Attach,
    /// An `append` that needed a page the session did not hold yet, so it ran the `Extend` RPC (one
    /// batch of pages for every layer) and pre-faulted the new frames before writing.
    Extend,
    /// An `append` within pages already held: shared memory only, no RPC.
    Append,
    /// Decode attention for one query over every page of one layer.
    Attention,
    /// The `SessionStats` RPC.
    Stats,
    /// `Session::detach`: the `Detach` RPC (the daemon wipes the session's pages).
    Detach,
}

impl Operation {
    /// Every operation, in the order of one cycle.
    pub const ALL: [Operation; 7] = [
        Operation::Connect,
        Operation::Attach,
        Operation::Extend,
        Operation::Append,
        Operation::Attention,
        Operation::Stats,
        Operation::Detach,
    ];

    /// The name used in the table and the JSON.
    pub fn name(self) -> &'static str {
        match self {
            Operation::Connect => "connect",
            Operation::Attach => "attach",
            Operation::Extend => "extend",
            Operation::Append => "append",
            Operation::Attention => "attention",
            Operation::Stats => "stats",
            Operation::Detach => "detach",
        }
    }
}

/// gRPC codes that a load run may meet without failing: a full budget refuses pages by design.
pub const ALLOWED_CODES: [&str; 1] = ["RESOURCE_EXHAUSTED"];

pub use kvmm_client::error::code_name;

/// Whether failures with this code (by [`code_name`]) leave the run passing.
pub fn is_allowed(code: &str) -> bool {
    ALLOWED_CODES.contains(&code)
}

/// Why a report could not be built or merged.
#[derive(Debug)]
pub enum ReportError {
    /// The histogram library refused a bucket (a value it cannot hold, an overflowing count).
    Histogram(String),
    /// A worker's output was not a report.
    Malformed(String),
}

impl fmt::Display for ReportError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReportError::Histogram(e) => write!(f, "a latency histogram refused a value: {e}"),
            ReportError::Malformed(e) => write!(f, "a worker's report is not valid JSON of the expected shape: {e}"),
        }
    }
}

impl std::error::Error for ReportError {}

/// Significant decimal digits kept by every histogram: values within 0.1% share a bucket.
const SIGNIFICANT_DIGITS: u8 = 3;

/// The longest latency a histogram tells apart, in nanoseconds (an hour); longer ones are counted
/// as this. Fixed bounds, so every worker's buckets are the parent's.
const HIGHEST_NS: u64 = 3_600_000_000_000;

/// An empty histogram of nanoseconds, 1 ns to [`HIGHEST_NS`].
fn histogram() -> Result<Histogram<u64>, ReportError> {
    Histogram::new_with_bounds(1, HIGHEST_NS, SIGNIFICANT_DIGITS).map_err(|e| ReportError::Histogram(e.to_string()))
}

/// What one worker process prints when it stops: its own histograms and error counts.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerReport {
    /// Attach-to-detach cycles begun.
    pub cycles: u64,
    /// Per operation, the recorded buckets of its latency histogram as `(value_ns, count)`.
    pub latencies: BTreeMap<Operation, Vec<(u64, u64)>>,
    /// Per operation, failed calls by gRPC code name.
    pub errors: BTreeMap<Operation, BTreeMap<String, u64>>,
}

/// The measurements of one worker, while it runs.
#[derive(Debug)]
pub struct Recorder {
    /// Successful calls of each operation, in nanoseconds.
    latencies: BTreeMap<Operation, Histogram<u64>>,
    /// Failed calls by operation and gRPC code name.
    errors: BTreeMap<Operation, BTreeMap<String, u64>>,
    /// Cycles begun.
    cycles: u64,
}

impl Recorder {
    /// A recorder with an empty histogram for every operation.
    pub fn new() -> Result<Recorder, ReportError> {
        let latencies = Operation::ALL.into_iter().map(|op| Ok((op, histogram()?))).collect::<Result<_, _>>()?;
        Ok(Recorder { latencies, errors: BTreeMap::new(), cycles: 0 })
    }

    /// Counts a new cycle.
    pub fn begin_cycle(&mut self) {
        self.cycles += 1;
    }

    /// Records a successful call of `op` that took `took`.
    pub fn record(&mut self, op: Operation, took: Duration) {
        let ns = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
        if let Some(h) = self.latencies.get_mut(&op) {
            h.saturating_record(ns.clamp(1, HIGHEST_NS));
        }
    }

    /// Counts a failed call of `op`; returns whether it is the first failure of `op` with `code`,
    /// so the caller can print the first message of each kind and not flood its log.
    pub fn fail(&mut self, op: Operation, code: tonic::Code) -> bool {
        let count = self.errors.entry(op).or_default().entry(code_name(code).to_owned()).or_default();
        *count += 1;
        *count == 1
    }

    /// The report to print.
    pub fn report(&self) -> WorkerReport {
        let latencies = self
            .latencies
            .iter()
            .map(|(op, h)| (*op, h.iter_recorded().map(|v| (v.value_iterated_to(), v.count_at_value())).collect()))
            .collect();
        WorkerReport { cycles: self.cycles, latencies, errors: self.errors.clone() }
    }
}

/// A worker that did not hand in a report, and why.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerFailure {
    /// The worker's index (0-based).
    pub worker: u32,
    /// What happened, as a sentence.
    pub what: String,
}

/// Every worker's report added up.
#[derive(Debug)]
pub struct Merged {
    /// Successful calls of each operation over every worker, in nanoseconds.
    latencies: BTreeMap<Operation, Histogram<u64>>,
    /// Failed calls by operation and gRPC code name over every worker.
    errors: BTreeMap<Operation, BTreeMap<String, u64>>,
    /// Cycles begun over every worker.
    cycles: u64,
    /// Workers that reported.
    reported: u32,
    /// Workers that did not.
    failures: Vec<WorkerFailure>,
}

impl Merged {
    /// Nothing merged yet.
    pub fn new() -> Result<Merged, ReportError> {
        let latencies = Operation::ALL.into_iter().map(|op| Ok((op, histogram()?))).collect::<Result<_, _>>()?;
        Ok(Merged { latencies, errors: BTreeMap::new(), cycles: 0, reported: 0, failures: Vec::new() })
    }

    /// Parses one worker's output line and adds it.
    pub fn add_line(&mut self, line: &str) -> Result<(), ReportError> {
        let report: WorkerReport = serde_json::from_str(line).map_err(|e| ReportError::Malformed(e.to_string()))?;
        self.add(&report)
    }

    /// Adds one worker's report.
    pub fn add(&mut self, report: &WorkerReport) -> Result<(), ReportError> {
        for (op, buckets) in &report.latencies {
            let merged = match self.latencies.get_mut(op) {
                Some(h) => h,
                None => continue,
            };
            for &(value, count) in buckets {
                merged.record_n(value, count).map_err(|e| ReportError::Histogram(format!("{e:?}")))?;
            }
        }
        for (op, codes) in &report.errors {
            let merged = self.errors.entry(*op).or_default();
            for (code, n) in codes {
                *merged.entry(code.clone()).or_default() += n;
            }
        }
        self.cycles += report.cycles;
        self.reported += 1;
        Ok(())
    }

    /// Records a worker that did not report.
    pub fn worker_failed(&mut self, worker: u32, what: String) {
        self.failures.push(WorkerFailure { worker, what });
    }

    /// The summary of the run.
    pub fn summary(&self, processes: u32, seconds: u64) -> Summary {
        let us = |ns: u64| ns as f64 / 1e3;
        let operations: Vec<OperationSummary> = Operation::ALL
            .into_iter()
            .map(|op| {
                let errors = self.errors.get(&op).cloned().unwrap_or_default();
                match self.latencies.get(&op).filter(|h| !h.is_empty()) {
                    Some(h) => OperationSummary {
                        op,
                        count: h.len(),
                        p50_us: us(h.value_at_quantile(0.50)),
                        p99_us: us(h.value_at_quantile(0.99)),
                        p999_us: us(h.value_at_quantile(0.999)),
                        max_us: us(h.max()),
                        errors,
                    },
                    None => {
                        OperationSummary { op, count: 0, p50_us: 0.0, p99_us: 0.0, p999_us: 0.0, max_us: 0.0, errors }
                    }
                }
            })
            .collect();
        let mut errors: BTreeMap<String, u64> = BTreeMap::new();
        for (code, n) in operations.iter().flat_map(|o| o.errors.iter()) {
            *errors.entry(code.clone()).or_default() += n;
        }
        let unexpected_errors = errors.iter().filter(|(code, _)| !is_allowed(code)).map(|(_, n)| n).sum();
        Summary {
            processes,
            seconds,
            workers_reported: self.reported,
            cycles: self.cycles,
            operations,
            errors,
            unexpected_errors,
            failed_workers: self.failures.clone(),
            passed: unexpected_errors == 0 && self.failures.is_empty(),
        }
    }
}

/// Latency and errors of one operation over the run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OperationSummary {
    /// The operation.
    pub op: Operation,
    /// Successful calls.
    pub count: u64,
    /// Median latency of the successful calls, µs.
    pub p50_us: f64,
    /// 99th percentile, µs.
    pub p99_us: f64,
    /// 99.9th percentile, µs.
    pub p999_us: f64,
    /// Slowest call, µs.
    pub max_us: f64,
    /// Failed calls by gRPC code name.
    pub errors: BTreeMap<String, u64>,
}

/// The merged result of a run: what `kvmm-load --json` prints, and what its table shows.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// Worker processes started.
    pub processes: u32,
    /// Seconds each worker ran its loop.
    pub seconds: u64,
    /// Workers whose report was merged.
    pub workers_reported: u32,
    /// Attach-to-detach cycles begun over every worker.
    pub cycles: u64,
    /// Every operation, in cycle order, including those never called.
    pub operations: Vec<OperationSummary>,
    /// Failed calls by gRPC code name, over every operation.
    pub errors: BTreeMap<String, u64>,
    /// Failed calls whose code is not in [`ALLOWED_CODES`].
    pub unexpected_errors: u64,
    /// Workers that did not report (killed at the hard cap, crashed, or printed no report).
    pub failed_workers: Vec<WorkerFailure>,
    /// No unexpected error and every worker reported.
    pub passed: bool,
}

impl Summary {
    /// The summary of `op`.
    pub fn operation(&self, op: Operation) -> Option<&OperationSummary> {
        self.operations.iter().find(|o| o.op == op)
    }
}

/// `CODE=n, CODE=n`, or `-` when there are none.
fn error_list(errors: &BTreeMap<String, u64>) -> String {
    if errors.is_empty() {
        return "-".to_owned();
    }
    errors.iter().map(|(code, n)| format!("{code}={n}")).collect::<Vec<_>>().join(", ")
}

impl fmt::Display for Summary {
    /// A Markdown table, one row per operation, then the error totals and the verdict.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let plural = if self.processes == 1 { "" } else { "es" };
        writeln!(
            f,
            "{} worker process{plural} × {} s: {} reported, {} cycles",
            self.processes, self.seconds, self.workers_reported, self.cycles
        )?;
        writeln!(f)?;
        writeln!(f, "| operation | count | p50 µs | p99 µs | p999 µs | max µs | errors |")?;
        writeln!(f, "|---|---:|---:|---:|---:|---:|---|")?;
        for o in &self.operations {
            writeln!(
                f,
                "| {} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {} |",
                o.op.name(),
                o.count,
                o.p50_us,
                o.p99_us,
                o.p999_us,
                o.max_us,
                error_list(&o.errors)
            )?;
        }
        writeln!(f)?;
        writeln!(f, "errors by code: {}", error_list(&self.errors))?;
        for w in &self.failed_workers {
            writeln!(f, "worker {} failed: {}", w.worker, w.what)?;
        }
        let verdict = if self.passed {
            "PASS".to_owned()
        } else {
            format!(
                "FAIL: {} unexpected errors (only {} allowed), {} workers failed",
                self.unexpected_errors,
                ALLOWED_CODES.join(", "),
                self.failed_workers.len()
            )
        };
        write!(f, "{verdict}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn worker(attach_us: &[u64], errors: &[(Operation, tonic::Code)]) -> WorkerReport {
        let mut r = Recorder::new().unwrap();
        r.begin_cycle();
        for &us in attach_us {
            r.record(Operation::Attach, Duration::from_micros(us));
        }
        for &(op, code) in errors {
            r.fail(op, code);
        }
        r.report()
    }

    #[test]
    fn a_report_survives_its_json_line() {
        let report = worker(&[10, 20, 30], &[(Operation::Extend, tonic::Code::ResourceExhausted)]);
        let line = serde_json::to_string(&report).unwrap();
        assert!(!line.contains('\n'));
        assert_eq!(serde_json::from_str::<WorkerReport>(&line).unwrap(), report);
    }

    #[test]
    fn merged_percentiles_are_those_of_every_call_not_an_average_of_workers() {
        // One worker has 99 fast calls, the other one slow call: the merged p50 is fast, the max
        // slow. Averaging per-worker medians would give about half the slow value.
        let fast = worker(&[100; 99], &[]);
        let slow = worker(&[10_000], &[]);
        let mut merged = Merged::new().unwrap();
        merged.add(&fast).unwrap();
        merged.add_line(&serde_json::to_string(&slow).unwrap()).unwrap();
        let summary = merged.summary(2, 1);
        let attach = summary.operation(Operation::Attach).unwrap();
        assert_eq!(attach.count, 100);
        assert!((attach.p50_us - 100.0).abs() < 0.5, "{attach:?}");
        assert!((attach.max_us - 10_000.0).abs() < 10.0, "{attach:?}");
        assert_eq!(summary.cycles, 2);
        assert!(summary.passed);
    }

    #[test]
    fn resource_exhausted_passes_and_any_other_code_fails() {
        let mut merged = Merged::new().unwrap();
        merged.add(&worker(&[5], &[(Operation::Attach, tonic::Code::ResourceExhausted)])).unwrap();
        let summary = merged.summary(1, 1);
        assert!(summary.passed);
        assert_eq!(summary.errors.get("RESOURCE_EXHAUSTED"), Some(&1));

        merged.add(&worker(&[5], &[(Operation::Detach, tonic::Code::Internal)])).unwrap();
        let summary = merged.summary(2, 1);
        assert!(!summary.passed);
        assert_eq!(summary.unexpected_errors, 1);
        assert_eq!(summary.operation(Operation::Detach).unwrap().errors.get("INTERNAL"), Some(&1));
        assert!(summary.to_string().contains("FAIL: 1 unexpected errors"));
    }

    #[test]
    fn a_worker_that_did_not_report_fails_the_run() {
        let mut merged = Merged::new().unwrap();
        merged.add(&worker(&[5], &[])).unwrap();
        merged.worker_failed(1, "killed 10 s after the deadline".to_owned());
        let summary = merged.summary(2, 1);
        assert!(!summary.passed);
        assert_eq!(summary.workers_reported, 1);
        assert!(summary.to_string().contains("worker 1 failed: killed"));
    }

    #[test]
    fn the_first_failure_of_each_kind_is_flagged_once() {
        let mut r = Recorder::new().unwrap();
        assert!(r.fail(Operation::Attach, tonic::Code::ResourceExhausted));
        assert!(!r.fail(Operation::Attach, tonic::Code::ResourceExhausted));
        assert!(r.fail(Operation::Extend, tonic::Code::ResourceExhausted));
    }

    #[test]
    fn latencies_keep_their_magnitude_from_nanoseconds_to_minutes() {
        let mut r = Recorder::new().unwrap();
        for (op, took) in [
            (Operation::Append, Duration::from_nanos(700)),
            (Operation::Attach, Duration::from_micros(1_234)),
            (Operation::Detach, Duration::from_secs(90)),
        ] {
            r.record(op, took);
        }
        let mut merged = Merged::new().unwrap();
        merged.add(&r.report()).unwrap();
        let summary = merged.summary(1, 1);
        let max = |op| summary.operation(op).unwrap().max_us;
        assert!((max(Operation::Append) - 0.7).abs() < 0.01, "{summary:?}");
        assert!((max(Operation::Attach) - 1_234.0).abs() < 2.0, "{summary:?}");
        assert!((max(Operation::Detach) - 90e6).abs() < 90e3, "{summary:?}");
    }

    #[test]
    fn a_garbled_line_is_a_malformed_report() {
        let mut merged = Merged::new().unwrap();
        assert!(matches!(merged.add_line("progress tokens=3"), Err(ReportError::Malformed(_))));
    }

    #[test]
    fn operations_never_called_are_listed_with_zero_counts() {
        let summary = Merged::new().unwrap().summary(0, 0);
        assert_eq!(summary.operations.len(), Operation::ALL.len());
        assert!(summary.operations.iter().all(|o| o.count == 0));
    }
}
