use std::path::PathBuf;

/// Everything that can go wrong while checkpointing or restoring.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CkptError {
    /// A registration, configuration or argument is inconsistent.
    #[error("invalid checkpoint input: {0}")]
    Invalid(String),
    /// Data failed verification (checksum, length, manifest).
    #[error("corrupt checkpoint data ({what}): {detail}")]
    Corrupt {
        /// Which copy (e.g. `replica of rank 2 on rank 3`, a file path).
        what: String,
        /// What did not match.
        detail: String,
    },
    /// A file is not a checkpoint this engine can read (truncated, foreign, wrong format).
    #[error("{path}: not a readable checkpoint file: {why}")]
    Format {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        why: String,
    },
    /// A checkpoint's global layout does not fit the model or the loading layout: a tensor
    /// missing or of another shape, a slice outside its tensor, owner slices that overlap or
    /// leave a hole, a slice that failed its checksum.
    #[error("checkpoint layout: tensor `{tensor}`{}: {detail}", file.as_ref().map(|f| format!(" in {f}")).unwrap_or_default())]
    Layout {
        /// The global tensor.
        tensor: String,
        /// The file it was read from or found in, if one.
        file: Option<String>,
        /// What is wrong.
        detail: String,
    },
    /// No valid checkpoint anywhere.
    #[error("no valid checkpoint to restore: tried {tried}\n  hint: {hint}")]
    NothingToRestore {
        /// Every place looked at, with why it was rejected.
        tried: String,
        /// What to do.
        hint: String,
    },
    /// File system error.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// Copying the committed iteration into the memory that outlives the process
    /// ([`crate::EngineConfig::keep_dir`]) failed; the copies of the iteration before stay.
    #[error("cannot keep iteration {iter} in {dir}: {detail}\n  hint: {hint}")]
    Keep {
        /// The keep directory (of this rank).
        dir: PathBuf,
        /// The iteration being copied.
        iter: u64,
        /// What failed.
        detail: String,
        /// What to do.
        hint: String,
    },
    /// Transport error during replication or recovery.
    #[error(transparent)]
    Transport(#[from] ironweave_transport::Error),
}

impl CkptError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        CkptError::Io { path: path.into(), source }
    }
}

/// Result alias.
pub type Result<T, E = CkptError> = std::result::Result<T, E>;
