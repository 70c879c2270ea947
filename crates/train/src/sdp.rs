//! Sharded data parallelism of the dense GPT on `ironweave-shard`: each parameter tensor is a
//! unit of sharding. A step gathers every tensor (all gathers issued at once, each on its
//! group's collective thread), computes the loss and gradients of this rank's batch with the
//! full parameters, reduce-scatters every gradient (issued at once), and steps AdamW on the
//! local shards; the gathered parameters are dropped, so between iterations a rank holds only
//! its shards of the parameters and both moments.
//!
//! Under `hsdp` a tensor of transformer layer `l` is split by the plan's fraction for `l`;
//! embeddings, the final norm and the head take the mean fraction.

use ironweave_shard::{Adam, Groups, ShardEngine, Strategy};
use ironweave_transport::{Communicator, ReduceOp};

use crate::data::Corpus;
use crate::error::{Result, TrainError};
use crate::model::Params;
use crate::{TrainConfig, Trainer};

/// One rank of a sharded data-parallel job.
pub struct SdpTrainer {
    tr: Trainer,
    corpus: Corpus,
    engine: ShardEngine,
    world: Communicator,
    iter: u64,
}

impl std::fmt::Debug for SdpTrainer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SdpTrainer").field("strategy", &self.engine.strategy()).field("iter", &self.iter).finish()
    }
}

/// The transformer layer a parameter belongs to (`l3.attn.wq` → 3).
fn layer_of(name: &str) -> Option<usize> {
    name.strip_prefix('l')?.split('.').next()?.parse().ok()
}

impl SdpTrainer {
    /// Rank `world.rank()` of a job sharded under `strategy` over `groups`; `fractions`: the
    /// share of each transformer layer sharded over all ranks (`hsdp`; ignored otherwise).
    /// Collective: every rank calls it.
    pub fn new(
        cfg: TrainConfig,
        corpus: Corpus,
        world: &Communicator,
        groups: Groups,
        strategy: Strategy,
        fractions: &[f64],
    ) -> Result<Self> {
        if (0..cfg.model.layers).any(|l| cfg.is_moe(l)) {
            return Err(TrainError::Config(
                "sharded data parallelism runs dense configs (configs/gpt-sdp.toml): this one has MoE layers".into(),
            ));
        }
        if strategy == Strategy::Hsdp && fractions.len() != cfg.model.layers {
            return Err(TrainError::Config(format!(
                "hsdp needs one fraction per layer: the model has {} layers, the plan {}",
                cfg.model.layers,
                fractions.len()
            )));
        }
        let mut tr = Trainer::new(cfg.clone(), corpus.clone(), world.rank());
        let mean = if fractions.is_empty() { 1.0 } else { fractions.iter().sum::<f64>() / fractions.len() as f64 };
        let per_tensor: Vec<f64> =
            tr.params.list.iter().map(|p| layer_of(&p.name).and_then(|l| fractions.get(l).copied()).unwrap_or(mean)).collect();
        let values: Vec<Vec<f32>> = tr.params.list.iter().map(|p| p.w.clone()).collect();
        let decay: Vec<bool> = tr.params.list.iter().map(|p| p.shape.len() == 2).collect();
        let adam = Adam { lr: cfg.train.lr, weight_decay: cfg.train.weight_decay, ..Adam::default() };
        let engine = ShardEngine::new(groups, strategy, &values, &per_tensor, adam)?.with_decay(&decay)?;
        // only the shards stay between iterations
        for p in tr.params.list.iter_mut() {
            p.w = Vec::new();
            p.m = Vec::new();
            p.v = Vec::new();
        }
        Ok(SdpTrainer { tr, corpus, engine, world: world.dup(), iter: 0 })
    }

    /// One iteration; returns the loss averaged over the ranks.
    pub fn step(&mut self) -> Result<f32> {
        self.iter += 1;
        let n = self.tr.params.list.len();
        let gathers = (0..n).map(|l| self.engine.start_gather(l)).collect::<std::result::Result<Vec<_>, _>>()?;
        for (p, g) in self.tr.params.list.iter_mut().zip(gathers) {
            p.w = g.wait()?;
        }
        let (b, t) = (self.tr.cfg.train.batch, self.tr.cfg.model.seq);
        let (x, y) = self.corpus.batch(self.tr.cfg.train.seed, self.iter, self.world.rank(), b, t);
        let (loss, _, grads) = self.tr.gradients(&x, &y, b, None)?;
        for p in self.tr.params.list.iter_mut() {
            p.w = Vec::new();
        }
        let reduces =
            grads.iter().enumerate().map(|(l, g)| self.engine.start_reduce(l, g)).collect::<std::result::Result<Vec<_>, _>>()?;
        for r in reduces {
            self.engine.finish_reduce(r)?;
        }
        self.engine.step()?;
        let mut l = [loss];
        self.world.all_reduce(&mut l, ReduceOp::Avg)?;
        Ok(l[0])
    }

    /// Parameters, gradients and both Adam moments held between iterations, bytes.
    pub fn state_bytes_per_rank(&self) -> u64 {
        self.engine.state_bytes()
    }

    /// Every parameter, gathered (collective), with this rank's view of nothing else: the
    /// moments stay sharded.
    pub fn full_params(&self) -> Result<Params> {
        let mut out = self.tr.params.clone();
        for (l, p) in out.list.iter_mut().enumerate() {
            p.w = self.engine.start_gather(l)?.wait()?;
        }
        out.step = self.iter;
        Ok(out)
    }
}
