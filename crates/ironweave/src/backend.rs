//! Choosing a backend by name among those compiled in, and joining the job over it.

use std::fmt;
use std::str::FromStr;

use ironweave_transport::rendezvous::JobEnv;
use ironweave_transport::{CommOptions, Communicator, Error, Result};

/// A transport backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Backend {
    /// Pure Rust over `std::net` (always compiled).
    Tcp,
    /// UCX: shared memory and TCP links (feature `ucx`; libucp is loaded at run time).
    Ucx,
    /// Raw InfiniBand verbs (feature `verbs`).
    Verbs,
    /// NCCL on CUDA devices, host traffic over TCP (feature `nccl`; loaded at run time).
    Nccl,
}

impl Backend {
    /// Every backend, in the order `auto` tries the fast ones.
    pub const ALL: [Backend; 4] = [Backend::Tcp, Backend::Ucx, Backend::Verbs, Backend::Nccl];

    /// Its name (`tcp`, `ucx`, `verbs`, `nccl`), also the cargo feature that compiles it.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Tcp => "tcp",
            Backend::Ucx => "ucx",
            Backend::Verbs => "verbs",
            Backend::Nccl => "nccl",
        }
    }

    /// Whether this build has it.
    pub fn compiled(self) -> bool {
        match self {
            Backend::Tcp => true,
            Backend::Ucx => cfg!(feature = "ucx"),
            Backend::Verbs => cfg!(feature = "verbs"),
            Backend::Nccl => cfg!(feature = "nccl"),
        }
    }

    /// `Ok` if compiled in, else `NotCompiledWith` naming the feature to build with.
    pub fn check(self) -> Result<()> {
        if self.compiled() {
            Ok(())
        } else {
            Err(Error::NotCompiledWith { feature: self.name() })
        }
    }

    /// Whether it can run here (library found, devices present), or why not.
    pub fn usable(self) -> Result<()> {
        self.check()?;
        match self {
            Backend::Tcp => Ok(()),
            Backend::Ucx => ucx::available().map(drop),
            Backend::Verbs => verbs::available(),
            Backend::Nccl => nccl::available(),
        }
    }

    /// The backend named by `name`: one of the four, or `auto` (UCX where compiled in and
    /// usable here, else TCP).
    pub fn pick(name: &str) -> Result<Backend> {
        if name.trim() == "auto" {
            return Ok(if Backend::Ucx.usable().is_ok() { Backend::Ucx } else { Backend::Tcp });
        }
        let b: Backend = name.parse()?;
        b.check()?;
        Ok(b)
    }

    /// `IRONWEAVE_BACKEND` (default `tcp`), resolved by [`Backend::pick`].
    pub fn from_env() -> Result<Backend> {
        Backend::pick(&std::env::var("IRONWEAVE_BACKEND").unwrap_or_else(|_| "tcp".into()))
    }
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Backend {
    type Err = Error;

    fn from_str(s: &str) -> Result<Backend> {
        Backend::ALL
            .into_iter()
            .find(|b| b.name() == s.trim())
            .ok_or_else(|| Error::InvalidArgument(format!("unknown backend {s:?}; choose one of tcp, ucx, verbs, nccl, or auto")))
    }
}

/// Joins the job described by `env` over `backend`, each backend configured from its own
/// environment variables (`IRONWEAVE_TCP_LINKS`, `IRONWEAVE_UCX_LINKS`, ...). Every wait of the
/// joining itself (rendezvous, connecting the links) has `opts.timeout`, as every wait after it
/// does.
pub fn connect(backend: Backend, env: &JobEnv, opts: CommOptions) -> Result<Communicator> {
    backend.check()?;
    match backend {
        Backend::Tcp => ironweave_tcp::connect(env, &tcp_config(&opts)?, opts),
        Backend::Ucx => ucx::connect(env, opts),
        Backend::Verbs => verbs::connect(env, opts),
        Backend::Nccl => nccl::connect(env, opts),
    }
}

/// The TCP configuration from the environment, its joining waits bounded by `opts.timeout`
/// (TCP links, and NCCL's bootstrap over them).
fn tcp_config(opts: &CommOptions) -> Result<ironweave_tcp::TcpConfig> {
    Ok(ironweave_tcp::TcpConfig { timeout: opts.timeout, ..ironweave_tcp::TcpConfig::from_env()? })
}

/// Joins the job in the environment over `backend`; compute threads are set first (see
/// [`init_from_env`]).
pub fn init(backend: Backend) -> Result<Communicator> {
    let env = JobEnv::from_env()?;
    ironweave_transport::threads::apply_to_process(env.local_world_size)?;
    connect(backend, &env, CommOptions::from_env()?)
}

/// Joins the job in the environment over the backend `IRONWEAVE_BACKEND` names (default
/// `tcp`; `auto`: UCX if compiled in and usable, else TCP). Before anything else it gives this
/// rank `cores / ranks on this host` compute threads unless the user set `RAYON_NUM_THREADS` or
/// `OMP_NUM_THREADS` (see `transport::threads`): call it first in `main`, before other threads
/// start.
pub fn init_from_env() -> Result<Communicator> {
    init(Backend::from_env()?)
}

