//! `ironweave selftest ckpt`: a rank program for the checkpoint recovery tests. Each iteration
//! runs a training all-reduce, checkpoints a deterministic state with the Capricorn engine and
//! commits. When a peer dies the survivors re-form the job as generation `g + 1` (master port
//! `IRONWEAVE_MASTER_PORT + g`, job id suffixed `-g<g>`) with the restarted rank, restore the
//! newest committed iteration, check it bit for bit, and go on. Lines go to
//! `$IRONWEAVE_SELFTEST_DIR/rank<R>.log`.
//!
//! Environment: `IRONWEAVE_GENERATION` (0; a restarted rank gets the survivors' next one),
//! `IRONWEAVE_SELFTEST_ITERS` (40), `IRONWEAVE_SELFTEST_PERSIST_EVERY` (0: memory only),
//! `IRONWEAVE_SELFTEST_STEP_MS` (20).

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::error::{bail, Context, Result};
use ironweave_ckpt::{DType, Engine, EngineConfig, Registry, TensorSpec};
use ironweave_profile::CommKind;
use ironweave_transport::rendezvous::JobEnv;
use ironweave_transport::{CommOptions, ReduceOp};

fn env_num(k: &str, default: u64) -> Result<u64> {
    match std::env::var(k) {
        Ok(v) => v.trim().parse().with_context(|| format!("{k}={v:?} is not a number")),
        Err(_) => Ok(default),
    }
}

fn registry() -> Registry {
    Registry::new(&[
        TensorSpec::new("params", DType::F32, &[128, 1024]),
        TensorSpec::new("adam.m", DType::F32, &[128, 1024]),
        TensorSpec::new("step", DType::I64, &[]),
    ])
    .expect("static layout")
}

/// The state of `rank` after iteration `iter`: a pure function, so restores can be checked.
pub fn state(rank: usize, iter: u64) -> Vec<Vec<u8>> {
    registry()
        .tensors
        .iter()
        .enumerate()
        .map(|(t, m)| {
            (0..m.len).map(|i| (i.wrapping_mul(2654435761) ^ (iter * 1_000_003 + rank as u64 * 7919 + t as u64)) as u8).collect()
        })
        .collect()
}

pub fn run() -> Result<()> {
    let base = JobEnv::from_env()?;
    let dir = PathBuf::from(std::env::var("IRONWEAVE_SELFTEST_DIR").context("IRONWEAVE_SELFTEST_DIR")?);
    let mut gen = env_num("IRONWEAVE_GENERATION", 0)? as u16;
    let iters = env_num("IRONWEAVE_SELFTEST_ITERS", 40)?;
    let persist_every = env_num("IRONWEAVE_SELFTEST_PERSIST_EVERY", 0)?;
    let step = Duration::from_millis(env_num("IRONWEAVE_SELFTEST_STEP_MS", 20)?);
    let rank = base.rank;
    let mut log = std::fs::OpenOptions::new().create(true).append(true).open(dir.join(format!("rank{rank}.log")))?;
    let mut say = |line: String| {
        let _ = writeln!(log, "{line}");
        let _ = log.flush();
    };
    say(format!("start generation {gen} pid {}", std::process::id()));
    let cfg = EngineConfig {
        chunk_bytes: 128 << 10,
        copy_threads: 1,
        persist_dir: (persist_every > 0).then(|| dir.join("persist")),
        persist_every,
        timeout: Duration::from_secs(30),
        ..EngineConfig::default()
    };
    let mut engine: Option<Engine> = None;
    let mut need_restore = gen > 0;
    loop {
        if gen > 5 {
            bail!("gave up after 5 re-formations");
        }
        let mut env = base.clone();
        env.master.set_port(base.master.port() + gen);
        env.job_id = format!("{}-g{gen}", base.job_id);
        let opts = CommOptions { timeout: Duration::from_secs(30), ..CommOptions::default() };
        let comm = Arc::new(ironweave::connect(ironweave::Backend::Tcp, &env, opts)?);
        match engine.as_mut() {
            Some(e) => e.rebind(comm.clone())?,
            None => engine = Some(Engine::new(comm.clone(), registry(), cfg.clone())?),
        }
        let e = engine.as_mut().expect("just set");
        let r = (|| -> Result<()> {
            let mut start = 1;
            if need_restore {
                let r = e.restore_latest()?;
                let same = r.snapshot.data == state(rank, r.iter).concat();
                say(format!("restored iteration {} from {:?} identical {same}", r.iter, r.source));
                if !same {
                    bail!("restored state differs");
                }
                start = r.iter + 1;
            }
            let mut grad = vec![1f32; 64 << 10];
            for it in start..=iters {
                e.begin_iteration(it, None);
                {
                    let _c = e.profiler().comm(0, CommKind::Training, (grad.len() * 4) as u64);
                    comm.all_reduce(&mut grad, ReduceOp::Avg)?;
                }
                std::thread::sleep(step);
                e.end_iteration();
                let s = state(rank, it);
                let refs: Vec<&[u8]> = s.iter().map(|v| v.as_slice()).collect();
                e.checkpoint(it, &refs)?;
                let c = e.commit(true)?;
                say(format!("iteration {it} committed {}", c.map(|c| c as i64).unwrap_or(-1)));
            }
            Ok(())
        })();
        match r {
            Ok(()) => break,
            Err(err) => {
                say(format!("generation {gen} failed: {err:#}"));
                gen += 1;
                need_restore = true;
            }
        }
    }
    engine.expect("ran").shutdown()?;
    say("done".into());
    Ok(())
}
