//! The daemon's metrics: one `prometheus-client` [`Registry`] and its families, encoded in the
//! Prometheus text format (0.0.4) for the admin `Metrics` RPC and the optional metrics socket.
//!
//! Names follow `kvmm_<subsystem>_<what>_<unit>` (`_total` for counters, `_bytes`, `_seconds`,
//! `_ratio`). Two kinds of family live here:
//!
//! - **Measured here**: fault latency and faulted pages by tier (observed in `Daemon::fault`),
//!   flash batch latency (around `write_to_flash`/`read_from_flash`), sampled quantization error of
//!   demotions (1 in [`QUANT_SAMPLE_EVERY`] compressing demotions, decoded and compared with the
//!   source rows), and refusals by gRPC code (counted where `server/status.rs` maps error kinds,
//!   process-wide: one kvmmd per process).
//! - **Read at scrape time** from state the daemon keeps anyway ([`Metrics::encode`] refreshes them
//!   first, under a scrape lock so concurrent scrapes do not interleave): pages and bytes by tier and
//!   format (`Daemon::usage`), demotions/promotions and authentication failures (`TierCounters`),
//!   flash bytes (the flash tier's `TierStats`), the mode, thermal-throttle entries, sessions
//!   (and orphaned ones), stuck pins (`session::pins`) and uptime. Nothing is counted twice.
//!
//! Invariant: every family is registered in [`Metrics::new`] and nowhere else, and every label set
//! it can take is created there too (tiers × formats, engine × op, codes, modes), so each family has
//! samples from the first scrape on and the encoded text's `# TYPE` lines list every family the
//! daemon declares (the scenario test relies on it; the text encoder leaves out empty families).
//! Series never disappear: a combination no page is in reads 0.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use kvmm_kernels::{Format, PageShape};
use kvmm_store::tier::TierKind;
use parking_lot::Mutex;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::daemon::Daemon;
use crate::policy::mode::Mode;

/// One in this many demotions that compress a page is decoded and compared with its source.
pub const QUANT_SAMPLE_EVERY: u64 = 64;

/// A label set of one label.
type L1 = [(&'static str, &'static str); 1];
/// A label set of two labels.
type L2 = [(&'static str, &'static str); 2];

/// Refusals by gRPC code, process-wide: `server/status.rs` counts every error it maps, where no
/// daemon is at hand. Each [`Metrics`] registers a handle to this one family.
static REFUSALS: LazyLock<Family<L1, Counter>> = LazyLock::new(Family::default);

/// Counts one error returned to a client (a gRPC status or an fd refusal) under its code's name.
pub fn count_refusal(code: &'static str) {
    REFUSALS.get_or_create(&[("code", code)]).inc();
}

/// Which way a flash batch went.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlashOp {
    Read,
    Write,
}

impl FlashOp {
    fn name(self) -> &'static str {
        match self {
            FlashOp::Read => "read",
            FlashOp::Write => "write",
        }
    }
}

/// The daemon's metrics; a cheap handle (clones share the families). `Daemon::metrics` is the one
/// the servers encode; `Core::metrics` is the same families for code that runs under the core lock.
#[derive(Clone, Debug)]
pub struct Metrics {
    inner: Arc<Families>,
}

#[derive(Debug)]
struct Families {
    /// Every family below, registered once at construction. Written only there.
    registry: Registry,
    /// The flash tier's I/O engine, the `engine` label of the flash families ("none" without one).
    engine: &'static str,
    /// Serializes scrapes: each refreshes the scrape-time families and then encodes them.
    scrape: Mutex<()>,
    /// Compressing demotions seen, for sampling 1 in [`QUANT_SAMPLE_EVERY`].
    compressions: AtomicU64,

    // Measured here.
    fault_latency: Histogram,
    fault_pages: Family<L1, Counter>,
    flash_batch_latency: Family<L2, Histogram>,
    quant_error: Family<L1, Histogram>,

    // Refreshed at scrape time.
    tier_pages: Family<L2, Gauge>,
    tier_bytes: Family<L2, Gauge>,
    demotions: Family<L1, Counter>,
    promotions: Family<L1, Counter>,
    auth_failures: Counter,
    flash_read_bytes: Family<L1, Counter>,
    flash_written_bytes: Family<L1, Counter>,
    thermal_throttles: Counter,
    mode: Family<L1, Gauge>,
    sessions: Gauge,
    stuck_pins: Gauge,
    orphaned_sessions: Gauge,
    uptime: Gauge<f64, AtomicU64>,
}

