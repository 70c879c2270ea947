//! Emulated compute: one rank of the expert- and data-parallel MoE job with its math replaced by
//! the time a published accelerator takes for it, everything else real.
//!
//! Why: the systems ironweave implements were measured on accelerator clusters, where the math
//! runs on the device, the host's cores are mostly idle and the links are the bottleneck. Here
//! ([`Trainer::step_emulated`](crate::Trainer::step_emulated)) each layer's forward and backward
//! occupies the rank's [`EmulatedDevice`] for its roofline time — the layer's FLOPs, and the
//! bytes its weights and activations move, for the tokens this rank holds (an expert: the
//! tokens routed to it this iteration) — while the host thread sleeps. What stays real: the
//! all-to-all-v with this iteration's per-expert token counts (a recorded router's, see
//! [`crate::routing`]), the dense gradients' bucketed all-reduce overlapping the backward, the
//! parameters and both Adam moments of the configured model (this rank's share) in host
//! memory, updated every iteration by the real AdamW on deterministic pseudo-gradients — so
//! the checkpoint engine snapshots, replicates and restores real bytes, and a recovered run
//! ends in the clean run's digest.
//!
//! Time is dilated (docs/EMULATION.md): `dilation` divides the device's rates, so a device
//! operation lasts `dilation` times its published duration; the bed divides its link rates by
//! the same factor, which keeps every ratio the papers' results depend on.

use std::sync::Arc;
use std::time::Duration;

use ironweave_plan::{DType, DeviceDesc, ModelDesc, MoeDesc};
use ironweave_units::Roofline;

use crate::config::TrainConfig;
use crate::device::{EmulatedDevice, Sleep};
use crate::error::{Result, TrainError};
use crate::routing::{RoutingShape, RoutingTrace};

/// Element type of the activations on the wire and in device memory (mixed precision).
pub const ACTIVATION_DTYPE: DType = DType::BF16;

/// Vocabulary of the byte-level model (`model::init`'s embedding and head).
const VOCAB: u32 = 256;

fn config_err(why: impl Into<String>) -> TrainError {
    TrainError::Config(why.into())
}

/// What a rank's emulated device computes and how the router behaves: shared by the ranks'
/// steps, the tests and the bed's arithmetic.
#[derive(Debug)]
pub struct Emulated {
    /// The rank's device.
    pub device: Arc<EmulatedDevice>,
    /// The model as the cost formulas see it (the planner's own, [`ModelDesc`]).
    pub model: ModelDesc,
    /// The recorded router (MoE configurations only).
    trace: Option<RoutingTrace>,
    tokens_per_rank: u64,
    world: usize,
    moe_layers: Vec<usize>,
    dilation: f64,
}

/// One device operation of a step: what it is and what it costs (FLOPs, device-memory bytes).
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceOp {
    /// `l3.attn.fwd`, `l3.e5.bwd`, `head.fwd`, `optimizer`, ...
    pub what: String,
    /// Floating-point operations.
    pub flops: f64,
    /// Bytes moved through device memory.
    pub bytes: f64,
}

impl Emulated {
    /// The emulation of `cfg` on `world` ranks, each with a `device` whose rates are divided by
    /// `dilation`, routed as `trace` says. A configuration with MoE layers needs a trace; a dense
    /// one (the sharded and tensor-parallel workloads) takes none. Refuses a trace of another
    /// routing architecture (MoE layers, experts, top-k, ranks) or shorter than `iters`, and a
    /// dilation that is not a positive number, naming what differs. A trace recorded with
    /// another number of tokens per rank is scaled to this run's (the router's shares are kept,
    /// not its token count).
    pub fn new(
        cfg: &TrainConfig,
        world: usize,
        device: &DeviceDesc,
        dilation: f64,
        trace: Option<RoutingTrace>,
        iters: u64,
        sleep: Option<Arc<dyn Sleep>>,
    ) -> Result<Emulated> {
        if !(dilation.is_finite() && dilation > 0.0) {
            return Err(config_err(format!("dilation {dilation} must be a positive number (1: real time)")));
        }
        if world == 0 {
            return Err(config_err("emulated compute needs at least one rank"));
        }
        let model = model_desc(cfg, world)?;
        // the MoE layers of the cost model: a 1-expert "MoE" layer is costed as the dense
        // feed-forward it is
        let moe_layers: Vec<usize> = (0..cfg.model.layers).filter(|&l| model.is_moe_layer(l as u32)).collect();
        let shape = RoutingShape::of(cfg, world);
        let trace = match (moe_layers.is_empty(), trace) {
            (true, t) => t,
            (false, None) => {
                return Err(config_err(format!(
                    "{} has MoE layers: emulated compute replays a recorded router for them (--routing FILE from `ironweave train --record-routing`)",
                    cfg.name
                )))
            }
            (false, Some(t)) => {
                if cfg.model.experts % world != 0 {
                    return Err(config_err(format!(
                        "{} experts cannot be spread evenly over {world} ranks",
                        cfg.model.experts
                    )));
                }
                t.check_routes_for(&shape, iters)?;
                Some(t)
            }
        };
        let base = device.roofline();
        let rates = Roofline { flops_per_s: base.flops_per_s / dilation, bytes_per_s: base.bytes_per_s.map(|b| b / dilation) };
        let device = Arc::new(match sleep {
            Some(s) => EmulatedDevice::with_sleep(device.name.clone(), rates, s),
            None => EmulatedDevice::new(device.name.clone(), rates),
        });
        Ok(Emulated { device, model, trace, tokens_per_rank: shape.tokens_per_rank, world, moe_layers, dilation })
    }

