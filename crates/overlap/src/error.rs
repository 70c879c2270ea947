/// Errors of the overlap scheduler.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OverlapError {
    /// The program or schedule is malformed.
    #[error("invalid overlap program: {0}")]
    Program(String),
    /// A collective failed (a peer died, a deadline passed).
    #[error(transparent)]
    Transport(#[from] ironweave_transport::Error),
    /// The model's compute task failed.
    #[error("compute task {stage} (sub-batch {sub}) failed: {source}")]
    Compute {
        /// Stage name.
        stage: String,
        /// Sub-batch.
        sub: usize,
        /// What the model code reported.
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

/// Result alias.
pub type Result<T, E = OverlapError> = std::result::Result<T, E>;
