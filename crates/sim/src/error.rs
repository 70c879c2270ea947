/// Errors of the simulator.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SimError {
    /// The op graph is malformed (forward dependency, unknown resource, negative amount).
    #[error("invalid op graph: {0}")]
    BadDag(String),
    /// A scenario's inputs are inconsistent.
    #[error("invalid scenario input: {0}")]
    Invalid(String),
    /// The planner failed.
    #[error(transparent)]
    Plan(#[from] ironweave_plan::PlanError),
}

/// Result alias.
pub type Result<T, E = SimError> = std::result::Result<T, E>;
