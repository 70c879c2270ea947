/// Errors of the profiler.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ProfileError {
    /// Two inputs that must have the same shape do not.
    #[error("shape mismatch: {0}")]
    Shape(String),
}

/// Result alias.
pub type Result<T, E = ProfileError> = std::result::Result<T, E>;
