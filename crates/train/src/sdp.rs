//! Sharded data parallelism of the dense GPT on `ironweave-sdp`: each parameter tensor is a
//! unit of sharding. A step gathers every tensor (all gathers issued at once, each on its
//! group's collective thread), computes the loss and gradients of this rank's batch with the
//! full parameters, reduce-scatters every gradient (issued at once), and steps AdamW on the
//! local shards; the gathered parameters are dropped, so between iterations a rank holds only
//! its shards of the parameters and both moments.
//!
//! Under `hsdp` a tensor of transformer layer `l` is split by the plan's fraction for `l`;
//! embeddings, the final norm and the head take the plan's `head` fraction (or the layers'
//! mean when the plan gives none).

use std::time::Instant;

use ironweave_overlap::{Lane, Span};
use ironweave_sdp::{Adam, Gather, Groups, Reduce, ShardEngine, Strategy};
use ironweave_transport::{Communicator, ReduceOp};

use crate::data::Corpus;
use crate::emulated::{DeviceOp, Emulated};
use crate::error::{Result, TrainError};
use crate::model::{Model, Params};
use crate::{TrainConfig, Trainer};

/// One iteration's result: the loss averaged over the ranks and this rank's lanes — compute
/// (and waits, named `wait`) on [`Lane::Compute`], each group's collectives on
/// `Lane::Comm(ironweave_sdp::Lane::index())`.
#[derive(Debug, Clone)]
pub struct SdpStep {
    pub loss: f32,
    pub spans: Vec<Span>,
    pub elapsed_s: f64,
}

impl SdpStep {
    /// Seconds of compute (waits excluded).
    pub fn compute_s(&self) -> f64 {
        self.spans.iter().filter(|s| s.lane == Lane::Compute && s.name != "wait").map(|s| (s.end - s.start).as_secs_f64()).sum()
    }
    /// Seconds the compute lane waited for collectives.
    pub fn wait_s(&self) -> f64 {
        self.spans.iter().filter(|s| s.lane == Lane::Compute && s.name == "wait").map(|s| (s.end - s.start).as_secs_f64()).sum()
    }
    /// Seconds during which at least one collective was on the wire (the union of every
    /// communication lane's spans).
    pub fn comm_busy_s(&self) -> f64 {
        let mut v: Vec<(Instant, Instant)> =
            self.spans.iter().filter(|s| s.lane != Lane::Compute).map(|s| (s.start, s.end)).collect();
        v.sort();
        let (mut total, mut cur): (f64, Option<(Instant, Instant)>) = (0.0, None);
        for (a, b) in v {
            cur = match cur {
                Some((c0, c1)) if a <= c1 => Some((c0, c1.max(b))),
                Some((c0, c1)) => {
                    total += (c1 - c0).as_secs_f64();
                    Some((a, b))
                }
                None => Some((a, b)),
            };
        }
        total + cur.map_or(0.0, |(c0, c1)| (c1 - c0).as_secs_f64())
    }
    /// Seconds each communication lane was busy.
    pub fn lane_busy_s(&self, lane: usize) -> f64 {
        self.spans.iter().filter(|s| s.lane == Lane::Comm(lane)).map(|s| (s.end - s.start).as_secs_f64()).sum()
    }
}