/// Tier labels in the order of `Usage`'s tier numbers.
const TIERS: [&str; 3] = ["device", "dram", "flash"];

impl Families {
    /// Creates every label set a family can take (module doc).
    fn create_series(&self) {
        for tier in TIERS {
            for format in Format::ALL {
                let labels = [("tier", tier), ("format", format.name())];
                self.tier_pages.get_or_create_owned(&labels);
                self.tier_bytes.get_or_create_owned(&labels);
            }
            self.fault_pages.get_or_create_owned(&[("tier", tier)]);
        }
        for tier in ["dram", "flash"] {
            self.demotions.get_or_create_owned(&[("tier", tier)]);
            self.promotions.get_or_create_owned(&[("tier", tier)]);
        }
        for format in Format::ALL.into_iter().filter(|f| f.is_quantized()) {
            self.quant_error.get_or_create_owned(&[("format", format.name())]);
        }
        for op in [FlashOp::Read, FlashOp::Write] {
            self.flash_batch_latency.get_or_create_owned(&[("engine", self.engine), ("op", op.name())]);
        }
        self.flash_read_bytes.get_or_create_owned(&[("engine", self.engine)]);
        self.flash_written_bytes.get_or_create_owned(&[("engine", self.engine)]);
        for code in ALL_CODES {
            REFUSALS.get_or_create_owned(&[("code", crate::server::status::code_name(code))]);
        }
        for mode in Mode::ALL {
            self.mode.get_or_create_owned(&[("mode", mode.name())]);
        }
    }
}

/// Every code the daemon refuses with.
const ALL_CODES: [tonic::Code; 8] = [
    tonic::Code::InvalidArgument,
    tonic::Code::NotFound,
    tonic::Code::PermissionDenied,
    tonic::Code::ResourceExhausted,
    tonic::Code::FailedPrecondition,
    tonic::Code::Unavailable,
    tonic::Code::Internal,
    tonic::Code::DataLoss,
];

fn latency_histogram() -> Histogram {
    // 50 µs to about 1.6 s.
    Histogram::new(exponential_buckets(50e-6, 2.0, 16))
}

fn error_histogram() -> Histogram {
    // 0.1% to about 200% relative error.
    Histogram::new(exponential_buckets(0.001, 2.0, 12))
}

/// The tier label of a tier (as in [`TIERS`]).
pub fn tier_name(tier: TierKind) -> &'static str {
    match tier {
        TierKind::Device => "device",
        TierKind::Dram => "dram",
        TierKind::Flash => "flash",
    }
}

