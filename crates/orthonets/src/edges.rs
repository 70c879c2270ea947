//! Edge lists: TSV/CSV (header optional), STRING's `protein.links` (space-separated, scores
//! 0–1000), BioGRID's tab-delimited exports, PSI-MITAB 2.5 (IntAct, BioGRID, MINT exports) and
//! the mouse network committed under `data/orthonets`. Undirected: duplicates merge,
//! self-loops are dropped and counted.

use std::path::Path;
use std::time::Instant;

use crate::graph::{BuildCounts, Interner, Network};
use crate::read::records;
use crate::{Error, Result};

/// A column, by header name (case-insensitive) or 0-based position.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Col {
    /// By header name.
    Name(String),
    /// By position.
    Index(usize),
}

impl Col {
    /// `3` is a position, anything else a name.
    pub fn parse(s: &str) -> Col {
        s.parse().map_or_else(|_| Col::Name(s.to_owned()), Col::Index)
    }
}

/// Which columns hold the two proteins and the score.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Columns {
    /// Found from the header (see [`load`]), else the first two columns and a numeric third.
    Auto,
    /// Given.
    Given { a: Col, b: Col, score: Option<Col> },
}

/// A network read from a file.
#[derive(Debug, Clone)]
pub struct Loaded {
    /// The network.
    pub net: Network,
    /// What building it dropped and merged.
    pub counts: BuildCounts,
    /// Rows without an identifier on one side (empty or `-`), skipped.
    pub blank: usize,
    /// The columns used, in words.
    pub layout: String,
    /// Seconds to read and build.
    pub seconds: f64,
}

/// Header names recognised for each role, in order of preference (lower case).
const A_NAMES: &[&str] =
    &["protein1", "symbol_a", "official symbol interactor a", "source_genesymbol", "gene1", "node1", "interactor_a", "source"];
const B_NAMES: &[&str] =
    &["protein2", "symbol_b", "official symbol interactor b", "target_genesymbol", "gene2", "node2", "interactor_b", "target"];
const SCORE_NAMES: &[&str] = &["combined_score", "score", "weight", "confidence"];

fn find(header: &[String], names: &[&str]) -> Option<usize> {
    names.iter().find_map(|n| header.iter().position(|h| h.eq_ignore_ascii_case(n)))
}

/// Reads the edge list at `path`. With [`Columns::Auto`] a first record that names a known
/// column (`protein1`/`protein2` as STRING, `symbol_a`/`symbol_b`, BioGRID's `Official Symbol
/// Interactor A`/`B`, `source_genesymbol`/`target_genesymbol`, `gene1`/`gene2`, ...) is a
/// header and picks the columns, with `combined_score`, `score`, `weight` or `confidence` as
/// the score; otherwise there is no header, the proteins are the first two columns and a third
/// numeric column is the score. Scores must lie in [0, 1], except a `combined_score` column,
/// read as STRING's 0–1000; edges without a score get 1.
pub fn load(path: &Path, columns: &Columns) -> Result<Loaded> {
    let t0 = Instant::now();
    let list = read_pairs(path, columns)?;
    let mut ids = Interner::default();
    let pairs = list.pairs.iter().map(|p| (ids.intern(&p.a), ids.intern(&p.b), p.score.unwrap_or(1.0))).collect();
    let (net, counts) = Network::build(ids, pairs);
    Ok(Loaded { net, counts, blank: list.blank, layout: list.layout, seconds: t0.elapsed().as_secs_f64() })
}

/// One row of a pair list.
#[derive(Debug, Clone, PartialEq)]
pub struct Pair {
    /// First protein.
    pub a: String,
    /// Second protein.
    pub b: String,
    /// The row's score, if the list has a score column.
    pub score: Option<f32>,
    /// The row's line in the file.
    pub line: usize,
}

/// The rows of a pair list as they are (no merging): what [`load`] builds a network from, and
/// what an overlay classifies.
#[derive(Debug, Clone)]
pub struct PairList {
    /// Rows with both identifiers.
    pub pairs: Vec<Pair>,
    /// Rows without an identifier on one side (empty or `-`), skipped.
    pub blank: usize,
    /// PSI-MITAB rows between proteins of two species, skipped.
    pub interspecies: usize,
    /// The columns used, in words.
    pub layout: String,
}

/// Reads the rows of the pair list at `path`; the columns are found as [`load`] says.
pub fn read_pairs(path: &Path, columns: &Columns) -> Result<PairList> {
    read_pairs_where(path, columns, None)
}

