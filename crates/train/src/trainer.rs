//! The training loop of one rank (single process today: every expert local).

use ironweave_profile::{ExpertLoad, MonotonicClock, Phase, Profiler};
use sha2::{Digest, Sha256};

use crate::config::TrainConfig;
use crate::data::Corpus;
use crate::dist::Dist;
use crate::error::{Result, TrainError};
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

fn is_expert(name: &str) -> bool {
    name.split('.').nth(1).is_some_and(|s| s.starts_with('e') && s[1..].parse::<usize>().is_ok())
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
    dist: Option<Dist>,
}

impl Trainer {
    /// A trainer at iteration 0.
    pub fn new(cfg: TrainConfig, corpus: Corpus, rank: usize) -> Self {
        let params = init(&cfg);
        Trainer { cfg, params, corpus, rank, dist: None }
    }

    /// A trainer for rank `dist.rank()` of an expert- and data-parallel job: it keeps the
    /// dense parameters and the experts `e` with `e mod world == rank`.
    pub fn distributed(cfg: TrainConfig, corpus: Corpus, dist: Dist) -> Result<Self> {
        let (w, r) = (dist.world(), dist.rank());
        if cfg.model.experts % w != 0 {
            return Err(TrainError::Config(format!("{} experts cannot be spread evenly over {w} ranks", cfg.model.experts)));
        }
        let mut params = init(&cfg);
        params.list.retain(|p| {
            match p.name.split('.').nth(1).and_then(|s| s.strip_prefix('e')).and_then(|x| x.parse::<usize>().ok()) {
                Some(e) => e % w == r,
                None => true,
            }
        });
        Ok(Trainer { cfg, params, corpus, rank: r, dist: Some(dist) })
    }

    /// Run one iteration (the next step), timing layers with `prof` when given.
    pub fn step(&mut self, prof: Option<&Profiler<MonotonicClock>>) -> Result<StepReport> {
        let iter = self.params.step + 1;
        let (b, t) = (self.cfg.train.batch, self.cfg.model.seq);
        let (x_tok, y_tok) = self.corpus.batch(self.cfg.train.seed, iter, self.rank, b, t);
        let (loss, load, grads) = self.gradients(&x_tok, &y_tok, b, prof)?;
        {
            let _t = prof.map(|p| p.layer(0, Phase::Optimizer));
            adamw(&mut self.params, &grads, self.cfg.train.lr, self.cfg.train.weight_decay);
        }
        Ok(StepReport { iter, loss, load })
    }

    /// Loss, expert load and gradients (averaged over ranks when distributed) of `b`
    /// sequences, without updating anything.
    pub fn gradients(
        &self,
        x_tok: &[u32],
        y_tok: &[u32],
        b: usize,
        prof: Option<&Profiler<MonotonicClock>>,
    ) -> Result<(f32, ExpertLoad, Vec<Vec<f32>>)> {
        let x_tok = x_tok.to_vec();
        let y_tok = y_tok.to_vec();
        let mut model = Model::new(&self.cfg, &self.params)?;
        if let Some(d) = &self.dist {
            model = model.with_dist(d);
        }
        let mut grads: Vec<Vec<f32>> = self.params.list.iter().map(|p| vec![0.0; p.w.len()]).collect();
        // forward, keeping each layer's input
        let mut inputs = Vec::with_capacity(self.cfg.model.layers);
        let mut routings = Vec::with_capacity(self.cfg.model.layers);
        let mut eps = Vec::with_capacity(self.cfg.model.layers);
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
            eps.push(out.ep);
            x = out.y;
        }
        let (loss, mut g) = model.head(&x, &y_tok, &mut grads)?;
        for l in (0..self.cfg.model.layers).rev() {
            let _t = prof.map(|p| p.layer(l as u32, Phase::Backward));
            g = model.backward_layer(l, &inputs[l], routings[l].as_ref(), eps[l].as_ref(), &g, &mut grads)?;
        }
        model.embed_backward(&x_tok, b, &g, &mut grads)?;
        drop(model);
        let mut loss = loss;
        if let Some(d) = &self.dist {
            // data parallel: average dense gradients (one all-reduce); an expert's gradient
            // already sums every rank's tokens, so it only needs the same 1/world scale
            let w = d.world() as f32;
            let dense: Vec<usize> = (0..self.params.list.len()).filter(|&i| !is_expert(&self.params.list[i].name)).collect();
            let mut flat: Vec<f32> = dense.iter().flat_map(|&i| grads[i].iter().copied()).collect();
            d.all_reduce_avg(&mut flat)?;
            let mut off = 0;
            for &i in &dense {
                let n = grads[i].len();
                grads[i].copy_from_slice(&flat[off..off + n]);
                off += n;
            }
            for (i, g) in grads.iter_mut().enumerate() {
                if is_expert(&self.params.list[i].name) {
                    g.iter_mut().for_each(|x| *x /= w);
                }
            }
            let mut l = [loss];
            d.all_reduce_avg(&mut l)?;
            loss = l[0];
        }
        Ok((loss, load, grads))
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
