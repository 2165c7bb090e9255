//! `--kv-format`: which format the old pages of a kvmm-backed KV cache take, and who decides.
//!
//! A client writes its pages in the session's element type (f16) and cannot choose another: page
//! formats below it are the daemon's business. Two daemon mechanisms change them:
//!
//! - **demotion** (pages leaving the device for DRAM and flash), in the format of the daemon's policy
//!   (`demote_format`, per mode; with `adaptive_precision`, per page by age or by attention mass;
//!   raised to `[[policy.floor]]`s). The sink page and the last 128 tokens keep their precision
//!   (the last 32 under adaptive precision by age, which keeps the newest pages past them one step
//!   up and steps them down as they age).
//! - **recompression in place** (admin `Compress(session, layers, blocks, format)`), one format for
//!   all the pages named, for operators and tests. It does not spare the sink page or the recent
//!   window by itself.
//!
//! [`KvFormat`] maps the flag onto them:
//!
//! ```text
//!  flag     the client                                  old pages on the device   pages kvmmd demotes
//!  f16      asks nothing; notes a lossy demote_format   f16                       its demote_format
//!  auto     asks nothing; notes adaptive precision off  f16                       adaptive precision's
//!  q8, q4   Compress of the old blocks, after prefill   q8 / q4                   keep q8 / q4 (one-way)
//!           and at each page boundary (admin socket)
//! ```
//!
//! "Old" ([`old_blocks`]) is what the daemon's demotion would make lossy: full pages other than the
//! sink page with no token in the last 128. Compress needs the admin API (root or kvmmd's
//! `admin_group`); a client without it can use `f16` and `auto`, and then only reads the policy when
//! it may. Recompression is one-way: a page made q8 stays q8.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use kvmm_client::Client;
use kvmm_client::proto::admin_client::AdminClient;
use kvmm_client::proto::{CompressRequest, PageFormat, PolicyStatus, StatusRequest};
use tonic::transport::Channel;

use crate::error::InferError;
use crate::kvmm_cache::KvmmKvCache;

/// Tokens at the end of each layer whose pages keep the client's precision: the daemon's recent
/// window (`RECENT_WINDOW_TOKENS` in kvmmd's tiering), mirrored here so client-driven
/// recompression spares the same pages as the daemon's own demotion.
pub const RECENT_WINDOW_TOKENS: u32 = 128;

/// The format old pages take, as `--kv-format` asks; see the module documentation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvFormat {
    /// Pages stay in the session's element type; only the daemon's demotion policy changes them.
    #[default]
    F16,
    /// Old pages are recompressed to 8 bits per element (plus parameters) by the client's request.
    Q8,
    /// Old pages are recompressed to 4 bits per element (plus parameters) by the client's request.
    Q4,
    /// The daemon's adaptive precision decides per page when it demotes.
    Auto,
}

impl KvFormat {
    /// The flag's spelling.
    pub fn name(self) -> &'static str {
        match self {
            KvFormat::F16 => "f16",
            KvFormat::Q8 => "q8",
            KvFormat::Q4 => "q4",
            KvFormat::Auto => "auto",
        }
    }

    /// The format the client asks the daemon to recompress old pages to, if it asks at all.
    pub fn recompress_to(self) -> Option<PageFormat> {
        match self {
            KvFormat::Q8 => Some(PageFormat::Q8),
            KvFormat::Q4 => Some(PageFormat::Q4),
            KvFormat::F16 | KvFormat::Auto => None,
        }
    }
}

impl FromStr for KvFormat {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "f16" => Ok(KvFormat::F16),
            "q8" => Ok(KvFormat::Q8),
            "q4" => Ok(KvFormat::Q4),
            "auto" => Ok(KvFormat::Auto),
            other => Err(format!("{other:?} is not a KV format; use f16, q8, q4 or auto")),
        }
    }
}

/// The blocks of a layer holding `tokens` tokens that client-driven recompression may re-encode:
/// full pages other than the sink page (block 0) with no token in the last
/// [`RECENT_WINDOW_TOKENS`]. The same pages the daemon's demotion would make lossy.
pub fn old_blocks(tokens: u32, block_tokens: u32) -> Range<u32> {
    let end = tokens.saturating_sub(RECENT_WINDOW_TOKENS) / block_tokens.max(1);
    1..end.max(1)
}