/// [`read_pairs`], keeping only the rows whose column `only.0` (a header name,
/// case-insensitive) holds `only.1`: a filter on a list's other columns (liana's `resource`,
/// BioGRID's system, ...), applied in the same pass.
pub fn read_pairs_where(path: &Path, columns: &Columns, only: Option<(&str, &str)>) -> Result<PairList> {
    let mut rec = records(path)?;
    let mut f = Vec::new();
    rec.first_into(&mut f, "an edge list needs two proteins per line (a, b[, score])")?;
    if *columns == Columns::Auto {
        if let Some(header) = mitab::detect(&f) {
            if only.is_some() {
                return Err(Error::Format {
                    path: path.into(),
                    detail: "a row filter (column=value) does not apply to PSI-MITAB files; filter the file first".into(),
                });
            }
            return mitab::read(rec, f, header);
        }
    }
    let lower: Vec<String> = f.iter().map(|h| h.to_ascii_lowercase()).collect();
    let by_name = |c: &Col, what: &str| -> Result<usize> {
        match c {
            Col::Index(i) => Ok(*i),
            Col::Name(n) => lower.iter().position(|h| h.eq_ignore_ascii_case(n)).ok_or_else(|| Error::Format {
                path: path.into(),
                detail: format!("no column named {n:?} for {what} in the header ({})", f.join(", ")),
            }),
        }
    };
    let (a, b, score, header) = match columns {
        Columns::Given { a, b, score } => {
            let named = matches!(a, Col::Name(_)) || matches!(b, Col::Name(_)) || matches!(score, Some(Col::Name(_)));
            let s = score.as_ref().map(|c| by_name(c, "the score")).transpose()?;
            (by_name(a, "protein a")?, by_name(b, "protein b")?, s, named)
        }
        Columns::Auto => match (find(&lower, A_NAMES), find(&lower, B_NAMES)) {
            (Some(a), Some(b)) if a != b => (a, b, find(&lower, SCORE_NAMES), true),
            _ => (0, 1, (f.len() > 2 && f[2].parse::<f64>().is_ok()).then_some(2), false),
        },
    };
    let scale = match (header, score) {
        (true, Some(s)) if lower[s] == "combined_score" => 1000.0,
        _ => 1.0,
    };
    let layout = if header {
        format!(
            "header; proteins {:?} and {:?}; score {}",
            f[a],
            f[b],
            score.map_or("none (1)".into(), |s| format!("{:?}{}", f[s], if scale > 1.0 { " / 1000" } else { "" }))
        )
    } else {
        format!(
            "no header; proteins columns {} and {}; score {}",
            a + 1,
            b + 1,
            score.map_or("none (1)".into(), |s| format!("column {}", s + 1))
        )
    };
    let only = match only {
        None => None,
        Some((col, value)) => {
            let i = lower.iter().position(|h| h.eq_ignore_ascii_case(col)).filter(|_| header).ok_or_else(|| Error::Format {
                path: path.into(),
                detail: format!("no column named {col:?} to filter on in the header ({})", f.join(", ")),
            })?;
            Some((i, value))
        }
    };
    let layout = match only {
        Some((i, value)) => format!("{layout}; rows with {} = {value}", f[i]),
        None => layout,
    };
    // a row may leave its score out (empty or missing): it is then unscored
    let width = a.max(b) + 1;
    let mut pairs = Vec::new();
    let mut blank = 0usize;
    let mut first = !header;
    loop {
        if !first && !rec.next_into(&mut f)? {
            break;
        }
        first = false;
        if f.len() < width {
            return Err(rec.error(format!("{} fields, the layout ({layout}) needs {width}", f.len())));
        }
        if only.is_some_and(|(i, value)| f.get(i).is_none_or(|v| v != value)) {
            continue;
        }
        let (x, y) = (f[a].as_str(), f[b].as_str());
        if x.is_empty() || y.is_empty() || x == "-" || y == "-" {
            blank += 1;
            continue;
        }
        let s = match score.filter(|&s| f.get(s).is_some_and(|v| !v.is_empty())) {
            None => None,
            Some(s) => {
                let v: f64 = f[s].parse().map_err(|_| rec.error(format!("score {:?} is not a number", f[s])))?;
                let v = v / scale;
                if !(0.0..=1.0).contains(&v) {
                    return Err(rec.error(format!(
                        "score {:?} is outside [0, 1]{}",
                        f[s],
                        if scale > 1.0 {
                            " after dividing STRING's combined_score by 1000"
                        } else {
                            " (STRING's 0-1000 scores are read from a column named combined_score)"
                        }
                    )));
                }
                Some(v as f32)
            }
        };
        pairs.push(Pair { a: x.to_owned(), b: y.to_owned(), score: s, line: rec.line() });
    }
    if pairs.is_empty() {
        let why = if only.is_some() {
            "no row passes the filter or every such row lacks an identifier"
        } else {
            "every row lacks an identifier"
        };
        return Err(Error::Format { path: path.into(), detail: format!("no edges: {why} ({layout})") });
    }
    Ok(PairList { pairs, blank, interspecies: 0, layout })
}

/// PSI-MITAB 2.5: 15 tab-separated columns, each a `|`-list of `db:value(description)`.
mod mitab {
    use super::{Pair, PairList};
    use crate::read::Records;
    use crate::{Error, Result};

