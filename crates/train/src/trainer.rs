//! The training loop of one rank (single process today: every expert local).

use ironweave_profile::{ExpertLoad, MonotonicClock, Phase, Profiler};
use sha2::{Digest, Sha256};

use crate::config::TrainConfig;
use crate::data::Corpus;
use crate::error::Result;
use crate::model::{adamw, init, Model, Params};

/// What one iteration did.
#[derive(Debug, Clone)]
pub struct StepReport {
    /// Iteration (1-based).
    pub iter: u64,
    /// Mean cross-entropy (nats per byte).
    pub loss: f32,
    /// Expert load per MoE layer.
    pub load: ExpertLoad,
}

/// One rank's trainer.
#[derive(Debug)]
pub struct Trainer {
    /// Configuration.
    pub cfg: TrainConfig,
    /// Parameters and optimizer state.
    pub params: Params,
    corpus: Corpus,
    rank: usize,
}

impl Trainer {
    /// A trainer at iteration 0.
    pub fn new(cfg: TrainConfig, corpus: Corpus, rank: usize) -> Self {
        let params = init(&cfg);
        Trainer { cfg, params, corpus, rank }
    }

    /// Run one iteration (the next step), timing layers with `prof` when given.
    pub fn step(&mut self, prof: Option<&Profiler<MonotonicClock>>) -> Result<StepReport> {
        let iter = self.params.step + 1;
        let (b, t) = (self.cfg.train.batch, self.cfg.model.seq);
        let (x_tok, y_tok) = self.corpus.batch(self.cfg.train.seed, iter, self.rank, b, t);
        let model = Model::new(&self.cfg, &self.params)?;
        let mut grads: Vec<Vec<f32>> = self.params.list.iter().map(|p| vec![0.0; p.w.len()]).collect();
        // forward, keeping each layer's input
        let mut inputs = Vec::with_capacity(self.cfg.model.layers);
        let mut routings = Vec::with_capacity(self.cfg.model.layers);
        let mut load = ExpertLoad { tokens: Vec::new() };
        let mut x = model.embed(&x_tok, b)?;
        for l in 0..self.cfg.model.layers {
            let _t = prof.map(|p| p.layer(l as u32, Phase::Forward));
            let out = model.forward_layer(l, &x)?;
            inputs.push(x);
            if let Some(r) = &out.routing {
                load.tokens.push(r.wanted.clone());
            }
            routings.push(out.routing);
            x = out.y;
        }
        let (loss, mut g) = model.head(&x, &y_tok, &mut grads)?;
        for l in (0..self.cfg.model.layers).rev() {
            let _t = prof.map(|p| p.layer(l as u32, Phase::Backward));
            g = model.backward_layer(l, &inputs[l], routings[l].as_ref(), &g, &mut grads)?;
        }
        model.embed_backward(&x_tok, b, &g, &mut grads)?;
        drop(model);
        {
            let _t = prof.map(|p| p.layer(0, Phase::Optimizer));
            adamw(&mut self.params, &grads, self.cfg.train.lr, self.cfg.train.weight_decay);
        }
        Ok(StepReport { iter, loss, load })
    }

    /// SHA-256 of the parameters, both moments and the step, in order.
    pub fn state_sha256(&self) -> String {
        let mut h = Sha256::new();
        h.update(self.params.step.to_le_bytes());
        for p in &self.params.list {
            h.update(p.name.as_bytes());
            for v in [&p.w, &p.m, &p.v] {
                for x in v.iter() {
                    h.update(x.to_le_bytes());
                }
            }
        }
        h.finalize().iter().map(|b| format!("{b:02x}")).collect()
    }
}
