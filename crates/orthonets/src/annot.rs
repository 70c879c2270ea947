//! Annotations of organism 1's proteins: gene names and GO terms (Bioconductor's
//! `org.Hs.eg.db` and `GO.db`, exported to TSV by `scripts/deps.sh`) and the diseases HPO
//! links to each gene (`genes_to_phenotype.txt`, names from `phenotype.hpoa`). Aggregated per
//! protein, per pair (the GO terms both carry) and per view (the terms and diseases most of
//! what is shown carries).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::read::{records, Records};
use crate::{Error, Result};

/// A GO term or a disease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Term {
    /// `GO:0005515`, `OMIM:619340`, `ORPHA:...`.
    pub id: String,
    /// Its name (the id itself when no name was found).
    pub name: String,
    /// `BP`, `MF`, `CC` for GO terms; the database (`OMIM`, `ORPHA`, `DECIPHER`) for diseases.
    pub kind: String,
}

/// Terms with how many of a set of genes carry each, most first.
pub type Counted<'a> = Vec<(&'a Term, usize)>;

/// Where the annotations come from; any may be left out.
#[derive(Debug, Clone, Default)]
pub struct Sources {
    /// `symbol, gene_id, gene_name` (org.Hs.eg.db's `gene_info`).
    pub genes: Option<PathBuf>,
    /// `symbol, go_id, ontology` (org.Hs.eg.db's `go`).
    pub go: Option<PathBuf>,
    /// `go_id, term, ontology` (GO.db's `go_term`).
    pub go_terms: Option<PathBuf>,
    /// HPO's `genes_to_phenotype.txt` (`gene_symbol`, `disease_id`).
    pub hpo_genes: Option<PathBuf>,
    /// HPO's `phenotype.hpoa` (`database_id`, `disease_name`).
    pub hpo_diseases: Option<PathBuf>,
}

impl Sources {
    /// The files named.
    pub fn paths(&self) -> Vec<&Path> {
        [&self.genes, &self.go, &self.go_terms, &self.hpo_genes, &self.hpo_diseases]
            .into_iter()
            .flatten()
            .map(PathBuf::as_path)
            .collect()
    }
}

/// One protein's annotations.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Protein<'a> {
    /// Entrez gene id.
    pub entrez: Option<&'a str>,
    /// The gene's full name.
    pub full_name: Option<&'a str>,
    /// GO terms, by id.
    pub go: Vec<&'a Term>,
    /// Diseases, by id.
    pub diseases: Vec<&'a Term>,
}

/// Annotations by gene symbol.
#[derive(Debug, Clone, Default)]
pub struct Annotations {
    genes: HashMap<String, (String, String)>,
    terms: Vec<Term>,
    diseases: Vec<Term>,
    go_of: HashMap<String, Vec<u32>>,
    diseases_of: HashMap<String, Vec<u32>>,
    /// What was read: one line per file, with its row count.
    pub provenance: Vec<String>,
}