/// Whether kvmmd's demotion policy (`Status.policy`: `demote_format`, `adaptive_precision`) does
/// what `format` leaves to it; if not, a sentence saying how it differs. `f16` expects exact
/// demotion (`demote_format = none`), `auto` lossy demotion with adaptive precision; `q8` and `q4`
/// recompress old pages themselves and expect nothing.
pub fn policy_mismatch(format: KvFormat, demote_format: &str, adaptive_precision: bool) -> Option<String> {
    let lossless = demote_format == "none";
    match format {
        KvFormat::F16 if !lossless => Some(format!(
            "--kv-format f16: pages kvmmd demotes leave the device as {demote_format}, not f16 (the sink page and \
             the last {RECENT_WINDOW_TOKENS} tokens excepted); run kvmmd with demote_format = \"none\" to keep \
             every page exact"
        )),
        KvFormat::Auto if lossless => Some(
            "--kv-format auto: kvmmd demotes exactly (demote_format = \"none\"), so pages stay f16 and adaptive \
             precision never applies"
                .to_owned(),
        ),
        KvFormat::Auto if !adaptive_precision => Some(format!(
            "--kv-format auto: kvmmd's adaptive precision is off, so pages it demotes all become {demote_format}"
        )),
        _ => None,
    }
}

/// The admin socket beside a session socket (kvmmd binds all three in one directory).
pub fn admin_socket_beside(session_socket: &Path) -> PathBuf {
    session_socket.with_file_name(kvmm_client::connect::ADMIN_SOCKET)
}

/// The part of kvmmd's admin API that `--kv-format` uses: reading the policy and `Compress`.
/// Only root and members of the daemon's `admin_group` may use it.
#[derive(Debug)]
pub struct Admin {
    /// Runs the RPCs (its runtime; the channel was made on it).
    client: Client,
    rpc: AdminClient<Channel>,
    socket: PathBuf,
}

impl Admin {
    /// Opens the admin socket at `socket`, on `client`'s runtime. Nothing is asked yet, so
    /// permission is only checked by the first call.
    pub fn connect(client: &Client, socket: &Path) -> Result<Admin, InferError> {
        let channel = client.block_on(kvmm_client::connect::channel(socket)).map_err(|e| setup(socket, e))?;
        Ok(Admin { client: client.clone(), rpc: AdminClient::new(channel), socket: socket.to_owned() })
    }

    /// The daemon's policy in force (`Status.policy`): its mode, `demote_format`,
    /// `adaptive_precision` and floors.
    pub fn policy(&mut self) -> Result<PolicyStatus, InferError> {
        let mut rpc = self.rpc.clone();
        let status = self
            .client
            .block_on(rpc.status(StatusRequest {}))
            .map_err(|s| setup(&self.socket, kvmm_client::Error::from(s)))?
            .into_inner();
        status.policy.ok_or_else(|| InferError::CacheSetup {
            what: format!("read kvmmd's policy from {}", self.socket.display()),
            source: "the status reply has no policy".into(),
        })
    }

    fn compress(&mut self, request: CompressRequest) -> Result<kvmm_client::proto::CompressResponse, InferError> {
        let mut rpc = self.rpc.clone();
        let socket = &self.socket;
        self.client.block_on(rpc.compress(request)).map(tonic::Response::into_inner).map_err(|s| {
            InferError::CacheSetup {
                what: format!("recompress old pages through {}", socket.display()),
                source: Box::new(kvmm_client::Error::from(s)),
            }
        })
    }
}

fn setup(socket: &Path, e: kvmm_client::Error) -> InferError {
    InferError::CacheSetup { what: format!("use kvmmd's admin API at {}", socket.display()), source: Box::new(e) }
}

/// What client-driven recompression has done so far, summed over its `Compress` calls.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RecompressionTotals {
    /// `Compress` calls made.
    pub calls: u32,
    /// Pages re-encoded.
    pub compressed: u32,
    /// Pages left as they were: already at or below the format, not on the device (demoted pages
    /// keep the daemon's format), pinned, not full, or not encodable.
    pub skipped: u32,
    /// Frame bytes of the re-encoded pages before and after.
    pub bytes_before: u64,
    pub bytes_after: u64,
}

/// Client-driven recompression of one session's old pages (`--kv-format q8|q4`): each
/// [`catch_up`](Recompression::catch_up) asks the daemon to re-encode the [`old_blocks`] it has not
/// asked for yet, in every layer, with one `Compress` call.
#[derive(Debug)]
pub struct Recompression {
    admin: Admin,
    format: PageFormat,
    /// The first block not yet asked for (block 0, the sink page, never is).
    next_block: u32,
    totals: RecompressionTotals,
}

impl Recompression {
    /// Recompression to `format` through `admin`; fails with [`InferError::InvalidArgument`] for a
    /// format the client does not recompress to (f16, auto).
    pub fn new(admin: Admin, format: KvFormat) -> Result<Recompression, InferError> {
        let Some(format) = format.recompress_to() else {
            return Err(InferError::InvalidArgument(format!(
                "--kv-format {} leaves page formats to the daemon; only q8 and q4 recompress",
                format.name()
            )));
        };
        Ok(Recompression { admin, format, next_block: 1, totals: RecompressionTotals::default() })
    }