/// One rank of a sharded data-parallel job.
pub struct SdpTrainer {
    tr: Trainer,
    corpus: Corpus,
    engine: ShardEngine,
    world: Communicator,
    iter: u64,
    /// The tensors of each block (a unit of the engine), in forward order.
    blocks: Vec<Vec<usize>>,
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

/// The tensors of each block, in forward order: the embeddings, each transformer layer, the
/// final norm with the head.
fn blocks_of(params: &Params, layers: usize) -> Vec<Vec<usize>> {
    let list = &params.list;
    let of = |pred: &dyn Fn(&str) -> bool| (0..list.len()).filter(|&i| pred(&list[i].name)).collect::<Vec<_>>();
    let mut out = vec![of(&|n| n == "tok_emb" || n == "pos_emb")];
    for l in 0..layers {
        out.push(of(&|n| layer_of(n) == Some(l)));
    }
    out.push(of(&|n| n.starts_with("lnf.") || n == "head"));
    out
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
        let nl = cfg.model.layers;
        if strategy == Strategy::Hsdp && fractions.len() != nl && fractions.len() != nl + 1 {
            return Err(TrainError::Config(format!(
                "hsdp needs one fraction per layer (and optionally one more for the embeddings and the head): the model has {nl} layers, the plan {}",
                fractions.len()
            )));
        }
        let mut tr = Trainer::new(cfg.clone(), corpus.clone(), world.rank());
        // the embeddings, final norm and head: the extra fraction if given, else the mean
        let rest = match fractions.get(nl) {
            Some(&f) => f,
            None if fractions.is_empty() => 1.0,
            None => fractions.iter().sum::<f64>() / fractions.len() as f64,
        };
        // one flat unit per block (FSDP's flat parameter): one gather and one reduction per
        // block and part instead of one per tensor; weight decay on its matrices only
        let blocks = blocks_of(&tr.params, nl);
        let mut values = Vec::with_capacity(blocks.len());
        let mut decay = Vec::with_capacity(blocks.len());
        let mut block_fractions = Vec::with_capacity(blocks.len());
        for (bi, block) in blocks.iter().enumerate() {
            let (mut flat, mut ranges) = (Vec::new(), Vec::new());
            for &i in block {
                let p = &tr.params.list[i];
                if p.shape.len() == 2 {
                    ranges.push(flat.len()..flat.len() + p.w.len());
                }
                flat.extend_from_slice(&p.w);
            }
            values.push(flat);
            decay.push(ranges);
            let layer = (1..=nl).contains(&bi).then(|| bi - 1);
            block_fractions.push(layer.and_then(|l| fractions.get(l).copied()).unwrap_or(rest));
        }
        let adam = Adam { lr: cfg.train.lr, weight_decay: cfg.train.weight_decay, ..Adam::default() };
        let engine = ShardEngine::new(groups, strategy, &values, &block_fractions, adam)?.with_decay_ranges(&decay)?;
        // only the shards stay between iterations
        for p in tr.params.list.iter_mut() {
            p.w = Vec::new();
            p.m = Vec::new();
            p.v = Vec::new();
        }
        Ok(SdpTrainer { tr, corpus, engine, world: world.dup(), iter: 0, blocks })
    }

    /// One iteration; returns the loss averaged over the ranks.
    pub fn step(&mut self) -> Result<f32> {
        Ok(self.step_timed()?.loss)
    }

    /// One iteration with the real math, its lanes timed (`step_with`, shared with [`SdpTrainer::step_emulated`]).
    pub fn step_timed(&mut self) -> Result<SdpStep> {
        self.step_with(None)
    }

    /// One iteration with emulated compute ([`crate::emulated`]): each block's math is a wait on
    /// `emu`'s device, in the order of [`Emulated::ops`] (the embeddings' are left out: a table
    /// lookup); the gathers, reductions and the sharded AdamW stay real, the gradients are
    /// deterministic pseudo-gradients of each block's size. The loss is NaN: nothing is learned.
    pub fn step_emulated(&mut self, emu: &Emulated) -> Result<SdpStep> {
        self.step_with(Some(emu))
    }

    /// Parameters of this rank's shards.
    fn shard_params(&self) -> usize {
        self.engine.shard_tensors().iter().filter(|(n, _)| n.ends_with(".p")).map(|(_, x)| x.len()).sum()
    }

    fn gather_block(&self, bi: usize) -> Result<Gather> {
        Ok(self.engine.start_gather(bi)?)
    }

