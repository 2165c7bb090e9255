//! Wrong arguments give the right `KernelError`, with a message a person can act on.

mod common;

use common::{Fill, Paged};
use kvmm_kernels::{
    AttnShape, DecodeAttention, Format, Isa, KernelError, KernelErrorKind, PageShape, PageView, decode_attention,
    init_page, quantize, reference_attention_f32, write_rows,
};

const SMOL: AttnShape = AttnShape { q_heads: 9, kv_heads: 3, head_dim: 64, block_tokens: 32 };

fn page_bytes() -> usize {
    SMOL.page_shape().page_bytes(Format::F16)
}

/// An initialized, empty f16 page of the SmolLM2 shape.
fn f16_page() -> Vec<u8> {
    let mut page = vec![0u8; page_bytes()];
    init_page(SMOL.page_shape(), Format::F16, &mut page).expect("valid shape");
    page
}

#[test]
fn query_of_the_wrong_length_says_what_the_geometry_needs() {
    let err = DecodeAttention::new(SMOL, &[0.0; 575], 0.125).unwrap_err();
    assert_eq!(err, KernelError::QueryLength { got: 575, q_heads: 9, head_dim: 64 });
    assert_eq!(err.to_string(), "query has 575 floats but this geometry needs q_heads × head_dim = 9 × 64 = 576");
    assert_eq!(err.kind(), KernelErrorKind::BadLength);
}

#[test]
fn q_heads_not_a_multiple_of_kv_heads_is_an_invalid_shape() {
    let shape = AttnShape { q_heads: 10, ..SMOL };
    let err = DecodeAttention::new(shape, &[0.0; 640], 1.0).unwrap_err();
    assert_eq!(err, KernelError::GroupMismatch { q_heads: 10, kv_heads: 3 });
    assert_eq!(err.kind(), KernelErrorKind::InvalidShape);
}

#[test]
fn head_dim_and_block_tokens_outside_the_rules_are_refused() {
    let err = AttnShape { head_dim: 24, ..SMOL }.validate().unwrap_err();
    assert_eq!(err.to_string(), "head_dim is 24, but it must be a multiple of 16 in 16..=256");
    let err = AttnShape { block_tokens: 48, ..SMOL }.validate().unwrap_err();
    assert_eq!(err.to_string(), "block_tokens is 48, but it must be a power of two in 8..=256");
    let err = AttnShape { block_tokens: 4, ..SMOL }.validate().unwrap_err();
    assert_eq!(err.kind(), KernelErrorKind::InvalidShape);
}

#[test]
fn page_shorter_than_its_shape_is_refused_without_changing_state() {
    let mut attention = DecodeAttention::new(SMOL, &[0.0; 576], 0.125).unwrap();
    let short = &f16_page()[..page_bytes() - 2];
    let err = attention.page(PageView { bytes: short, format: Format::F16, tokens: 1 }).unwrap_err();
    assert_eq!(
        err.to_string(),
        "page has 25406 bytes but a f16 page of kv_heads = 3, head_dim = 64, block_tokens = 32 \
         needs 25408"
    );
    assert_eq!(attention.pages(), 0);
}

#[test]
fn page_token_count_outside_one_to_block_tokens_is_out_of_range() {
    let page = f16_page();
    let mut attention = DecodeAttention::new(SMOL, &[0.0; 576], 0.125).unwrap();
    for tokens in [0, 33] {
        let err = attention.page(PageView { bytes: &page, format: Format::F16, tokens }).unwrap_err();
        assert_eq!(err, KernelError::PageTokens { page: 0, tokens, block_tokens: 32 });
        assert_eq!(err.kind(), KernelErrorKind::OutOfRange);
    }
}

#[test]
fn output_and_mass_buffers_must_match_heads_and_pages() {
    let page = f16_page();
    let view = PageView { bytes: &page, format: Format::F16, tokens: 32 };
    let q = vec![0.1; 576];
    let mut out = vec![0.0; 576];
    let mut mass = vec![0.0; 2];

    let err = decode_attention(SMOL, &q, 0.125, &[view], &mut out[..575], &mut mass[..1]).unwrap_err();
    assert_eq!(err, KernelError::OutputLength { got: 575, q_heads: 9, head_dim: 64 });

    let err = decode_attention(SMOL, &q, 0.125, &[view], &mut out, &mut mass).unwrap_err();
    assert_eq!(err, KernelError::MassLength { got: 2, need: 1, per: "page" });
    assert_eq!(err.to_string(), "mass has 2 slots but needs one per page, 1 in all");

    let attention = DecodeAttention::new(SMOL, &q, 0.125).unwrap();
    assert_eq!(attention.finish(&mut out, &mut []).unwrap_err(), KernelError::NoPages);
}

#[test]
fn unavailable_isa_is_refused() {
    let missing = Isa::ALL.into_iter().find(|isa| !isa.is_available());
    if let Some(isa) = missing {
        let err = DecodeAttention::with_isa(isa, SMOL, &[0.0; 576], 1.0).unwrap_err();
        assert_eq!(err.kind(), KernelErrorKind::Unsupported);
    }
}

