//! `kvmm-test-client`: a real client process for the scenarios in `tests/tests/`.
//!
//! It speaks a line protocol: it prints `key=value` report lines on stdout and takes commands on
//! stdin. Every attention output is compared with a scalar reference computed in f64 over the same
//! K/V, which the process keeps privately (rounded to the session's element type, as stored). A
//! mismatch prints `FAIL ...` and exits 3; an error from kvmm prints `error code=... msg=...` and
//! exits 2.
//!
//! Modes:
//! - `run [geometry] --tokens N [--requantized-from q8]`: attach, append N tokens to every layer with
//!   attention on every layer at every step, print `appended ...`, then obey commands: `check K`,
//!   `append K`, `loop` (attention rounds until `stop`), `stats`, `exit`. Pages the daemon has
//!   recompressed are checked against this process's own K/V passed through the same quantizer
//!   (through the compressed format this process last read the page in first, when the page has
//!   stepped down since, else through the `--requantized-from` format when it steps down from
//!   that). `append-only K` appends without attention (pages the daemon demoted stay where they
//!   are). `digest` prints
//!   a digest of the exact bits of every layer's output for a fixed query; `prefetch` hints every
//!   page of the session. `--canary` fills every value row with the bytes of `CANARY`.
//!   `--quota-tokens Q [--evict]` attach with a quota (and opt-in eviction); `--attend-every K`
//!   attends after every K-th token only; `--heavy-every H` scales up the keys of every H-th page
//!   (heavy hitters). With a quota, every attention checks that no page eviction must keep was
//!   dropped, and reports print `quota ... heavy_kept=KEPT/ELIGIBLE`.
//!   `--hot-blocks 9,30 [--hot-scale 8]` scales the keys of those blocks (every layer), so random
//!   queries give them most of the attention mass; `formats` prints the format each page of each
//!   layer is read in, after a checked attention.
//!   `--linger-ms L` attaches a session that outlives this process's connection for L ms;
//!   `--model-id M` attaches it with that model id.
//!   `share-sockets` lets a child (`sleep`) inherit this process's sockets, its connection to kvmmd
//!   included, and prints `shared holder=PID sockets=N`.
//!   `--resume S --tokens N` takes over session S (whose process appended N tokens with the same
//!   seed and `--no-attend`, then went away) instead of attaching: it rebuilds its own copy of that
//!   K/V without appending, checks the token counts the session carried over, prints
//!   `resumed session=S tokens=T blocks=B resume_us=U` (U: the library's `resume`, handshake and
//!   mappings included) and obeys the same commands.
//! - `append-forever [geometry]`: append and attend until killed, printing `progress tokens=T`.
//! - `raw-attach [geometry] [--fetch]`: Attach over gRPC without the library; print the session id
//!   and token (and, with --fetch, the received arena's inode), then wait for `exit`.
//! - `fd-request --session S --token HEX`: present a token on the fd socket; print the reply.
//! - `foreign --session S`: from another uid, try every session RPC on S and print the codes, and
//!   how many sessions `ListOrphans` shows this uid (`orphans=N`).
//! - `crash-run [geometry] --tokens N`: like `run`, but survives kvmmd dying: reconnects, attaches
//!   again, appends its K/V again and carries on (`tests/tests/crash_restart.rs`).
//! - `attend-spin [geometry] --tokens N`: appends N tokens to every layer, takes each layer's output
//!   for one fixed query, prints `ready session=S`, then runs attention over every layer with that
//!   query, back to back, until a call fails: every output must equal the first bit for bit (else
//!   `FAIL`, exit 3), and the error ends it (`error code=... attentions=A`, exit 2). Nearly all of
//!   its time is spent reading pinned pages, which is where a wipe must be caught (`tests/tests/wipe.rs`).
//!
//! `wipe` (in `run`) wipes the session through the session socket, as its owner may.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::io::BufRead;
use std::os::fd::AsFd;
use std::path::PathBuf;
use std::sync::mpsc;

use kvmm_client::{AttachOptions, Client, ElementType, Geometry, Priority, Session, proto as pb};
use kvmm_kernels::attention::reference::reference_attention_f32;
use kvmm_shm::fdpass::{FdReply, FdRequest, SeqpacketConn};

struct Args(HashMap<String, String>);

impl Args {
    fn parse(args: &[String]) -> Args {
        let mut m = HashMap::new();
        let mut i = 0;
        while i < args.len() {
            let key = args[i].trim_start_matches("--").to_owned();
            if i + 1 < args.len() && !args[i + 1].starts_with("--") {
                m.insert(key, args[i + 1].clone());
                i += 2;
            } else {
                m.insert(key, "true".to_owned());
                i += 1;
            }
        }
        Args(m)
    }
    fn get<T: std::str::FromStr>(&self, k: &str, default: T) -> T {
        self.0.get(k).and_then(|v| v.parse().ok()).unwrap_or(default)
    }
    fn flag(&self, k: &str) -> bool {
        self.0.contains_key(k)
    }
    fn socket(&self) -> PathBuf {
        PathBuf::from(self.0.get("socket").expect("--socket is required"))
    }
    fn geometry(&self) -> Geometry {
        Geometry {
            layers: self.get("layers", 2),
            kv_heads: self.get("kv-heads", 3),
            q_heads: self.get("q-heads", 9),
            head_dim: self.get("head-dim", 64),
            block_tokens: self.get("block-tokens", 32),
            element_type: if self.flag("bf16") { ElementType::Bf16 } else { ElementType::F16 },
            max_tokens: self.get("max-tokens", 4096),
        }
    }
}

/// xorshift64*: deterministic K/V/q per seed.
struct Rng(u64);
impl Rng {
    fn f(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let x = self.0.wrapping_mul(0x2545_F491_4F6C_DD1D);
        ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.f()).collect()
    }
}

