//! Real models with their KV cache in kvmm: `kvmm-infer`'s forward pass over `KvmmKvCache`, against
//! a real kvmmd.
//!
//! - A padded session (stories260K's 8-channel heads stored as 16) attends like the in-process
//!   cache: to f32 rounding over the same f16-rounded rows, to f16 rounding over the raw rows.
//! - stories260K greedy from BOS through kvmm (f16 pages) reproduces llama2.c's 256 golden ids, also
//!   when every few steps the session's full pages are forced down to DRAM or flash (lossless
//!   ladder, `--demote-format none`) and attention faults them back; and when a first process runs
//!   the first 100 positions into a lingering session and exits without detaching, a second
//!   process finds the session by its model id, resumes it and carries on to the same 256 ids.
//! - `kvmm-generate --kv kvmm` prints the golden story; with `--kv-format q8` it has the daemon
//!   recompress the pages outside the sink page and the recent window, and reads them as q8.
//!   Without the admin API (uid 65534) q8 is refused with a sentence saying why; f16 runs.
//! - SmolLM2 asked "What is the capital of France?" through its chat template answers Paris
//!   (skipped with a message when the model has not been fetched).
//!
//! These live here rather than in `infer/tests` because they need the kvmmd binary and the
//! harness that runs it; `cargo test --workspace` builds both.

#![allow(clippy::unwrap_used)]

use std::process::Command;
use std::time::Duration;

use kvmm_infer::generate::Stop;
use kvmm_infer::model::gguf;
use kvmm_infer::tokenizer::BOS;
use kvmm_infer::{
    Forward, KvCache, KvmmCacheOptions, KvmmKvCache, LocalKvCache, ModelConfig, Tokenizer, argmax, generate_greedy,
};
use kvmm_proto::v1::Tier;
use kvmm_tests::{Daemon, models, workspace_bin};

/// `<|im_end|>`, SmolLM2's EOS.
const IM_END: u32 = 2;

fn attach(daemon: &Daemon, config: &ModelConfig, max_tokens: usize) -> KvmmKvCache {
    KvmmKvCache::connect(&daemon.socket(), config, max_tokens, KvmmCacheOptions::default()).unwrap()
}

fn shape(heads: usize, kv_heads: usize, head_dim: usize, layers: usize) -> ModelConfig {
    ModelConfig {
        dim: heads * head_dim,
        hidden_dim: 4,
        layers,
        heads,
        kv_heads,
        head_dim,
        vocab_size: 4,
        seq_len: 512,
        rope_theta: 10000.0,
        norm_eps: 1e-5,
    }
}