    /// Columns: identifiers A/B, alternative identifiers A/B, aliases A/B, taxids A/B,
    /// confidence values.
    const ID: [usize; 2] = [0, 1];
    const ALT: [usize; 2] = [2, 3];
    const ALIAS: [usize; 2] = [4, 5];
    const TAXID: [usize; 2] = [9, 10];
    const CONFIDENCE: usize = 14;

    /// Whether the first record is PSI-MITAB: `Some(true)` a header line without `#`
    /// (`ID(s) interactor A ...`), `Some(false)` a data line (`db:value` identifiers and taxids).
    pub(super) fn detect(f: &[String]) -> Option<bool> {
        if f.len() < 15 {
            return None;
        }
        let l0 = f[0].to_ascii_lowercase();
        if l0.starts_with("id") && l0.contains("interactor") {
            return Some(true);
        }
        let dbval =
            |s: &str| s == "-" || s.split('|').all(|e| e.split_once(':').is_some_and(|(d, v)| !d.is_empty() && !v.is_empty()));
        (dbval(&f[0]) && f[0] != "-" && [&f[TAXID[0]], &f[TAXID[1]]].iter().all(|t| t.as_str() == "-" || t.starts_with("taxid:")))
            .then_some(false)
    }

    /// The entries of a field: `(db, value, description)`, quotes removed.
    fn entries(field: &str) -> impl Iterator<Item = (&str, &str, &str)> {
        field.split('|').filter(|e| *e != "-").filter_map(|e| {
            let (db, rest) = e.split_once(':')?;
            let (value, desc) = match rest.rfind('(') {
                Some(i) if rest.ends_with(')') && i > 0 => (&rest[..i], &rest[i + 1..rest.len() - 1]),
                _ => (rest, ""),
            };
            Some((db.trim_matches('"'), value.trim_matches('"'), desc))
        })
    }

    /// The name of interactor `side`: its gene name among the aliases, else a gene symbol among
    /// the alternative identifiers (BioGRID's `entrez gene/locuslink:SYMBOL`), else its first
    /// identifier's value. The flag says whether a gene name was found.
    fn name(f: &[String], side: usize) -> Option<(String, bool)> {
        let gene = entries(&f[ALIAS[side]]).find(|e| e.2 == "gene name").map(|e| e.1).or_else(|| {
            entries(&f[ALT[side]])
                .find(|e| e.0 == "entrez gene/locuslink" && !e.1.bytes().all(|c| c.is_ascii_digit()))
                .map(|e| e.1)
        });
        match gene {
            Some(g) if !g.is_empty() => Some((g.to_owned(), true)),
            _ => entries(&f[ID[side]]).next().filter(|e| !e.1.is_empty()).map(|e| (e.1.to_owned(), false)),
        }
    }

    pub(super) fn read(mut rec: Records, mut f: Vec<String>, header: bool) -> Result<PairList> {
        let mut pairs = Vec::new();
        let (mut blank, mut interspecies, mut by_id) = (0usize, 0usize, 0usize);
        let mut first = !header;
        loop {
            if !first && !rec.next_into(&mut f)? {
                break;
            }
            first = false;
            if f.len() < 15 {
                return Err(rec.error(format!("{} fields: PSI-MITAB 2.5 has 15 tab-separated columns", f.len())));
            }
            if let [Some(x), Some(y)] = TAXID.map(|c| entries(&f[c]).next().map(|e| e.1)) {
                if x != y {
                    interspecies += 1;
                    continue;
                }
            }
            let (Some((a, ga)), Some((b, gb))) = (name(&f, 0), name(&f, 1)) else {
                blank += 1;
                continue;
            };
            by_id += usize::from(!ga) + usize::from(!gb);
            let mut score = None;
            for (db, v, _) in entries(&f[CONFIDENCE]) {
                let Ok(x) = v.parse::<f64>() else { continue };
                if x.is_nan() || x < 0.0 {
                    return Err(rec.error(format!("confidence {db}:{v} is not a score (NaN or negative)")));
                }
                // the first value on a 0-1 scale (intact-miscore, score); others (counts,
                // 0-1000 scales) are not probabilities
                if x <= 1.0 {
                    score = Some(x as f32);
                    break;
                }
            }
            pairs.push(Pair { a, b, score, line: rec.line() });
        }
        if pairs.is_empty() {
            return Err(Error::Format {
                path: rec.path().into(),
                detail: format!("no edges: {blank} rows without an identifier, {interspecies} between two species"),
            });
        }
        let layout = format!(
            "PSI-MITAB 2.5; proteins by gene name (alias `(gene name)` or BioGRID's entrez gene/locuslink symbol), else the first identifier ({by_id} interactors); score the first confidence value in [0, 1]; {interspecies} rows between two species skipped"
        );
        Ok(PairList { pairs, blank, interspecies, layout })
    }
}
