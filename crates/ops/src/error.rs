//! The one error type of `ironweave-ops`: the typed errors of the crates below, kept as they
//! are (a caller can match on a transport or checkpoint failure), plus what an operation
//! itself refuses ([`Error::Msg`]: what is wrong and what to do) and the context an operation
//! adds on the way up ([`Error::Context`]; the binary prints the whole chain).

use std::fmt::Display;

/// An operation's failure.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Input an operation cannot take, or a run that did not go as it must; says what to do.
    #[error("{0}")]
    Msg(String),
    /// What was being done when `source` happened.
    #[error("{context}")]
    Context {
        /// What the operation was doing.
        context: String,
        /// What went wrong.
        #[source]
        source: Box<Error>,
    },
    /// The run ended with this exit status after saying why (a rank that cannot recover its
    /// committed state: [`ironweave::elastic::EXIT_UNRECOVERABLE`], which the launcher does not
    /// restart); the binary exits with it and prints nothing more.
    #[error("the run ended with exit status {0} (the reason was printed above)")]
    Exit(i32),
    /// A file or process could not be read, written or started.
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// A JSON file or message that does not decode.
    #[error(transparent)]
    Json(#[from] serde_json::Error),
    /// A TOML file that does not decode.
    #[error(transparent)]
    Toml(#[from] toml::de::Error),
    /// The transport (a peer lost, a deadline passed, a bad configuration).
    #[error(transparent)]
    Transport(#[from] ironweave::transport::Error),
    /// The checkpoint engine.
    #[error(transparent)]
    Ckpt(#[from] ironweave::ckpt::CkptError),
    /// The in-job recovery runtime.
    #[error(transparent)]
    Elastic(#[from] ironweave::elastic::Error),
    /// The reference workload.
    #[error(transparent)]
    Train(#[from] ironweave_train::TrainError),
    /// The sharded engine.
    #[error(transparent)]
    Sdp(#[from] ironweave_sdp::SdpError),
    /// The planners.
    #[error(transparent)]
    Plan(#[from] ironweave_plan::PlanError),
    /// The simulator.
    #[error(transparent)]
    Sim(#[from] ironweave_sim::SimError),
    /// The overlap scheduler.
    #[error(transparent)]
    Overlap(#[from] ironweave_overlap::OverlapError),
    /// The profiler.
    #[error(transparent)]
    Profile(#[from] ironweave_profile::ProfileError),
    /// A byte size (`4K`, `16M`) that does not parse.
    #[error(transparent)]
    Size(#[from] ironweave_units::ParseError),
    /// A number that does not parse.
    #[error(transparent)]
    Int(#[from] std::num::ParseIntError),
    /// A number that does not parse.
    #[error(transparent)]
    Float(#[from] std::num::ParseFloatError),
    /// A number out of range.
    #[error(transparent)]
    Range(#[from] std::num::TryFromIntError),
    /// An environment variable that is missing or not text.
    #[error(transparent)]
    Env(#[from] std::env::VarError),
}

impl Error {
    /// The exit status a run chose ([`Error::Exit`], under any context), if it did.
    pub fn exit_status(&self) -> Option<i32> {
        match self {
            Error::Exit(code) => Some(*code),
            Error::Context { source, .. } => source.exit_status(),
            _ => None,
        }
    }

    /// An error saying `msg`.
    pub fn msg(msg: impl Display) -> Self {
        Error::Msg(msg.to_string())
    }

    /// This error with `c` as what was being done.
    pub fn context(self, c: impl Display) -> Self {
        Error::Context { context: c.to_string(), source: Box::new(self) }
    }

    /// Whether `pred` holds for this error or any error under it.
    pub fn any_in_chain(&self, pred: impl Fn(&Error) -> bool) -> bool {
        let mut e = self;
        loop {
            if pred(e) {
                return true;
            }
            match e {
                Error::Context { source, .. } => e = source,
                _ => return false,
            }
        }
    }
}

/// Result of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// `.context(..)` / `.with_context(..)` on results and options: what was being done.
pub trait Context<T> {
    /// Adds `c` as what was being done.
    fn context<C: Display>(self, c: C) -> Result<T>;
    /// Adds what `f` says as what was being done (evaluated only on failure).
    fn with_context<C: Display, F: FnOnce() -> C>(self, f: F) -> Result<T>;
}

impl<T, E: Into<Error>> Context<T> for std::result::Result<T, E> {
    fn context<C: Display>(self, c: C) -> Result<T> {
        self.map_err(|e| Error::Context { context: c.to_string(), source: Box::new(e.into()) })
    }
    fn with_context<C: Display, F: FnOnce() -> C>(self, f: F) -> Result<T> {
        self.map_err(|e| Error::Context { context: f().to_string(), source: Box::new(e.into()) })
    }
}

impl<T> Context<T> for Option<T> {
    fn context<C: Display>(self, c: C) -> Result<T> {
        self.ok_or_else(|| Error::Msg(c.to_string()))
    }
    fn with_context<C: Display, F: FnOnce() -> C>(self, f: F) -> Result<T> {
        self.ok_or_else(|| Error::Msg(f().to_string()))
    }
}

/// Returns early with an [`Error::Msg`] formatted like `format!`.
macro_rules! bail {
    ($($t:tt)*) => {
        return Err($crate::error::Error::Msg(format!($($t)*)))
    };
}
pub(crate) use bail;

/// An [`Error::Msg`] formatted like `format!`.
macro_rules! err {
    ($($t:tt)*) => {
        $crate::error::Error::Msg(format!($($t)*))
    };
}
pub(crate) use err;
