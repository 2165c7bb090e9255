//! The pre-tokenizer of byte-level BPE: text is cut into pieces, and BPE merges never cross a cut.
//!
//! [`PreTokenizer::Gpt2`] is GPT-2's regular expression, written out by hand (Rust's `regex` has no
//! look-ahead); each alternative is tried in order at the current position and the first that
//! matches, greedily, is the next piece:
//!
//! ```text
//!   's|'t|'re|'ve|'m|'ll|'d        contractions (lower case only)
//!   | ?\p{L}+                      an optional space and a run of letters
//!   | ?\p{N}+                      an optional space and a run of digits
//!   | ?[^\s\p{L}\p{N}]+            an optional space and a run of anything else
//!   |\s+(?!\S)                     whitespace not followed by a non-space: a run of n ≥ 2 spaces
//!                                  before a word leaves its last space to join the word
//!   |\s+                           any other whitespace run
//! ```
//!
//! [`PreTokenizer::Gpt2Digits`] (llama.cpp's `smollm`, `starcoder`, `refact` ... pre-tokenizers; the
//! Hugging Face `Digits(individual_digits=true)` + `ByteLevel` sequence) first cuts every `\p{N}`
//! character into a piece of its own, then applies GPT-2's expression inside each remaining piece.
//! So `" 2024"` becomes `" "`, `"2"`, `"0"`, `"2"`, `"4"`: a digit never carries a space.
//!
//! Character classes: `\p{N}` is [`char::is_numeric`] (`Nd`, `Nl`, `No`, exactly); `\s` is
//! [`char::is_whitespace`] (the Unicode `White_Space` property, as in llama.cpp); `\p{L}` is
//! [`char::is_alphabetic`] minus the numerals, which also admits the combining marks that Unicode
//! calls `Other_Alphabetic` (some Indic vowel signs, for instance), where the regular expression
//! would treat them as "anything else". English text never meets the difference.

/// Which expression cuts the text.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PreTokenizer {
    /// GPT-2's expression (llama.cpp `gpt2`, `mpt`, `olmo`, `jais`).
    Gpt2,
    /// Every digit alone, then GPT-2's expression (llama.cpp `smollm`, `starcoder`, `refact`,
    /// `command-r`, `codeshell`, `exaone`, `minerva`).
    Gpt2Digits,
}

impl PreTokenizer {
    /// The pre-tokenizer llama.cpp uses for the GGUF `tokenizer.ggml.pre` value `name`.
    pub fn from_gguf_name(name: &str) -> Option<Self> {
        match name {
            "gpt2" | "mpt" | "olmo" | "jais" => Some(Self::Gpt2),
            "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva" => {
                Some(Self::Gpt2Digits)
            }
            _ => None,
        }
    }

