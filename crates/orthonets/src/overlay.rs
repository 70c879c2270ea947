//! A user's list of pairs (an experiment's interactions) overlaid on a database network: each
//! row classified as known, new between proteins the network has, new with a protein it lacks,
//! a protein with itself, or a repeat of an earlier row. A protein the network lacks whose name
//! joins subunits with `_` (OmniPath's and liana's complexes, `ITGA1_ITGB1`) is a complex: the
//! row is classified by its subunits' pairs.

use std::collections::HashSet;

use crate::edges::{Pair, PairList};
use crate::graph::Network;

/// What a row of the list is, against the network.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Status {
    /// The network has this edge.
    Known,
    /// Both proteins are in the network, the edge is not.
    NewBetweenKnown,
    /// At least one protein is not in the network.
    NewProtein,
    /// A protein paired with itself.
    SelfPair,
    /// The same pair (either orientation) as an earlier row.
    Duplicate,
}

impl Status {
    /// The name in tables.
    pub fn name(self) -> &'static str {
        match self {
            Status::Known => "known",
            Status::NewBetweenKnown => "new between known proteins",
            Status::NewProtein => "new protein",
            Status::SelfPair => "self",
            Status::Duplicate => "duplicate",
        }
    }

    /// Whether the row is an interaction the network lacks.
    pub fn is_new(self) -> bool {
        matches!(self, Status::NewBetweenKnown | Status::NewProtein)
    }
}

/// One classified row.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    /// The row as read.
    pub pair: Pair,
    /// Its class.
    pub status: Status,
    /// The network's score of the edge (known rows; for a complex, its best subunit pair's).
    pub db_score: Option<f32>,
    /// Whether a side is a complex, classified by its subunits.
    pub complex: bool,
}

/// The classified list and what it says about the identifiers.
#[derive(Debug, Clone)]
pub struct Overlay {
    /// Every row, in the file's order.
    pub rows: Vec<Row>,
    /// Distinct proteins of the list (a complex's subunits counted, not the complex).
    pub proteins: usize,
    /// Of those, how many the network has.
    pub proteins_known: usize,
    /// A warning when most of the list's proteins are unknown, with the identifier type the
    /// list seems to use and the network's.
    pub warning: Option<String>,
}

impl Overlay {
    /// The classified rows as TSV: line, a, b, the row's score, status, the network's score,
    /// whether a side is a complex.
    pub fn tsv(&self) -> String {
        let mut t = String::from("line\ta\tb\tscore\tstatus\tdb_score\tcomplex\n");
        for r in &self.rows {
            let num = |x: Option<f32>| x.map_or(String::new(), |s| s.to_string());
            t += &format!(
                "{}\t{}\t{}\t{}\t{}\t{}\t{}\n",
                r.pair.line,
                r.pair.a,
                r.pair.b,
                num(r.pair.score),
                r.status.name(),
                num(r.db_score),
                if r.complex { "yes" } else { "" }
            );
        }
        t
    }

    /// Rows with a complex on a side.
    pub fn complexes(&self) -> usize {
        self.rows.iter().filter(|r| r.complex).count()
    }

    /// Rows per status, in [`Status`]'s order.
    pub fn counts(&self) -> Vec<(Status, usize)> {
        [Status::Known, Status::NewBetweenKnown, Status::NewProtein, Status::SelfPair, Status::Duplicate]
            .into_iter()
            .map(|s| (s, self.rows.iter().filter(|r| r.status == s).count()))
            .collect()
    }
}

/// The subunits of `name` if it names a complex (`A_B[_C...]`, at least two non-empty parts),
/// whatever network it is looked up in.
pub fn complex_parts(name: &str) -> Option<Vec<&str>> {
    let parts: Vec<&str> = name.split('_').collect();
    (parts.len() >= 2 && parts.iter().all(|p| !p.is_empty())).then_some(parts)
}

/// The proteins `name` stands for in `net`: itself if the network has it or it is no complex,
/// else its subunits.
pub fn members<'a>(net: &Network, name: &'a str) -> Vec<&'a str> {
    match complex_parts(name) {
        Some(parts) if net.nodes.get(name).is_none() => parts,
        _ => vec![name],
    }
}