    /// Asks for the old pages of `cache` not asked for yet; does nothing (no RPC) until a page has
    /// left the recent window since the last call. Returns the pages re-encoded by this call.
    pub fn catch_up(&mut self, cache: &KvmmKvCache) -> Result<u32, InferError> {
        let session = cache.session();
        let g = session.geometry();
        let tokens = (0..g.layers).map(|l| session.tokens(l)).min().unwrap_or(0);
        let blocks = old_blocks(tokens, g.block_tokens);
        let blocks = self.next_block.max(blocks.start)..blocks.end;
        if blocks.is_empty() {
            return Ok(0);
        }
        let r = self.admin.compress(CompressRequest {
            session_id: session.id(),
            first_layer: 0,
            layers: 0,
            first_block: blocks.start,
            blocks: blocks.end - blocks.start,
            format: self.format as i32,
            adaptive: false,
        })?;
        self.next_block = blocks.end;
        let t = &mut self.totals;
        t.calls += 1;
        t.compressed += r.compressed;
        t.skipped += r.skipped_pinned
            + r.skipped_not_full
            + r.skipped_already
            + r.skipped_invalid
            + r.skipped_floor
            + r.skipped_window;
        t.bytes_before += r.bytes_before;
        t.bytes_after += r.bytes_after;
        Ok(r.compressed)
    }

    /// What the calls so far did.
    pub fn totals(&self) -> RecompressionTotals {
        self.totals
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn old_blocks_spare_the_sink_page_and_the_last_128_tokens() {
        // 32-token pages: until 192 tokens, only block 0 and the window's pages exist.
        assert!(old_blocks(0, 32).is_empty());
        assert!(old_blocks(191, 32).is_empty());
        // Block 1 holds tokens 32..64; it leaves the window once 64 + 128 tokens are written.
        assert_eq!(old_blocks(192, 32), 1..2);
        assert_eq!(old_blocks(223, 32), 1..2);
        assert_eq!(old_blocks(224, 32), 1..3);
        assert_eq!(old_blocks(1000, 32), 1..27);
        // 256-token pages: the window lies inside one or two pages.
        assert!(old_blocks(383, 256).is_empty());
        assert_eq!(old_blocks(640, 256), 1..2);
    }

    #[test]
    fn old_blocks_agree_with_the_daemons_rule_for_every_page() {
        // kvmmd's `keeps_precision`: block 0, or a page with a token in the last 128.
        let keeps = |b: u32, bt: u32, tokens: u32| b == 0 || (b + 1) * bt + RECENT_WINDOW_TOKENS > tokens;
        for bt in [8, 16, 32, 64, 128, 256] {
            for tokens in 0..1200 {
                let old = old_blocks(tokens, bt);
                for b in 0..tokens.div_ceil(bt) {
                    assert_eq!(old.contains(&b), !keeps(b, bt, tokens), "block {b}, {bt}-token pages, {tokens} tokens");
                }
            }
        }
    }

    #[test]
    fn the_daemons_policy_is_checked_against_what_the_format_leaves_to_it() {
        use KvFormat::*;
        let cases = [
            (F16, "none", true, None),
            (F16, "q8", true, Some("leave the device as q8, not f16")),
            (Auto, "q8", true, None),
            (Auto, "q4", false, Some("adaptive precision is off, so pages it demotes all become q4")),
            (Auto, "none", true, Some("adaptive precision never applies")),
            (Q8, "q4", false, None),
            (Q4, "none", true, None),
        ];
        for (format, demote, adaptive, want) in cases {
            let got = policy_mismatch(format, demote, adaptive);
            match want {
                None => assert_eq!(got, None, "{format:?} under {demote}, adaptive {adaptive}"),
                Some(part) => assert!(got.as_deref().is_some_and(|m| m.contains(part)), "{format:?}: {got:?}"),
            }
        }
    }

    #[test]
    fn kv_formats_parse_and_only_q8_and_q4_recompress() {
        let parsed: Vec<KvFormat> = ["f16", "q8", "q4", "auto"].iter().map(|s| s.parse().unwrap()).collect();
        assert_eq!(parsed, [KvFormat::F16, KvFormat::Q8, KvFormat::Q4, KvFormat::Auto]);
        assert!(parsed.iter().all(|f| f.name().parse::<KvFormat>() == Ok(*f)));
        assert_eq!(parsed.iter().filter_map(|f| f.recompress_to()).count(), 2);
        assert!("q2".parse::<KvFormat>().unwrap_err().contains("use f16, q8, q4 or auto"));
    }
}
