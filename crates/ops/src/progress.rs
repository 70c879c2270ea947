//! Progress people expect on long work: a bar with ETA when stderr is a terminal, one plain
//! line per step on stderr (with an ETA too) when it is not (logs, CI, pipes), nothing with
//! `--quiet`. Results (tables, summaries) go to stdout, progress never does.

use std::io::IsTerminal;
use std::time::Instant;

use indicatif::{ProgressBar, ProgressStyle};

/// How progress is shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Bar,
    Lines,
    Quiet,
}

/// Set (to 1) by `--quiet` for every process a command starts; every [`Progress`] obeys it.
pub const QUIET_VAR: &str = "IRONWEAVE_QUIET";

fn quiet_env() -> bool {
    std::env::var(QUIET_VAR).is_ok_and(|v| v == "1")
}

impl Mode {
    /// A bar on a terminal, lines elsewhere ([`Progress::new`] turns either off when
    /// `IRONWEAVE_QUIET=1`).
    pub fn detect() -> Mode {
        if std::io::stderr().is_terminal() {
            Mode::Bar
        } else {
            Mode::Lines
        }
    }
}

/// Progress of `len` steps of something.
#[derive(Debug)]
pub struct Progress {
    mode: Mode,
    bar: Option<ProgressBar>,
    what: String,
    len: u64,
    start: Instant,
    first: u64,
}

impl Progress {
    /// Starts at step `first` (a resumed run starts past 0).
    pub fn new(what: &str, first: u64, len: u64, mode: Mode) -> Progress {
        let mode = if quiet_env() { Mode::Quiet } else { mode };
        let bar = (mode == Mode::Bar).then(|| {
            let b = ProgressBar::new(len);
            b.set_style(
                ProgressStyle::with_template("{prefix} [{bar:30}] {pos}/{len} ETA {eta} {msg}")
                    .unwrap_or_else(|_| ProgressStyle::default_bar())
                    .progress_chars("=> "),
            );
            b.set_prefix(what.to_string());
            b.set_position(first);
            b
        });
        Progress { mode, bar, what: what.to_string(), len, start: Instant::now(), first }
    }

    /// Step `pos` is done; `msg` says how it went.
    pub fn step(&self, pos: u64, msg: &str) {
        match (&self.bar, self.mode) {
            (Some(b), _) => {
                b.set_position(pos);
                b.set_message(msg.to_string());
            }
            (None, Mode::Lines) => {
                let done = pos.saturating_sub(self.first);
                let eta = if done > 0 {
                    let per = self.start.elapsed().as_secs_f64() / done as f64;
                    format!(", ETA {:.0} s", per * self.len.saturating_sub(pos) as f64)
                } else {
                    String::new()
                };
                eprintln!("{} {pos}/{}{eta}: {msg}", self.what, self.len);
            }
            _ => {}
        }
    }

    /// Clears the bar.
    pub fn finish(&self) {
        if let Some(b) = &self.bar {
            b.finish_and_clear();
        }
    }
}