#[test]
fn rows_that_are_not_whole_tokens_or_disagree_are_refused() {
    let shape = PageShape { kv_heads: 2, head_dim: 4, block_tokens: 8 };
    let mut page = vec![0u8; shape.page_bytes(Format::F16)];
    init_page(shape, Format::F16, &mut page).unwrap();
    let err = write_rows(shape, Format::F16, &mut page, 0, &[0.0; 7], &[0.0; 7]).unwrap_err();
    assert_eq!(
        err.to_string(),
        "keys hold 7 elements, which is not a whole number of tokens of kv_heads × head_dim = \
         2 × 4 = 8 elements each"
    );
    let err = write_rows(shape, Format::F16, &mut page, 0, &[0.0; 8], &[0.0; 16]).unwrap_err();
    assert_eq!(err, KernelError::KeyValueMismatch { k_len: 8, v_len: 16 });
    let err = write_rows(shape, Format::F16, &mut page[..10], 0, &[0.0; 8], &[0.0; 8]).unwrap_err();
    assert_eq!(err.kind(), KernelErrorKind::BadLength);
}

#[test]
fn unknown_format_code_is_unsupported() {
    let err = Format::try_from(6).unwrap_err();
    assert_eq!(err.to_string(), "page format code 6 is not implemented by this build of kvmm-kernels");
    assert_eq!(err.kind(), KernelErrorKind::Unsupported);
}

#[test]
fn reference_checks_its_lengths_too() {
    let mut out = vec![0.0; 32];
    let err = reference_attention_f32(2, 1, 16, &[0.0; 32], &[0.0; 17], &[0.0; 17], 1.0, &mut out).unwrap_err();
    assert_eq!(err.kind(), KernelErrorKind::BadLength);
}

/// Feeds `page` as `format` with `tokens` filled and returns the error.
fn refused(page: &[u8], format: Format, tokens: usize) -> KernelError {
    let mut attention = DecodeAttention::new(SMOL, &[0.1; 576], 0.125).expect("valid query");
    let err = attention.page(PageView { bytes: page, format, tokens }).expect_err("the page must be refused");
    assert_eq!(attention.pages(), 0, "a refused page changes nothing");
    err
}

#[test]
fn page_never_initialized_is_refused_with_what_to_do() {
    let err = refused(&vec![0u8; page_bytes()], Format::F16, 4);
    assert_eq!(err, KernelError::HeaderUninitialized);
    assert!(err.to_string().contains("call init_page on every new frame"), "{err}");
    assert_eq!(err.kind(), KernelErrorKind::BadPage);
}

#[test]
fn page_of_another_format_is_refused_by_its_format_byte() {
    let paged = Paged::random(SMOL, Format::Q8, 32, 1, Fill::Zero);
    let page = &paged.pages[0];
    let err = refused(page, Format::Q4, 32);
    assert_eq!(err.to_string().split(';').next(), Some("page format byte is 3, expected 4 (q4)"));
    let mut seven = page.clone();
    seven[0] = 7;
    let err = refused(&seven, Format::Q8, 32);
    assert_eq!(err.to_string().split(';').next(), Some("page format byte is 7, expected 3 (q8)"));
    // A q8 page is shorter than an f16 one: read as f16 it is refused for its length first.
    assert_eq!(refused(page, Format::F16, 32).kind(), KernelErrorKind::BadLength);
}

#[test]
fn page_with_a_wrong_version_or_geometry_is_refused() {
    let mut page = f16_page();
    page[1] = 2;
    assert_eq!(refused(&page, Format::F16, 1), KernelError::HeaderVersion { got: 2 });
    let mut page = f16_page();
    page[6] = 128;
    let err = refused(&page, Format::F16, 1);
    assert_eq!(err, KernelError::HeaderField { field: "head_dim", got: 128, want: 64 });
    assert_eq!(
        err.to_string(),
        "page header field head_dim is 128, expected 64 for this geometry and format; the page belongs \
         to another geometry or is corrupt"
    );
    let mut page = f16_page();
    page[40] = 1;
    assert_eq!(refused(&page, Format::F16, 1), KernelError::HeaderReserved { offset: 40, byte: 1 });
    let mut page = f16_page();
    page[10] = 3;
    assert_eq!(refused(&page, Format::F16, 1).kind(), KernelErrorKind::BadPage);
}

#[test]
fn quantized_page_cannot_be_asked_for_more_tokens_than_it_encodes() {
    let paged = Paged::random(SMOL, Format::Q4, 20, 2, Fill::Zero);
    let err = refused(&paged.pages[0], Format::Q4, 21);
    assert_eq!(err, KernelError::EncodedTokens { tokens: 21, encoded: 20, format: Format::Q4 });
    assert_eq!(err.kind(), KernelErrorKind::OutOfRange);
}

#[test]
fn quantize_refuses_lossy_sources_and_unquantizable_values() {
    let shape = SMOL.page_shape();
    let paged = Paged::random(SMOL, Format::Q8, 32, 3, Fill::Zero);
    let mut dst = vec![0u8; shape.page_bytes(Format::Q4)];
    let err = quantize(shape, Format::Q8, &paged.pages[0], 32, Format::Q4, &mut dst).unwrap_err();
    assert_eq!(err, KernelError::QuantizePair { from: Format::Q8, to: Format::Q4 });

    let mut src = f16_page();
    let mut k = vec![0.5f32; 3 * 64 * 2];
    k[64 + 64 * 3 + 5] = f32::INFINITY; // token 1, head 1, channel 5
    write_rows(shape, Format::F16, &mut src, 0, &k, &k).unwrap();
    dst.fill(0xee);
    let err = quantize(shape, Format::F16, &src, 2, Format::Q4, &mut dst).unwrap_err();
    assert_eq!(
        err.to_string(),
        "the key at token 1, KV head 1, channel 5 is inf, which a q4 page cannot store: quantized pages \
         hold finite values within ±65504; keep the page in f16 or bf16"
    );
    assert_eq!(err.kind(), KernelErrorKind::BadValue);
    assert!(dst[..64].iter().all(|&b| b == 0), "a refused page is left without a header");
}