/// Uniform in [-2, 2), from a xorshift state.
fn uniform(state: &mut u64) -> f32 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    ((*state >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
}

fn f16_rounded(x: &[f32]) -> Vec<f32> {
    x.iter().map(|&v| half::f16::from_f32(v).to_f32()).collect()
}

/// Appends the same random rows to a kvmm cache, a local cache of the f16-rounded rows and a
/// local cache of the raw rows, and compares attention after every token of every layer; returns
/// the largest differences (to the rounded-rows reference, to the raw-rows reference).
fn compare_with_local(daemon: &Daemon, config: &ModelConfig, tokens: usize, seed: u64) -> (f32, f32) {
    let mut kvmm = attach(daemon, config, tokens);
    let mut rounded = LocalKvCache::new(config, tokens).unwrap();
    let mut raw = LocalKvCache::new(config, tokens).unwrap();
    let mut state = seed | 1;
    let (mut worst_rounded, mut worst_raw) = (0f32, 0f32);
    let (mut ours, mut want_rounded, mut want_raw) =
        (vec![0f32; config.q_dim()], vec![0f32; config.q_dim()], vec![0f32; config.q_dim()]);
    for _ in 0..tokens {
        for layer in 0..config.layers {
            let k: Vec<f32> = (0..config.kv_dim()).map(|_| uniform(&mut state)).collect();
            let v: Vec<f32> = (0..config.kv_dim()).map(|_| uniform(&mut state)).collect();
            let q: Vec<f32> = (0..config.q_dim()).map(|_| uniform(&mut state)).collect();
            kvmm.append(layer, &k, &v).unwrap();
            rounded.append(layer, &f16_rounded(&k), &f16_rounded(&v)).unwrap();
            raw.append(layer, &k, &v).unwrap();
            kvmm.attention(layer, &q, &mut ours).unwrap();
            rounded.attention(layer, &q, &mut want_rounded).unwrap();
            raw.attention(layer, &q, &mut want_raw).unwrap();
            for ((a, b), c) in ours.iter().zip(&want_rounded).zip(&want_raw) {
                worst_rounded = worst_rounded.max((a - b).abs());
                worst_raw = worst_raw.max((a - c).abs());
            }
        }
    }
    assert_eq!((kvmm.tokens(0), kvmm.tokens(config.layers - 1)), (tokens, tokens));
    (worst_rounded, worst_raw)
}

#[test]
fn a_padded_session_attends_like_the_local_cache() {
    let daemon = Daemon::start(&[]);
    // stories260K's shape (8 channels padded to 16), a head padded from 24 to 32 channels, and
    // SmolLM2's shape, which needs no padding. 100 tokens: three full pages and a partial one.
    for (config, seed) in [(shape(8, 4, 8, 5), 1), (shape(4, 2, 24, 2), 2), (shape(9, 3, 64, 2), 3)] {
        let padded = attach(&daemon, &config, 8).padded_head_dim();
        let (rounded, raw) = compare_with_local(&daemon, &config, 100, seed);
        println!(
            "head_dim {} as {padded}: worst |Δ| {rounded:e} over f16-rounded rows, {raw:e} over raw rows",
            config.head_dim
        );
        assert_eq!(padded, config.head_dim.next_multiple_of(16));
        // Values lie in [-2, 2): f32 rounding of the same arithmetic in another order...
        assert!(rounded <= 2e-5, "head_dim {}: {rounded} from the local cache over the same f16 rows", config.head_dim);
        // ... and within f16 rounding of the rows (2^-11 relative, 2^-10 absolute at 2).
        assert!(raw <= 4e-3, "head_dim {}: {raw} from the local cache over f32 rows", config.head_dim);
    }
}

#[test]
fn stories260k_greedy_through_kvmm_reproduces_run_c() {
    let daemon = Daemon::start(&[]);
    let model = models::stories260k();
    let mut cache = attach(&daemon, model.config(), 256);
    assert_eq!((cache.head_dim(), cache.padded_head_dim()), (8, 16));
    let generation = generate_greedy(&model, &mut cache, &[BOS], 256, &[BOS]).unwrap();

    let golden = models::golden_ids();
    let first_diff = generation.generated.iter().zip(&golden).position(|(a, b)| a != b);
    assert_eq!(first_diff, None, "generation through kvmm diverges from the golden ids at step {first_diff:?}");
    assert_eq!(generation.generated, golden);
    assert_eq!(generation.stop, Stop::Steps);
    let stats = cache.stats().unwrap();
    assert_eq!(stats.tokens, 256);
    assert_eq!(stats.pages, [5 * 8, 0, 0], "5 layers × 8 pages of 32 tokens, all on the device");
    assert!(cache.session().last_formats().iter().all(|f| *f == Some(kvmm_kernels::Format::F16)));
}

/// Greedy from BOS for `steps` positions through `cache`, calling `between(pos, cache)` after each
/// forward pass; returns the generated ids.
fn greedy_with(
    model: &kvmm_infer::Model,
    cache: &mut KvmmKvCache,
    steps: usize,
    mut between: impl FnMut(usize, &KvmmKvCache),
) -> Vec<u32> {
    let mut forward = Forward::new(model);
    let mut generated = Vec::with_capacity(steps);
    let mut token = BOS;
    for pos in 0..steps {
        token = argmax(forward.step(model, cache, token, pos).unwrap());
        generated.push(token);
        between(pos, cache);
    }
    generated
}

#[test]
fn stories260k_greedy_stays_exact_while_its_pages_go_to_flash_and_back() {
    let flash = tempfile::tempdir().unwrap();
    let daemon = Daemon::start_tiered("64MiB", flash.path(), &["--demote-format", "none"]);
    let model = models::stories260k();
    let mut cache = attach(&daemon, model.config(), 256);
    let session = cache.session().id();
    let mut demoted = [0u32; 2];
    // Every 20 positions (never on a page boundary twice in a row) the full pages of every layer
    // leave the device, alternately for flash and for DRAM; the next attention faults them back.
    let generated = greedy_with(&model, &mut cache, 256, |pos, _| {
        if pos % 20 == 19 {
            let (tier, i) = if (pos / 20) % 2 == 0 { (Tier::Flash, 1) } else { (Tier::Dram, 0) };
            demoted[i] += daemon.demote(session, tier).demoted;
        }
    });

    assert_eq!(generated, models::golden_ids(), "the lossless ladder changed the generation");
    let stats = cache.stats().unwrap();
    println!("demoted {demoted:?} (dram, flash); {stats:?}");
    assert!(demoted[0] > 0 && demoted[1] > 0, "pages went to DRAM and to flash: {demoted:?}");
    assert!(stats.faults > 0, "attention faulted the pages back: {stats:?}");
    assert_eq!(stats.promoted_from_flash, u64::from(demoted[1]), "every page sent to flash came back: {stats:?}");
    assert_eq!(stats.promoted_from_dram, u64::from(demoted[0]), "every page sent to DRAM came back: {stats:?}");
    let s = daemon.status();
    assert_eq!((s.demoted_to_flash, s.promoted_from_flash), (u64::from(demoted[1]), u64::from(demoted[1])), "{s:?}");
    let flash_tier = s.tiers.iter().find(|t| t.tier == "flash").unwrap();
    assert!(flash_tier.pages_in > 0 && flash_tier.pages_in == flash_tier.pages_out, "{flash_tier:?}");
    assert!(cache.session().last_formats().iter().all(|f| *f == Some(kvmm_kernels::Format::F16)), "lossless");
}

/// Set in the environment of the first process of
/// [`stories260k_generation_carries_on_in_a_process_that_resumes_the_session`] (this test binary run
/// again for that test alone): the session socket.
const FIRST_PROCESS: &str = "KVMM_TEST_FIRST_PROCESS_SOCKET";

#[test]
fn stories260k_generation_carries_on_in_a_process_that_resumes_the_session() {
    let model = models::stories260k();
    if let Ok(socket) = std::env::var(FIRST_PROCESS) {
        // The first process: 100 positions from BOS into a session that lingers, then gone
        // without detaching (no destructor runs), as a crash would leave it.
        let options = KvmmCacheOptions {
            linger: Duration::from_secs(60),
            model_id: "stories260K".to_owned(),
            ..KvmmCacheOptions::default()
        };
        let mut cache = KvmmKvCache::connect(socket.as_ref(), model.config(), 256, options).unwrap();
        let generated = greedy_with(&model, &mut cache, 100, |_, _| {});
        let ids: Vec<String> = generated.iter().map(u32::to_string).collect();
        println!("first-process session={} generated={}", cache.session().id(), ids.join(","));
        std::process::exit(0);
    }
    let daemon = Daemon::start(&[]);
    let first = Command::new(std::env::current_exe().unwrap())
        .args(["stories260k_generation_carries_on_in_a_process_that_resumes_the_session", "--exact", "--nocapture"])
        .env(FIRST_PROCESS, daemon.socket())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&first.stdout);
    assert!(first.status.success(), "{stdout}{}", String::from_utf8_lossy(&first.stderr));
    let line = stdout.lines().find_map(|l| l.strip_prefix("first-process ")).unwrap_or_else(|| panic!("{stdout}"));
    let fields: std::collections::HashMap<&str, &str> = line.split(' ').filter_map(|f| f.split_once('=')).collect();
    let session: u64 = fields["session"].parse().unwrap();
    let mut generated: Vec<u32> = fields["generated"].split(',').map(|t| t.parse().unwrap()).collect();
    daemon.wait_status(Duration::from_secs(10), |s| s.orphaned_sessions == 1);

    // This process takes the session over: its 100 positions are there, and greedy decoding
    // carries on from the last generated id (chosen, not yet fed) to llama2.c's golden 256.
    let client = kvmm_client::Client::connect(daemon.socket()).unwrap();
    // A model of another shape cannot take it over, and leaves it for one that can.
    let refused = KvmmKvCache::resume(&client, &shape(4, 2, 16, 3), session).unwrap_err();
    let other = format!("{refused}: {}", std::error::Error::source(&refused).unwrap());
    println!("{other}");
    assert!(other.contains("attached for another model") && other.contains("left as it was"), "{other}");
    assert_eq!(daemon.status().orphaned_sessions, 1);
    // A process that kept no id finds the session by its model: not under another model id, not
    // for a model of another shape.
    assert!(KvmmKvCache::resume_newest(&client, model.config(), "another model").unwrap().is_none());
    assert!(KvmmKvCache::resume_newest(&client, &shape(4, 2, 16, 3), "stories260K").unwrap().is_none());
    assert_eq!(daemon.status().orphaned_sessions, 1);
    let mut cache = KvmmKvCache::resume_newest(&client, model.config(), "stories260K").unwrap().unwrap();
    assert_eq!(cache.session().id(), session);
    assert_eq!((0..5).map(|l| cache.tokens(l)).collect::<Vec<_>>(), [100; 5]);
    let mut forward = Forward::new(&model);
    let mut token = *generated.last().unwrap();
    for pos in 100..256 {
        token = argmax(forward.step(&model, &mut cache, token, pos).unwrap());
        generated.push(token);
    }
    let golden = models::golden_ids();
    let first_diff = generated.iter().zip(&golden).position(|(a, b)| a != b);
    assert_eq!(first_diff, None, "the resumed generation diverges from the golden ids at step {first_diff:?}");
    assert_eq!(generated, golden);
    assert_eq!(cache.stats().unwrap().tokens, 256);

    drop(cache);
    assert!(daemon.stop().success());
}