    /// Waits for a block's gather and puts its tensors' full parameters in place (emulated
    /// compute reads none of them: the gathered bytes are dropped).
    fn fill(&mut self, bi: usize, gather: Option<Gather>, spans: &mut Vec<Span>, emulated: bool) -> Result<()> {
        let t0 = Instant::now();
        if let Some(g) = gather {
            let flat = g.wait()?;
            if emulated {
                spans.push(Span { lane: Lane::Compute, name: "wait".into(), start: t0, end: Instant::now() });
                return Ok(());
            }
            let mut at = 0;
            for &i in &self.blocks[bi] {
                let p = &mut self.tr.params.list[i];
                let n: usize = p.shape.iter().product();
                p.w = flat.get(at..at + n).ok_or_else(|| TrainError::Config(format!("block {bi} gathered short")))?.to_vec();
                at += n;
            }
        }
        spans.push(Span { lane: Lane::Compute, name: "wait".into(), start: t0, end: Instant::now() });
        Ok(())
    }

    fn free(&mut self, bi: usize) {
        for &i in &self.blocks[bi] {
            self.tr.params.list[i].w = Vec::new();
        }
    }

    /// One iteration, block by block: each block's parameters are gathered while the block
    /// before it computes (one block of prefetch, forward and backward), freed after use; each
    /// block's gradients are reduce-scattered as soon as its backward ends, and its host part's
    /// cross-host all-reduce follows at once, while the next block's backward computes.
    fn step_with(&mut self, emu: Option<&Emulated>) -> Result<SdpStep> {
        self.iter += 1;
        // emulated: the device operations of this iteration, consumed in order
        let ops: Vec<DeviceOp> = emu.map(|e| e.ops(self.iter, self.world.rank(), self.shard_params())).unwrap_or_default();
        let mut ops = ops.iter();
        let mut device = |what: &str| -> Result<()> {
            let e = emu.ok_or_else(|| TrainError::Config("no emulated device".into()))?;
            let op =
                ops.next().ok_or_else(|| TrainError::Config(format!("emulated step: no device operation left for {what}")))?;
            e.device.run(op.flops, op.bytes);
            Ok(())
        };
        let t_start = Instant::now();
        let nb = self.blocks.len();
        let layers = self.tr.cfg.model.layers;
        let (b, t) = (self.tr.cfg.train.batch, self.tr.cfg.model.seq);
        let (x_tok, y_tok) = self.corpus.batch(self.tr.cfg.train.seed, self.iter, self.world.rank(), b, t);
        let mut spans: Vec<Span> = Vec::new();
        let cfg = self.tr.cfg.clone();
        let compute = |spans: &mut Vec<Span>, name: String, t0: Instant| {
            spans.push(Span { lane: Lane::Compute, name, start: t0, end: Instant::now() })
        };

        // forward: the embeddings and every layer; the head's forward is its backward's start
        let mut pending = Some(self.gather_block(0)?);
        let mut inputs = Vec::with_capacity(layers);
        let mut x = None;
        for bi in 0..nb - 1 {
            let next = self.gather_block(bi + 1)?;
            self.fill(bi, pending.take(), &mut spans, emu.is_some())?;
            let t0 = Instant::now();
            if emu.is_some() {
                if bi > 0 {
                    device("attention forward")?;
                    device("feed-forward forward")?;
                    compute(&mut spans, format!("forward {}", bi - 1), t0);
                }
                pending = Some(next);
                continue;
            }
            let model = Model::new(&cfg, &self.tr.params)?;
            if bi == 0 {
                x = Some(model.embed(&x_tok, b)?);
                compute(&mut spans, "embed".into(), t0);
            } else {
                let xi = x.take().ok_or_else(|| TrainError::Config("no activations".into()))?;
                let out = model.forward_layer(bi - 1, &xi)?;
                inputs.push(xi);
                x = Some(out.y);
                compute(&mut spans, format!("forward {}", bi - 1), t0);
            }
            drop(model);
            self.free(bi);
            pending = Some(next);
        }
        // backward: the head, then the layers in reverse, then the embeddings
        let mut grads: Vec<Vec<f32>> = vec![Vec::new(); self.tr.params.list.len()];
        let mut reduces: Vec<Reduce> = Vec::new();
        let mut g = None;
        let mut loss = 0.0;
        for bi in (0..nb).rev() {
            // the next block's gather goes out before this block computes (the embeddings need
            // no parameters for their backward)
            let next = if bi >= 2 { Some(self.gather_block(bi - 1)?) } else { None };
            if bi > 0 {
                self.fill(bi, pending.take(), &mut spans, emu.is_some())?;
            }
            for &i in &self.blocks[bi] {
                grads[i] = vec![0.0; self.tr.params.list[i].shape.iter().product()];
            }
            let t0 = Instant::now();
            if emu.is_some() {
                if bi == nb - 1 {
                    device("head forward")?;
                    device("head backward")?;
                    compute(&mut spans, "head".into(), t0);
                } else if bi > 0 {
                    if let Some(h) = &self.tr.backward_hook {
                        h(self.iter, bi - 1);
                    }
                    device("feed-forward backward")?;
                    device("attention backward")?;
                    compute(&mut spans, format!("backward {}", bi - 1), t0);
                }
                for &i in &self.blocks[bi] {
                    crate::trainer::pseudo_gradient(&mut grads[i], self.iter, self.world.rank(), i);
                }
            } else {
                let model = Model::new(&cfg, &self.tr.params)?;
                if bi == nb - 1 {
                    let xi = x.take().ok_or_else(|| TrainError::Config("no activations".into()))?;
                    let (l, gx) = model.head(&xi, &y_tok, &mut grads)?;
                    loss = l;
                    g = Some(gx);
                    compute(&mut spans, "head".into(), t0);
                } else if bi > 0 {
                    let l = bi - 1;
                    if let Some(h) = &self.tr.backward_hook {
                        h(self.iter, l);
                    }
                    let gy = g.take().ok_or_else(|| TrainError::Config("no gradient".into()))?;
                    g = Some(model.backward_layer(l, &inputs[l], None, None, &gy, &mut grads)?);
                    compute(&mut spans, format!("backward {l}"), t0);
                } else {
                    let gy = g.take().ok_or_else(|| TrainError::Config("no gradient".into()))?;
                    model.embed_backward(&x_tok, b, &gy, &mut grads)?;
                    compute(&mut spans, "embed backward".into(), t0);
                }
                drop(model);
            }
            self.free(bi);
            // this block's reduction goes out; the previous block's advances to its cross-host
            // stage
            let mut flat = Vec::with_capacity(self.engine.layer_len(bi));
            for &i in &self.blocks[bi] {
                flat.extend_from_slice(&std::mem::take(&mut grads[i]));
            }
            let mine = self.engine.start_reduce(bi, &flat)?;
            drop(flat);
            reduces.push(self.engine.advance_reduce(mine)?);
            pending = next;
        }
        let t0 = Instant::now();
        for r in reduces {
            self.engine.finish_reduce(r)?;
        }
        spans.push(Span { lane: Lane::Compute, name: "wait".into(), start: t0, end: Instant::now() });
        let t0 = Instant::now();
        if emu.is_some() {
            device("optimizer")?;
        }
        self.engine.step()?;
        compute(&mut spans, "optimizer".into(), t0);
        if let Some(op) = ops.next() {
            return Err(TrainError::Config(format!("emulated step {}: device operation {} was not run", self.iter, op.what)));
        }
        // the loss average is also where the ranks meet: the time a faster rank waits for the
        // slowest one is a wait too
        let t0 = Instant::now();
        let mut l = [if emu.is_some() { f32::NAN } else { loss }];
        self.world.all_reduce(&mut l, ReduceOp::Avg)?;
        spans.push(Span { lane: Lane::Compute, name: "wait".into(), start: t0, end: Instant::now() });
        for c in self.engine.take_spans() {
            spans.push(Span { lane: Lane::Comm(c.lane.index()), name: c.name, start: c.start, end: c.end });
        }
        Ok(SdpStep { loss: l[0], spans, elapsed_s: t_start.elapsed().as_secs_f64() })
    }

