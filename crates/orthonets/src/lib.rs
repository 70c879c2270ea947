//! # ironweave-orthonets
//!
//! OrthoNets as a library: protein–protein interaction networks of two organisms, the orthology
//! between them, and the questions asked of the pair — which edges are conserved (an ortholog of
//! each end interacts in the other organism), and, later in this crate's plan, a user's
//! experimental pairs overlaid on the database network and validated by their interologs.
//!
//! An application of the workspace, like `crates/airq`: it uses nothing of ironweave's
//! training runtime. Inputs are ordinary files (TSV/CSV edge lists, STRING's links, ortholog
//! tables from BioMart and HCOP), read by [`read`] with typed errors that name the file and
//! the line; identifiers are interned ([`graph::Interner`]) and adjacency is compressed
//! ([`graph::Network`], CSR), so STRING's human network loads in a fraction of a second.
//!
//! ```no_run
//! use ironweave_orthonets::{edges, ortho, conserved};
//! let human = edges::load("string_links.csv".as_ref(), &edges::Columns::Auto)?;
//! let mouse = edges::load("biogrid-mouse-3.4.128.tsv.gz".as_ref(), &edges::Columns::Auto)?;
//! let map = ortho::load("human_to_mouse.csv".as_ref(), &human.net, &mouse.net)?;
//! let proj = conserved::Projection::new(&map.orthology, &human.net, &mouse.net);
//! println!("{} human edges conserved in mouse", conserved::count(&human.net, &mouse.net, &proj));
//! # Ok::<(), ironweave_orthonets::Error>(())
//! ```

pub mod annot;
pub mod conserved;
pub mod data;
pub mod edges;
pub mod export;
pub mod graph;
pub mod html;
pub mod ortho;
pub mod overlay;
pub mod read;
pub mod validate;
pub mod view;

use std::path::PathBuf;

/// Everything that can go wrong reading or relating networks; every variant names the file
/// (and the line, where there is one) and says what to do.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The file cannot be opened or read (a truncated `.gz` lands here too).
    #[error("{}: {detail}", path.display())]
    Io { path: PathBuf, detail: String },
    /// A line that does not parse.
    #[error("{}:{line}: {detail}", path.display())]
    Parse { path: PathBuf, line: usize, detail: String },
    /// A file whose shape is wrong as a whole (empty, one column, no known layout, the wrong
    /// species).
    #[error("{}: {detail}", path.display())]
    Format { path: PathBuf, detail: String },
    /// A name asked for (a seed protein) that the input lacks.
    #[error("{name:?}: {detail}")]
    Unknown { name: String, detail: String },
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
