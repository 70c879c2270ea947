//! The training loop of one rank: alone (every expert local) or one rank of an expert- and
//! data-parallel job.

use std::time::Instant;

use ironweave_profile::{ExpertLoad, MonotonicClock, Phase, Profiler};
use ironweave_sdp::ddp::{backward_with_buckets, Handoff};
use ironweave_transport::Communicator;

use crate::buckets::{plan_buckets, Bucket, GradSyncStats};
use crate::config::TrainConfig;
use crate::data::Corpus;
use crate::dist::Dist;
use crate::emulated::Emulated;
use crate::error::{Result, TrainError};
use crate::model::{adamw, init, init_keeping, Model, Params};

/// What one iteration did.
#[derive(Debug, Clone)]
pub struct StepReport {
    /// Iteration (1-based).
    pub iter: u64,
    /// Mean cross-entropy (nats per byte).
    pub loss: f32,
    /// Expert load per MoE layer.
    pub load: ExpertLoad,
    /// The data-parallel gradient averaging (zero when alone).
    pub sync: GradSyncStats,
}

/// Deterministic stand-in gradients of emulated compute: small values that differ by
/// iteration, rank and parameter, so the averaged gradients and the updated state are real
/// arithmetic that a recovered run must reproduce bit for bit.
pub(crate) fn pseudo_gradient(g: &mut [f32], iter: u64, rank: usize, param: usize) {
    let base = (iter as u32).wrapping_mul(0x9e37_79b9)
        ^ (rank as u32).wrapping_mul(0x85eb_ca6b)
        ^ (param as u32).wrapping_mul(0xc2b2_ae35);
    for (k, x) in g.iter_mut().enumerate() {
        let h = (k as u32).wrapping_mul(0x2545_f491) ^ base;
        *x = ((h >> 16) as f32 - 32768.0) * (1e-3 / 32768.0);
    }
}

/// The parameters rank `rank` of `world` holds, at their initial values: every dense tensor
/// and the experts `e` with `e mod world == rank` (the others are never allocated).
pub fn rank_params(cfg: &TrainConfig, rank: usize, world: usize) -> Params {
    let w = world.max(1);
    init_keeping(cfg, |name| expert_of(name).is_none_or(|e| e % w == rank))
}

/// The expert a parameter belongs to (`l3.e5.w1` → 5), if any.
pub fn expert_of(name: &str) -> Option<usize> {
    name.split('.').nth(1).and_then(|s| s.strip_prefix('e')).and_then(|x| x.parse::<usize>().ok())
}

fn is_expert(name: &str) -> bool {
    expert_of(name).is_some()
}

/// One rank's trainer.
pub struct Trainer {
    /// Configuration.
    pub cfg: TrainConfig,
    /// Parameters and optimizer state.
    pub params: Params,
    corpus: Corpus,
    rank: usize,
    dist: Option<Dist>,
    /// Data parallelism: the buckets of dense gradients and the communicator (a `dup` of the
    /// world) their averages run on, beside the expert-parallel exchanges of the backward pass.
    grad_sync: Option<(Vec<Bucket>, Communicator)>,
    /// Called at the start of each layer's backward with (iteration, layer) — fault
    /// injection (`--fail`) kills the process there, mid-backward.
    pub backward_hook: Option<Box<dyn Fn(u64, usize) + Send>>,
}

impl std::fmt::Debug for Trainer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Trainer")
            .field("config", &self.cfg.name)
            .field("rank", &self.rank)
            .field("step", &self.params.step)
            .finish()
    }
}

impl Trainer {
    /// A trainer at iteration 0.
    pub fn new(cfg: TrainConfig, corpus: Corpus, rank: usize) -> Self {
        let params = init(&cfg);
        Trainer { cfg, params, corpus, rank, dist: None, grad_sync: None, backward_hook: None }
    }