    /// Cuts `text` into pieces, in order; their concatenation is `text`.
    pub fn split(self, text: &str) -> Vec<&str> {
        let mut pieces = Vec::new();
        match self {
            Self::Gpt2 => split_gpt2(text, &mut pieces),
            Self::Gpt2Digits => {
                let mut rest_start = 0;
                for (i, c) in text.char_indices() {
                    if c.is_numeric() {
                        split_gpt2(&text[rest_start..i], &mut pieces);
                        pieces.push(&text[i..i + c.len_utf8()]);
                        rest_start = i + c.len_utf8();
                    }
                }
                split_gpt2(&text[rest_start..], &mut pieces);
            }
        }
        pieces
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Class {
    Letter,
    Number,
    Space,
    Other,
}

fn class(c: char) -> Class {
    if c.is_whitespace() {
        Class::Space
    } else if c.is_numeric() {
        Class::Number
    } else if c.is_alphabetic() {
        Class::Letter
    } else {
        Class::Other
    }
}

/// GPT-2's expression over `text`, appending the pieces.
fn split_gpt2<'a>(text: &'a str, pieces: &mut Vec<&'a str>) {
    let chars: Vec<(usize, char)> = text.char_indices().collect();
    let n = chars.len();
    let at = |k: usize| if k < n { chars[k].0 } else { text.len() };
    let mut i = 0;
    while i < n {
        let c = chars[i].1;
        let next = |k: usize| chars.get(i + k).map(|&(_, c)| c);
        let end = if c == '\'' && matches!(next(1), Some('s' | 't' | 'm' | 'd')) {
            i + 2
        } else if c == '\''
            && matches!((next(1), next(2)), (Some('r'), Some('e')) | (Some('v'), Some('e')) | (Some('l'), Some('l')))
        {
            i + 3
        } else {
            // An optional space joins a following run that is not whitespace.
            let first = if c == ' ' && next(1).is_some_and(|d| class(d) != Class::Space) { i + 1 } else { i };
            match class(chars[first].1) {
                Class::Space => {
                    let mut k = i;
                    while k < n && class(chars[k].1) == Class::Space {
                        k += 1;
                    }
                    // \s+(?!\S): before a non-space, a run of two or more leaves its last character.
                    if k < n && k - i >= 2 { k - 1 } else { k }
                }
                run => {
                    let mut k = first + 1;
                    while k < n && class(chars[k].1) == run {
                        k += 1;
                    }
                    k
                }
            }
        };
        pieces.push(&text[at(i)..at(end)]);
        i = end;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn gpt2(text: &str) -> Vec<&str> {
        PreTokenizer::Gpt2.split(text)
    }

    #[test]
    fn words_take_their_leading_space_and_punctuation_runs_stand_apart() {
        assert_eq!(gpt2("Hello world!"), ["Hello", " world", "!"]);
        assert_eq!(gpt2("Hi, there... ok?!"), ["Hi", ",", " there", "...", " ok", "?!"]);
    }

    #[test]
    fn lower_case_contractions_split_off_and_upper_case_ones_do_not() {
        assert_eq!(gpt2("don't we'll they're"), ["don", "'t", " we", "'ll", " they", "'re"]);
        assert_eq!(gpt2("DON'T"), ["DON", "'", "T"]);
    }

    #[test]
    fn a_space_run_before_a_word_leaves_one_space_for_the_word() {
        assert_eq!(gpt2("a   b"), ["a", "  ", " b"]);
        assert_eq!(gpt2("a\n\nb"), ["a", "\n", "\n", "b"]);
        assert_eq!(gpt2("a \n b"), ["a", " \n", " b"]);
        assert_eq!(gpt2("end  "), ["end", "  "]);
        assert_eq!(gpt2(" "), [" "]);
    }

    #[test]
    fn gpt2_keeps_digit_runs_and_their_space() {
        assert_eq!(gpt2("in 1787 x"), ["in", " 1787", " x"]);
    }

    #[test]
    fn the_smollm_variant_cuts_every_digit_alone() {
        let split = PreTokenizer::Gpt2Digits.split("in 1787, Section 9.");
        assert_eq!(split, ["in", " ", "1", "7", "8", "7", ",", " Section", " ", "9", "."]);
        assert_eq!(PreTokenizer::Gpt2Digits.split("x²½"), ["x", "²", "½"]);
    }

    #[test]
    fn non_ascii_letters_and_symbols_are_classified() {
        assert_eq!(gpt2("café über €5 🙂"), ["café", " über", " €", "5", " 🙂"]);
    }

    #[test]
    fn gguf_names_map_to_the_llama_cpp_expressions() {
        assert_eq!(PreTokenizer::from_gguf_name("smollm"), Some(PreTokenizer::Gpt2Digits));
        assert_eq!(PreTokenizer::from_gguf_name("gpt2"), Some(PreTokenizer::Gpt2));
        assert_eq!(PreTokenizer::from_gguf_name("llama-bpe"), None);
    }

    proptest! {
        #[test]
        fn pieces_concatenate_to_the_text_and_are_never_empty(text in "\\PC{0,40}") {
            for pre in [PreTokenizer::Gpt2, PreTokenizer::Gpt2Digits] {
                let pieces = pre.split(&text);
                prop_assert_eq!(pieces.concat(), text.clone());
                prop_assert!(pieces.iter().all(|p| !p.is_empty()));
            }
        }
    }
}
