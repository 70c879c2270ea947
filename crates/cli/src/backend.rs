//! Backend selection by name. A backend that was not compiled in returns
//! `Error::NotCompiledWith`, so callers need no `cfg`.

use ironweave_transport::{Communicator, Error, Result};

/// Names accepted by `--backend`.
pub const NAMES: [&str; 4] = ["tcp", "ucx", "verbs", "nccl"];

/// Joins the job in the environment over the named backend.
pub fn connect(name: &str) -> Result<Communicator> {
    check(name)?;
    ironweave_tcp::init_from_env()
}

/// Checks a backend name before any process is started.
pub fn check(name: &str) -> Result<()> {
    match name {
        "tcp" => Ok(()),
        "ucx" => missing("ucx", cfg!(feature = "ucx")),
        "verbs" => missing("verbs", cfg!(feature = "verbs")),
        "nccl" => missing("nccl", cfg!(feature = "nccl")),
        other => Err(Error::InvalidArgument(format!("unknown backend {other:?}; choose one of {NAMES:?}"))),
    }
}

/// The feature names are reserved; the backends behind them land in later work. Until then a
/// build that enables one says so instead of pretending a rebuild would help.
fn missing(feature: &'static str, enabled: bool) -> Result<()> {
    if enabled {
        Err(Error::Config(format!(
            "the `{feature}` feature is enabled but this version has no {feature} backend yet; use --backend tcp"
        )))
    } else {
        Err(Error::NotCompiledWith { feature })
    }
}