    /// The dilation factor.
    pub fn dilation(&self) -> f64 {
        self.dilation
    }

    /// Ranks.
    pub fn world(&self) -> usize {
        self.world
    }

    /// Tokens each rank routes at iteration `iter` (1-based: the trace's `iter`-th recorded
    /// iteration) in MoE layer `m` to each expert, before capacity: `[rank][expert]`, scaled to
    /// this run's tokens per rank.
    /// Empty for a dense configuration (no MoE layer, no trace).
    pub fn wanted(&self, iter: u64, m: usize) -> Vec<Vec<u64>> {
        let Some(trace) = &self.trace else { return Vec::new() };
        let i = (iter.saturating_sub(1) as usize).min(trace.iterations.len().saturating_sub(1));
        let recorded = trace.shape.tokens_per_rank.max(1);
        trace.iterations[i][m]
            .iter()
            .map(|row| row.iter().map(|&c| (c as u128 * self.tokens_per_rank as u128 / recorded as u128) as u64).collect())
            .collect()
    }

    /// The tokens each rank sends to each expert in MoE layer `m` at `iter`: [`Emulated::wanted`]
    /// cut at the expert's capacity on the sending rank, as the real router does
    /// (`ceil(capacity_factor × tokens × top_k / experts)`).
    pub fn dispatched(&self, iter: u64, m: usize) -> Vec<Vec<u64>> {
        let Some(moe) = &self.model.moe else { return self.wanted(iter, m) };
        let cap = (moe.capacity_factor * (self.tokens_per_rank * moe.top_k as u64) as f64 / moe.experts as f64).ceil() as u64;
        let cap = cap.max(1);
        self.wanted(iter, m).into_iter().map(|row| row.into_iter().map(|c| c.min(cap)).collect()).collect()
    }

    /// Index of layer `l` among the MoE layers.
    pub fn moe_index(&self, l: usize) -> Option<usize> {
        self.moe_layers.iter().position(|&x| x == l)
    }

    fn seqs(&self) -> f64 {
        self.tokens_per_rank as f64 / self.model.seq as f64
    }

    fn act(&self) -> f64 {
        ACTIVATION_DTYPE.size() as f64
    }

    /// One attention block's forward on this rank's tokens: its matmuls' FLOPs; its weights
    /// read once and its input, output and three projections (q, k, v) through memory.
    pub fn attn_forward(&self) -> DeviceOp {
        self.attn_forward_on(self.seqs(), 1)
    }

    /// An attention block's forward on `seqs` sequences, its heads split over `split` devices
    /// (tensor parallelism: each computes `1/split` of the heads, reads `1/split` of the
    /// weights, and holds its whole input and output).
    pub fn attn_forward_on(&self, seqs: f64, split: usize) -> DeviceOp {
        let m = &self.model;
        let d = split.max(1) as f64;
        DeviceOp {
            what: "attn.fwd".into(),
            flops: m.attn_flops(seqs) / d,
            bytes: m.attn_params() * self.act() / d + (2.0 + 3.0 / d) * m.activation_bytes(seqs),
        }
    }

    /// One feed-forward block (dense, or one expert) on `tokens` tokens: the matmuls' FLOPs;
    /// its weights read once, the tokens in and out and the hidden activations.
    pub fn mlp_forward(&self, tokens: u64) -> DeviceOp {
        self.mlp_forward_on(tokens as f64 / self.model.seq as f64, 1)
    }

    /// A feed-forward block on `seqs` sequences, its hidden units split over `split` devices.
    pub fn mlp_forward_on(&self, seqs: f64, split: usize) -> DeviceOp {
        let m = &self.model;
        let d = split.max(1) as f64;
        DeviceOp {
            what: "mlp.fwd".into(),
            flops: m.mlp_flops(seqs) / d,
            bytes: m.mlp_params() * self.act() / d + (2.0 + 2.0 * m.ffn_mult / d) * m.activation_bytes(seqs),
        }
    }

    /// The LM head (and loss) forward on this rank's tokens.
    pub fn head_forward(&self) -> DeviceOp {
        self.head_forward_on(self.seqs())
    }

