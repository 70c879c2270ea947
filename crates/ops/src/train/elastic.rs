//! A training rank's way into [`ironweave::elastic`]: joining the job, the `--fail` hook, what
//! rank 0 says of a recovery, and running the job to its end.

use std::path::Path;

use ironweave::ckpt::EngineConfig;

use crate::error::Result;
use std::path::PathBuf;

use crate::rundir::{append_line, mark_recovery};

/// This rank of an elastic job of `iters` iterations under `ecfg` (the launcher exports the
/// backend `ironweave train --backend` named); rank 0 says the compute threads chosen.
pub fn join_job(
    iters: u64,
    ecfg: EngineConfig,
    links: ironweave::elastic::CheckpointLinks,
    resume_from: Option<&Path>,
) -> Result<ironweave::elastic::Job> {
    let mut cfg = ironweave::elastic::Config::new(iters, ecfg);
    cfg.checkpoint_links = links;
    cfg.resume_from = resume_from.map(Path::to_path_buf);
    let job = ironweave::elastic::Job::from_env(cfg)?;
    if let (0, Some(t)) = (job.rank(), job.threads()) {
        eprintln!("ironweave train: {t}");
    }
    Ok(job)
}

/// The `--fail` hook of a rank: when `armed`, it kills this process with SIGKILL at the start
/// of layer `layer`'s backward in iteration `iter` (mid-backward: its peers are inside
/// collectives with it).
pub fn kill_hook(armed: bool, rank: usize, iter: u64, layer: usize) -> Box<dyn Fn(u64, usize) + Send> {
    Box::new(move |it, l| {
        if armed && it == iter && l == layer {
            eprintln!("rank {rank}: --fail: killing myself with SIGKILL in the backward of iteration {iter}, layer {layer}");
            // SAFETY: kill(2) on our own pid with a valid signal number.
            unsafe {
                libc::kill(libc::getpid(), libc::SIGKILL);
            }
        }
    })
}

/// What rank 0 says of a recovery (on stdout even with `--quiet`: a recovery is news) and
/// the marker `ironweave chaos` reads in `iterations.jsonl`.
pub fn say_recovery(r: &ironweave::elastic::Recovery, dir: &Path) -> Result<()> {
    use ironweave::elastic::RestoreSource;
    if r.source == RestoreSource::InitialState {
        println!("recovered: nothing was committed yet; every rank starts over from the initial state");
        return mark_recovery(dir, 0);
    }
    // an older iteration than one committed before: some rank's copies of the newer ones are
    // all gone (a rank died with its holders); said, not hidden, though training redoes them
    // to the same state
    if r.lost_committed() > 0 {
        eprintln!(
            "warning: iteration {} was committed but a rank's every copy of it is gone (a rank died with its replica holders; --replicas 3 keeps one more); restored iteration {}, {} committed iteration(s) to redo",
            r.committed_before.unwrap_or(0),
            r.iter,
            r.lost_committed()
        );
    }
    println!("recovered: every rank restored iteration {} (rank 0 from {})", r.iter, r.source.name());
    mark_recovery(dir, r.iter)
}

/// Runs an elastic job; a committed iteration that cannot be restored (rank 0 says what was
/// lost) or a checkpoint that cannot be resumed (every rank says which part failed) is
/// [`crate::Error::Exit`] with the runtime's exit status
/// ([`ironweave::elastic::EXIT_UNRECOVERABLE`], which the launcher does not restart).
pub fn run_elastic<W: ironweave::elastic::Worker>(
    job: ironweave::elastic::Job,
    w: &mut W,
) -> Result<ironweave::elastic::Finished> {
    let rank = job.rank();
    match job.run(w) {
        Ok(done) => Ok(done),
        Err(e @ ironweave::elastic::Error::Unrecoverable { .. }) => {
            if rank == 0 {
                eprintln!("rank 0: cannot recover: {e}");
            }
            Err(crate::Error::Exit(e.exit_code()))
        }
        Err(e @ ironweave::elastic::Error::JobFinished) => {
            // restarted after every rank passed the final barrier: nothing to do, and that
            // is success (exit status 0, as documented), not a failure the launcher reports
            eprintln!("rank {rank}: {e}");
            Err(crate::Error::Exit(e.exit_code()))
        }
        Err(e @ ironweave::elastic::Error::Transport(ironweave::transport::Error::Board { .. })) => {
            eprintln!("rank {rank}: {e}");
            Err(crate::Error::Exit(e.exit_code()))
        }
        Err(e @ ironweave::elastic::Error::Resume { .. }) => {
            // every rank says it: the one whose part failed names the tensor and the file
            eprintln!("rank {rank}: {e}");
            Err(crate::Error::Exit(e.exit_code()))
        }
        Err(e) => Err(e.into()),
    }
}

/// What a training run's rank 0 shows and records while it runs: its progress bar and its
/// per-iteration lines in `iterations.jsonl` (the report is built from them), and what it
/// says of a recovery. Every method is a no-op on the other ranks.
#[derive(Debug)]
pub struct RankLog {
    rank: usize,
    iters: u64,
    dir: PathBuf,
    progress: Option<crate::progress::Progress>,
}

impl RankLog {
    /// The log of `rank` of a run of `iters` iterations writing under `dir`.
    pub fn new(rank: usize, iters: u64, dir: &Path) -> Self {
        RankLog { rank, iters, dir: dir.to_path_buf(), progress: None }
    }

    /// A generation starts stepping at `first_iter`: rank 0's progress bar.
    pub fn start(&mut self, first_iter: u64) {
        if self.rank == 0 {
            self.progress =
                Some(crate::progress::Progress::new("iter", first_iter - 1, self.iters, crate::progress::Mode::detect()));
        }
    }

    /// Iteration `iter` ended: rank 0 records `line` and shows `text` beside its progress.
    pub fn iteration(&self, iter: u64, line: &serde_json::Value, text: &str) -> Result<()> {
        if self.rank != 0 {
            return Ok(());
        }
        append_line(&self.dir, line)?;
        if let Some(p) = &self.progress {
            p.step(iter, text);
        }
        Ok(())
    }

    /// A recovery: rank 0 says it ([`say_recovery`]).
    pub fn recovered(&self, r: &ironweave::elastic::Recovery) -> Result<()> {
        if self.rank == 0 {
            say_recovery(r, &self.dir)?;
        }
        Ok(())
    }

    /// The generation stopped (done or failed): the bar ends.
    pub fn stop(&mut self) {
        if let Some(p) = self.progress.take() {
            p.finish();
        }
    }
}