impl Metrics {
    /// Registers every family. `engine`: the flash tier's I/O engine, if there is a flash tier.
    pub fn new(engine: Option<&'static str>) -> Metrics {
        let mut registry = Registry::default();
        let fault_latency = latency_histogram();
        let fault_pages = Family::<L1, Counter>::default();
        let flash_batch_latency = Family::<L2, Histogram>::new_with_constructor(latency_histogram as fn() -> Histogram);
        let quant_error = Family::<L1, Histogram>::new_with_constructor(error_histogram as fn() -> Histogram);
        let f = Families {
            engine: engine.unwrap_or("none"),
            scrape: Mutex::new(()),
            compressions: AtomicU64::new(0),
            fault_latency,
            fault_pages,
            flash_batch_latency: flash_batch_latency.clone(),
            quant_error: quant_error.clone(),
            tier_pages: Family::default(),
            tier_bytes: Family::default(),
            demotions: Family::default(),
            promotions: Family::default(),
            auth_failures: Counter::default(),
            flash_read_bytes: Family::default(),
            flash_written_bytes: Family::default(),
            thermal_throttles: Counter::default(),
            mode: Family::default(),
            sessions: Gauge::default(),
            stuck_pins: Gauge::default(),
            orphaned_sessions: Gauge::default(),
            uptime: Gauge::default(),
            registry: Registry::default(),
        };
        // Counters are registered without `_total`: the encoder appends it.
        registry.register(
            "kvmm_tier_pages",
            "Pages held, by tier (device, dram, flash) and page format",
            f.tier_pages.clone(),
        );
        registry.register(
            "kvmm_tier_page_bytes",
            "Bytes the pages take in their tier (frames, DRAM slots, flash slots), by tier and page format",
            f.tier_bytes.clone(),
        );
        registry.register(
            "kvmm_tier_demotions",
            "Pages demoted, by the tier they went to (dram: from the device; flash: from DRAM)",
            f.demotions.clone(),
        );
        registry.register(
            "kvmm_tier_promotions",
            "Pages promoted back to the device, by the tier they came from",
            f.promotions.clone(),
        );
        registry.register(
            "kvmm_fault_pages",
            "Pages named by Fault requests, by the tier each was in when the request arrived",
            f.fault_pages.clone(),
        );
        registry.register(
            "kvmm_fault_latency_seconds",
            "Duration of Fault requests (making room, promotion and retries), successful or not",
            f.fault_latency.clone(),
        );
        registry.register(
            "kvmm_flash_read_bytes",
            "Page bytes read from the flash tier, by I/O engine",
            f.flash_read_bytes.clone(),
        );
        registry.register(
            "kvmm_flash_written_bytes",
            "Page bytes written to the flash tier, by I/O engine",
            f.flash_written_bytes.clone(),
        );
        registry.register(
            "kvmm_flash_batch_latency_seconds",
            "Duration of one flash batch (seal and write, or read and open), by I/O engine and op (read, write)",
            f.flash_batch_latency.clone(),
        );
        registry.register(
            "kvmm_seal_auth_failures",
            "Pages that failed AEAD authentication in DRAM or on flash (reported as DATA_LOSS)",
            f.auth_failures.clone(),
        );
        registry.register(
            "kvmm_demotion_quantization_error_ratio",
            "Relative L2 error of sampled compressing demotions (1 in 64), by the format the page went to",
            f.quant_error.clone(),
        );
        registry.register(
            "kvmm_rpc_errors",
            "Errors returned to clients (gRPC statuses and fd refusals), by code; resource_exhausted counts full budgets and quotas",
            REFUSALS.clone(),
        );
        registry.register("kvmm_policy_thermal_throttles", "Entries into thermal mode", f.thermal_throttles.clone());
        registry.register(
            "kvmm_policy_mode",
            "The operating mode in force: 1 for it, 0 for the others",
            f.mode.clone(),
        );
        registry.register("kvmm_daemon_sessions", "Sessions attached", f.sessions.clone());
        registry.register(
            "kvmm_daemon_stuck_pins",
            "Pages clients have held pinned past the pin lease (without an unpin)",
            f.stuck_pins.clone(),
        );
        registry.register(
            "kvmm_daemon_orphaned_sessions",
            "Lingering sessions whose connection closed, waiting for a Resume",
            f.orphaned_sessions.clone(),
        );
        registry.register("kvmm_daemon_uptime_seconds", "Seconds since kvmmd started", f.uptime.clone());
        f.create_series();
        Metrics { inner: Arc::new(Families { registry, ..f }) }
    }

    /// Records one Fault request's duration.
    pub fn observe_fault(&self, took: Duration) {
        self.inner.fault_latency.observe(took.as_secs_f64());
    }

    /// Counts one page a Fault request named, by the tier it was in.
    pub fn count_fault(&self, tier: TierKind) {
        self.inner.fault_pages.get_or_create(&[("tier", tier_name(tier))]).inc();
    }

    /// Runs one flash batch and records its duration.
    pub fn time_flash<T>(&self, op: FlashOp, batch: impl FnOnce() -> T) -> T {
        let started = std::time::Instant::now();
        let out = batch();
        let labels = [("engine", self.inner.engine), ("op", op.name())];
        self.inner.flash_batch_latency.get_or_create(&labels).observe(started.elapsed().as_secs_f64());
        out
    }

    /// Whether this compressing demotion is one of the sampled ones (the first, then 1 in
    /// [`QUANT_SAMPLE_EVERY`]).
    pub fn sample_quantization(&self) -> bool {
        self.inner.compressions.fetch_add(1, Ordering::Relaxed).is_multiple_of(QUANT_SAMPLE_EVERY)
    }

    /// Decodes the first `tokens` rows of `src` (format `from`) and of `dst` (format `to`) and records
    /// the relative L2 error of `dst` against `src`. A page that does not decode is not recorded.
    pub fn observe_quantization(&self, shape: PageShape, from: (Format, &[u8]), to: (Format, &[u8]), tokens: usize) {
        let n = tokens * shape.kv_heads * shape.head_dim;
        let (mut k0, mut v0, mut k1, mut v1) = (vec![0f32; n], vec![0f32; n], vec![0f32; n], vec![0f32; n]);
        let decoded = kvmm_kernels::dequantize(shape, from.0, from.1, tokens, &mut k0, &mut v0)
            .and_then(|()| kvmm_kernels::dequantize(shape, to.0, to.1, tokens, &mut k1, &mut v1));
        if decoded.is_err() {
            return;
        }
        k0.extend_from_slice(&v0);
        k1.extend_from_slice(&v1);
        if let Some(error) = relative_l2(&k0, &k1) {
            self.inner.quant_error.get_or_create(&[("format", to.0.name())]).observe(error);
        }
    }

