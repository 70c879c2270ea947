/// Errors of the trainer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TrainError {
    /// A configuration is invalid.
    #[error("invalid training configuration: {0}")]
    Config(String),
    /// The data cannot be used.
    #[error("training data {path}: {why}")]
    Data {
        /// The file.
        path: String,
        /// Why.
        why: String,
    },
    /// candle failed.
    #[error("tensor computation failed: {0}")]
    Candle(#[from] candle_core::Error),
    /// Communication failed.
    #[error(transparent)]
    Transport(#[from] ironweave_transport::Error),
    /// Checkpointing failed.
    #[error(transparent)]
    Ckpt(#[from] ironweave_ckpt::CkptError),
    /// Sharding failed.
    #[error(transparent)]
    Sdp(#[from] ironweave_sdp::SdpError),
}

/// Result alias.
pub type Result<T, E = TrainError> = std::result::Result<T, E>;