    /// A trainer for rank `dist.rank()` of an expert- and data-parallel job: it keeps the
    /// dense parameters and the experts `e` with `e mod world == rank`.
    pub fn distributed(cfg: TrainConfig, corpus: Corpus, dist: Dist) -> Result<Self> {
        let (w, r) = (dist.world(), dist.rank());
        if (0..cfg.model.layers).any(|l| cfg.is_moe(l)) && cfg.model.experts % w != 0 {
            return Err(TrainError::Config(format!("{} experts cannot be spread evenly over {w} ranks", cfg.model.experts)));
        }
        let params = rank_params(&cfg, r, w);
        let dense: Vec<(usize, &str, usize)> = params
            .list
            .iter()
            .enumerate()
            .filter(|(_, p)| !is_expert(&p.name))
            .map(|(i, p)| (i, p.name.as_str(), p.w.len()))
            .collect();
        let bucket_bytes = (cfg.train.bucket_kb > 0).then_some(cfg.train.bucket_kb << 10);
        let buckets = plan_buckets(&dense, cfg.model.layers, bucket_bytes)?;
        // alone, there is nothing to average (and no thread to start)
        let grad_sync = (w > 1).then(|| (buckets, dist.comm.dup()));
        Ok(Trainer { cfg, params, corpus, rank: r, dist: Some(dist), grad_sync, backward_hook: None })
    }

    /// The gradient buckets of a data-parallel trainer (empty when alone).
    pub fn buckets(&self) -> &[Bucket] {
        self.grad_sync.as_ref().map_or(&[], |(b, _)| b.as_slice())
    }

    /// Run one iteration (the next step), timing layers with `prof` when given.
    pub fn step(&mut self, prof: Option<&Profiler<MonotonicClock>>) -> Result<StepReport> {
        let iter = self.params.step + 1;
        let (b, t) = (self.cfg.train.batch, self.cfg.model.seq);
        let (x_tok, y_tok) = self.corpus.batch(self.cfg.train.seed, iter, self.rank, b, t);
        let (loss, load, grads, sync) = self.gradients_with_stats(&x_tok, &y_tok, b, prof)?;
        {
            let _t = prof.map(|p| p.layer(0, Phase::Optimizer));
            adamw(&mut self.params, &grads, self.cfg.train.lr, self.cfg.train.weight_decay);
        }
        Ok(StepReport { iter, loss, load, sync })
    }

    /// Gives each expert's gradient the 1/world scale of the averaged dense gradients (an
    /// expert's gradient already sums every rank's tokens); nothing when alone.
    fn scale_expert_gradients(&self, grads: &mut [Vec<f32>]) {
        if let Some(d) = &self.dist {
            let w = d.world() as f32;
            for (p, g) in self.params.list.iter().zip(grads) {
                if is_expert(&p.name) {
                    g.iter_mut().for_each(|x| *x /= w);
                }
            }
        }
    }

