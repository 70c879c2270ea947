//! The trainer: a candle model's parameters held replicated (bucketed averaging during the
//! backward pass) or sharded, stepped with AdamW, and its state as checkpoint buffers.

use ironweave_units::Locked;
use std::sync::Arc;
use std::time::Instant;

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::VarMap;
use ironweave_ckpt::{Snapshot, TensorSpec};
use ironweave_sdp::ddp::{self, Bucket, GradSyncStats};
use ironweave_sdp::{adam_update, Groups, ShardEngine};
use ironweave_transport::{Communicator, ReduceOp};

use super::staged::{staged_backward, to_host, Param, Staged};
use super::{Error, Layout, Result, StepStats, TrainerConfig};

/// How the state is held.
#[derive(Debug)]
enum Holder {
    /// Host copies of every parameter and both moments.
    Replicated { w: Vec<Vec<f32>>, m: Vec<Vec<f32>>, v: Vec<Vec<f32>>, comm: Arc<Communicator> },
    /// Shards in the engine; units of whole parameters in name order.
    Sharded { engine: ShardEngine, comm: Arc<Communicator> },
}

impl Holder {
    /// The communicator the holder's collectives run on (data parallel: a `dup` of the job's,
    /// beside the model's own traffic; sharded: the job's).
    fn comm(&self) -> &Arc<Communicator> {
        match self {
            Holder::Replicated { comm, .. } | Holder::Sharded { comm, .. } => comm,
        }
    }
}

/// Trains one rank's replica or shard of a candle model (see the module documentation).
#[derive(Debug)]
pub struct Trainer {
    params: Vec<Param>,
    layout: Layout,
    cfg: TrainerConfig,
    holder: Holder,
    /// Sharded units: parameter index ranges in name order.
    units: Vec<std::ops::Range<usize>>,
    /// The backward stage after which each parameter's gradient is final (learned in the
    /// first step: None before it).
    stage_of: Option<Vec<usize>>,
    stages: usize,
    buckets: Vec<Bucket>,
    /// Whether every rank was found to hold the same bucket plan.
    plan_checked: bool,
    /// The initial parameters, to start over from.
    initial: Vec<Vec<f32>>,
    step: u64,
    step_bytes: [u8; 8],
}