    /// Refreshes the scrape-time families from `daemon` and encodes every family.
    pub fn encode(&self, daemon: &Daemon) -> String {
        let _scrape = self.inner.scrape.lock();
        self.refresh(daemon);
        self.encode_registry()
    }

    /// Encodes the registry as it is (no refresh).
    fn encode_registry(&self) -> String {
        let mut text = String::new();
        // Writing into a String cannot fail, and every family encodes values it owns.
        if let Err(e) = prometheus_client::encoding::prometheus_text::encode(&mut text, &self.inner.registry) {
            tracing::error!(error = %e, "encoding the metrics failed");
        }
        text
    }

    fn refresh(&self, daemon: &Daemon) {
        let f = &*self.inner;
        let usage = daemon.usage();
        for (t, tier) in TIERS.into_iter().enumerate() {
            for format in Format::ALL {
                let (pages, bytes) = usage.0.get(&(t as u8, format.as_u8())).copied().unwrap_or_default();
                let labels = [("tier", tier), ("format", format.name())];
                f.tier_pages.get_or_create(&labels).set(pages as i64);
                f.tier_bytes.get_or_create(&labels).set(bytes as i64);
            }
        }
        let status = daemon.status();
        let c = status.tier_counters;
        set_counter(&f.demotions.get_or_create(&[("tier", "dram")]), c.demoted_to_dram);
        set_counter(&f.demotions.get_or_create(&[("tier", "flash")]), c.demoted_to_flash);
        set_counter(&f.promotions.get_or_create(&[("tier", "dram")]), c.promoted_from_dram);
        set_counter(&f.promotions.get_or_create(&[("tier", "flash")]), c.promoted_from_flash);
        set_counter(&f.auth_failures, c.data_loss);
        let (read, written) = status.flash.map_or((0, 0), |s| (s.bytes_out, s.bytes_in));
        set_counter(&f.flash_read_bytes.get_or_create(&[("engine", f.engine)]), read);
        set_counter(&f.flash_written_bytes.get_or_create(&[("engine", f.engine)]), written);
        let policy = daemon.policy.lock().view();
        set_counter(&f.thermal_throttles, policy.thermal_entries);
        for mode in Mode::ALL {
            f.mode.get_or_create(&[("mode", mode.name())]).set(i64::from(mode == policy.mode));
        }
        f.sessions.set(i64::from(status.sessions));
        f.stuck_pins.set(i64::from(status.stuck_pins));
        f.orphaned_sessions.set(i64::from(status.orphaned_sessions));
        f.uptime.set(daemon.started.elapsed().as_secs_f64());
    }
}

/// Sets a counter exported from a count the daemon keeps elsewhere (monotonic there too).
fn set_counter(counter: &Counter, value: u64) {
    counter.inner().store(value, Ordering::Relaxed);
}

