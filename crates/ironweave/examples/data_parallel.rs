//! Data-parallel training with a checkpoint every iteration, restored after a restart.
//! Each rank fits `y = <w*, x>` on its own samples; gradients are averaged with an all-reduce;
//! the Capricorn engine replicates each iteration's state to a peer's memory and writes the
//! persistent tier; a job started again picks up from the newest committed iteration (it says
//! so with `restore_other_jobs`: by default a job takes only its own files).
//!
//! ```sh
//! cargo build --release -p ironweave --example data_parallel
//! ironweave launch -n 2 -- target/release/examples/data_parallel 20 /tmp/dp   # iterations, dir
//! ironweave launch -n 2 -- target/release/examples/data_parallel 40 /tmp/dp   # resumes at 21
//! ```
use std::sync::Arc;

use ironweave::ckpt::{engine::Strategy, CkptError, DType, Engine, EngineConfig, Registry, TensorSpec};
use ironweave::ReduceOp;

const N: usize = 4096;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let comm = Arc::new(ironweave::init_from_env()?); // IRONWEAVE_BACKEND picks the backend
    let mut args = std::env::args().skip(1);
    let iters: u64 = args.next().unwrap_or_else(|| "20".into()).parse()?;
    let dir = std::path::PathBuf::from(args.next().unwrap_or_else(|| "target/dp-example".into()));
    let specs = [TensorSpec::new("w", DType::F32, &[N as u64]), TensorSpec::new("step", DType::I64, &[])];
    // a job started again continues the one before it from the directory: said explicitly,
    // since by default a job restores only files it wrote itself (the launcher's job id)
    let cfg = EngineConfig {
        strategy: Strategy::Capricorn,
        persist_dir: Some(dir),
        persist_every: 1,
        restore_other_jobs: true,
        ..Default::default()
    };
    let mut engine = Engine::new(comm.clone(), Registry::new(&specs)?, cfg)?;
    let mut w = vec![0f32; N];
    let mut start = 1;
    match engine.restore_latest() {
        Ok(r) => {
            let bytes = r.snapshot.tensor("w").ok_or("restored state has no `w`")?;
            w = bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
            start = r.iter + 1;
            println!("rank {}: restored iteration {} from {:?}", comm.rank(), r.iter, r.source);
        }
        Err(CkptError::NothingToRestore { .. }) => {} // a fresh job
        Err(e) => return Err(e.into()),
    }
    let target = |i: usize| ((i * 7919) % 13) as f32 / 13.0 - 0.5; // w*
    for it in start..=iters {
        engine.begin_iteration(it, None);
        let mut grad = vec![0f32; N];
        for s in 0..8 {
            // this rank's sample s of iteration `it`: a sparse x, deterministic
            let x: Vec<usize> = (0..32).map(|k| (it as usize * 131 + comm.rank() * 977 + s * 61 + k * 127) % N).collect();
            let err: f32 = x.iter().map(|&i| w[i] - target(i)).sum();
            x.iter().for_each(|&i| grad[i] += err / 8.0);
        }
        comm.all_reduce(&mut grad, ReduceOp::Avg)?;
        w.iter_mut().zip(&grad).for_each(|(w, g)| *w -= 0.02 * g);
        engine.end_iteration();
        let step = (it as i64).to_le_bytes();
        engine.checkpoint(it, &[bytemuck::cast_slice(&w), &step])?;
        engine.commit(false)?;
    }
    let last = engine.commit(true)?; // wait until the last iteration is on every replica
    let loss: f32 = (0..N).map(|i| (w[i] - target(i)).powi(2)).sum();
    println!("rank {}: {iters} iterations, distance to w* {loss:.4}, last committed {last:?}", comm.rank());
    engine.shutdown()?;
    Ok(())
}