/// Bytes that `--canary` writes into every value row (an even number of bytes, each pair a finite
/// f16 whose little-endian bytes are these).
const CANARY: &[u8; 16] = b"KVMM-CANARY-7e1d";

/// A value row whose f16 encoding is [`CANARY`] repeated.
fn canary_row(n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let at = (2 * i) % CANARY.len();
            half::f16::from_bits(u16::from_le_bytes([CANARY[at], CANARY[at + 1]])).to_f32()
        })
        .collect()
}

fn round_to(et: ElementType, x: f32) -> f32 {
    match et {
        ElementType::Bf16 => half::bf16::from_f32(x).to_f32(),
        _ => half::f16::from_f32(x).to_f32(),
    }
}

fn die(e: kvmm_client::Error) -> ! {
    println!("error code={:?} msg={}", e.code(), e.to_string().replace('\n', " "));
    std::process::exit(2);
}

/// Keys and values of a page, token-major.
type Rows = (Vec<f32>, Vec<f32>);

/// A session plus the private copy of its K/V.
struct Checked {
    session: Session,
    g: Geometry,
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
    rng: Rng,
    attentions: u64,
    worst: f64,
    /// Pages read in each format (by format code), over all attentions.
    formats_seen: std::collections::BTreeMap<u8, u64>,
    /// This process's own K/V of a page passed through the daemon's quantizer: what a recompressed
    /// page must decode to, keyed by (layer, block, format code).
    requantized: HashMap<(u32, u32, u8), Rows>,
    /// `--canary`: every value row holds [`CANARY`] (as f16 bytes), to be searched for in storage.
    canary: bool,
    /// The format lower pages were recompressed from (`--requantized-from q8`), if not from 16-bit.
    via: Option<kvmm_kernels::format::Format>,
    /// The compressed format each page (layer, block) was last read in: a page read in a lower
    /// one later was stepped down from it.
    read_as: HashMap<(u32, u32), kvmm_kernels::format::Format>,
    /// `--attend-every K`: attention on every layer after every K-th appended token only.
    attend_every: usize,
    /// `--hot-blocks`, `--hot-scale`: blocks whose keys are scaled, and by how much.
    hot: Hot,
}

/// Blocks whose keys are scaled up so that they draw most of the attention mass: `--hot-blocks`
/// names them, `--heavy-every H` takes every H-th (blocks 1, 1 + H, ...).
#[derive(Default)]
struct Hot {
    blocks: Vec<usize>,
    every: u32,
    scale: f32,
}

impl Hot {
    fn parse(a: &Args) -> Hot {
        let blocks = a.0.get("hot-blocks").map_or(Vec::new(), |list| {
            list.split(',').map(|b| b.trim().parse().expect("--hot-blocks takes block numbers")).collect()
        });
        Hot { blocks, every: a.get("heavy-every", 0), scale: a.get("hot-scale", 8.0) }
    }

    /// Whether `block` is hot.
    fn is_hot(&self, block: u32) -> bool {
        self.blocks.contains(&(block as usize)) || (self.every > 0 && block % self.every == 1)
    }

    /// The key row of token `token`, scaled when its block is hot.
    fn heat(&self, block_tokens: u32, token: usize, mut k: Vec<f32>) -> Vec<f32> {
        if self.is_hot((token / block_tokens as usize) as u32) {
            k.iter_mut().for_each(|x| *x *= self.scale);
        }
        k
    }
}

/// The name of the format a page was read in (`dropped` for a page eviction dropped).
fn page_format_name(format: &Option<kvmm_kernels::format::Format>) -> &'static str {
    format.map_or("dropped", |f| f.name())
}

impl Checked {
    /// Whether `block` is one of the hot pages.
    fn heavy(&self, block: u32) -> bool {
        self.hot.is_hot(block)
    }

    fn append(&mut self, n: usize, attend: bool) {
        self.rows(n, attend, true);
    }

    /// Rebuilds this process's copy of the K/V of `n` tokens appended without attention (by the
    /// process this one resumed from, with the same seed), without appending them.
    fn replay(&mut self, n: usize) {
        self.rows(n, false, false);
    }

    fn rows(&mut self, n: usize, attend: bool, append: bool) {
        let row = (self.g.kv_heads * self.g.head_dim) as usize;
        for i in 0..n {
            for layer in 0..self.g.layers {
                let token = self.keys[layer as usize].len() / row;
                let k = self.hot.heat(self.g.block_tokens, token, self.rng.vec(row));
                let v = if self.canary { canary_row(row) } else { self.rng.vec(row) };
                if append {
                    self.session.append(layer, &k, &v).unwrap_or_else(|e| die(e));
                }
                let et = self.g.element_type;
                self.keys[layer as usize].extend(k.iter().map(|&x| round_to(et, x)));
                self.values[layer as usize].extend(v.iter().map(|&x| round_to(et, x)));
                if attend && (i + 1) % self.attend_every == 0 {
                    self.attend(layer);
                }
            }
        }
    }

    /// Takes `k` tokens back with `Session::truncate` (fewer where the cut would fall inside a full
    /// page: such a page may have been compressed, and this process could not say which values the
    /// cut then keeps; the cut goes to that page's start instead), and forgets them too.
    fn truncate(&mut self, k: usize) {
        let (row, bt) = ((self.g.kv_heads * self.g.head_dim) as usize, self.g.block_tokens as usize);
        let tokens = self.keys[0].len() / row;
        let keep = if k < tokens % bt { tokens - k } else { tokens.saturating_sub(k) / bt * bt };
        self.session.truncate(keep as u32).unwrap_or_else(|e| die(e));
        for rows in self.keys.iter_mut().chain(self.values.iter_mut()) {
            rows.truncate(keep * row);
        }
        // Blocks from the cut's on hold other tokens from now on.
        let first = (keep / bt) as u32;
        self.requantized.retain(|&(_, block, _), _| block < first);
        self.read_as.retain(|&(_, block), _| block < first);
    }