fn f32_from_le(b: &[u8], name: &str, n: usize) -> Result<Vec<f32>> {
    if b.len() != n * 4 {
        return Err(Error::Invalid(format!(
            "`{name}`: {} bytes restored for {n} floats (a checkpoint of another model or layout)",
            b.len()
        )));
    }
    Ok(b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
}

impl Trainer {
    /// A trainer of every variable of `varmap` (in name order: the same on every rank),
    /// holding them as `layout` says over `comm`. Collective: every rank calls it, and every
    /// rank starts from rank 0's parameters (broadcast here, as DDP does), which are also the
    /// state [`Trainer::start_over`] goes back to.
    pub fn new(varmap: &VarMap, comm: &Arc<Communicator>, layout: Layout, cfg: TrainerConfig) -> Result<Trainer> {
        Self::build(varmap, comm, layout, cfg, true)
    }

    /// The trainer of an elastic job's generation, in [`crate::elastic::Worker::join`]: built
    /// at the job's first generation (every rank together, as [`Trainer::new`]), built without
    /// the broadcast by a process the launcher restarted into a later generation (its peers
    /// are rebinding, not building; its state comes from the restore that follows), and
    /// rebound ([`Trainer::rebind`]) by a survivor.
    pub fn join(
        slot: &mut Option<Trainer>,
        varmap: &VarMap,
        generation: &crate::elastic::Generation<'_>,
        layout: Layout,
        cfg: TrainerConfig,
    ) -> Result<()> {
        match slot {
            Some(t) => t.rebind(generation.comm),
            None => {
                *slot = Some(Self::build(varmap, generation.comm, layout, cfg, generation.number == 0)?);
                Ok(())
            }
        }
    }

    fn build(varmap: &VarMap, comm: &Arc<Communicator>, layout: Layout, cfg: TrainerConfig, sync: bool) -> Result<Trainer> {
        let mut named: Vec<(String, Var)> = varmap.data().locked().iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        named.sort_by(|a, b| a.0.cmp(&b.0));
        if named.is_empty() {
            return Err(Error::Invalid("the VarMap holds no variables: build the model from it first".into()));
        }
        let mut params = Vec::with_capacity(named.len());
        let mut initial = Vec::with_capacity(named.len());
        for (name, var) in named {
            let t = var.as_tensor();
            if t.dtype() != DType::F32 {
                return Err(Error::Invalid(format!("`{name}` is {:?}: the adapter trains f32 parameters", t.dtype())));
            }
            if !matches!(t.device(), Device::Cpu) {
                return Err(Error::Invalid(format!("`{name}` is not on the CPU: the adapter trains CPU models")));
            }
            let shape = t.dims().to_vec();
            let len = t.elem_count();
            initial.push(to_host(t)?);
            params.push(Param { name, var, shape, len });
        }
        if sync {
            broadcast_params(comm, &params, &mut initial)?;
        }
        let units = Self::plan_units(&params, cfg.bucket_bytes);
        let holder = Self::hold(&params, &initial, &units, comm, &layout, cfg)?;
        let mut t = Trainer {
            params,
            layout,
            cfg,
            holder,
            units,
            stage_of: None,
            stages: 1,
            buckets: Vec::new(),
            plan_checked: false,
            initial,
            step: 0,
            step_bytes: [0; 8],
        };
        t.plan_buckets();
        Ok(t)
    }

    /// Units of whole parameters in name order, each at most `bucket_bytes` (one per
    /// parameter above it; one unit for everything with `None`).
    fn plan_units(params: &[Param], bucket_bytes: Option<usize>) -> Vec<std::ops::Range<usize>> {
        let cap = bucket_bytes.map(|b| (b / 4).max(1));
        let mut out: Vec<std::ops::Range<usize>> = Vec::new();
        let mut len = 0;
        for (i, p) in params.iter().enumerate() {
            match out.last_mut() {
                Some(u) if cap.is_none_or(|c| len + p.len <= c) => {
                    u.end = i + 1;
                    len += p.len;
                }
                _ => {
                    out.push(i..i + 1);
                    len = p.len;
                }
            }
        }
        out
    }

    fn hold(
        params: &[Param],
        values: &[Vec<f32>],
        units: &[std::ops::Range<usize>],
        comm: &Arc<Communicator>,
        layout: &Layout,
        cfg: TrainerConfig,
    ) -> Result<Holder> {
        Ok(match layout {
            Layout::DataParallel => Holder::Replicated {
                w: values.to_vec(),
                m: params.iter().map(|p| vec![0.0; p.len]).collect(),
                v: params.iter().map(|p| vec![0.0; p.len]).collect(),
                // the buckets average on a communicator of their own, beside the model's traffic
                comm: Arc::new(comm.dup()),
            },
            Layout::Sharded { strategy, ranks_per_host, fractions, full_link, inter_link } => {
                let groups = Groups::new(comm, *ranks_per_host, *full_link, *inter_link)?;
                let flat: Vec<Vec<f32>> = units.iter().map(|u| values[u.clone()].concat()).collect();
                let fr: Vec<f64> = match fractions.len() {
                    1 => vec![fractions[0]; units.len()],
                    _ => fractions.clone(),
                };
                Holder::Sharded { engine: ShardEngine::new(groups, *strategy, &flat, &fr, cfg.adam)?, comm: comm.clone() }
            }
        })
    }

    fn plan_buckets(&mut self) {
        let last = self.stages.saturating_sub(1);
        let staged: Vec<(usize, usize, usize)> = match &self.stage_of {
            Some(s) => self.params.iter().enumerate().map(|(i, p)| (i, s[i], p.len)).collect(),
            None => self.params.iter().enumerate().map(|(i, p)| (i, last, p.len)).collect(),
        };
        let bytes = if self.stage_of.is_some() { self.cfg.bucket_bytes } else { None };
        self.buckets = ddp::plan_buckets(&staged, bytes, last);
        self.plan_checked = false;
    }

    /// Every rank must pack the same parameters in the same order into the same buckets (and
    /// reduce the sharded units in the same order): equal lengths would let a different
    /// packing through the transport's length checks and sum one parameter's gradient into
    /// another's. One small all-reduce after each new plan compares a digest of it.
    fn check_plan(&mut self) -> Result<()> {
        if self.plan_checked {
            return Ok(());
        }
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        let mut mix = |x: u64| {
            h ^= x;
            h = h.wrapping_mul(0x0100_0000_01b3);
        };
        for b in &self.buckets {
            mix(b.ready_after as u64);
            b.params.iter().for_each(|&i| mix(i as u64));
            mix(u64::MAX);
        }
        if let Some(s) = &self.stage_of {
            s.iter().for_each(|&x| mix(x as u64));
        }
        // the digest's low 62 bits, as +h and -h: one max gives both the largest and the smallest
        let d = (h >> 2) as i64;
        let mut v = [d, -d];
        self.holder.comm().all_reduce(&mut v, ReduceOp::Max)?;
        if v[0] != -v[1] {
            return Err(Error::Invalid(
                "the ranks bucket their gradients differently (a rank that did not learn the model's stages with the others): build or rebind every rank's trainer together".into(),
            ));
        }
        self.plan_checked = true;
        Ok(())
    }

    /// Joins a new communicator (an elastic job's next generation) keeping every parameter,
    /// moment and the step. Collective for sharded layouts.
    pub fn rebind(&mut self, comm: &Arc<Communicator>) -> Result<()> {
        // every rank must bucket alike: a restarted peer has not learned the stages, so every
        // rank learns them again in the generation's first step (results do not depend on it)
        self.stage_of = None;
        self.plan_buckets();
        match &mut self.holder {
            Holder::Replicated { comm: c, .. } => *c = Arc::new(comm.dup()),
            Holder::Sharded { engine, .. } => {
                // a fresh engine over the new groups, then this rank's shards moved into it
                let saved: Vec<(String, Vec<u8>)> =
                    engine.shard_tensors().into_iter().map(|(n, x)| (n, bytemuck::cast_slice(x).to_vec())).collect();
                let steps = engine.steps();
                let zeros: Vec<Vec<f32>> = self.params.iter().map(|p| vec![0.0; p.len]).collect();
                let mut h = Self::hold(&self.params, &zeros, &self.units, comm, &self.layout, self.cfg)?;
                if let Holder::Sharded { engine, .. } = &mut h {
                    engine.load_shards(steps, |n| saved.iter().find(|(k, _)| k == n).map(|(_, b)| b.clone()))?;
                }
                self.holder = h;
            }
        }
        Ok(())
    }

    /// Steps taken.
    pub fn steps(&self) -> u64 {
        self.step
    }

    /// Parameter names in the order of the state (name order).
    pub fn param_names(&self) -> Vec<&str> {
        self.params.iter().map(|p| p.name.as_str()).collect()
    }

    /// Buckets of the data-parallel averaging (one until the first step has shown which stage
    /// touches which parameter).
    pub fn buckets(&self) -> &[Bucket] {
        &self.buckets
    }

    /// One training step on this rank's `input`: forward, the loss `loss(output)`, backward
    /// with the averaging (or reductions) overlapping it, AdamW. Collective.
    pub fn step<M: Staged>(
        &mut self,
        model: &M,
        input: &Tensor,
        loss: impl Fn(&Tensor) -> candle_core::Result<Tensor>,
    ) -> Result<StepStats> {
        let k = model.stages();
        if k == 0 {
            return Err(Error::Invalid("a staged model needs at least one stage".into()));
        }
        if self.stages != k {
            // the stages are the model's: learn them again
            self.stages = k;
            self.stage_of = None;
            self.plan_buckets();
        }
        self.check_plan()?;
        if let Holder::Sharded { .. } = self.holder {
            self.gather_into_vars()?;
        }
        let mut grads: Vec<Vec<f32>> = self.params.iter().map(|p| vec![0.0; p.len]).collect();
        let mut seen = vec![usize::MAX; self.params.len()];
        let (l, sync) = match &mut self.holder {
            Holder::Replicated { comm, .. } => {
                let (params, buckets) = (&self.params, &self.buckets);
                ddp::backward_with_buckets(Some(&*comm), buckets, None, &mut grads, |g, h| -> Result<f32> {
                    staged_backward(model, input, &loss, params, g, &mut seen, |stage, g, t0| {
                        h.computed(t0, Instant::now());
                        Ok(h.stage_done(stage, g)?)
                    })
                })?
            }
            Holder::Sharded { engine, .. } => {
                let ready: Vec<usize> = match &self.stage_of {
                    Some(s) => self.units.iter().map(|u| u.clone().map(|i| s[i]).max().unwrap_or(0)).collect(),
                    None => vec![k - 1; self.units.len()],
                };
                let units = &self.units;
                let mut next = 0;
                let mut pending = Vec::new();
                let l = staged_backward(model, input, &loss, &self.params, &mut grads, &mut seen, |stage, g, _| {
                    // a unit's reduction starts once its last parameter's gradient is final
                    let mut order: Vec<usize> = (0..units.len()).filter(|&u| ready[u] == stage).collect();
                    order.sort_unstable();
                    for u in order {
                        let flat = g[units[u].clone()].concat();
                        let r = engine.start_reduce(u, &flat)?;
                        pending.push(engine.advance_reduce(r)?);
                        next += 1;
                    }
                    Ok(())
                })?;
                for r in pending {
                    engine.finish_reduce(r)?;
                }
                if next != units.len() {
                    return Err(Error::Invalid(format!("{} of {} units were reduced", next, units.len())));
                }
                (l, GradSyncStats::default())
            }
        };
        if self.stage_of.is_none() {
            // parameters no stage touched get the last stage (their gradient is zero)
            self.stage_of = Some(seen.iter().map(|&s| if s == usize::MAX { k - 1 } else { s }).collect());
            self.plan_buckets();
        }
        self.step += 1;
        self.step_bytes = (self.step as i64).to_le_bytes();
        let adam = self.cfg.adam;
        match &mut self.holder {
            Holder::Replicated { w, m, v, .. } => {
                for (i, p) in self.params.iter().enumerate() {
                    adam_update(&adam, self.step, true, &mut w[i], &mut m[i], &mut v[i], &grads[i]);
                    p.var.set(&Tensor::from_slice(&w[i], p.shape.as_slice(), &Device::Cpu)?)?;
                }
            }
            Holder::Sharded { engine, .. } => engine.step()?,
        }
        let mut lv = [l];
        self.holder.comm().all_reduce(&mut lv, ReduceOp::Avg)?;
        Ok(StepStats { loss: lv[0], sync })
    }

    /// Sets the learning rate of the next steps (a schedule, or a fine-tuning phase): the
    /// moments and the step count carry on. Every rank sets the same rate before the same step.
    pub fn set_lr(&mut self, lr: f64) -> Result<()> {
        if !lr.is_finite() || lr < 0.0 {
            return Err(Error::Invalid(format!("learning rate {lr}: give a finite rate ≥ 0")));
        }
        self.cfg.adam.lr = lr;
        if let Holder::Sharded { engine, .. } = &mut self.holder {
            engine.set_lr(lr);
        }
        Ok(())
    }

    /// Gathers every sharded unit and writes it into the model's variables (collective).
    fn gather_into_vars(&mut self) -> Result<()> {
        let Holder::Sharded { engine, .. } = &self.holder else { return Ok(()) };
        // every gather in flight at once; waited in order
        let pending: Vec<_> = (0..self.units.len()).map(|u| engine.start_gather(u)).collect::<Result<_, _>>()?;
        for (u, g) in pending.into_iter().enumerate() {
            let flat = g.wait()?;
            let mut at = 0;
            for p in &self.params[self.units[u].clone()] {
                p.var.set(&Tensor::from_slice(&flat[at..at + p.len], p.shape.as_slice(), &Device::Cpu)?)?;
                at += p.len;
            }
        }
        Ok(())
    }

    /// The checkpoint layout of this rank's state: data parallel, every parameter with its two
    /// moments (`adam.m.NAME`, `adam.v.NAME`); sharded, this rank's shards
    /// (`shard.UNIT.PART.p|m|v`); then the step.
    pub fn state_specs(&self) -> Vec<TensorSpec> {
        let mut v = Vec::new();
        match &self.holder {
            Holder::Replicated { .. } => {
                for p in &self.params {
                    let shape: Vec<u64> = p.shape.iter().map(|&d| d as u64).collect();
                    v.push(TensorSpec::new(p.name.clone(), ironweave_ckpt::DType::F32, &shape));
                    v.push(TensorSpec::new(format!("adam.m.{}", p.name), ironweave_ckpt::DType::F32, &shape));
                    v.push(TensorSpec::new(format!("adam.v.{}", p.name), ironweave_ckpt::DType::F32, &shape));
                }
            }
            Holder::Sharded { engine, .. } => {
                for (name, x) in engine.shard_tensors() {
                    v.push(TensorSpec::new(format!("shard.{name}"), ironweave_ckpt::DType::F32, &[x.len() as u64]));
                }
            }
        }
        v.push(TensorSpec::new("step", ironweave_ckpt::DType::I64, &[]));
        v
    }

    /// The state as byte buffers in [`Trainer::state_specs`] order.
    pub fn state(&self) -> Vec<&[u8]> {
        let mut out: Vec<&[u8]> = Vec::new();
        match &self.holder {
            Holder::Replicated { w, m, v, .. } => {
                for i in 0..self.params.len() {
                    for x in [&w[i], &m[i], &v[i]] {
                        out.push(bytemuck::cast_slice(x));
                    }
                }
            }
            Holder::Sharded { engine, .. } => {
                out.extend(engine.shard_tensors().into_iter().map(|(_, x)| bytemuck::cast_slice::<f32, u8>(x)));
            }
        }
        out.push(&self.step_bytes);
        out
    }

    /// The state as the model itself holds it, in [`Trainer::state_specs`] order: each
    /// parameter (or this rank's shard of it) read from the model's variables — weights and
    /// biases alike — the moments and the step from the trainer. After a restore this equals
    /// the restored snapshot only if the restore reached the variables, which the host copies
    /// of [`Trainer::state`] cannot show: the elastic runtime checks it
    /// ([`crate::elastic::Worker::restored_state`]).
    pub fn state_from_variables(&self) -> Result<Vec<Vec<u8>>> {
        let bytes = |x: &[f32]| bytemuck::cast_slice::<f32, u8>(x).to_vec();
        let mut out = Vec::new();
        match &self.holder {
            Holder::Replicated { m, v, .. } => {
                for (i, p) in self.params.iter().enumerate() {
                    out.push(bytes(&to_host(p.var.as_tensor())?));
                    out.push(bytes(&m[i]));
                    out.push(bytes(&v[i]));
                }
            }
            Holder::Sharded { engine, .. } => {
                // each unit's parameters flattened as the engine shards them
                let flat: Vec<Vec<f32>> = self
                    .units
                    .iter()
                    .map(|u| self.params[u.clone()].iter().map(|p| to_host(p.var.as_tensor())).collect::<Result<Vec<_>>>())
                    .map(|r| r.map(|v| v.concat()))
                    .collect::<Result<_>>()?;
                let blocks = engine.shard_tensors();
                for (c, (_, block)) in engine.checkpoint_tensors().iter().zip(&blocks) {
                    if c.name.ends_with(".p") {
                        let l: usize = c.name.split('.').next().and_then(|x| x.parse().ok()).unwrap_or(usize::MAX);
                        let held = flat
                            .get(l)
                            .and_then(|f| f.get(c.offset..c.offset + c.values.len()))
                            .ok_or_else(|| Error::Invalid(format!("shard `{}` lies outside its unit's parameters", c.name)))?;
                        // the block's padding past the held elements is zero
                        let mut b = vec![0f32; block.len()];
                        b[..held.len()].copy_from_slice(held);
                        out.push(bytes(&b));
                    } else {
                        out.push(bytes(block));
                    }
                }
            }
        }
        out.push(self.step_bytes.to_vec());
        Ok(out)
    }

    /// Bytes of the state this rank keeps between steps (what one checkpoint of it carries):
    /// `1/world` of the data-parallel state under `full`.
    pub fn state_bytes(&self) -> u64 {
        self.state().iter().map(|b| b.len() as u64).sum()
    }

    /// SHA-256 of the state (the same on two runs that end in the same state).
    pub fn state_digest(&self) -> [u8; 32] {
        use sha2::Digest;
        let mut h = sha2::Sha256::new();
        for b in self.state() {
            h.update(b);
        }
        h.finalize().into()
    }

    /// Loads a state saved from [`Trainer::state`] (a restored snapshot) and writes the
    /// parameters into the model (collective for sharded layouts).
    pub fn restore(&mut self, snap: &Snapshot) -> Result<()> {
        let get = |name: &str| -> Result<&[u8]> {
            snap.tensor(name).ok_or_else(|| {
                Error::Invalid(format!("the checkpoint lacks `{name}` (it was written by another model or layout)"))
            })
        };
        let step = get("step")?;
        let step = i64::from_le_bytes(step.try_into().map_err(|_| Error::Invalid("`step` is not 8 bytes".into()))?) as u64;
        match &mut self.holder {
            Holder::Replicated { w, m, v, .. } => {
                for (i, p) in self.params.iter().enumerate() {
                    w[i] = f32_from_le(get(&p.name)?, &p.name, p.len)?;
                    m[i] = f32_from_le(get(&format!("adam.m.{}", p.name))?, &p.name, p.len)?;
                    v[i] = f32_from_le(get(&format!("adam.v.{}", p.name))?, &p.name, p.len)?;
                    p.var.set(&Tensor::from_slice(&w[i], p.shape.as_slice(), &Device::Cpu)?)?;
                }
            }
            Holder::Sharded { engine, .. } => {
                engine.load_shards(step, |n| snap.tensor(&format!("shard.{n}")).map(<[u8]>::to_vec))?;
            }
        }
        self.step = step;
        self.step_bytes = (step as i64).to_le_bytes();
        self.gather_into_vars()
    }

    /// Goes back to the initial state — rank 0's initial parameters (broadcast again: a
    /// restarted process built its own), zero moments, step 0 — and writes it into the model.
    /// Collective.
    pub fn start_over(&mut self) -> Result<()> {
        let mut initial = self.initial.clone();
        let comm = self.holder.comm().clone();
        broadcast_params(&comm, &self.params, &mut initial)?;
        self.holder = Self::hold(&self.params, &initial, &self.units, &comm, &self.layout, self.cfg)?;
        self.step = 0;
        self.step_bytes = [0; 8];
        Ok(())
    }
}

/// Every rank takes rank 0's `values` (one broadcast of all of them) and writes them into the
/// variables. Collective.
fn broadcast_params(comm: &Communicator, params: &[Param], values: &mut [Vec<f32>]) -> Result<()> {
    if comm.size() == 1 {
        return Ok(());
    }
    let mut flat = values.concat();
    comm.broadcast(&mut flat, 0)?;
    let mut at = 0;
    for (p, w) in params.iter().zip(values.iter_mut()) {
        w.copy_from_slice(&flat[at..at + p.len]);
        p.var.set(&Tensor::from_slice(w.as_slice(), p.shape.as_slice(), &Device::Cpu)?)?;
        at += p.len;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::{init_uniform, Whole};
    use super::*;
    use candle_nn::VarBuilder;

    fn model(vm: &VarMap) -> candle_nn::Linear {
        let vb = VarBuilder::from_varmap(vm, DType::F32, &Device::Cpu);
        let lin = candle_nn::linear(3, 2, vb.pp("lin")).unwrap();
        init_uniform(vm, 1).unwrap();
        lin
    }

    /// Runs `f(rank, comm)` on every rank of an in-process world of `n`.
    fn on_world<T: Send>(n: usize, f: impl Fn(usize, Arc<Communicator>) -> T + Sync) -> Vec<T> {
        let comms = ironweave_transport::inproc::communicators(n).unwrap();
        std::thread::scope(|s| {
            let hs: Vec<_> = comms
                .into_iter()
                .enumerate()
                .map(|(r, c)| {
                    s.spawn({
                        let f = &f;
                        move || f(r, Arc::new(c))
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn ranks_that_bucket_differently_are_refused_not_mixed() {
        let out = on_world(2, |r, comm| {
            let vm = VarMap::new();
            let lin = model(&vm);
            let mut t = Trainer::new(&vm, &comm, Layout::DataParallel, TrainerConfig::default()).unwrap();
            if r == 1 {
                // as a rank that learned the stages while its peer did not
                t.stage_of = Some(vec![0; t.params.len()]);
                t.plan_buckets();
            }
            let x = Tensor::ones((4, 3), DType::F32, &Device::Cpu).unwrap();
            t.step(&Whole(&lin), &x, |y| y.sqr()?.mean_all()).map(|s| s.loss).map_err(|e| e.to_string())
        });
        for o in out {
            assert!(o.as_ref().is_err_and(|e| e.contains("bucket their gradients differently")), "{o:?}");
        }
    }

    #[test]
    fn a_step_averages_over_ranks_and_the_state_round_trips() {
        let out = on_world(2, |r, comm| {
            let vm = VarMap::new();
            let lin = model(&vm);
            let mut t = Trainer::new(&vm, &comm, Layout::DataParallel, TrainerConfig::default()).unwrap();
            // each rank its own data; the update must be the same everywhere
            let x = Tensor::full(r as f32 + 1.0, (4, 3), &Device::Cpu).unwrap();
            for _ in 0..3 {
                t.step(&Whole(&lin), &x, |y| y.sqr()?.mean_all()).unwrap();
            }
            let specs = t.state_specs();
            let reg = Arc::new(ironweave_ckpt::Registry::new(&specs).unwrap());
            let snap = ironweave_ckpt::SnapshotBuffers::new(1, 4096).take(3, 0, &reg, &t.state()).unwrap();
            let (digest, weight) = (t.state_digest(), to_host(lin.weight()).unwrap());
            // move on: the host copies (weights, moments, step) and the model's variables change,
            // then the variables are scrambled differently on each rank
            for _ in 0..2 {
                t.step(&Whole(&lin), &x, |y| y.sqr()?.mean_all()).unwrap();
            }
            let moved = t.state_digest();
            init_uniform(&vm, 99 + r as u64).unwrap();
            t.restore(&snap).unwrap();
            (digest, moved, t.state_digest(), t.steps(), weight, to_host(lin.weight()).unwrap())
        });
        assert_eq!(out[0].0, out[1].0, "both ranks hold the same state");
        for (r, (before, moved, after, steps, weight, restored)) in out.iter().enumerate() {
            assert_ne!(before, moved, "rank {r}: the later steps changed the state (else the test proves nothing)");
            assert_eq!((after, *steps), (before, 3), "rank {r}: the host state is iteration 3's again");
            assert_eq!(restored, weight, "rank {r}: the model's variables hold iteration 3's weights again");
        }
    }

    #[test]
    fn the_state_read_from_the_variables_shows_whether_a_restore_reached_them() {
        for layout in [Layout::DataParallel, Layout::sharded(ironweave_sdp::Strategy::Full, 2)] {
            let out = on_world(2, |r, comm| {
                let vm = VarMap::new();
                let lin = model(&vm);
                let mut t = Trainer::new(&vm, &comm, layout.clone(), TrainerConfig::default()).unwrap();
                let x = Tensor::full(r as f32 + 1.0, (4, 3), &Device::Cpu).unwrap();
                for _ in 0..2 {
                    t.step(&Whole(&lin), &x, |y| y.sqr()?.mean_all()).unwrap();
                }
                let reg = Arc::new(ironweave_ckpt::Registry::new(&t.state_specs()).unwrap());
                let snap = ironweave_ckpt::SnapshotBuffers::new(1, 4096).take(2, 0, &reg, &t.state()).unwrap();
                let tensors = |st: &[Vec<u8>]| -> Vec<(String, bool)> {
                    reg.tensors
                        .iter()
                        .zip(st)
                        .map(|(m, b)| (m.name.clone(), snap.tensor(&m.name) == Some(b.as_slice())))
                        .collect()
                };
                t.step(&Whole(&lin), &x, |y| y.sqr()?.mean_all()).unwrap();
                t.restore(&snap).unwrap();
                let restored = tensors(&t.state_from_variables().unwrap());
                // a restore that never reached the variables: the host copies are right, the
                // model is not (its weights and biases scrambled after the restore)
                init_uniform(&vm, 77 + r as u64).unwrap();
                let host = tensors(&t.state().iter().map(|b| b.to_vec()).collect::<Vec<_>>());
                let vars = tensors(&t.state_from_variables().unwrap());
                (restored, host, vars)
            });
            for (r, (restored, host, vars)) in out.into_iter().enumerate() {
                assert!(restored.iter().all(|(_, same)| *same), "{layout:?} rank {r}: {restored:?}");
                assert!(host.iter().all(|(_, same)| *same), "{layout:?} rank {r}: the host copies cannot tell");
                // every parameter tensor of this rank differs, biases too
                let params: Vec<&(String, bool)> = vars
                    .iter()
                    .filter(|(n, _)| !n.contains("adam.") && !n.ends_with(".m") && !n.ends_with(".v") && n != "step")
                    .collect();
                assert!(!params.is_empty() && params.iter().all(|(_, same)| !*same), "{layout:?} rank {r}: {vars:?}");
                if layout == Layout::DataParallel {
                    assert!(params.iter().any(|(n, _)| n.ends_with("bias")), "{vars:?}");
                }
            }
        }
    }

    #[test]
    fn a_learning_rate_of_zero_holds_the_weights_and_a_bad_one_is_refused() {
        for layout in [Layout::DataParallel, Layout::sharded(ironweave_sdp::Strategy::Full, 2)] {
            let out = on_world(2, |_, comm| {
                let vm = VarMap::new();
                let lin = model(&vm);
                let mut t = Trainer::new(&vm, &comm, layout.clone(), TrainerConfig::default()).unwrap();
                let x = Tensor::ones((4, 3), DType::F32, &Device::Cpu).unwrap();
                let step = |t: &mut Trainer| {
                    t.step(&Whole(&lin), &x, |y| y.sqr()?.mean_all()).unwrap();
                    to_host(lin.weight()).unwrap()
                };
                step(&mut t);
                // sharded, the variables show the weights gathered at a step's start: compare
                // two steps at rate 0, then two at a rate above it
                t.set_lr(0.0).unwrap();
                let moved = step(&mut t);
                let held = step(&mut t);
                t.set_lr(1e-3).unwrap();
                step(&mut t);
                let again = step(&mut t);
                (moved, held, again, t.set_lr(f64::NAN).map_err(|e| e.to_string()))
            });
            for (moved, held, again, bad) in out {
                assert_eq!(moved, held, "{layout:?}: no step at rate 0");
                assert_ne!(held, again, "{layout:?}: steps again at a rate above 0");
                assert!(bad.is_err_and(|e| e.contains("learning rate")), "{layout:?}");
            }
        }
    }
}