/// Classifies `list` against `net`.
pub fn overlay(net: &Network, list: &PairList) -> Overlay {
    let mut seen = HashSet::new();
    let mut proteins = HashSet::new();
    let rows = list
        .pairs
        .iter()
        .map(|p| {
            let (ma, mb) = (members(net, &p.a), members(net, &p.b));
            proteins.extend(ma.iter().chain(&mb).copied());
            let complex = ma.len() > 1 || mb.len() > 1;
            let key = if p.a <= p.b { (p.a.as_str(), p.b.as_str()) } else { (p.b.as_str(), p.a.as_str()) };
            let (status, db_score) = if p.a == p.b {
                (Status::SelfPair, None)
            } else if !seen.insert(key) {
                (Status::Duplicate, None)
            } else {
                let ids = |m: &[&str]| m.iter().map(|n| net.nodes.get(n)).collect::<Option<Vec<u32>>>();
                match (ids(&ma), ids(&mb)) {
                    (Some(xs), Some(ys)) => {
                        // a complex's interaction is known when a pair of its subunits interacts
                        let best = xs
                            .iter()
                            .flat_map(|&x| ys.iter().filter_map(move |&y| if x == y { None } else { net.edge(x, y) }))
                            .max_by(f32::total_cmp);
                        match best {
                            Some(s) => (Status::Known, Some(s)),
                            None => (Status::NewBetweenKnown, None),
                        }
                    }
                    _ => (Status::NewProtein, None),
                }
            };
            Row { pair: p.clone(), status, db_score, complex }
        })
        .collect();
    let known = proteins.iter().filter(|n| net.nodes.get(n).is_some()).count();
    let warning = (proteins.len() >= 4 && known * 2 < proteins.len()).then(|| {
        let sample: Vec<&str> = proteins.iter().copied().filter(|n| net.nodes.get(n).is_none()).take(200).collect();
        let upper = sample.iter().filter(|n| net.nodes.get(&n.to_ascii_uppercase()).is_some()).count();
        format!(
            "{} of the list's {} proteins are not in the network: the list's identifiers look like {}, the network's like {}{}",
            proteins.len() - known,
            proteins.len(),
            id_type(&sample),
            id_type(&(0..net.node_count().min(200) as u32).map(|v| net.nodes.name(v)).collect::<Vec<_>>()),
            if upper * 2 > sample.len() {
                " (upper-casing them would match: human symbols are upper case, mouse ones capitalised)"
            } else {
                ""
            }
        )
    });
    Overlay { rows, proteins: proteins.len(), proteins_known: known, warning }
}

/// The identifier type most of `names` look like.
pub fn id_type(names: &[&str]) -> &'static str {
    let kind = |n: &str| -> &'static str {
        let b = n.as_bytes();
        if n.starts_with("ENSG") || n.starts_with("ENSMUSG") {
            "Ensembl gene ids"
        } else if n.starts_with("ENSP") || n.starts_with("ENSMUSP") {
            "Ensembl protein ids"
        } else if n.contains('.') && n.split('.').next().is_some_and(|t| t.bytes().all(|c| c.is_ascii_digit())) {
            "STRING ids (taxon.protein)"
        } else if !b.is_empty() && b.iter().all(u8::is_ascii_digit) {
            "Entrez gene ids"
        } else if b.len() >= 6
            && matches!(b[0], b'O' | b'P' | b'Q' | b'A'..=b'N' | b'R'..=b'Z')
            && b[1].is_ascii_digit()
            && b.iter().all(u8::is_ascii_alphanumeric)
            && b.len() <= 10
            && b[b.len() - 1].is_ascii_digit()
        {
            "UniProt accessions"
        } else {
            "gene symbols"
        }
    };
    let mut counts: Vec<(&'static str, usize)> = Vec::new();
    for n in names {
        let k = kind(n);
        match counts.iter_mut().find(|c| c.0 == k) {
            Some(c) => c.1 += 1,
            None => counts.push((k, 1)),
        }
    }
    counts.into_iter().max_by_key(|c| c.1).map_or("nothing", |c| c.0)
}