    /// Parameters, gradients and both Adam moments held between iterations, bytes.
    pub fn state_bytes_per_rank(&self) -> u64 {
        self.engine.state_bytes()
    }

    /// Iterations done (the optimizer's step count; also the data position).
    pub fn iter(&self) -> u64 {
        self.iter
    }

    /// The checkpoint layout of this rank's state: its shards (parameters and both moments of
    /// each part), the step and the seed — registered with the checkpoint engine like any
    /// rank's state.
    ///
    /// Each shard is a slice of a flat global tensor per layer (`layer7.p`, `.m`, `.v`: the
    /// layer's parameters in order, and their moments), padding left out, so a checkpoint of
    /// one sharding loads onto another (`ironweave_ckpt::layout`).
    pub fn state_specs(&self) -> Vec<ironweave_ckpt::TensorSpec> {
        use ironweave_ckpt::{DType, GlobalSlice, TensorSpec};
        let mut v: Vec<TensorSpec> = self
            .engine
            .checkpoint_tensors()
            .into_iter()
            .map(|t| {
                TensorSpec::new(format!("shard.{}", t.name), DType::F32, &[t.values.len() as u64]).with_global(GlobalSlice {
                    tensor: t.global,
                    shape: vec![t.global_len as u64],
                    offsets: vec![t.offset as u64],
                    owner: t.owner,
                })
            })
            .collect();
        let rank0 = self.world.rank() == 0;
        for n in ["step", "seed"] {
            v.push(TensorSpec::new(n, DType::I64, &[]).with_global(GlobalSlice::whole(n, &[], rank0)));
        }
        v
    }

