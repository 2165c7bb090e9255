//! [`EvalReport`]: what [`evaluate`](super::evaluate) measured, as a table for people
//! ([`Display`](std::fmt::Display), Markdown) and as one JSON object per line for tools
//! ([`EvalReport::json_lines`]).
//!
//! Bits per element count page memory per K or V element slot of the pages: every page is counted
//! whole (the partial last page of a layer too), header, key bounds, quantization parameters and
//! padding included, over elements of the pages' head_dim (for a model whose head_dim is padded to
//! a multiple of 16, elements of the padded heads).

use std::fmt;

use kvmm_kernels::Format;

use super::paged::Storage;

/// The scores of one pass (one storage) over the text.
#[derive(Clone, Debug, PartialEq)]
pub struct PassReport {
    /// How the pages leaving the window were stored.
    pub storage: Storage,
    /// `exp(mean NLL)` of the true next token.
    pub perplexity: f64,
    /// Mean over the steps of KL(reference ‖ this pass), over the whole vocabulary.
    pub mean_kl: f64,
    /// The median KL of a step (nearest rank).
    pub median_kl: f64,
    /// The 99th percentile of the KL of a step (nearest rank).
    pub p99_kl: f64,
    /// The largest KL of a step.
    pub max_kl: f64,
    /// Steps counted for top-1 agreement: those where the reference's top-2 logit margin is at
    /// least [`EvalReport::margin`].
    pub top1_counted: usize,
    /// Of those, the steps whose top-1 token is the reference's.
    pub top1_agree: usize,
    /// Bits per element of every page at the end of the text (module documentation).
    pub bits_per_element: f64,
    /// Bits per element of the pages outside the sink page and the window (the ones demotion
    /// re-encodes); `None` when there are none.
    pub old_bits_per_element: Option<f64>,
    /// The format of every page at the end of the text, per layer, in page order.
    pub page_formats: Vec<Vec<Format>>,
}

impl PassReport {
    /// The share of counted steps whose top-1 token agrees with the reference's; `None` when no
    /// step was counted.
    pub fn top1_agreement(&self) -> Option<f64> {
        (self.top1_counted > 0).then(|| self.top1_agree as f64 / self.top1_counted as f64)
    }

    /// Pages per format over every layer, in [`Format::ALL`] order, formats with no page left out.
    pub fn census(&self) -> Vec<(Format, usize)> {
        Format::ALL
            .into_iter()
            .map(|f| (f, self.page_formats.iter().flatten().filter(|&&p| p == f).count()))
            .filter(|&(_, n)| n > 0)
            .collect()
    }

    /// Pages per format as `f16 12, q4 180`.
    pub fn census_text(&self) -> String {
        self.census().iter().map(|(f, n)| format!("{f} {n}")).collect::<Vec<_>>().join(", ")
    }

    /// Every layer's pages, one line per layer and one character per page in page order: `F`
    /// f16, `B` bf16, `8` q8, `k` k8v4, `4` q4, `2` q2.
    pub fn page_map(&self) -> String {
        let mut map = String::new();
        for (layer, formats) in self.page_formats.iter().enumerate() {
            let pages: String = formats.iter().map(|&f| page_char(f)).collect();
            map += &format!("{layer:>3} {pages}\n");
        }
        map
    }
}

/// A page's format as one character of [`PassReport::page_map`].
fn page_char(format: Format) -> char {
    match format {
        Format::F16 => 'F',
        Format::Bf16 => 'B',
        Format::Q8 => '8',
        Format::K8V4 => 'k',
        Format::Q4 => '4',
        Format::Q2 => '2',
        _ => '?',
    }
}

