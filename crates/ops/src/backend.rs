//! Backends for the command line, through the `ironweave` facade: a name is checked (compiled
//! in?) before any process starts, and each rank joins over the named backend.

use ironweave::{Backend, Communicator, Result};

pub use ironweave::doctor;

/// Checks a backend name (`tcp`, `ucx`, `verbs`, `nccl`, `auto`) and that it was compiled in.
pub fn check(name: &str) -> Result<()> {
    Backend::pick(name).map(drop)
}

/// Joins the job in the environment over the named backend (compute threads set first).
pub fn connect(name: &str) -> Result<Communicator> {
    ironweave::init(Backend::pick(name)?)
}
