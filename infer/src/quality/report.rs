//! Tables of [`Quality`] results, as Markdown or as aligned plain text.
//!
//! Relative errors are printed in percent with three decimals, cosines with six; every table built
//! per layer ends with an `all` row aggregated over every layer and scored position (not a mean of
//! the layer rows).

use super::{Quality, Scheme, Summary};

/// How a [`Table`] is rendered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Style {
    /// A GitHub-flavoured Markdown table.
    Markdown,
    /// Columns padded to a common width, for a terminal.
    Plain,
}

/// A header and rows of cells, all rows as wide as the header.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Table {
    /// Column titles.
    pub header: Vec<String>,
    /// Cells, row by row.
    pub rows: Vec<Vec<String>>,
}

impl Table {
    fn new(header: &[&str]) -> Table {
        Table { header: header.iter().map(|h| (*h).to_owned()).collect(), rows: Vec::new() }
    }

    /// The table as text, one line per row, ending with a newline.
    pub fn render(&self, style: Style) -> String {
        let widths: Vec<usize> = (0..self.header.len())
            .map(|c| {
                self.rows
                    .iter()
                    .map(|r| r.get(c).map_or(0, |s| s.chars().count()))
                    .fold(self.header[c].len(), usize::max)
            })
            .collect();
        let line = |cells: &[String]| {
            let padded: Vec<String> = cells.iter().zip(&widths).map(|(s, w)| format!("{s:>w$}")).collect();
            match style {
                Style::Markdown => format!("| {} |\n", padded.join(" | ")),
                Style::Plain => format!("{}\n", padded.join("  ").trim_end()),
            }
        };
        let mut out = line(&self.header);
        match style {
            Style::Markdown => {
                let rule: Vec<String> =
                    widths.iter().map(|w| format!("{}:", "-".repeat(w.saturating_sub(1).max(2)))).collect();
                out.push_str(&format!("|{}|\n", rule.iter().map(|r| format!(" {r} ")).collect::<Vec<_>>().join("|")));
            }
            Style::Plain => {
                out.push_str(&format!(
                    "{}\n",
                    "-".repeat(widths.iter().sum::<usize>() + 2 * widths.len().saturating_sub(1))
                ));
            }
        }
        for row in &self.rows {
            out.push_str(&line(row));
        }
        out
    }
}

/// A relative error in percent.
pub fn percent(x: f64) -> String {
    format!("{:.3}%", 100.0 * x)
}

/// A cosine similarity.
pub fn cosine(x: f64) -> String {
    format!("{x:.6}")
}

fn error_cells(s: &Summary) -> [String; 5] {
    [
        percent(s.mean_rel_error),
        percent(s.p99_rel_error),
        percent(s.max_rel_error),
        cosine(s.mean_cosine),
        cosine(s.min_cosine),
    ]
}

fn selection_cells(s: &Summary) -> [String; 3] {
    [
        format!("{:.1}%", 100.0 * s.mean_pages_read),
        format!("{:.4}", s.mean_mass_kept),
        format!("{:.4}", s.min_mass_kept),
    ]
}

/// One scheme per layer: mean, p99 and max relative error, mean and min cosine (and, for a
/// selection, the pages read and the attention mass they hold), then the `all` row.
pub fn layer_table(quality: &Quality) -> Table {
    let selecting = matches!(quality.scheme, Scheme::Selected { .. });
    let mut header = vec!["layer", "mean rel err", "p99 rel err", "max rel err", "mean cos", "min cos"];
    if selecting {
        header.extend(["pages read", "mass kept", "min mass kept"]);
    }
    let mut table = Table::new(&header);
    let rows = quality.layers.iter().enumerate().map(|(l, s)| (l.to_string(), s));
    for (name, s) in rows.chain([("all".to_owned(), &quality.overall)]) {
        let mut row = vec![name];
        row.extend(error_cells(s));
        if selecting {
            row.extend(selection_cells(s));
        }
        table.rows.push(row);
    }
    table
}

/// One row per scheme, over every layer: pages stored in the format, mean, p99 and max relative
/// error, mean and min cosine.
pub fn overall_table(results: &[&Quality]) -> Table {
    let mut table =
        Table::new(&["scheme", "old pages", "mean rel err", "p99 rel err", "max rel err", "mean cos", "min cos"]);
    for q in results {
        let mut row = vec![q.scheme.label(), format!("{}/{}", q.quantized_pages, q.pages)];
        row.extend(error_cells(&q.overall));
        table.rows.push(row);
    }
    table
}

/// One row per scheme, over every layer: bits per element of the old pages (metadata included),
/// mean, p99 and max relative error, mean and min cosine: schemes compared at equal bytes.
pub fn budget_table(results: &[&Quality]) -> Table {
    let mut table =
        Table::new(&["scheme", "bits/element", "mean rel err", "p99 rel err", "max rel err", "mean cos", "min cos"]);
    for q in results {
        let mut row = vec![q.scheme.label(), format!("{:.3}", q.old_bits_per_element)];
        row.extend(error_cells(&q.overall));
        table.rows.push(row);
    }
    table
}

/// Two schemes side by side per layer (mean, p99 and max relative error, min cosine of each),
/// then the `all` row: the KIVI layout against per-token keys. `names` title their columns.
pub fn comparison_table(a: &Quality, b: &Quality, names: [&str; 2]) -> Table {
    let [la, lb] = names;
    let titles: Vec<String> =
        ["mean", "p99", "max", "min cos"].iter().flat_map(|m| [format!("{la} {m}"), format!("{lb} {m}")]).collect();
    let mut header = vec!["layer"];
    header.extend(titles.iter().map(String::as_str));
    let mut table = Table::new(&header);
    let rows = a.layers.iter().zip(&b.layers).enumerate().map(|(l, (x, y))| (l.to_string(), x, y));
    for (name, x, y) in rows.chain([("all".to_owned(), &a.overall, &b.overall)]) {
        table.rows.push(vec![
            name,
            percent(x.mean_rel_error),
            percent(y.mean_rel_error),
            percent(x.p99_rel_error),
            percent(y.p99_rel_error),
            percent(x.max_rel_error),
            percent(y.max_rel_error),
            cosine(x.min_cosine),
            cosine(y.min_cosine),
        ]);
    }
    table
}

/// One row per scheme, over every layer, with the pages read and the attention mass they hold:
/// page selection against full attention.
pub fn selection_table(results: &[&Quality]) -> Table {
    let mut table = Table::new(&[
        "scheme",
        "mean rel err",
        "p99 rel err",
        "max rel err",
        "mean cos",
        "min cos",
        "pages read",
        "mass kept",
        "min mass kept",
    ]);
    for q in results {
        let mut row = vec![q.scheme.label()];
        row.extend(error_cells(&q.overall));
        row.extend(selection_cells(&q.overall));
        table.rows.push(row);
    }
    table
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markdown_and_plain_tables_have_a_rule_and_aligned_cells() {
        let mut table = Table::new(&["layer", "err"]);
        table.rows.push(vec!["0".to_owned(), percent(0.012346)]);
        table.rows.push(vec!["all".to_owned(), percent(0.5)]);
        assert_eq!(
            table.render(Style::Markdown),
            "| layer |     err |\n| ----: | ------: |\n|     0 |  1.235% |\n|   all | 50.000% |\n"
        );
        assert_eq!(table.render(Style::Plain), "layer      err\n--------------\n    0   1.235%\n  all  50.000%\n");
    }
}
