//! Shared paths and loaders for the integration tests.
//!
//! stories260K's files live in the `shared/` directory beside the repository
//! (`CARGO_MANIFEST_DIR/../../shared/models/stories260K`); a missing directory fails the test with
//! the path it looked in. SmolLM2's GGUF lives in the model cache that
//! `shared/scripts/fetch-smollm2.sh` fills (`$KVMM_MODEL_CACHE`, else `~/.cache/kvmm/models`); when
//! it is missing, the SmolLM2 tests print how to fetch it and pass.

#![allow(dead_code, reason = "each test binary uses a different subset")]

use std::path::{Path, PathBuf};

use kvmm_infer::{Llama2cTokenizer, Model, model::llama2c};

/// The stories260K directory, or a panic naming where it was looked for.
pub fn models_dir() -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/models/stories260K");
    assert!(
        dir.is_dir(),
        "the stories260K model directory is missing: looked for {} (shared/models/stories260K beside the \
         repository checkout)",
        dir.display()
    );
    dir
}

pub fn model() -> Model {
    let path = models_dir().join("stories260K.bin");
    llama2c::load(&path).unwrap_or_else(|e| panic!("{e}"))
}

pub fn tokenizer(model: &Model) -> Llama2cTokenizer {
    let path = models_dir().join("tok512.bin");
    Llama2cTokenizer::load(&path, model.config().vocab_size).unwrap_or_else(|e| panic!("{e}"))
}

/// The 256 token ids llama2.c `run.c` generates greedily from BOS.
pub fn golden_ids() -> Vec<u32> {
    let path = models_dir().join("golden_greedy_bos_256.ids.txt");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("could not read {}: {e}", path.display()));
    text.split_whitespace()
        .map(|w| w.parse().unwrap_or_else(|e| panic!("{} holds {w:?}, not a token id: {e}", path.display())))
        .collect()
}

/// The text `run.c` printed for [`golden_ids`].
pub fn golden_text() -> Vec<u8> {
    let path = models_dir().join("golden_greedy_bos_256.txt");
    std::fs::read(&path).unwrap_or_else(|e| panic!("could not read {}: {e}", path.display()))
}

/// The committed fixture.
pub fn fixture_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/stories260k_bos_256.kvfx")
}

/// SmolLM2-135M-Instruct's GGUF in the model cache, or `None` after printing how to fetch it.
pub fn smollm2_gguf() -> Option<PathBuf> {
    kvmm_infer::model::smollm2_in_cache().map_err(|why| println!("skipped: {why}")).ok()
}

/// The evaluation text shipped in `infer/texts/`.
pub fn evaluation_text() -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("texts/us-constitution.txt");
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("could not read {}: {e}", path.display()))
}
