//! Scalar element access for every format: the definition the kernels are tested against.
//!
//! [`PageReader`] decodes one key or value element at a time from a page whose header and length
//! were already checked: 16-bit elements exactly, quantized ones as `min + scale × code` (see
//! [`super::quant`]). Slow by design; the scalar attention kernel, [`super::quant::dequantize`]'s
//! scalar path and the bounds reader use it.

use crate::format::quant::{QuantLayout, V_GROUP, get_code, get_params};
use crate::format::rows::decode;
use crate::format::{Format, PageShape};

/// Reads elements of one page in place.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PageReader<'a> {
    shape: PageShape,
    format: Format,
    bytes: &'a [u8],
    /// The quantized layout, for quantized formats.
    quant: Option<QuantLayout>,
}

impl<'a> PageReader<'a> {
    /// A reader of `bytes`, a page of `shape` in `format` whose length passed
    /// [`PageShape::check_page`] (indexing panics otherwise; it never reads out of bounds).
    pub fn new(shape: PageShape, format: Format, bytes: &'a [u8]) -> PageReader<'a> {
        PageReader { shape, format, bytes, quant: QuantLayout::new(shape, format).ok() }
    }

    fn wide(&self, at: usize) -> f32 {
        decode(self.format, u16::from_le_bytes([self.bytes[at], self.bytes[at + 1]]))
    }

    /// `(scale, min)` of key channel `d` of head `h` of a quantized page.
    pub fn key_params(&self, q: &QuantLayout, h: usize, d: usize) -> (f32, f32) {
        get_params(self.bytes, q.k_param(h, d))
    }

    /// Key channel `d` of KV head `h` at token slot `t`.
    pub fn key(&self, h: usize, d: usize, t: usize) -> f32 {
        match &self.quant {
            None => self.wide(self.shape.k_byte(h, d, t)),
            Some(q) => {
                let (scale, min) = self.key_params(q, h, d);
                let code = get_code(self.bytes, q.k_codes(h) + d * q.k_row_bytes(), t, q.k_bits);
                min + scale * code as f32
            }
        }
    }

    /// Value channel `d` of KV head `h` at token slot `t`.
    pub fn value(&self, h: usize, t: usize, d: usize) -> f32 {
        match &self.quant {
            None => self.wide(self.shape.v_byte(h, t, d)),
            Some(q) => {
                let (scale, min) = get_params(self.bytes, q.v_param(h, d / V_GROUP, t));
                let code = get_code(self.bytes, q.v_codes(h) + t * q.v_row_bytes(), d, q.v_bits);
                min + scale * code as f32
            }
        }
    }

    /// The key bounds `(min, max)` of channel `d` of head `h`: the stored summary of a 16-bit page
    /// (`(+∞, −∞)` while empty), or `[min, min + scale × (2^b − 1)]` of a quantized page.
    pub fn key_bounds(&self, h: usize, d: usize) -> (f32, f32) {
        match &self.quant {
            None => {
                let at = self.shape.bound_byte(h, d);
                (self.wide(at), self.wide(at + 2))
            }
            Some(q) => {
                let (scale, min) = self.key_params(q, h, d);
                (min, min + scale * ((1u32 << q.k_bits) - 1) as f32)
            }
        }
    }
}