    /// Runs `backward` — which fills `grads` stage by stage, calling `stage_done` after each —
    /// while this trainer's gradient buckets are averaged on the communication thread as their
    /// stages finish (nothing to average when alone).
    fn backward_bucketed<R>(
        &self,
        grads: &mut [Vec<f32>],
        backward: impl FnOnce(&mut [Vec<f32>], &mut Handoff<'_>) -> Result<R>,
    ) -> Result<(R, GradSyncStats)> {
        let no_buckets: &[Bucket] = &[];
        let (buckets, grad_comm) = match &self.grad_sync {
            Some((bk, c)) => (bk.as_slice(), Some(c)),
            None => (no_buckets, None),
        };
        let dprof = self.dist.as_ref().and_then(|d| d.prof.clone());
        backward_with_buckets(grad_comm, buckets, dprof.as_ref(), grads, backward)
    }

    /// Runs one iteration with emulated compute ([`crate::emulated`]): every layer's math is a
    /// wait on `emu`'s device, in the order of [`Emulated::ops`]; the expert exchanges carry
    /// this iteration's routed tokens (`hidden` bf16 values each) over the real communicator,
    /// the dense gradients are averaged in buckets during the backward as in [`Trainer::step`],
    /// and the real AdamW updates the state with deterministic pseudo-gradients. The loss is
    /// NaN: nothing is learned.
    pub fn step_emulated(&mut self, emu: &Emulated, prof: Option<&Profiler<MonotonicClock>>) -> Result<StepReport> {
        let iter = self.params.step + 1;
        let layers = self.cfg.model.layers;
        let rank = self.rank;
        let dev = &emu.device;
        let n_params: usize = self.params.list.iter().map(|p| p.w.len()).sum();
        let ops = emu.ops(iter, rank, n_params);
        let mut ops = ops.iter();
        let mut run = |what: &str| -> Result<()> {
            let op =
                ops.next().ok_or_else(|| TrainError::Config(format!("emulated step: no device operation left for {what}")))?;
            dev.run(op.flops, op.bytes);
            Ok(())
        };
        // activations travel as bf16: `hidden` values of 2 bytes = hidden / 2 floats a row
        let width = (self.cfg.model.hidden * crate::emulated::ACTIVATION_DTYPE.size()).div_ceil(4);
        let world = self.dist.as_ref().map_or(1, Dist::world);
        let experts = self.cfg.model.experts;
        // alone, world is 1 and every expert is local
        let local_experts = (0..experts).filter(|e| e % world == rank).count();
        // per MoE layer: rows this rank sends to each rank, rows it receives from each
        let mut exchanges: Vec<Option<(Vec<usize>, Vec<usize>)>> = Vec::with_capacity(layers);
        let mut load = ExpertLoad { tokens: Vec::new() };
        for l in 0..layers {
            let _t = prof.map(|p| p.layer(l as u32, Phase::Forward));
            run("attention forward")?;
            let Some(m) = emu.moe_index(l) else {
                run("feed-forward forward")?;
                exchanges.push(None);
                continue;
            };
            load.tokens.push(emu.wanted(iter, m)[rank].clone());
            let d = emu.dispatched(iter, m);
            let rows =
                |src: usize, dst: usize| (0..experts).filter(|e| e % world == dst).map(|e| d[src][e] as usize).sum::<usize>();
            let send: Vec<usize> = (0..world).map(|dst| rows(rank, dst)).collect();
            let recv: Vec<usize> = (0..world).map(|src| rows(src, rank)).collect();
            if let Some(dist) = &self.dist {
                // the counts travel as in the real trainer, and must agree with the trace's
                let got = dist.exchange_counts(&send.iter().map(|&c| c as i64).collect::<Vec<_>>())?;
                if got.iter().zip(&recv).any(|(&g, &r)| g != r as i64) {
                    return Err(TrainError::Config(format!(
                        "emulated step {iter}, layer {l}: peers send {got:?} rows, the routing trace says {recv:?} (ranks run different traces?)"
                    )));
                }
                let out = dist.exchange(&vec![0f32; send.iter().sum::<usize>() * width], &send, &recv, width)?;
                (0..local_experts).try_for_each(|_| run("expert forward"))?;
                dist.exchange(&out, &recv, &send, width)?;
            } else {
                (0..local_experts).try_for_each(|_| run("expert forward"))?;
            }
            exchanges.push(Some((send, recv)));
        }
        let mut grads: Vec<Vec<f32>> = self.params.list.iter().map(|p| vec![0.0; p.w.len()]).collect();
        let stages: Vec<usize> =
            self.params.list.iter().map(|p| crate::buckets::backward_stage(&p.name, layers)).collect::<Result<_>>()?;
        let fill = |grads: &mut [Vec<f32>], stage: usize| {
            for (i, g) in grads.iter_mut().enumerate().filter(|(i, _)| stages[*i] == stage) {
                pseudo_gradient(g, iter, rank, i);
            }
        };
        let (hook, dist) = (&self.backward_hook, &self.dist);
        let ((), sync) = self.backward_bucketed(&mut grads, |grads, h| -> Result<()> {
            let t0 = Instant::now();
            run("head forward")?;
            run("head backward")?;
            fill(grads, 0);
            h.computed(t0, Instant::now());
            h.stage_done(0, grads)?;
            for l in (0..layers).rev() {
                if let Some(f) = hook {
                    f(iter, l);
                }
                let t0 = Instant::now();
                {
                    let _t = prof.map(|p| p.layer(l as u32, Phase::Backward));
                    match (&exchanges[l], dist) {
                        (Some((send, recv)), Some(dist)) => {
                            // the combine's gradient goes to the experts and theirs comes back
                            let back = dist.exchange(&vec![0f32; send.iter().sum::<usize>() * width], send, recv, width)?;
                            (0..local_experts).try_for_each(|_| run("expert backward"))?;
                            dist.exchange(&back, recv, send, width)?;
                        }
                        (Some(_), None) => (0..local_experts).try_for_each(|_| run("expert backward"))?,
                        (None, _) => run("feed-forward backward")?,
                    }
                    run("attention backward")?;
                }
                fill(grads, 1 + (layers - 1 - l));
                h.computed(t0, Instant::now());
                h.stage_done(1 + (layers - 1 - l), grads)?;
            }
            fill(grads, layers + 1);
            h.stage_done(layers + 1, grads)?;
            Ok(())
        })?;
        self.scale_expert_gradients(&mut grads);
        {
            let _t = prof.map(|p| p.layer(0, Phase::Optimizer));
            run("optimizer")?;
            adamw(&mut self.params, &grads, self.cfg.train.lr, self.cfg.train.weight_decay);
        }
        if let Some(op) = ops.next() {
            return Err(TrainError::Config(format!("emulated step {iter}: device operation {} was not run", op.what)));
        }
        Ok(StepReport { iter, loss: f32::NAN, load, sync })
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
        self.gradients_with_stats(x_tok, y_tok, b, prof).map(|(l, e, g, _)| (l, e, g))
    }

    /// [`Trainer::gradients`] and what the data-parallel averaging did: each bucket of dense
    /// gradients is averaged on a communication thread as soon as backward has finished it.
    pub fn gradients_with_stats(
        &self,
        x_tok: &[u32],
        y_tok: &[u32],
        b: usize,
        prof: Option<&Profiler<MonotonicClock>>,
    ) -> Result<(f32, ExpertLoad, Vec<Vec<f32>>, GradSyncStats)> {
        let x_tok = x_tok.to_vec();
        let y_tok = y_tok.to_vec();
        let mut model = Model::new(&self.cfg, &self.params)?;
        if let Some(d) = &self.dist {
            model = model.with_dist(d);
        }
        let mut grads: Vec<Vec<f32>> = self.params.list.iter().map(|p| vec![0.0; p.w.len()]).collect();
        // forward, keeping each layer's input
        let layers = self.cfg.model.layers;
        let mut inputs = Vec::with_capacity(layers);
        let mut routings = Vec::with_capacity(layers);
        let mut eps = Vec::with_capacity(layers);
        let mut load = ExpertLoad { tokens: Vec::new() };
        let mut x = model.embed(&x_tok, b)?;
        for l in 0..layers {
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
        let hook = &self.backward_hook;
        let step = self.params.step + 1;
        let (loss, stats) = self.backward_bucketed(&mut grads, |grads, h| -> Result<f32> {
            let t0 = Instant::now();
            let (loss, mut g) = model.head(&x, &y_tok, grads)?;
            h.computed(t0, Instant::now());
            h.stage_done(0, grads)?;
            for l in (0..layers).rev() {
                if let Some(f) = hook {
                    f(step, l);
                }
                let t0 = Instant::now();
                {
                    let _t = prof.map(|p| p.layer(l as u32, Phase::Backward));
                    g = model.backward_layer(l, &inputs[l], routings[l].as_ref(), eps[l].as_ref(), &g, grads)?;
                }
                h.computed(t0, Instant::now());
                h.stage_done(1 + (layers - 1 - l), grads)?;
            }
            let t0 = Instant::now();
            model.embed_backward(&x_tok, b, &g, grads)?;
            h.computed(t0, Instant::now());
            h.stage_done(layers + 1, grads)?;
            Ok(loss)
        })?;
        drop(model);
        let mut loss = loss;
        self.scale_expert_gradients(&mut grads);
        if let Some(d) = &self.dist {
            let mut l = [loss];
            d.all_reduce_avg(&mut l)?;
            loss = l[0];
        }
        Ok((loss, load, grads, stats))
    }

    /// The checkpoint layout of this rank's state: every parameter with its two moments, the
    /// optimizer step (which is also the data position) and the seed.
    ///
    /// Every tensor is the whole of a global tensor of the same name: an expert's on the rank
    /// that holds it (its owner), a dense tensor on every rank (data parallelism keeps them
    /// equal; rank 0's copy is the owner). So the persistent tier's files load onto another
    /// world size or expert placement (`ironweave_ckpt::layout`).
    pub fn state_specs(&self) -> Vec<ironweave_ckpt::TensorSpec> {
        specs_of(self.params.list.iter().map(|p| (p.name.as_str(), p.shape.as_slice())), self.rank)
    }

    /// The parallel layout of this rank's state, as the persistent tier's manifests name it.
    pub fn layout(&self) -> std::collections::BTreeMap<String, String> {
        let w = self.dist.as_ref().map_or(1, |d| d.world());
        let mut m = std::collections::BTreeMap::new();
        m.insert("kind".into(), "data + expert parallel (experts e on rank e mod world)".into());
        m.insert("world".into(), w.to_string());
        m.insert("experts".into(), self.cfg.model.experts.to_string());
        m.insert("experts_per_rank".into(), (self.cfg.model.experts / w.max(1)).to_string());
        m.insert("model".into(), self.cfg.name.clone());
        m
    }

    /// The state as byte buffers, in `state_specs` order.
    pub fn state_bytes(&self) -> (Vec<&[u8]>, [u8; 8], [u8; 8]) {
        let mut v: Vec<&[u8]> = Vec::new();
        for p in &self.params.list {
            for x in [&p.w, &p.m, &p.v] {
                v.push(f32_bytes(x));
            }
        }
        (v, (self.params.step as i64).to_le_bytes(), (self.cfg.train.seed as i64).to_le_bytes())
    }

    /// Load a state laid out as `state_specs` (from a restored snapshot).
    pub fn load_state(&mut self, tensor: impl Fn(&str) -> Option<Vec<u8>>) -> Result<()> {
        let missing = |n: &str| TrainError::Config(format!("restored state lacks `{n}`"));
        for p in &mut self.params.list {
            for (prefix, dst) in [("", &mut p.w), ("adam.m.", &mut p.m), ("adam.v.", &mut p.v)] {
                let name = format!("{prefix}{}", p.name);
                let b = tensor(&name).ok_or_else(|| missing(&name))?;
                if b.len() != dst.len() * 4 {
                    return Err(TrainError::Config(format!("`{name}`: {} bytes for {} floats", b.len(), dst.len())));
                }
                for (d, c) in dst.iter_mut().zip(b.chunks_exact(4)) {
                    *d = f32::from_le_bytes(c.try_into().expect("4 bytes"));
                }
            }
        }
        let step = tensor("step").ok_or_else(|| missing("step"))?;
        self.params.step = i64::from_le_bytes(step.as_slice().try_into().map_err(|_| missing("step"))?) as u64;
        Ok(())
    }

    /// Record communication in `prof` (the checkpoint engine's profiler) from now on.
    pub fn set_profiler(&mut self, prof: std::sync::Arc<Profiler<MonotonicClock>>) {
        if let Some(d) = &mut self.dist {
            d.prof = Some(prof);
        }
    }

    /// SHA-256 of the parameters, both moments and the step, in order.
    pub fn state_digest(&self) -> [u8; 32] {
        self.params.digest()
    }

    /// [`Trainer::state_digest`] in hex.
    pub fn state_sha256(&self) -> String {
        self.state_digest().iter().map(|b| format!("{b:02x}")).collect()
    }
}

/// The checkpoint layout (with global slices) of `rank` holding `params` (name, shape).
fn specs_of<'a>(params: impl Iterator<Item = (&'a str, &'a [usize])>, rank: usize) -> Vec<ironweave_ckpt::TensorSpec> {
    use ironweave_ckpt::{DType, GlobalSlice, TensorSpec};
    let whole = |name: String, shape: &[u64], owner: bool| {
        TensorSpec::new(name.clone(), DType::F32, shape).with_global(GlobalSlice::whole(name, shape, owner))
    };
    let mut v = Vec::new();
    for (name, shape) in params {
        let shape: Vec<u64> = shape.iter().map(|&d| d as u64).collect();
        let owner = is_expert(name) || rank == 0;
        v.push(whole(name.to_string(), &shape, owner));
        v.push(whole(format!("adam.m.{name}"), &shape, owner));
        v.push(whole(format!("adam.v.{name}"), &shape, owner));
    }
    for n in ["step", "seed"] {
        v.push(TensorSpec::new(n, DType::I64, &[]).with_global(GlobalSlice::whole(n, &[], rank == 0)));
    }
    v
}

/// The checkpoint layout [`Trainer::state_specs`] gives rank `rank` of `world` for `cfg`,
/// without a job (offline resharding): the dense tensors, and the experts `e` with
/// `e mod world == rank` — also when they do not divide evenly, which a loader may take even
/// though training refuses it.
pub fn state_specs_for(cfg: &TrainConfig, rank: usize, world: usize) -> Vec<ironweave_ckpt::TensorSpec> {
    let params = rank_params(cfg, rank, world);
    specs_of(params.list.iter().map(|p| (p.name.as_str(), p.shape.as_slice())), rank)
}

pub(crate) fn f32_bytes(v: &[f32]) -> &[u8] {
    bytemuck::cast_slice(v)
}