    /// The LM head (and loss) forward on `seqs` sequences.
    pub fn head_forward_on(&self, seqs: f64) -> DeviceOp {
        let m = &self.model;
        DeviceOp {
            what: "head.fwd".into(),
            flops: m.head_flops(seqs),
            bytes: m.embed_params() * self.act() + m.activation_bytes(seqs) * (1.0 + m.vocab as f64 / m.hidden as f64),
        }
    }

    /// The backward of `fwd`: twice its FLOPs (input and weight gradients) and its bytes.
    pub fn backward(fwd: &DeviceOp) -> DeviceOp {
        DeviceOp { what: fwd.what.replace(".fwd", ".bwd"), flops: 2.0 * fwd.flops, bytes: 2.0 * fwd.bytes }
    }

    /// AdamW over `params` parameters on the device: memory-bound (parameter, gradient, both
    /// moments read, parameter and moments written, fp32), about 12 FLOPs each.
    pub fn optimizer(&self, params: usize) -> DeviceOp {
        DeviceOp { what: "optimizer".into(), flops: 12.0 * params as f64, bytes: 28.0 * params as f64 }
    }

    /// Every device operation rank `rank` runs in iteration `iter`, in order, for a state of
    /// `params` parameters: what [`crate::Trainer::step_emulated`] runs, and what the tests and
    /// the simulator compare the device's busy time with.
    pub fn ops(&self, iter: u64, rank: usize, params: usize) -> Vec<DeviceOp> {
        let layers = self.model.layers as usize;
        let mut fwd: Vec<Vec<DeviceOp>> = Vec::with_capacity(layers);
        for l in 0..layers {
            let mut v = Vec::new();
            let mut a = self.attn_forward();
            a.what = format!("l{l}.attn.fwd");
            v.push(a);
            match self.moe_index(l) {
                Some(m) => {
                    let d = self.dispatched(iter, m);
                    for e in (0..self.model.moe.as_ref().map_or(0, |x| x.experts as usize)).filter(|e| e % self.world == rank) {
                        let n: u64 = d.iter().map(|row| row[e]).sum();
                        let mut op = self.mlp_forward(n);
                        op.what = format!("l{l}.e{e}.fwd");
                        v.push(op);
                    }
                }
                None => {
                    let mut op = self.mlp_forward(self.tokens_per_rank);
                    op.what = format!("l{l}.mlp.fwd");
                    v.push(op);
                }
            }
            fwd.push(v);
        }
        let mut out: Vec<DeviceOp> = fwd.iter().flatten().cloned().collect();
        let head = self.head_forward();
        out.push(head.clone());
        out.push(Emulated::backward(&head));
        for v in fwd.iter().rev() {
            // backward runs the feed-forward before the attention
            out.extend(v.iter().rev().map(Emulated::backward));
        }
        out.push(self.optimizer(params));
        out
    }

    /// The device time of [`Emulated::ops`] on this device.
    pub fn busy(&self, ops: &[DeviceOp]) -> Duration {
        ops.iter().map(|o| self.device.duration(o.flops, o.bytes)).sum()
    }
}

/// The cost model's view of `cfg` trained on `world` ranks (the byte-level vocabulary, bf16
/// activations).
pub fn model_desc(cfg: &TrainConfig, world: usize) -> Result<ModelDesc> {
    let m = &cfg.model;
    let u = |v: usize, what: &str| u32::try_from(v).map_err(|_| config_err(format!("model.{what} = {v} is too large")));
    let moe = (m.experts > 1).then_some(MoeDesc {
        experts: m.experts as u32,
        top_k: m.top_k as u32,
        capacity_factor: m.capacity_factor,
        every: m.moe_every as u32,
    });
    let d = ModelDesc {
        name: cfg.name.clone(),
        layers: u(m.layers, "layers")?,
        hidden: u(m.hidden, "hidden")?,
        heads: u(m.heads, "heads")?,
        seq: u(m.seq, "seq")?,
        global_batch: u(cfg.train.batch * world, "batch")?,
        micro_batch: u(cfg.train.batch, "batch")?,
        vocab: VOCAB,
        ffn_mult: m.ffn_mult as f64,
        dtype: ACTIVATION_DTYPE,
        // the trainers average fp32 gradients
        grad_dtype: Some(DType::F32),
        activation_recompute: false,
        moe,
    };
    d.validate().map_err(|e| config_err(format!("{}: {e}", cfg.name)))?;
    Ok(d)
}

/// Bytes of parameters and both Adam moments (fp32) one rank of `world` holds for `model`:
/// every dense tensor (data parallel) and its share of the experts. An estimate from the
/// model's sizes (biases and norms left out), for checking a bed fits in memory before any
/// rank starts.
pub fn state_bytes_per_rank(model: &ModelDesc, world: usize) -> f64 {
    let experts = model.moe.as_ref().map_or(1, |m| m.experts) as f64;
    let mut params = 2.0 * model.embed_params();
    for l in 0..model.layers {
        params += model.attn_params();
        params += if model.is_moe_layer(l) { model.mlp_params() * experts / world.max(1) as f64 } else { model.mlp_params() };
    }
    12.0 * params
}
