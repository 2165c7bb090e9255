//! `kvmm-dump-kv` over a GGUF model: the tokenizer comes from the file, the text is encoded as a
//! SmolLM2 document (no BOS), and the fixture holds SmolLM2's shape and exactly the trace the
//! library records in process. Skipped (with a message) when the model has not been fetched.

#![allow(clippy::unwrap_used)]

mod common;

use std::path::Path;
use std::process::Command;

use kvmm_infer::model::gguf;
use kvmm_infer::{Tokenizer, fixture, trace_tokens};

fn dump_tool(model: &Path, extra: &[&str], out: &Path) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_kvmm-dump-kv"))
        .arg("--model")
        .arg(model)
        .args(extra)
        .arg("--out")
        .arg(out)
        .output()
        .unwrap()
}

#[test]
fn a_gguf_model_dumps_a_text_with_its_own_tokenizer() {
    let Some(path) = common::smollm2_gguf() else { return };
    let dir = tempfile::tempdir().unwrap();
    let text_path = dir.path().join("preamble.txt");
    let text = "We the People of the United States, in Order to form";
    std::fs::write(&text_path, text).unwrap();
    let out = dir.path().join("smollm2.kvfx");
    let run = dump_tool(&path, &["--text", text_path.to_str().unwrap(), "--max-tokens", "6"], &out);
    assert!(run.status.success(), "kvmm-dump-kv failed: {}", String::from_utf8_lossy(&run.stderr));

    let (model, tokenizer) = gguf::load(&path).unwrap();
    let tokenizer = Tokenizer::from(tokenizer);
    let tokens = tokenizer.encode_document(text);
    assert_ne!(tokens[0], tokenizer.bos(), "SmolLM2 documents start without BOS");
    let trace = fixture::read(&out).unwrap();
    assert_eq!(trace.config, *model.config());
    assert_eq!(trace.tokens, tokens[..6]);
    assert_eq!(trace.layers.len(), 30);
    assert_eq!(trace.layers[29].q.len(), 6 * 9 * 64);
    assert_eq!(trace, trace_tokens(&model, &tokens[..6]).unwrap());
}

#[test]
fn a_gguf_model_refuses_a_separate_tokenizer() {
    let Some(path) = common::smollm2_gguf() else { return };
    let dir = tempfile::tempdir().unwrap();
    let run = dump_tool(&path, &["--tokenizer", "tok512.bin", "--bos-steps", "2"], &dir.path().join("x.kvfx"));
    assert!(!run.status.success());
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(stderr.contains("carries its own tokenizer"), "{stderr}");
}