    /// Checks the pages eviction dropped: never the first page, never one with a token among the
    /// last 128 of its layer. Returns the dropped blocks.
    fn check_dropped(&self, layer: u32) -> Vec<u32> {
        let dropped = self.session.dropped_blocks(layer).unwrap_or_else(|e| die(e));
        let (bt, tokens) = (self.g.block_tokens, self.session.tokens(layer));
        for &b in &dropped {
            if b == 0 || (b + 1) * bt + 128 > tokens {
                println!("FAIL layer={layer} tokens={tokens} dropped block {b}, which eviction must keep");
                std::process::exit(3);
            }
        }
        dropped
    }

    /// The K/V this process expects the daemon's pages to hold, given the format each page was read
    /// in: its own rows for 16-bit pages, its own rows quantized and decoded for compressed ones
    /// (quantization is deterministic, so this is exact).
    fn expected_rows(&mut self, layer: u32) -> (Vec<f32>, Vec<f32>) {
        let (g, bt) = (self.g, self.g.block_tokens as usize);
        let row = (g.kv_heads * g.head_dim) as usize;
        let (keys, values) = (&self.keys[layer as usize], &self.values[layer as usize]);
        let formats = self.session.last_formats().to_vec();
        let mut k = Vec::with_capacity(keys.len());
        let mut v = Vec::with_capacity(values.len());
        for (block, format) in formats.into_iter().enumerate() {
            // A page eviction dropped is not read: its tokens are not in the reference either.
            let Some(format) = format else { continue };
            *self.formats_seen.entry(format.as_u8()).or_default() += 1;
            let span = block * bt * row..((block + 1) * bt * row).min(keys.len());
            if !format.is_quantized() {
                k.extend_from_slice(&keys[span.clone()]);
                v.extend_from_slice(&values[span]);
                continue;
            }
            let earlier = self.read_as.insert((layer, block as u32), format);
            let via = earlier.filter(|&e| e != format).or(self.via);
            let (kq, vq) = self.requantized.entry((layer, block as u32, format.as_u8())).or_insert_with(|| {
                let shape = g.page_shape();
                let mut page = vec![0u8; shape.page_bytes(g.format())];
                kvmm_kernels::init_page(shape, g.format(), &mut page).unwrap();
                kvmm_kernels::write_rows(shape, g.format(), &mut page, 0, &keys[span.clone()], &values[span.clone()])
                    .unwrap();
                let mut q = vec![0u8; shape.page_bytes(format)];
                match via.filter(|v| v.k_bits() + v.v_bits() > format.k_bits() + format.v_bits()) {
                    // The daemon stepped this page down from `via`: quantize to it first, as it did.
                    Some(via) => {
                        let mut mid = vec![0u8; shape.page_bytes(via)];
                        kvmm_kernels::quantize(shape, g.format(), &page, bt, via, &mut mid).unwrap();
                        kvmm_kernels::requantize(shape, g.format(), via, &mid, bt, format, &mut q).unwrap();
                    }
                    None => kvmm_kernels::quantize(shape, g.format(), &page, bt, format, &mut q).unwrap(),
                }
                let (mut kd, mut vd) = (vec![0f32; bt * row], vec![0f32; bt * row]);
                kvmm_kernels::dequantize(shape, format, &q, bt, &mut kd, &mut vd).unwrap();
                (kd, vd)
            });
            k.extend_from_slice(kq);
            v.extend_from_slice(vq);
        }
        (k, v)
    }

    fn attend(&mut self, layer: u32) {
        self.check_dropped(layer);
        let g = self.g;
        let n = (g.q_heads * g.head_dim) as usize;
        let q = self.rng.vec(n);
        let mut out = vec![0f32; n];
        self.session.attention(layer, &q, &mut out).unwrap_or_else(|e| die(e));
        let mut want = vec![0f32; n];
        let scale = 1.0 / (g.head_dim as f32).sqrt();
        let (keys, values) = self.expected_rows(layer);
        reference_attention_f32(
            g.q_heads as usize,
            g.kv_heads as usize,
            g.head_dim as usize,
            &q,
            &keys,
            &values,
            scale,
            &mut want,
        )
        .unwrap();
        let (mut diff, mut norm) = (0f64, 0f64);
        for (a, b) in out.iter().zip(&want) {
            diff += f64::from(a - b).powi(2);
            norm += f64::from(*b).powi(2);
        }
        let rel = (diff / norm.max(1e-30)).sqrt();
        self.worst = self.worst.max(rel);
        self.attentions += 1;
        if rel.is_nan() || rel > 1e-3 {
            println!(
                "FAIL layer={layer} tokens={} rel_err={rel:e} out0={} want0={}",
                self.session.tokens(layer),
                out[0],
                want[0]
            );
            std::process::exit(3);
        }
    }