/// The first record of `path` as a header naming `cols` (case-insensitive): their positions.
fn table(path: &Path, cols: &[&str]) -> Result<(Records, Vec<usize>)> {
    let mut rec = records(path)?;
    let mut f = Vec::new();
    rec.first_into(&mut f, "an annotation table needs a header and tab-separated columns")?;
    let pos = cols
        .iter()
        .map(|c| {
            f.iter().position(|h| h.eq_ignore_ascii_case(c)).ok_or_else(|| Error::Format {
                path: path.into(),
                detail: format!("no column {c:?} in the header ({}): expected columns {}", f.join(", "), cols.join(", ")),
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok((rec, pos))
}

/// Calls `row` with the named columns of every record after the header; the number of rows.
fn each_row(path: &Path, cols: &[&str], mut row: impl FnMut(&[&str])) -> Result<usize> {
    let (mut rec, pos) = table(path, cols)?;
    let width = pos.iter().max().map_or(0, |m| m + 1);
    let (mut f, mut n) = (Vec::new(), 0usize);
    while rec.next_into(&mut f)? {
        if f.len() < width {
            return Err(rec.error(format!("{} fields, the header has column {} ({})", f.len(), width, cols.join(", "))));
        }
        let v: Vec<&str> = pos.iter().map(|&i| f[i].as_str()).collect();
        row(&v);
        n += 1;
    }
    Ok(n)
}

impl Annotations {
    /// Reads what `src` names.
    pub fn load(src: &Sources) -> Result<Annotations> {
        let mut a = Annotations::default();
        if let Some(p) = &src.genes {
            let n = each_row(p, &["symbol", "gene_id", "gene_name"], |v| {
                a.genes.entry(v[0].to_owned()).or_insert_with(|| (v[1].to_owned(), v[2].to_owned()));
            })?;
            a.provenance.push(format!("gene names: {} ({n} rows)", p.display()));
        }
        let mut term_ids: HashMap<String, u32> = HashMap::new();
        if let Some(p) = &src.go_terms {
            let n = each_row(p, &["go_id", "term", "ontology"], |v| {
                term_ids.insert(v[0].to_owned(), a.terms.len() as u32);
                a.terms.push(Term { id: v[0].to_owned(), name: v[1].to_owned(), kind: v[2].to_owned() });
            })?;
            a.provenance.push(format!("GO term names: {} ({n} rows)", p.display()));
        }
        if let Some(p) = &src.go {
            let n = each_row(p, &["symbol", "go_id", "ontology"], |v| {
                let t = *term_ids.entry(v[1].to_owned()).or_insert_with(|| {
                    a.terms.push(Term { id: v[1].to_owned(), name: v[1].to_owned(), kind: v[2].to_owned() });
                    a.terms.len() as u32 - 1
                });
                a.go_of.entry(v[0].to_owned()).or_default().push(t);
            })?;
            a.provenance.push(format!("GO annotations: {} ({n} rows)", p.display()));
        }
        let mut disease_ids: HashMap<String, u32> = HashMap::new();
        if let Some(p) = &src.hpo_diseases {
            let n = each_row(p, &["database_id", "disease_name"], |v| {
                if !disease_ids.contains_key(v[0]) {
                    disease_ids.insert(v[0].to_owned(), a.diseases.len() as u32);
                    let kind = v[0].split_once(':').map_or("", |d| d.0).to_owned();
                    a.diseases.push(Term { id: v[0].to_owned(), name: v[1].to_owned(), kind });
                }
            })?;
            a.provenance.push(format!("disease names: {} ({n} rows)", p.display()));
        }
        if let Some(p) = &src.hpo_genes {
            let n = each_row(p, &["gene_symbol", "disease_id"], |v| {
                let d = *disease_ids.entry(v[1].to_owned()).or_insert_with(|| {
                    let kind = v[1].split_once(':').map_or("", |d| d.0).to_owned();
                    a.diseases.push(Term { id: v[1].to_owned(), name: v[1].to_owned(), kind });
                    a.diseases.len() as u32 - 1
                });
                a.diseases_of.entry(v[0].to_owned()).or_default().push(d);
            })?;
            a.provenance.push(format!("disease genes: {} ({n} rows)", p.display()));
        }
        for l in a.go_of.values_mut().chain(a.diseases_of.values_mut()) {
            l.sort_unstable();
            l.dedup();
        }
        Ok(a)
    }

    /// Genes with a GO term or a disease.
    pub fn annotated_genes(&self) -> usize {
        let mut n = self.go_of.len();
        n += self.diseases_of.keys().filter(|g| !self.go_of.contains_key(*g)).count();
        n
    }

    /// What is known of gene `symbol`.
    pub fn protein(&self, symbol: &str) -> Protein<'_> {
        let g = self.genes.get(symbol);
        Protein {
            entrez: g.map(|g| g.0.as_str()),
            full_name: g.map(|g| g.1.as_str()),
            go: self.go_of.get(symbol).map_or(&[][..], Vec::as_slice).iter().map(|&t| &self.terms[t as usize]).collect(),
            diseases: self
                .diseases_of
                .get(symbol)
                .map_or(&[][..], Vec::as_slice)
                .iter()
                .map(|&d| &self.diseases[d as usize])
                .collect(),
        }
    }

    /// The GO terms both `a` and `b` carry, by id.
    pub fn shared_go(&self, a: &str, b: &str) -> Vec<&Term> {
        let (x, y) = (self.go_of.get(a), self.go_of.get(b));
        let (Some(x), Some(y)) = (x, y) else { return Vec::new() };
        // both sorted: a merge
        let (mut i, mut j, mut out) = (0, 0, Vec::new());
        while i < x.len() && j < y.len() {
            match x[i].cmp(&y[j]) {
                std::cmp::Ordering::Less => i += 1,
                std::cmp::Ordering::Greater => j += 1,
                std::cmp::Ordering::Equal => {
                    out.push(&self.terms[x[i] as usize]);
                    i += 1;
                    j += 1;
                }
            }
        }
        out
    }

    /// The `k` GO terms and the `k` diseases carried by most of `genes`, with how many carry
    /// each (ties by id). GO's three roots (`GO:0003674`, `GO:0005575`, `GO:0008150`: "no
    /// more specific term known") are left out.
    pub fn top(&self, genes: &[&str], k: usize) -> (Counted<'_>, Counted<'_>) {
        const ROOTS: [&str; 3] = ["GO:0003674", "GO:0005575", "GO:0008150"];
        fn count<'t>(genes: &[&str], k: usize, of: &HashMap<String, Vec<u32>>, all: &'t [Term], skip: &[&str]) -> Counted<'t> {
            let mut c: HashMap<u32, usize> = HashMap::new();
            for g in genes {
                for &t in of.get(*g).map_or(&[][..], Vec::as_slice) {
                    *c.entry(t).or_default() += 1;
                }
            }
            let mut v: Vec<(&Term, usize)> =
                c.into_iter().map(|(t, n)| (&all[t as usize], n)).filter(|(t, _)| !skip.contains(&t.id.as_str())).collect();
            v.sort_by(|x, y| y.1.cmp(&x.1).then_with(|| x.0.id.cmp(&y.0.id)));
            v.truncate(k);
            v
        }
        (count(genes, k, &self.go_of, &self.terms, &ROOTS), count(genes, k, &self.diseases_of, &self.diseases, &[]))
    }
}
