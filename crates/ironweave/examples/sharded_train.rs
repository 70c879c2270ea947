//! The same small candle model trained data parallel (`dp`) or sharded (`full`, `hybrid`,
//! `hsdp`) through the adapter: each rank keeps `1/world` of the parameters and Adam moments
//! under `full`, and the loss follows the data-parallel one.
//!
//! ```sh
//! cargo build --release -p ironweave --features candle --example sharded_train
//! ironweave launch -n 4 -- target/release/examples/sharded_train full 10 2   # layout, iterations, ranks per host
//! ```
use std::sync::Arc;

use candle_nn::VarMap;
use ironweave::candle::{Layout, Trainer, TrainerConfig};
use ironweave::sdp::{Adam, Strategy};

#[path = "common/mlp.rs"]
mod mlp;

fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let mut args = std::env::args().skip(1);
    let mode = args.next().unwrap_or_else(|| "full".into());
    let iters: u64 = args.next().unwrap_or_else(|| "10".into()).parse()?;
    let ranks_per_host: usize = args.next().unwrap_or_else(|| "1".into()).parse()?;
    let comm = Arc::new(ironweave::init_from_env()?);
    let layout = match mode.as_str() {
        "dp" => Layout::DataParallel,
        s => Layout::Sharded {
            strategy: Strategy::parse(s)?,
            ranks_per_host,
            fractions: vec![0.5], // hsdp: half of each unit over all ranks, half within the host
            full_link: 0,
            inter_link: comm.links().len() - 1,
        },
    };
    let vm = VarMap::new();
    let model = mlp::Mlp::new(&vm, 7)?;
    let cfg = TrainerConfig { adam: Adam { lr: 1e-2, ..Adam::default() }, bucket_bytes: Some(64 << 10) };
    let mut t = Trainer::new(&vm, &comm, layout, cfg)?;
    for it in 1..=iters {
        let (x, y) = mlp::batch(it, comm.rank(), 64)?;
        let s = t.step(&model, &x, |out| mlp::mse(out, &y))?;
        if comm.rank() == 0 {
            println!("iteration {it} loss {:.9}", s.loss);
        }
    }
    println!("rank {}: {mode} holds {} state bytes", comm.rank(), t.state_bytes());
    Ok(())
}