/// `‖approx − reference‖₂ / ‖reference‖₂`; `None` for an all-zero reference or lengths that differ.
pub fn relative_l2(reference: &[f32], approx: &[f32]) -> Option<f64> {
    if reference.len() != approx.len() {
        return None;
    }
    let (mut diff, mut norm) = (0f64, 0f64);
    for (&r, &a) in reference.iter().zip(approx) {
        let (r, a) = (f64::from(r), f64::from(a));
        diff += (a - r) * (a - r);
        norm += r * r;
    }
    (norm > 0.0 && norm.is_finite() && diff.is_finite()).then(|| (diff / norm).sqrt())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The family names the text declares, from its `# TYPE` lines.
    fn families(text: &str) -> Vec<String> {
        text.lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .map(|l| l.split_whitespace().next().unwrap().to_owned())
            .collect()
    }

    #[test]
    fn every_family_is_named_kvmm_subsystem_what_unit() {
        let m = Metrics::new(Some("io_uring"));
        let text = m.encode_registry();
        let names = families(&text);
        assert_eq!(names.len(), 18, "{text}");
        let subsystems = ["tier", "fault", "flash", "seal", "demotion", "rpc", "policy", "daemon"];
        for name in &names {
            let parts: Vec<&str> = name.split('_').collect();
            assert_eq!(parts[0], "kvmm", "{name}");
            assert!(subsystems.contains(&parts[1]), "{name}: unknown subsystem");
            assert!(parts.len() >= 3, "{name}: kvmm_<subsystem>_<what>[_<unit>]");
            assert!(name.chars().all(|c| c.is_ascii_lowercase() || c == '_'), "{name}");
        }
        // Counters end in _total, and only counters do.
        for line in text.lines().filter_map(|l| l.strip_prefix("# TYPE ")) {
            let (name, kind) = line.split_once(' ').unwrap();
            assert_eq!(name.ends_with("_total"), kind == "counter", "{line}");
            if kind == "histogram" {
                assert!(name.ends_with("_seconds") || name.ends_with("_ratio"), "{line}: a histogram has a unit");
            }
        }
        for help in text.lines().filter_map(|l| l.strip_prefix("# HELP ")) {
            assert!(help.split_once(' ').is_some_and(|(_, h)| h.len() > 10), "{help}: every family is explained");
        }
    }

    #[test]
    fn measured_values_appear_in_the_text_with_their_labels() {
        let m = Metrics::new(Some("pread"));
        m.observe_fault(Duration::from_micros(300));
        m.count_fault(TierKind::Flash);
        m.count_fault(TierKind::Flash);
        let got = m.time_flash(FlashOp::Write, || 7);
        assert_eq!(got, 7);
        let text = m.encode_registry();
        assert!(text.contains("kvmm_fault_pages_total{tier=\"flash\"} 2\n"), "{text}");
        assert!(text.contains("kvmm_fault_latency_seconds_count 1\n"), "{text}");
        assert!(text.contains("kvmm_fault_latency_seconds_bucket{le=\"0.0004\"} 1\n"), "{text}");
        assert!(text.contains("kvmm_flash_batch_latency_seconds_count{engine=\"pread\",op=\"write\"} 1\n"), "{text}");
    }

    #[test]
    fn refusals_are_counted_by_code_across_every_registry() {
        let a = Metrics::new(None);
        count_refusal("resource_exhausted");
        let b = Metrics::new(None);
        for text in [a.encode_registry(), b.encode_registry()] {
            let line = text.lines().find(|l| l.starts_with("kvmm_rpc_errors_total{code=\"resource_exhausted\"}"));
            let n: u64 = line.unwrap().rsplit(' ').next().unwrap().parse().unwrap();
            assert!(n >= 1, "{text}");
        }
    }

    #[test]
    fn the_first_compressing_demotion_is_sampled_then_one_in_64() {
        let m = Metrics::new(None);
        let sampled: Vec<usize> = (0..200).filter(|_| m.sample_quantization()).collect();
        assert_eq!(sampled.len(), 4);
        let m = Metrics::new(None);
        let picks: Vec<usize> = (0..130).filter(|_| m.sample_quantization()).collect();
        assert_eq!(picks, vec![0, 64, 128]);
    }

    #[test]
    fn relative_l2_error_is_the_norm_of_the_difference_over_the_norm_of_the_source() {
        assert_eq!(relative_l2(&[3.0, 4.0], &[3.0, 4.0]), Some(0.0));
        let e = relative_l2(&[3.0, 4.0], &[3.0, 5.0]).unwrap();
        assert!((e - 0.2).abs() < 1e-12, "{e}");
        assert_eq!(relative_l2(&[0.0, 0.0], &[1.0, 0.0]), None);
        assert_eq!(relative_l2(&[1.0], &[1.0, 2.0]), None);
    }

    #[test]
    fn a_q8_page_decodes_within_a_percent_of_its_source() {
        let shape = PageShape { kv_heads: 2, head_dim: 64, block_tokens: 32 };
        let mut src = vec![0u8; shape.page_bytes(Format::F16)];
        kvmm_kernels::init_page(shape, Format::F16, &mut src).unwrap();
        let row: Vec<f32> =
            (0..shape.kv_heads * shape.head_dim).map(|i| ((i * 37 % 101) as f32 - 50.0) / 10.0).collect();
        for t in 0..shape.block_tokens {
            kvmm_kernels::write_rows(shape, Format::F16, &mut src, t, &row, &row).unwrap();
        }
        let mut dst = vec![0u8; shape.page_bytes(Format::Q8)];
        kvmm_kernels::quantize(shape, Format::F16, &src, 32, Format::Q8, &mut dst).unwrap();
        let m = Metrics::new(None);
        m.observe_quantization(shape, (Format::F16, &src), (Format::Q8, &dst), 32);
        let text = m.encode_registry();
        assert!(text.contains("kvmm_demotion_quantization_error_ratio_count{format=\"q8\"} 1\n"), "{text}");
        assert!(
            text.contains("kvmm_demotion_quantization_error_ratio_bucket{format=\"q8\",le=\"0.016\"} 1\n"),
            "{text}"
        );
    }
}