    /// Attention with a page budget against the same call without one: how many pages were read,
    /// and how far the sparse output is from the full one.
    fn sparse(&mut self, rounds: usize, budget: usize) {
        let g = self.g;
        let n = (g.q_heads * g.head_dim) as usize;
        let (mut max_read, mut worst, mut sum, mut calls) = (0usize, 0f64, 0f64, 0usize);
        for _ in 0..rounds {
            for layer in 0..g.layers {
                let q = self.rng.vec(n);
                let (mut sparse, mut full) = (vec![0f32; n], vec![0f32; n]);
                self.session.set_page_budget(Some(budget)).unwrap_or_else(|e| die(e));
                self.session.attention(layer, &q, &mut sparse).unwrap_or_else(|e| die(e));
                let read = self.session.last_mass().iter().filter(|&&m| m > 0.0).count();
                self.session.set_page_budget(None).unwrap_or_else(|e| die(e));
                self.session.attention(layer, &q, &mut full).unwrap_or_else(|e| die(e));
                let (mut d, mut nrm) = (0f64, 0f64);
                for (a, b) in sparse.iter().zip(&full) {
                    d += f64::from(a - b).powi(2);
                    nrm += f64::from(*b).powi(2);
                }
                let rel = (d / nrm.max(1e-30)).sqrt();
                (max_read, worst, sum, calls) = (max_read.max(read), worst.max(rel), sum + rel, calls + 1);
            }
        }
        println!(
            "sparse budget={budget} pages={} max_read={max_read} mean_rel_err={:e} max_rel_err={worst:e}",
            self.session.allocated_blocks().min(self.session.tokens(0).div_ceil(g.block_tokens)),
            sum / calls as f64
        );
    }

