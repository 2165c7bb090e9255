//! [`Cursor`]: sequential little-endian reads over a byte slice, shared by the file parsers.
//!
//! Every read returns `None` instead of panicking when the slice runs out, and consumes nothing in
//! that case; callers turn `None` into an error that names the file and the field.

/// A read position in a byte slice.
#[derive(Clone, Debug)]
pub(crate) struct Cursor<'a> {
    bytes: &'a [u8],
    /// Offset of the next unread byte; never past `bytes.len()`.
    at: usize,
}

impl<'a> Cursor<'a> {
    /// A cursor at `offset` (clamped to the end).
    pub(crate) fn at(bytes: &'a [u8], offset: usize) -> Self {
        Self { bytes, at: offset.min(bytes.len()) }
    }

    /// Offset of the next unread byte.
    pub(crate) fn offset(&self) -> usize {
        self.at
    }

    /// Bytes not yet read.
    pub(crate) fn remaining(&self) -> usize {
        self.bytes.len() - self.at
    }

    /// The next `n` bytes.
    pub(crate) fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.bytes.len())?;
        let out = &self.bytes[self.at..end];
        self.at = end;
        Some(out)
    }

    /// The next `N` bytes as an array.
    fn array<const N: usize>(&mut self) -> Option<[u8; N]> {
        self.take(N).map(|b| b.try_into().expect("take(N) yields N bytes"))
    }

    fn word(&mut self) -> Option<[u8; 4]> {
        self.array()
    }

    /// The next byte.
    pub(crate) fn u8(&mut self) -> Option<u8> {
        self.array::<1>().map(|[b]| b)
    }

    /// The next little-endian `u16`.
    pub(crate) fn u16(&mut self) -> Option<u16> {
        self.array().map(u16::from_le_bytes)
    }

    /// The next little-endian `u32`.
    pub(crate) fn u32(&mut self) -> Option<u32> {
        self.word().map(u32::from_le_bytes)
    }

    /// The next little-endian `u64`.
    pub(crate) fn u64(&mut self) -> Option<u64> {
        self.array().map(u64::from_le_bytes)
    }

    /// The next little-endian `i32`.
    pub(crate) fn i32(&mut self) -> Option<i32> {
        self.word().map(i32::from_le_bytes)
    }

    /// The next little-endian `f32`.
    pub(crate) fn f32(&mut self) -> Option<f32> {
        self.word().map(f32::from_le_bytes)
    }

    /// The next `n` little-endian `u32`s.
    pub(crate) fn u32s(&mut self, n: usize) -> Option<Vec<u32>> {
        let b = self.take(n.checked_mul(4)?)?;
        Some(b.chunks_exact(4).map(|w| u32::from_le_bytes(w.try_into().expect("chunks_exact(4)"))).collect())
    }

    /// The next `n` little-endian `f32`s.
    pub(crate) fn f32s(&mut self, n: usize) -> Option<Vec<f32>> {
        let b = self.take(n.checked_mul(4)?)?;
        Some(b.chunks_exact(4).map(|w| f32::from_le_bytes(w.try_into().expect("chunks_exact(4)"))).collect())
    }
}

/// The index and value of the first non-finite float, if any.
pub(crate) fn first_non_finite(values: &[f32]) -> Option<(usize, f32)> {
    values.iter().position(|v| !v.is_finite()).map(|i| (i, values[i]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_past_the_end_return_none_and_consume_nothing() {
        let bytes = [1, 0, 0, 0, 0xff];
        let mut c = Cursor::at(&bytes, 0);
        assert_eq!(c.i32(), Some(1));
        assert_eq!(c.f32(), None);
        assert_eq!((c.offset(), c.remaining()), (4, 1));
        assert_eq!(c.take(1), Some(&[0xff][..]));
        assert_eq!(c.f32s(usize::MAX), None);
    }
}
