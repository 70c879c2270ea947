//! Backend selection by name. Backends that were not compiled in return
//! `Error::NotCompiledWith`, so callers need no `cfg`.

use ironweave_transport::{Communicator, Error, Result};

/// Names accepted by `--backend`.
pub const NAMES: [&str; 4] = ["tcp", "ucx", "verbs", "nccl"];

/// Joins the job in the environment over the named backend.
pub fn connect(name: &str) -> Result<Communicator> {
    match name {
        "tcp" => ironweave_tcp::init_from_env(),
        "ucx" => Err(Error::NotCompiledWith { feature: "ucx" }),
        "verbs" => Err(Error::NotCompiledWith { feature: "verbs" }),
        "nccl" => Err(Error::NotCompiledWith { feature: "nccl" }),
        other => Err(Error::InvalidArgument(format!("unknown backend {other:?}; choose one of {NAMES:?}"))),
    }
}

/// Checks a backend name before any process is started.
pub fn check(name: &str) -> Result<()> {
    match name {
        "tcp" => Ok(()),
        "ucx" | "verbs" | "nccl" => Err(Error::NotCompiledWith {
            feature: match name {
                "ucx" => "ucx",
                "verbs" => "verbs",
                _ => "nccl",
            },
        }),
        other => Err(Error::InvalidArgument(format!("unknown backend {other:?}; choose one of {NAMES:?}"))),
    }
}