/// Runs `kvmm-generate` on stories260K from BOS against `daemon` with `extra` flags; returns
/// (stdout, stderr).
fn kvmm_generate(daemon: &Daemon, extra: &[&str]) -> (Vec<u8>, String) {
    let out = Command::new(workspace_bin("kvmm-generate"))
        .arg("--model")
        .arg(models::stories260k_bin())
        .arg("--tokenizer")
        .arg(models::stories260k_tokenizer_bin())
        .arg("--kv")
        .arg("kvmm")
        .arg("--socket")
        .arg(daemon.socket())
        .args(extra)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "kvmm-generate failed: {stderr}");
    (out.stdout, stderr)
}

#[test]
fn kvmm_generate_through_kvmm_prints_run_c_s_story() {
    let daemon = Daemon::start(&[]);
    let (stdout, stderr) = kvmm_generate(&daemon, &["--max-tokens", "256"]);
    let mut want = models::golden_text();
    want.push(b'\n');
    assert_eq!(String::from_utf8_lossy(&stdout), String::from_utf8_lossy(&want));
    println!("{stderr}");
    assert!(stderr.contains("stopped by --max-tokens 256"), "{stderr}");
    assert!(stderr.contains("head_dim 8 as 16"), "{stderr}");
    assert!(stderr.contains("the last attention (layer 4) read f16 8"), "{stderr}");
}

