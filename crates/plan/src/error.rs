use std::fmt;

/// Everything that can go wrong while describing, costing or planning.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PlanError {
    /// A description (TOML) could not be parsed.
    #[error("{what}: {source}\n  hint: compare with the files under configs/ (every field is documented in docs/SIMULATION.md)")]
    Parse {
        /// Which description (e.g. `model file`).
        what: String,
        /// The parser's message, with line and column.
        #[source]
        source: toml::de::Error,
    },
    /// A description parsed but is inconsistent (zero nodes, efficiency above one, ...).
    #[error("invalid {what}: {why}")]
    Invalid {
        /// Which description or option.
        what: String,
        /// What is wrong and what to change.
        why: String,
    },
    /// No plan satisfies the constraints (usually memory).
    #[error("no feasible plan: {why}\n  hint: {hint}")]
    Infeasible {
        /// Which constraint cannot be met, with the numbers.
        why: String,
        /// What to change.
        hint: String,
    },
    /// The solver failed or stopped without an optimal answer.
    #[error("solver (HiGHS) failed: {0}")]
    Solver(String),
    /// A brute-force search was asked for an instance too large to enumerate.
    #[error("brute force would enumerate {combinations} combinations (limit {limit}); use the ILP")]
    TooLarge {
        /// Number of combinations the search would visit.
        combinations: f64,
        /// The limit.
        limit: f64,
    },
}

impl PlanError {
    pub(crate) fn invalid(what: impl fmt::Display, why: impl fmt::Display) -> Self {
        PlanError::Invalid { what: what.to_string(), why: why.to_string() }
    }
}

/// Result alias for this crate.
pub type Result<T, E = PlanError> = std::result::Result<T, E>;