/// The result of an evaluation: the reference and every storage asked for.
#[derive(Clone, Debug, PartialEq)]
pub struct EvalReport {
    /// Tokens the text encodes to (before the cap).
    pub text_tokens: usize,
    /// Tokens fed or predicted: the first `tokens − 1` are fed, and each step predicts the next.
    pub tokens: usize,
    /// Whether the tokens start with BOS.
    pub bos: bool,
    /// Tokens per page.
    pub block_tokens: usize,
    /// Tokens at the end of a layer kept at full precision (with the sink page).
    pub window_tokens: usize,
    /// The reference top-2 margin from which a step counts for top-1 agreement.
    pub margin: f32,
    /// Layers of the model.
    pub layers: usize,
    /// The model's head_dim, and the pages' (padded to a multiple of 16).
    pub head_dim: usize,
    /// The pages' head_dim.
    pub page_head_dim: usize,
    /// The reference: f16 pages everywhere (its KL is 0 and its agreement 100% by definition).
    pub reference: PassReport,
    /// The storages asked for, in the order asked.
    pub passes: Vec<PassReport>,
    /// Wall-clock seconds of the whole evaluation.
    pub seconds: f64,
}

impl EvalReport {
    /// Steps scored (`tokens − 1`).
    pub fn steps(&self) -> usize {
        self.tokens.saturating_sub(1)
    }

    /// The pass of `storage`, if it was evaluated.
    pub fn pass(&self, storage: Storage) -> Option<&PassReport> {
        self.passes.iter().find(|p| p.storage == storage)
    }

    /// Perplexity change of `pass` against the reference, in percent.
    pub fn delta_perplexity_percent(&self, pass: &PassReport) -> f64 {
        (pass.perplexity / self.reference.perplexity - 1.0) * 100.0
    }

    /// One JSON object per line, the reference first (`"reference": true`), with the fields
    /// `format, reference, tokens, steps, ppl, dppl_pct, kl_mean, kl_p50, kl_p99, kl_max, top1,
    /// top1_agree, top1_steps,
    /// margin, bits, old_bits, pages` (`top1` and `old_bits` are `null` when undefined; `pages`
    /// maps format names to page counts).
    pub fn json_lines(&self) -> String {
        let number = |x: Option<f64>| match x {
            Some(x) if x.is_finite() => format!("{x}"),
            _ => "null".to_owned(),
        };
        std::iter::once((true, &self.reference))
            .chain(self.passes.iter().map(|p| (false, p)))
            .map(|(reference, p)| {
                let pages = p.census().iter().map(|(f, n)| format!("\"{f}\":{n}")).collect::<Vec<_>>().join(",");
                format!(
                    "{{\"format\":\"{}\",\"reference\":{reference},\"tokens\":{},\"steps\":{},\"ppl\":{},\
                     \"dppl_pct\":{},\"kl_mean\":{},\"kl_p50\":{},\"kl_p99\":{},\"kl_max\":{},\"top1\":{},\"top1_agree\":{},\
                     \"top1_steps\":{},\"margin\":{},\"bits\":{},\"old_bits\":{},\"pages\":{{{pages}}}}}\n",
                    p.storage,
                    self.tokens,
                    self.steps(),
                    number(Some(p.perplexity)),
                    number(Some(self.delta_perplexity_percent(p))),
                    number(Some(p.mean_kl)),
                    number(Some(p.median_kl)),
                    number(Some(p.p99_kl)),
                    number(Some(p.max_kl)),
                    number(p.top1_agreement()),
                    p.top1_agree,
                    p.top1_counted,
                    self.margin,
                    number(Some(p.bits_per_element)),
                    number(p.old_bits_per_element),
                )
            })
            .collect()
    }
}

