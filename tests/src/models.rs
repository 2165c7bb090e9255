//! The real models the inference scenarios run, found where CI puts them.
//!
//! stories260K lives in the `shared/` directory beside the repository
//! (`CARGO_MANIFEST_DIR/../../shared/models/stories260K`); a missing directory fails the test with
//! the path it looked in. SmolLM2's GGUF lives in the model cache that
//! `shared/scripts/fetch-smollm2.sh` fills (`$KVMM_MODEL_CACHE`, else `~/.cache/kvmm/models`); when
//! it is missing, [`smollm2_gguf`] prints how to fetch it and the test passes without it. The same
//! rules as `infer/tests/common`, which `kvmm-infer`'s own tests use.

use std::path::{Path, PathBuf};

use kvmm_infer::{Llama2cTokenizer, Model, model::llama2c};

/// The stories260K directory, or a panic naming where it was looked for.
pub fn stories260k_dir() -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/models/stories260K");
    assert!(
        dir.is_dir(),
        "the stories260K model directory is missing: looked for {} (shared/models/stories260K beside the \
         repository checkout)",
        dir.display()
    );
    dir
}

/// stories260K's checkpoint.
pub fn stories260k_bin() -> PathBuf {
    stories260k_dir().join("stories260K.bin")
}

/// stories260K's tokenizer file.
pub fn stories260k_tokenizer_bin() -> PathBuf {
    stories260k_dir().join("tok512.bin")
}

/// stories260K, loaded.
pub fn stories260k() -> Model {
    llama2c::load(&stories260k_bin()).unwrap_or_else(|e| panic!("{e}"))
}

/// stories260K's tokenizer, loaded.
pub fn stories260k_tokenizer(model: &Model) -> Llama2cTokenizer {
    Llama2cTokenizer::load(&stories260k_tokenizer_bin(), model.config().vocab_size).unwrap_or_else(|e| panic!("{e}"))
}

/// The 256 token ids llama2.c `run.c` generates greedily from BOS with stories260K.
pub fn golden_ids() -> Vec<u32> {
    let path = stories260k_dir().join("golden_greedy_bos_256.ids.txt");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("could not read {}: {e}", path.display()));
    text.split_whitespace()
        .map(|w| w.parse().unwrap_or_else(|e| panic!("{} holds {w:?}, not a token id: {e}", path.display())))
        .collect()
}

/// The text `run.c` printed for [`golden_ids`] (without the newline it prints after the loop).
pub fn golden_text() -> Vec<u8> {
    let path = stories260k_dir().join("golden_greedy_bos_256.txt");
    std::fs::read(&path).unwrap_or_else(|e| panic!("could not read {}: {e}", path.display()))
}

/// SmolLM2-135M-Instruct's GGUF in the model cache, or `None` after printing how to fetch it.
pub fn smollm2_gguf() -> Option<PathBuf> {
    kvmm_infer::model::smollm2_in_cache().map_err(|why| println!("skipped: {why}")).ok()
}
