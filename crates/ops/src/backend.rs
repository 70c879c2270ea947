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

/// `ironweave doctor`'s options.
#[derive(Debug, Clone, clap::Args)]
pub struct DoctorArgs {
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// `ironweave doctor`: every backend, compiled in or not, usable here or why not, and its
/// links; a table, or JSON with `--json`.
pub fn doctor_command(a: &DoctorArgs) -> crate::Result<i32> {
    let reports = doctor();
    if a.json {
        println!("{}", serde_json::to_string_pretty(&reports)?);
        return Ok(0);
    }
    for r in &reports {
        let state = match (r.compiled, r.usable) {
            (false, _) => "not compiled",
            (true, true) => "usable",
            (true, false) => "NOT usable",
        };
        println!("{:<6} {:<13} {}", r.backend, state, r.detail);
        for l in &r.links {
            println!("       {} {:<16} {}", if l.usable { "ok " } else { "BAD" }, l.name, l.detail);
        }
    }
    Ok(0)
}