impl fmt::Display for EvalReport {
    /// A Markdown table, one row per storage, the reference first, under a line that says what
    /// was measured.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "{} tokens of {} ({} steps{}), {}-token pages, sink page and last {} tokens kept {}; top-1 \
             agreement over steps where the reference's top-2 margin ≥ {}; {:.1} s",
            self.tokens,
            self.text_tokens,
            self.steps(),
            if self.bos { ", BOS first" } else { "" },
            self.block_tokens,
            self.window_tokens,
            self.reference.storage,
            self.margin,
            self.seconds,
        )?;
        let own: Vec<String> = self
            .passes
            .iter()
            .filter(|p| p.storage.window(self.window_tokens) != self.window_tokens)
            .map(|p| format!("{} the last {}", p.storage, p.storage.window(self.window_tokens)))
            .collect();
        if !own.is_empty() {
            writeln!(f, "windows of their own (adaptive precision by age): {}", own.join(", "))?;
        }
        if self.page_head_dim != self.head_dim {
            writeln!(
                f,
                "head_dim {} zero-padded to {} in pages (bits count padded elements)",
                self.head_dim, self.page_head_dim
            )?;
        }
        writeln!(f)?;
        writeln!(
            f,
            "| format | ppl | Δppl | mean KL | median KL | p99 KL | max KL | top-1 agree (steps) | bits/elem | old pages bits/elem | pages |"
        )?;
        writeln!(f, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")?;
        for (reference, p) in std::iter::once((true, &self.reference)).chain(self.passes.iter().map(|p| (false, p))) {
            let agree = match p.top1_agreement() {
                Some(a) => format!("{:.2}% ({}/{})", a * 100.0, p.top1_agree, p.top1_counted),
                None => "— (0 steps)".to_owned(),
            };
            writeln!(
                f,
                "| {}{} | {:.4} | {:+.2}% | {:.6} | {:.2e} | {:.2e} | {:.4} | {agree} | {:.2} | {} | {} |",
                p.storage,
                if reference { " (ref)" } else { "" },
                p.perplexity,
                self.delta_perplexity_percent(p),
                p.mean_kl,
                p.median_kl,
                p.p99_kl,
                p.max_kl,
                p.bits_per_element,
                p.old_bits_per_element.map_or_else(|| "—".to_owned(), |b| format!("{b:.2}")),
                p.census_text(),
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pass(storage: Storage, perplexity: f64, counted: usize) -> PassReport {
        PassReport {
            storage,
            perplexity,
            mean_kl: 0.25,
            median_kl: 0.125,
            p99_kl: 0.5,
            max_kl: 1.0,
            top1_counted: counted,
            top1_agree: counted / 2,
            bits_per_element: 5.5,
            old_bits_per_element: (counted > 0).then_some(5.0),
            page_formats: vec![vec![Format::F16, Format::Q4, Format::Q4], vec![Format::F16, Format::Q8, Format::Q4]],
        }
    }

    fn report() -> EvalReport {
        EvalReport {
            text_tokens: 100,
            tokens: 10,
            bos: false,
            block_tokens: 32,
            window_tokens: 128,
            margin: 0.5,
            layers: 2,
            head_dim: 8,
            page_head_dim: 16,
            reference: pass(Storage::Uniform(Format::F16), 4.0, 4),
            passes: vec![pass(Storage::Uniform(Format::Q4), 5.0, 4), pass(Storage::AUTO, 4.0, 0)],
            seconds: 1.5,
        }
    }

    #[test]
    fn json_lines_hold_one_object_per_pass_with_null_for_the_undefined() {
        let json = report().json_lines();
        let lines: Vec<&str> = json.lines().collect();
        assert_eq!(lines.len(), 3);
        assert!(lines.iter().all(|l| l.starts_with("{\"format\":\"") && l.ends_with("}}")), "{json}");
        assert!(lines[0].contains("\"format\":\"f16\",\"reference\":true"), "{}", lines[0]);
        assert!(lines[1].contains("\"dppl_pct\":25,") && lines[1].contains("\"top1\":0.5,"), "{}", lines[1]);
        assert!(lines[1].contains("\"pages\":{\"f16\":2,\"q8\":1,\"q4\":3}"), "{}", lines[1]);
        assert!(lines[2].contains("\"top1\":null") && lines[2].contains("\"old_bits\":null"), "{}", lines[2]);
    }

    #[test]
    fn the_table_has_a_row_per_pass_and_says_what_was_padded() {
        let table = report().to_string();
        assert!(table.contains("head_dim 8 zero-padded to 16"), "{table}");
        assert!(table.contains("| f16 (ref) | 4.0000 | +0.00% |"), "{table}");
        assert!(table.contains("| q4 | 5.0000 | +25.00% |"), "{table}");
        assert!(table.contains("| auto | 4.0000 | +0.00% |") && table.contains("— (0 steps)"), "{table}");
        assert!(table.contains("f16 2, q8 1, q4 3"), "{table}");
    }

    #[test]
    fn the_page_map_has_a_line_per_layer_and_a_character_per_page() {
        assert_eq!(report().passes[0].page_map(), "  0 F44\n  1 F84\n");
    }
}