    /// Attention of every layer for a fixed query, and a digest of the outputs' exact bits: equal
    /// digests mean bit-identical outputs (the lossless tier ladder).
    fn digest(&mut self) {
        let g = self.g;
        let n = (g.q_heads * g.head_dim) as usize;
        let q = Rng(0x5eed).vec(n);
        let mut hash = 0xcbf2_9ce4_8422_2325u64;
        for layer in 0..g.layers {
            let mut out = vec![0f32; n];
            self.session.attention(layer, &q, &mut out).unwrap_or_else(|e| die(e));
            for x in out {
                for b in x.to_bits().to_le_bytes() {
                    hash = (hash ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
                }
            }
        }
        let s = self.session.stats().unwrap_or_else(|e| die(e));
        println!(
            "digest value={hash:016x} faults={} fault_hits={} promoted_dram={} promoted_flash={} device_pages={} \
             dram_pages={} flash_pages={}",
            s.faults, s.fault_hits, s.promoted_from_dram, s.promoted_from_flash, s.pages[0], s.pages[1], s.pages[2]
        );
    }

    /// One checked attention per layer, then the format each of its pages was read in:
    /// `formats layer=L pages=f16,q8,q4,...`.
    fn print_formats(&mut self) {
        for layer in 0..self.g.layers {
            self.attend(layer);
            let names: Vec<&str> = self.session.last_formats().iter().map(page_format_name).collect();
            println!("formats layer={layer} pages={}", names.join(","));
        }
    }

    fn round(&mut self) {
        for layer in 0..self.g.layers {
            self.attend(layer);
        }
    }

    fn report(&self, what: &str) {
        let s = self.session.stats().unwrap_or_else(|e| die(e));
        let seen: Vec<String> = self
            .formats_seen
            .iter()
            .map(|(f, n)| format!("{}:{n}", kvmm_kernels::format::Format::from_u8(*f).map_or("?", |f| f.name())))
            .collect();
        println!(
            "{what} session={} tokens={} device_bytes={} moved={} attentions={} worst_rel_err={:e} formats_seen={} \
             faults={} device_pages={} dram_pages={} flash_pages={} owner={}",
            self.session.id(),
            s.tokens,
            s.device_bytes,
            s.pages_moved,
            self.attentions,
            self.worst,
            seen.join(","),
            s.faults,
            s.pages[0],
            s.pages[1],
            s.pages[2],
            s.owner_name
        );
        if s.quota_tokens > 0 {
            // Per layer: pages kept, and how many of the heavy pages eviction could have dropped
            // (full, outside the sink page and the recent window) it kept.
            let (mut kept, mut heavy, mut heavy_kept) = (Vec::new(), 0, 0);
            for layer in 0..self.g.layers {
                let dropped = self.check_dropped(layer);
                let (bt, tokens) = (self.g.block_tokens, self.session.tokens(layer));
                kept.push((self.session.allocated_blocks() - dropped.len() as u32).to_string());
                for b in (1..tokens / bt).filter(|&b| self.heavy(b) && (b + 1) * bt + 128 <= tokens) {
                    heavy += 1;
                    heavy_kept += u32::from(!dropped.contains(&b));
                }
            }
            println!(
                "quota tokens={} dropped_pages={} kept_pages={} heavy_kept={heavy_kept}/{heavy}",
                s.quota_tokens,
                s.dropped_pages,
                kept.join(",")
            );
        }
    }
}

fn stdin_lines() -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

fn run(a: &Args, forever: bool) {
    let client = Client::connect(a.socket()).unwrap_or_else(|e| die(e));
    let g = a.geometry();
    let priority = match a.0.get("priority").map(String::as_str) {
        None | Some("foreground") => Priority::Foreground,
        Some("background") => Priority::Background,
        Some("batch") => Priority::Batch,
        Some(other) => panic!("unknown priority {other}"),
    };
    let opts = AttachOptions {
        extend_batch: a.get("extend-batch", 4),
        priority,
        quota_tokens: a.get("quota-tokens", 0),
        evict: a.flag("evict"),
        linger: std::time::Duration::from_millis(a.get("linger-ms", 0)),
        model_id: a.0.get("model-id").cloned().unwrap_or_default(),
    };
    let resume: Option<u64> = a.0.get("resume").map(|id| id.parse().expect("--resume takes a session id"));
    let started = std::time::Instant::now();
    let session = match resume {
        Some(id) => client.resume(id, Some((&g).into())).unwrap_or_else(|e| die(e)),
        None => client.attach_with(g, opts).unwrap_or_else(|e| die(e)),
    };
    let resume_us = started.elapsed().as_micros();
    assert_eq!(*session.geometry(), g, "the resumed session's geometry is the one given on the command line");
    let mut c = Checked {
        session,
        g,
        keys: vec![Vec::new(); g.layers as usize],
        values: vec![Vec::new(); g.layers as usize],
        rng: Rng(a.get("seed", 1u64) | 1),
        canary: a.flag("canary"),
        attentions: 0,
        worst: 0.0,
        formats_seen: Default::default(),
        requantized: HashMap::new(),
        read_as: HashMap::new(),
        via: a.0.get("requantized-from").map(|name| {
            kvmm_kernels::format::Format::ALL
                .into_iter()
                .find(|f| f.name() == name)
                .unwrap_or_else(|| panic!("unknown format {name}"))
        }),
        attend_every: a.get("attend-every", 1usize).max(1),
        hot: Hot::parse(a),
    };
    if resume.is_some() {
        c.replay(a.get("tokens", 100));
        let row = (g.kv_heads * g.head_dim) as usize;
        let layers = 0..g.layers;
        if let Some(layer) = layers.clone().find(|&l| c.session.tokens(l) as usize != c.keys[l as usize].len() / row) {
            println!(
                "FAIL resumed layer={layer} with {} tokens published, {} expected",
                c.session.tokens(layer),
                c.keys[layer as usize].len() / row
            );
            std::process::exit(3);
        }
        println!(
            "resumed session={} tokens={} blocks={} resume_us={}",
            c.session.id(),
            c.session.tokens(0),
            c.session.allocated_blocks(),
            resume_us
        );
    } else {
        println!("attached session={}", c.session.id());
    }
    if forever {
        loop {
            c.append(64, true);
            println!("progress tokens={}", c.session.tokens(0));
        }
    }
    if resume.is_none() {
        c.append(a.get("tokens", 100), !a.flag("no-attend"));
        c.report("appended");
    }
    let lines = stdin_lines();
    while let Ok(line) = lines.recv() {
        let mut words = line.split_whitespace();
        match (words.next(), words.next().and_then(|w| w.parse::<usize>().ok())) {
            (Some("check"), Some(k)) => {
                for _ in 0..k {
                    c.round();
                }
                c.report("checked");
            }
            (Some("append"), Some(k)) => {
                c.append(k, true);
                c.report("appended");
            }
            (Some("append-only"), Some(k)) => {
                c.append(k, false);
                c.report("appended");
            }
            (Some("loop"), _) => {
                let mut rounds = 0u64;
                while lines.try_recv().is_err() {
                    c.round();
                    rounds += 1;
                }
                c.report(&format!("looped rounds={rounds}"));
            }
            (Some("sparse"), Some(rounds)) => {
                let budget: usize = words.next().and_then(|w| w.parse().ok()).expect("sparse ROUNDS BUDGET");
                c.sparse(rounds, budget);
            }
            (Some("bad-budget"), _) => match c.session.set_page_budget(Some(2)) {
                Ok(()) => println!("unexpected ok"),
                Err(e) => println!("error code={:?} msg={}", e.code(), e),
            },
            (Some("bad-query"), _) => {
                let mut out = vec![0f32; (g.q_heads * g.head_dim) as usize];
                match c.session.attention(0, &[0.0; 3], &mut out) {
                    Ok(()) => println!("unexpected ok"),
                    Err(e) => println!("error code={:?} msg={}", e.code(), e),
                }
            }
            (Some("truncate"), Some(k)) => {
                c.truncate(k);
                c.report("truncated");
            }
            (Some("stats"), _) => c.report("stats"),
            (Some("digest"), _) => c.digest(),
            (Some("formats"), _) => c.print_formats(),
            (Some("prefetch"), _) => {
                let blocks = c.session.allocated_blocks();
                let (resident, scheduled) = c.session.prefetch(0..g.layers, 0..blocks).unwrap_or_else(|e| die(e));
                println!("prefetched resident={resident} scheduled={scheduled}");
            }
            (Some("wipe"), _) => {
                let [device, dram, flash] = c.session.wipe().unwrap_or_else(|e| die(e));
                println!("wiped device={device} dram={dram} flash={flash}");
            }
            (Some("share-sockets"), _) => share_sockets(),
            (Some("exit"), _) => break,
            _ => println!("unknown command {line}"),
        }
    }
    let wiped = c.session.detach().unwrap_or_else(|e| die(e));
    println!("detached bytes={wiped}");
}

/// Lets a child inherit every socket of this process, its connection to kvmmd included (as a fork
/// without exec would), and starts one that holds them (`sleep`, stdio closed): prints
/// `shared holder=PID sockets=N`.
#[allow(clippy::zombie_processes, reason = "the holder outlives this process by design; the test kills it")]
fn share_sockets() {
    let mut sockets = 0;
    for entry in std::fs::read_dir("/proc/self/fd").unwrap() {
        let entry = entry.unwrap();
        let is_socket = std::fs::read_link(entry.path()).is_ok_and(|t| t.to_string_lossy().starts_with("socket:"));
        let Some(fd) = entry.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else { continue };
        if is_socket {
            // SAFETY: `fd` is open in this process (listed in /proc/self/fd just now, and nothing
            // here closes fds meanwhile); F_SETFD only clears its close-on-exec flag.
            assert_eq!(unsafe { libc::fcntl(fd, libc::F_SETFD, 0) }, 0, "fcntl(F_SETFD) on fd {fd}");
            sockets += 1;
        }
    }
    let holder = std::process::Command::new("sleep")
        .arg("600")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    println!("shared holder={} sockets={sockets}", holder.id());
}

fn to_hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn from_hex(s: &str) -> Vec<u8> {
    (0..s.len() / 2).map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap()).collect()
}

