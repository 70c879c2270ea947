//! What the engine records of its collectives: the lane each ran on and when ([`CollSpan`]).

use std::sync::{Arc, Mutex};
use std::time::Instant;

use ironweave_units::Locked;
use serde::{Deserialize, Serialize};

/// The lane a collective ran on: each group has its own collective thread and link.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Lane {
    /// The all-rank group (the `full` part; `replicated`'s all-reduce).
    World,
    /// The host group (the `hybrid` part's gathers and reduce-scatters).
    Intra,
    /// The cross-host group (the `hybrid` part's all-reduce of shard gradients).
    Inter,
}

impl Lane {
    /// Every lane, in trace order.
    pub const ALL: [Lane; 3] = [Lane::World, Lane::Intra, Lane::Inter];
    /// Index in [`Lane::ALL`].
    pub fn index(self) -> usize {
        match self {
            Lane::World => 0,
            Lane::Intra => 1,
            Lane::Inter => 2,
        }
    }
}

/// One collective's time on its group's collective thread (when it started and ended there,
/// not when the caller waited).
#[derive(Debug, Clone)]
pub struct CollSpan {
    pub lane: Lane,
    /// `gather 3`, `reduce-scatter 3`, `all-reduce 3` (the layer).
    pub name: String,
    pub start: Instant,
    pub end: Instant,
    /// Elements of the buffer handed to the collective.
    pub elems: usize,
}

/// Where finished collectives are logged; shared by the engine and its handles.
pub(crate) type SpanLog = Arc<Mutex<Vec<CollSpan>>>;

pub(crate) fn log_span(log: &SpanLog, span: CollSpan) {
    log.locked().push(span);
}