    /// The state as byte buffers, in `state_specs` order (step and seed last).
    pub fn state_bufs(&self) -> (Vec<&[u8]>, [u8; 8], [u8; 8]) {
        let v = self.engine.checkpoint_tensors().into_iter().map(|t| crate::trainer::f32_bytes(t.values)).collect();
        (v, (self.iter as i64).to_le_bytes(), (self.tr.cfg.train.seed as i64).to_le_bytes())
    }

    /// Loads a state laid out as `state_specs` (a restored snapshot).
    pub fn load_state(&mut self, tensor: impl Fn(&str) -> Option<Vec<u8>>) -> Result<()> {
        let step = tensor("step").ok_or_else(|| TrainError::Config("restored state lacks `step`".into()))?;
        let step = i64::from_le_bytes(
            step.as_slice().try_into().map_err(|_| TrainError::Config("restored `step` is not 8 bytes".into()))?,
        );
        let step = u64::try_from(step).map_err(|_| TrainError::Config(format!("restored step {step} is negative")))?;
        self.engine.load_shards(step, |name| tensor(&format!("shard.{name}")))?;
        self.iter = step;
        Ok(())
    }

    /// SHA-256 of the step and this rank's shards (parameters and both moments): equal
    /// digests, equal states.
    pub fn state_digest(&self) -> [u8; 32] {
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        h.update(self.iter.to_le_bytes());
        for (name, x) in self.engine.shard_tensors() {
            h.update(name.as_bytes());
            h.update(crate::trainer::f32_bytes(x));
        }
        h.finalize().into()
    }

    /// The fault-injection hook (`--fail`): called at the start of each layer's backward with
    /// (iteration, layer).
    pub fn set_backward_hook(&mut self, hook: Box<dyn Fn(u64, usize) + Send>) {
        self.tr.backward_hook = Some(hook);
    }

    /// Every parameter, gathered (collective), with this rank's view of nothing else: the
    /// moments stay sharded.
    pub fn full_params(&self) -> Result<Params> {
        let mut out = self.tr.params.clone();
        for (bi, block) in self.blocks.iter().enumerate() {
            let flat = self.engine.start_gather(bi)?.wait()?;
            let mut at = 0;
            for &i in block {
                let p = &mut out.list[i];
                let n: usize = p.shape.iter().product();
                p.w = flat[at..at + n].to_vec();
                at += n;
            }
        }
        out.step = self.iter;
        Ok(out)
    }
}