fn fd_request(
    fd_socket: &std::path::Path,
    session: u64,
    token: &[u8],
) -> Result<Vec<std::os::fd::OwnedFd>, (u32, String)> {
    let conn = SeqpacketConn::connect(fd_socket).unwrap();
    conn.set_timeouts(std::time::Duration::from_secs(5)).unwrap();
    conn.send(&FdRequest { session_id: session, token: token.try_into().unwrap() }.encode(), &[]).unwrap();
    let mut buf = [0u8; 2048];
    let (n, fds) = conn.recv(&mut buf).unwrap();
    match FdReply::decode(&buf[..n]).unwrap() {
        FdReply::Granted { .. } => Ok(fds),
        FdReply::Refused { code, message } => Err((code, message)),
    }
}

fn inode(fd: &impl AsFd) -> u64 {
    rustix::fs::fstat(fd).unwrap().st_ino
}

/// Attach with the raw RPC: `--geometry` flags, `--quota-tokens`, `--evict`.
fn attach_rpc(client: &Client, a: &Args, model_id: &str) -> pb::AttachResponse {
    let mut rpc = client.rpc();
    client
        .block_on(rpc.attach(pb::AttachRequest {
            geometry: Some(kvmm_client::session::geometry_to_pb(&a.geometry())),
            model_id: model_id.into(),
            priority: 0,
            quota_tokens: a.get("quota-tokens", 0),
            evict: a.flag("evict"),
            linger_ms: a.get("linger-ms", 0),
        }))
        .unwrap_or_else(|e| die(e.into()))
        .into_inner()
}

fn raw_attach(a: &Args) {
    let client = Client::connect(a.socket()).unwrap_or_else(|e| die(e));
    let r = attach_rpc(&client, a, "raw");
    let mut line = format!("attached session={} token={}", r.session_id, to_hex(&r.fd_token));
    if a.flag("fetch") {
        let fds = fd_request(&a.socket().with_file_name("kvmm-fd.sock"), r.session_id, &r.fd_token).unwrap();
        line += &format!(" arena_ino={} arena_bytes={}", inode(&fds[0]), r.arena_bytes);
    }
    println!("{line}");
    for l in stdin_lines() {
        if l == "exit" {
            break;
        }
    }
}

/// Attaches with the raw RPCs, maps the session's memory itself, extends by one block and pins
/// page (L, 0) of layer L = `--pin-layer` (default 0) the way the client library does, then prints
/// `pinned session=N offset=O len=L` and obeys stdin: `write` fills the pinned frame with 0xAB (a
/// row write still under way after a wipe), `unpin` releases the pin, `pin` takes one again (`pin
/// pinned=true`), `publish` marks the page full (`published tokens=T`, so that `Compress` takes it
/// unless it is pinned), `stats` calls `SessionStats` (`stats code=Ok stuck_pins=N`, or the code,
/// the table's status and the message), `truncate` calls `Truncate` to 0 blocks (`truncate code=Ok
/// freed=N`, or the code and the message), and `exit` (or EOF) ends. Each command answers with one
/// line.
fn hold_pin(a: &Args) {
    use kvmm_shm::{Access, ClientRegion, Mapping, Memfd, SessionTable};
    let client = Client::connect(a.socket()).unwrap_or_else(|e| die(e));
    let g = a.geometry();
    let r = attach_rpc(&client, a, "hold-pin");
    let fds = fd_request(&a.socket().with_file_name("kvmm-fd.sock"), r.session_id, &r.fd_token).unwrap();
    let mut fds = fds.into_iter().map(|fd| Memfd::from_fd(fd).unwrap());
    let (arena, table, region) = (fds.next().unwrap(), fds.next().unwrap(), fds.next().unwrap());
    let arena = Mapping::map(&arena, Access::ReadWrite).unwrap();
    let table = SessionTable::open(table).unwrap();
    let region = ClientRegion::open(region, &g).unwrap();
    client
        .block_on(client.rpc().extend(pb::ExtendRequest { session_id: r.session_id, blocks: 1 }))
        .unwrap_or_else(|e| die(e.into()));
    let layer = a.get("pin-layer", 0u32);
    let entry = region.entry(layer, 0).unwrap();
    assert!(entry.pin(table.entry(layer, 0).unwrap()).is_pinned(), "a fresh page pins");
    let loc = table.entry(layer, 0).unwrap().location();
    let (offset, len) = (loc.offset as usize, loc.len as usize);
    println!("pinned session={} offset={offset} len={len}", r.session_id);
    for l in stdin_lines() {
        match l.as_str() {
            "write" => {
                arena.write_at(offset, &vec![0xAB; len]).unwrap();
                println!("written");
            }
            "unpin" => {
                entry.unpin();
                println!("unpinned");
            }
            "publish" => {
                entry.publish_tokens(g.block_tokens);
                println!("published tokens={}", g.block_tokens);
            }
            "pin" => {
                let outcome = entry.pin(table.entry(layer, 0).unwrap());
                println!("pin pinned={}", outcome.is_pinned());
            }
            "truncate" => {
                let truncate = pb::TruncateRequest { session_id: r.session_id, blocks: 0 };
                match client.block_on(client.rpc().truncate(truncate)) {
                    Ok(t) => println!("truncate code=Ok freed={}", t.into_inner().freed_pages),
                    Err(e) => println!("truncate code={:?} msg={}", e.code(), e.message()),
                }
            }
            "stats" => {
                let stats = pb::SessionStatsRequest { session_id: r.session_id };
                match client.block_on(client.rpc().session_stats(stats)) {
                    Ok(s) => println!("stats code=Ok stuck_pins={}", s.into_inner().stuck_pins),
                    Err(e) => println!("stats code={:?} table={:?} msg={}", e.code(), table.status(), e.message()),
                }
            }
            _ => break,
        }
    }
}

