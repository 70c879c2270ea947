//! Data-parallel training of a small candle model with a Capricorn checkpoint every iteration
//! in peers' memory, surviving `kill -9` of a rank: the runtime (`ironweave::elastic`) re-forms
//! the job with the restarted rank, every rank restores the newest committed iteration from
//! its own memory or a peer's, and training goes on — to the same final state as a run that
//! was never interrupted.
//!
//! ```sh
//! cargo build --release -p ironweave --features candle --example elastic_train
//! ironweave launch -n 4 --max-restarts 2 -- target/release/examples/elastic_train 60
//! # in another terminal: kill -9 one rank's pid (each rank prints it); the job goes on
//! ironweave launch -n 4 --max-restarts 2 -- target/release/examples/elastic_train 60 full   # sharded
//! ```
use candle_nn::VarMap;
use ironweave::candle::{Layout, Trainer, TrainerConfig};
use ironweave::ckpt::{engine::Strategy, EngineConfig, Snapshot, TensorSpec};
use ironweave::elastic::{BoxError, Config, Generation, Iteration, Job, Recovery, Step, StepContext, Worker};

#[path = "common/mlp.rs"]
mod mlp;

struct Run {
    rank: usize,
    layout: Layout,
    vm: VarMap,
    model: mlp::Mlp,
    trainer: Option<Trainer>, // built at the first generation joined, rebound at the next ones
}

impl Run {
    fn trainer(&mut self) -> Result<&mut Trainer, BoxError> {
        self.trainer.as_mut().ok_or_else(|| "no generation joined".into())
    }
}

impl Worker for Run {
    type Output = f32;

    fn join(&mut self, g: &Generation<'_>) -> Result<(), BoxError> {
        Ok(Trainer::join(&mut self.trainer, &self.vm, g, self.layout.clone(), TrainerConfig::default())?)
    }
    fn state_specs(&self) -> Vec<TensorSpec> {
        self.trainer.as_ref().map(Trainer::state_specs).unwrap_or_default()
    }
    fn state(&self) -> Vec<&[u8]> {
        self.trainer.as_ref().map(Trainer::state).unwrap_or_default()
    }
    fn restore(&mut self, s: &Snapshot) -> Result<(), BoxError> {
        Ok(self.trainer()?.restore(s)?)
    }
    fn restored_state(&self) -> Result<Vec<Vec<u8>>, BoxError> {
        // the model's variables, not the trainer's host copies: the check after a restore
        // sees whether it reached the model
        Ok(self.trainer.as_ref().ok_or("no generation joined")?.state_from_variables()?)
    }
    fn start_over(&mut self) -> Result<(), BoxError> {
        Ok(self.trainer()?.start_over()?)
    }
    fn step(&mut self, iter: u64, _cx: &StepContext<'_>) -> Result<Step<f32>, BoxError> {
        let (x, y) = mlp::batch(iter, self.rank, 64)?;
        let (model, t) = (&self.model, self.trainer.as_mut().ok_or("no generation joined")?);
        Ok(Step::new(t.step(model, &x, |out| mlp::mse(out, &y))?.loss))
    }
    fn on_iteration(&mut self, it: &Iteration<'_, f32>) -> Result<(), BoxError> {
        println!("rank {}: iteration {} loss {:.6} committed {:?}", self.rank, it.iter, it.output, it.committed);
        Ok(())
    }
    fn on_recovery(&mut self, r: &Recovery, _comm: &std::sync::Arc<ironweave::Communicator>) -> Result<(), BoxError> {
        println!("rank {}: restored iteration {} from {}", self.rank, r.iter, r.source.name());
        Ok(())
    }
}

fn main() -> Result<(), BoxError> {
    let mut args = std::env::args().skip(1);
    let iters: u64 = args.next().unwrap_or_else(|| "60".into()).parse()?;
    let layout = match args.next().as_deref() {
        None | Some("dp") => Layout::DataParallel,
        Some(s) => Layout::sharded(ironweave::sdp::Strategy::parse(s)?, 2), // hosts of 2 ranks
    };
    let engine = EngineConfig { strategy: Strategy::Capricorn, ..Default::default() };
    let job = Job::from_env(Config::new(iters, engine))?; // rank, world, generation from the launcher
    println!("rank {} pid {} generation {}", job.rank(), std::process::id(), job.generation());
    let vm = VarMap::new();
    let model = mlp::Mlp::new(&vm, 7)?;
    let mut run = Run { rank: job.rank(), layout, vm, model, trainer: None };
    let done = match job.run(&mut run) {
        Ok(done) => done,
        Err(e) => {
            eprintln!("rank {}: {e}", run.rank);
            std::process::exit(e.exit_code()); // 75: a committed iteration is lost; not restarted
        }
    };
    let digest = done.job_state_sha256(&run.trainer()?.state_digest())?;
    println!("rank {}: done, {} recoveries, final state {digest}", run.rank, done.recoveries());
    done.shutdown()?;
    Ok(())
}