// One module per optional backend: what it can do here, joining over it, and what the doctor
// reports; a backend left out of the build gets the stub below instead.

/// One link of a backend.
#[derive(Debug, Clone, serde::Serialize)]
pub struct LinkReport {
    /// The link's (or device's) name.
    pub name: String,
    /// Whether it works here.
    pub usable: bool,
    /// What was found, or why it does not work.
    pub detail: String,
}

#[cfg(feature = "ucx")]
pub(crate) mod ucx {
    use super::LinkReport;
    use super::*;
    pub fn available() -> Result<String> {
        ironweave_ucx::available()
    }
    pub fn connect(env: &JobEnv, opts: CommOptions) -> Result<Communicator> {
        let cfg = ironweave_ucx::UcxConfig { timeout: opts.timeout, ..ironweave_ucx::UcxConfig::from_env()? };
        ironweave_ucx::connect(env, &cfg, opts)
    }
    pub fn doctor() -> Result<(String, Vec<LinkReport>)> {
        let version = ironweave_ucx::available()?;
        let specs = ironweave_ucx::parse_links("shm,tcp")?;
        let links = ironweave_ucx::probe_links(&specs)
            .into_iter()
            .zip(&specs)
            .map(|((name, r), spec)| LinkReport {
                name,
                usable: r.is_ok(),
                detail: match r {
                    Ok(()) => format!("UCX_TLS={}", spec.tls.as_deref().unwrap_or("default")),
                    Err(e) => e.to_string(),
                },
            })
            .collect();
        Ok((version, links))
    }
}

#[cfg(feature = "verbs")]
pub(crate) mod verbs {
    use super::LinkReport;
    use super::*;
    pub fn available() -> Result<()> {
        ironweave_verbs::available().map(drop)
    }
    pub fn connect(env: &JobEnv, opts: CommOptions) -> Result<Communicator> {
        let cfg = ironweave_verbs::VerbsConfig { timeout: opts.timeout, ..ironweave_verbs::VerbsConfig::from_env()? };
        ironweave_verbs::connect(env, &cfg, opts)
    }
    pub fn doctor() -> Result<(String, Vec<LinkReport>)> {
        let devs = ironweave_verbs::available()?;
        let links = devs
            .iter()
            .map(|d| LinkReport { name: format!("verbs:{}", d.name), usable: d.active_ports > 0, detail: d.to_string() })
            .collect();
        Ok((format!("{} RDMA device(s)", devs.len()), links))
    }
}

#[cfg(feature = "nccl")]
pub(crate) mod nccl {
    use super::LinkReport;
    use super::*;
    pub fn available() -> Result<()> {
        ironweave_nccl::available().map(drop)
    }
    pub fn connect(env: &JobEnv, opts: CommOptions) -> Result<Communicator> {
        ironweave_nccl::connect(env, &tcp_config(&opts)?, opts)
    }
    pub fn doctor() -> Result<(String, Vec<LinkReport>)> {
        let info = ironweave_nccl::available()?;
        let links = (0..info.devices)
            .map(|d| LinkReport { name: format!("nccl:cuda{d}"), usable: true, detail: "CUDA device".into() })
            .collect();
        Ok((info.to_string(), links))
    }
}

/// A backend left out of this build: the same functions, answering NotCompiledWith.
#[allow(unused_macros)] // unused when every backend is compiled in
macro_rules! stub {
    ($m:ident, $f:literal, $avail:ty) => {
        #[allow(dead_code)]
        pub(crate) mod $m {
            use super::LinkReport;
            use super::*;
            pub fn available() -> Result<$avail> {
                Err(Error::NotCompiledWith { feature: $f })
            }
            pub fn connect(_: &JobEnv, _: CommOptions) -> Result<Communicator> {
                Err(Error::NotCompiledWith { feature: $f })
            }
            pub fn doctor() -> Result<(String, Vec<LinkReport>)> {
                Err(Error::NotCompiledWith { feature: $f })
            }
        }
    };
}
#[cfg(not(feature = "ucx"))]
stub!(ucx, "ucx", String);
#[cfg(not(feature = "verbs"))]
stub!(verbs, "verbs", ());
#[cfg(not(feature = "nccl"))]
stub!(nccl, "nccl", ());

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_unknown_ones_are_refused() {
        for b in Backend::ALL {
            assert_eq!(b.name().parse::<Backend>().unwrap(), b);
        }
        let e = "mpi".parse::<Backend>().unwrap_err().to_string();
        assert!(e.contains("unknown backend \"mpi\"") && e.contains("auto"), "{e}");
    }

    #[test]
    fn a_backend_left_out_names_its_feature() {
        for b in Backend::ALL {
            match b.check() {
                Ok(()) => assert!(b.compiled()),
                Err(Error::NotCompiledWith { feature }) => assert_eq!(feature, b.name()),
                Err(e) => panic!("{b}: {e}"),
            }
        }
        assert!(Backend::Tcp.usable().is_ok());
        // auto always lands on something compiled in
        assert!(Backend::pick("auto").unwrap().compiled());
    }
}