fn main() {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let (mode, rest) = argv.split_first().expect("usage: kvmm-test-client MODE [--key value]...");
    let a = Args::parse(rest);
    match mode.as_str() {
        "run" => run(&a, false),
        "append-forever" => run(&a, true),
        "raw-attach" => raw_attach(&a),
        "hold-pin" => hold_pin(&a),
        "fd-request" => {
            let token = from_hex(a.0.get("token").expect("--token"));
            match fd_request(&a.socket().with_file_name("kvmm-fd.sock"), a.get("session", 0), &token) {
                Ok(fds) => println!("granted fds={} arena_ino={}", fds.len(), inode(&fds[0])),
                Err((code, msg)) => println!("refused code={code} msg={msg}"),
            }
        }
        "foreign" => foreign(&a),
        "admin-all" => admin_all(&a),
        "crash-run" => crash_run(&a),
        "attend-spin" => attend_spin(&a),
        other => panic!("unknown mode {other}"),
    }
}

/// Calls every admin RPC on `--admin-socket` (session `--session` where one is named) and prints
/// `admin RPC=CODE ...`: from a uid that is not an administrator, every one must be refused.
fn admin_all(a: &Args) {
    let path = PathBuf::from(a.0.get("admin-socket").expect("--admin-socket"));
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let session_id: u64 = a.get("session", 1);
    let line = rt.block_on(async {
        let channel = match kvmm_client::connect::channel(&path).await {
            Ok(c) => c,
            Err(e) => return format!("connect={e}"),
        };
        let mut admin = pb::admin_client::AdminClient::new(channel);
        let code = |r: Result<(), tonic::Status>| r.err().map_or("Ok".to_owned(), |s| format!("{:?}", s.code()));
        let mut out = Vec::new();
        out.push(("Status", code(admin.status(pb::StatusRequest {}).await.map(|_| ()))));
        out.push(("ListSessions", code(admin.list_sessions(pb::ListSessionsRequest {}).await.map(|_| ()))));
        out.push(("Session", code(admin.session(pb::SessionRequest { session_id }).await.map(|_| ()))));
        out.push(("GetPolicy", code(admin.get_policy(pb::GetPolicyRequest {}).await.map(|_| ()))));
        let set = pb::SetPolicyRequest { policy_toml: "mode = \"powersave\"".into() };
        out.push(("SetPolicy", code(admin.set_policy(set).await.map(|_| ()))));
        out.push(("ReloadPolicy", code(admin.reload_policy(pb::ReloadPolicyRequest {}).await.map(|_| ()))));
        out.push(("Drain", code(admin.drain(pb::DrainRequest { resume: false }).await.map(|_| ()))));
        let compress = pb::CompressRequest { session_id, format: pb::PageFormat::Q8 as i32, ..Default::default() };
        out.push(("Compress", code(admin.compress(compress).await.map(|_| ()))));
        let demote = pb::DemoteRequest { session_id, tier: pb::Tier::Dram as i32, ..Default::default() };
        out.push(("Demote", code(admin.demote(demote).await.map(|_| ()))));
        out.push(("WipeSession", code(admin.wipe_session(pb::WipeRequest { session_id }).await.map(|_| ()))));
        out.push(("WipeUser", code(admin.wipe_user(pb::WipeUserRequest { uid: 0 }).await.map(|_| ()))));
        out.push(("WipeAll", code(admin.wipe_all(pb::WipeAllRequest {}).await.map(|_| ()))));
        out.push(("Metrics", code(admin.metrics(pb::MetricsRequest {}).await.map(|_| ()))));
        out.iter().map(|(rpc, code)| format!("{rpc}={code}")).collect::<Vec<_>>().join(" ")
    });
    println!("admin {line}");
}

/// From another uid: every session RPC on someone else's session must be refused.
fn foreign(a: &Args) {
    let client = Client::connect(a.socket()).unwrap_or_else(|e| die(e));
    let session_id: u64 = a.get("session", 0);
    let mut rpc = client.rpc();
    let code = |r: Result<(), tonic::Status>| r.err().map_or("Ok".to_owned(), |s| format!("{:?}", s.code()));
    let extend = client.block_on(rpc.extend(pb::ExtendRequest { session_id, blocks: 1 })).map(|_| ());
    let stats = client.block_on(rpc.session_stats(pb::SessionStatsRequest { session_id })).map(|_| ());
    let fault = client
        .block_on(rpc.fault(pb::FaultRequest { session_id, pages: vec![pb::PageRef { layer: 0, block: 0 }] }))
        .map(|_| ());
    let wipe = client.block_on(rpc.wipe(pb::WipeRequest { session_id })).map(|_| ());
    let detach = client.block_on(rpc.detach(pb::DetachRequest { session_id })).map(|_| ());
    let resume = client.block_on(rpc.resume(pb::ResumeRequest { session_id, geometry: None })).map(|_| ());
    // What this uid is shown of sessions left to resume: only its own.
    let orphans = client.orphans(None).unwrap_or_else(|e| die(e));
    println!(
        "foreign extend={} stats={} fault={} wipe={} detach={} resume={} orphans={}",
        code(extend),
        code(stats),
        code(fault),
        code(wipe),
        code(detach),
        code(resume),
        orphans.len()
    );
}