#[test]
fn kvmm_generate_with_kv_format_q8_has_the_old_pages_recompressed() {
    let daemon = Daemon::start(&[]);
    let (stdout, stderr) = kvmm_generate(&daemon, &["--max-tokens", "256", "--kv-format", "q8"]);
    println!("{stderr}");
    // The last attention reads 255 tokens: blocks 1 and 2 are full and older than the last 128
    // tokens (the sink page and blocks 3..=7 keep f16). The 256th token's pass then makes block 3 q8
    // too: 3 × 5 layers in all.
    assert!(stderr.contains("the last attention (layer 4) read f16 6, q8 2"), "{stderr}");
    assert!(stderr.contains("recompressed 15 pages in 3 calls"), "{stderr}");
    assert!(stderr.contains(" bytes, 0 skipped)"), "{stderr}");
    assert!(!stdout.is_empty());
}

#[test]
fn kv_format_q8_needs_the_admin_api_and_says_so_while_f16_runs_without_it() {
    if !kvmm_tests::can_run_as_nobody() {
        return;
    }
    let daemon = Daemon::start(&[]);
    // The model where uid 65534 can read it, whatever the checkout's permissions.
    let (model, tokenizer) = (daemon.dir().join("stories260K.bin"), daemon.dir().join("tok512.bin"));
    std::fs::copy(models::stories260k_bin(), &model).unwrap();
    std::fs::copy(models::stories260k_tokenizer_bin(), &tokenizer).unwrap();
    let run = |format: &str| {
        kvmm_tests::as_nobody(&workspace_bin("kvmm-generate"), None)
            .arg("--model")
            .arg(&model)
            .arg("--tokenizer")
            .arg(&tokenizer)
            .args(["--kv", "kvmm", "--max-tokens", "8", "--kv-format", format, "--socket"])
            .arg(daemon.socket())
            .output()
            .unwrap()
    };
    let refused = run("q8");
    let stderr = String::from_utf8_lossy(&refused.stderr);
    println!("{stderr}");
    assert!(!refused.status.success());
    assert!(stderr.contains("--kv-format q8 recompresses old pages through kvmmd's admin API"), "{stderr}");
    assert!(stderr.contains("use --kv-format f16 or auto"), "{stderr}");
    assert!(stderr.contains("ermission denied"), "the cause is named: {stderr}");

    let ran = run("f16");
    let stderr = String::from_utf8_lossy(&ran.stderr);
    assert!(ran.status.success(), "{stderr}");
    assert!(stderr.contains("kv: kvmm session"), "{stderr}");
    assert!(!stderr.contains("kvmmd demotes"), "no policy line without the admin API: {stderr}");
}

#[test]
fn smollm2_through_kvmm_answers_that_the_capital_of_france_is_paris() {
    let Some(path) = models::smollm2_gguf() else { return };
    let daemon = Daemon::start(&[]);
    let (model, tokenizer) = gguf::load(&path).unwrap();
    let tokenizer = Tokenizer::from(tokenizer);
    let prompt = tokenizer.chat_prompt("What is the capital of France?").unwrap();
    let steps = prompt.len() + 16;
    let mut cache = attach(&daemon, model.config(), steps);
    assert_eq!(cache.padded_head_dim(), 64, "SmolLM2's heads need no padding");
    let generation = generate_greedy(&model, &mut cache, &prompt, steps, tokenizer.stop_tokens()).unwrap();
    let answer = String::from_utf8(tokenizer.decode(prompt[prompt.len() - 1], &generation.generated).unwrap()).unwrap();
    println!("SmolLM2 through kvmm answered: {answer:?}");
    assert!(answer.contains("Paris"), "the answer does not name Paris: {answer:?}");
    assert_eq!(generation.stop, Stop::Token(IM_END), "the answer ran on: {answer:?}");
    assert_eq!(cache.stats().unwrap().tokens, generation.fed.len() as u64);
}