/// `crash-run`: appends `--tokens N` tokens to every layer, each followed by an attention over the
/// layer checked against this process's own K/V, and outlives kvmmd: when a call fails with
/// `UNAVAILABLE` (the daemon is gone) or `FAILED_PRECONDITION` (a page it was moving when it died
/// stays marked), it reconnects (retrying for 30 s), attaches a new session, appends its K/V again
/// and carries on. Prints `reconnected after=CODE` for each, then `done tokens=N reconnects=R
/// checked=C worst_rel_err=E` and waits for `exit` before detaching.
fn crash_run(a: &Args) {
    let g = a.geometry();
    let row = (g.kv_heads * g.head_dim) as usize;
    let target: usize = a.get("tokens", 100);
    let mut rng = Rng(a.get("seed", 1u64) | 1);
    let layers = g.layers as usize;
    // Rows as stored (rounded to the element type), per layer; appending them again stores the same.
    let (mut keys, mut values) = (vec![Vec::<f32>::new(); layers], vec![Vec::<f32>::new(); layers]);
    let (mut reconnects, mut checked, mut worst) = (0u32, 0u64, 0f64);
    let mut session = attach_retrying(a, g);
    loop {
        let result = (|| -> Result<(), kvmm_client::Error> {
            // A fresh session holds nothing: append what the last one held.
            for layer in 0..layers {
                let held = session.tokens(layer as u32) as usize;
                for t in held..keys[layer].len() / row {
                    let span = t * row..(t + 1) * row;
                    session.append(layer as u32, &keys[layer][span.clone()], &values[layer][span])?;
                }
            }
            for t in keys.iter().map(|k| k.len() / row).min().unwrap_or(0)..target {
                for layer in 0..layers {
                    if keys[layer].len() / row > t {
                        continue;
                    }
                    let (k, v) = (rng.vec(row), rng.vec(row));
                    session.append(layer as u32, &k, &v)?;
                    keys[layer].extend(k.iter().map(|&x| round_to(g.element_type, x)));
                    values[layer].extend(v.iter().map(|&x| round_to(g.element_type, x)));
                    let q = rng.vec((g.q_heads * g.head_dim) as usize);
                    let mut out = vec![0f32; q.len()];
                    session.attention(layer as u32, &q, &mut out)?;
                    let mut want = vec![0f32; q.len()];
                    let scale = 1.0 / (g.head_dim as f32).sqrt();
                    let (qh, kvh, d) = (g.q_heads as usize, g.kv_heads as usize, g.head_dim as usize);
                    reference_attention_f32(qh, kvh, d, &q, &keys[layer], &values[layer], scale, &mut want).unwrap();
                    let (mut diff, mut norm) = (0f64, 0f64);
                    for (x, y) in out.iter().zip(&want) {
                        diff += f64::from(x - y).powi(2);
                        norm += f64::from(*y).powi(2);
                    }
                    let rel = (diff / norm.max(1e-30)).sqrt();
                    if rel.is_nan() || rel > 1e-3 {
                        println!("FAIL layer={layer} token={t} rel_err={rel:e}");
                        std::process::exit(3);
                    }
                    worst = worst.max(rel);
                    checked += 1;
                }
            }
            Ok(())
        })();
        match result {
            Ok(()) => break,
            Err(e)
                if matches!(e.code(), tonic::Code::Unavailable | tonic::Code::FailedPrecondition) && reconnects < 3 =>
            {
                println!("reconnected after={:?} msg={}", e.code(), e.to_string().replace('\n', " "));
                reconnects += 1;
                session = attach_retrying(a, g);
            }
            Err(e) => die(e),
        }
    }
    println!("done tokens={target} reconnects={reconnects} checked={checked} worst_rel_err={worst:e}");
    let lines = stdin_lines();
    while let Ok(line) = lines.recv() {
        if line.trim() == "exit" {
            break;
        }
    }
    let wiped = session.detach().unwrap_or_else(|e| die(e));
    println!("detached wiped_bytes={wiped}");
}

/// Connects and attaches, retrying for 30 s while the daemon is unreachable (restarting).
fn attach_retrying(a: &Args, g: Geometry) -> Session {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        match Client::connect(a.socket()).and_then(|client| client.attach_with(g, AttachOptions::default())) {
            Ok(session) => return session,
            Err(e) if std::time::Instant::now() < deadline && e.code() == tonic::Code::Unavailable => {
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
            Err(e) => die(e),
        }
    }
}

/// `attend-spin`: see the module doc.
fn attend_spin(a: &Args) {
    let client = Client::connect(a.socket()).unwrap_or_else(|e| die(e));
    let g = a.geometry();
    let mut session = client.attach_with(g, AttachOptions::default()).unwrap_or_else(|e| die(e));
    let row = (g.kv_heads * g.head_dim) as usize;
    let mut rng = Rng(a.get("seed", 1u64) | 1);
    let tokens: usize = a.get("tokens", 100);
    for layer in 0..g.layers {
        session.append(layer, &rng.vec(tokens * row), &rng.vec(tokens * row)).unwrap_or_else(|e| die(e));
    }
    let q = rng.vec((g.q_heads * g.head_dim) as usize);
    let first: Vec<Vec<f32>> = (0..g.layers)
        .map(|layer| {
            let mut out = vec![0f32; q.len()];
            session.attention(layer, &q, &mut out).unwrap_or_else(|e| die(e));
            out
        })
        .collect();
    println!("ready session={}", session.id());
    let mut out = vec![0f32; q.len()];
    for attentions in 0u64.. {
        let layer = (attentions % u64::from(g.layers)) as u32;
        if let Err(e) = session.attention(layer, &q, &mut out) {
            println!("error code={:?} attentions={attentions} msg={}", e.code(), e.to_string().replace('\n', " "));
            std::process::exit(2);
        }
        let want = &first[layer as usize];
        if out.iter().zip(want).any(|(x, y)| x.to_bits() != y.to_bits()) {
            println!("FAIL layer={layer} attentions={attentions} out0={} want0={}", out[0], want[0]);
            std::process::exit(3);
        }
    }
}
