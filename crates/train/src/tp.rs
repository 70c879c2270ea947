//! Tensor parallelism of the dense GPT (Megatron-LM's layout), run by the overlap scheduler.
//!
//! Every transformer layer is two sub-layers. Attention: the query, key and value projections
//! are split by columns (each rank of the tensor-parallel group owns `heads / tp` heads), the
//! output projection by rows, so each rank produces a partial sum of the attention output that
//! one all-reduce completes. The MLP: first linear by columns, second by rows, one all-reduce.
//! In the backward pass, the gradient of each sub-layer's (replicated) input is a partial sum
//! too: one all-reduce per sub-layer again. Layer norms, embeddings and the head are replicated.
//!
//! The iteration is an [`ironweave_overlap::Program`]: one stage per sub-layer forward and
//! backward, each ending with its all-reduce, so the overlap scheduler decides what runs while
//! a collective is on the wire (Megatron: nothing; Oases: the next sub-batch). Each backward
//! stage first finishes the previous one (the layer norm behind the all-reduced gradient and
//! the residual), then back-propagates its own sub-layer up to its all-reduce. Data
//! parallelism over tensor-parallel groups adds one tail per layer: the layer's gradients are
//! averaged across groups as soon as backward has finished them.

use std::error::Error as StdError;

use candle_core::{Device, Tensor, Var};
use ironweave_overlap::{execute, steps, CommSpec, ExecStats, Program, Schedule, Stage, Step, Tail, Work};
use ironweave_transport::{Communicator, ReduceOp};
use sha2::{Digest, Sha256};

use crate::config::TrainConfig;
use crate::data::Corpus;
use crate::error::{Result, TrainError};
use crate::gelu::gelu;
use crate::model::{adamw, init, layer_norm, softmax_last, Params};

/// How the job is laid out and scheduled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TpSpec {
    /// Tensor-parallel degree (ranks per group; consecutive ranks form a group).
    pub tp: usize,
    /// Schedule of the collectives.
    pub schedule: Schedule,
    /// Sub-batches each rank's batch is split into.
    pub sub_batches: usize,
}

/// What one tensor-parallel iteration did.
#[derive(Debug, Clone)]
pub struct TpStepReport {
    /// Iteration (1-based).
    pub iter: u64,
    /// Mean cross-entropy over the whole (data-parallel) batch.
    pub loss: f32,
    /// The executor's spans and overlap (group 0: tensor parallel, group 1: data parallel).
    pub stats: ExecStats,
    /// Seconds of the step outside the executor: the loss average and the optimizer.
    pub outside_s: f64,
}

/// One rank of a tensor- (and data-) parallel job.
#[derive(Debug)]
pub struct TpTrainer {
    /// Configuration.
    pub cfg: TrainConfig,
    /// This rank's parameters: its shards of the split matrices, the replicated rest.
    pub params: Params,
    corpus: Corpus,
    spec: TpSpec,
    tp_rank: usize,
    dp_rank: usize,
    dp: usize,
    tp_comm: Option<Communicator>,
    dp_comm: Option<Communicator>,
    program: Program,
    steps: Vec<Step>,
    /// Parameter indices of each tail (data-parallel gradient group), in tail order.
    tail_params: Vec<Vec<usize>>,
    dev: Device,
    mask: Tensor,
}

/// How a parameter is split across the tensor-parallel group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Split {
    Columns,
    Rows,
    Replicated,
}

fn split_of(name: &str) -> Split {
    let tail = name.split_once('.').map_or(name, |(_, t)| t);
    match tail {
        "attn.wq" | "attn.wk" | "attn.wv" | "mlp.w1" => Split::Columns,
        "attn.wo" | "mlp.w2" => Split::Rows,
        _ => Split::Replicated,
    }
}

/// This rank's shard of the full parameters (`full` as `init` makes them, moments included).
pub fn shard(full: &Params, tp: usize, r: usize) -> Params {
    let mut out = full.clone();
    for p in &mut out.list {
        let (rows, cols) = match p.shape[..] {
            [a, b] => (a, b),
            _ => continue,
        };
        match split_of(&p.name) {
            Split::Columns => {
                let c = cols / tp;
                let take = |v: &[f32]| -> Vec<f32> {
                    (0..rows).flat_map(|i| v[i * cols + r * c..i * cols + (r + 1) * c].to_vec()).collect()
                };
                (p.w, p.m, p.v) = (take(&p.w), take(&p.m), take(&p.v));
                p.shape = vec![rows, c];
            }
            Split::Rows => {
                let n = rows / tp;
                let take = |v: &[f32]| v[r * n * cols..(r + 1) * n * cols].to_vec();
                (p.w, p.m, p.v) = (take(&p.w), take(&p.m), take(&p.v));
                p.shape = vec![n, cols];
            }
            Split::Replicated => {}
        }
    }
    out
}

type BoxErr = Box<dyn StdError + Send + Sync>;

impl TpTrainer {
    /// Rank `world.rank()` of a job of `world.size()` ranks (or alone when `world` is None):
    /// tensor-parallel groups of `spec.tp` consecutive ranks, data parallel across groups.
    /// Every rank must call this (it splits `world` twice).
    pub fn new(cfg: TrainConfig, corpus: Corpus, world: Option<&Communicator>, spec: TpSpec) -> Result<Self> {
        let (n, r) = world.map_or((1, 0), |w| (w.size(), w.rank()));
        let m = &cfg.model;
        let bad = |w: String| Err(TrainError::Config(format!("{}: {w}", cfg.name)));
        if spec.tp == 0 || n % spec.tp != 0 {
            return bad(format!("--tp {} does not divide the {n} ranks", spec.tp));
        }
        if (0..m.layers).any(|l| cfg.is_moe(l)) {
            return bad("tensor parallelism runs dense models: set moe_every above layers (see configs/gpt-tp.toml)".into());
        }
        if m.heads % spec.tp != 0 || (m.hidden * m.ffn_mult) % spec.tp != 0 {
            return bad(format!(
                "--tp {} must divide the heads ({}) and the MLP width ({})",
                spec.tp,
                m.heads,
                m.hidden * m.ffn_mult
            ));
        }
        if spec.sub_batches == 0 || spec.sub_batches > cfg.train.batch {
            return bad(format!("{} sub-batches of a batch of {} sequences", spec.sub_batches, cfg.train.batch));
        }
        let (tp_rank, dp_rank, dp) = (r % spec.tp, r / spec.tp, n / spec.tp);
        let (tp_comm, dp_comm) = match world {
            Some(w) if n > 1 => (Some(w.split(dp_rank as u32, r as u32)?), Some(w.split(tp_rank as u32, r as u32)?)),
            _ => (None, None),
        };
        let params = shard(&init(&cfg), spec.tp, tp_rank);
        let (program, tail_params) = program(&cfg, &params, spec.sub_batches, dp > 1);
        let steps = steps(&program, spec.schedule).map_err(|e| TrainError::Config(e.to_string()))?;
        let dev = Device::Cpu;
        let t = m.seq;
        let mask: Vec<f32> = (0..t * t).map(|i| if i % t > i / t { -1e9 } else { 0.0 }).collect();
        let mask = Tensor::from_slice(&mask, (t, t), &dev)?;
        Ok(TpTrainer {
            cfg,
            params,
            corpus,
            spec,
            tp_rank,
            dp_rank,
            dp,
            tp_comm,
            dp_comm,
            program,
            steps,
            tail_params,
            dev,
            mask,
        })
    }

    /// The program every iteration runs.
    pub fn program(&self) -> &Program {
        &self.program
    }

    /// (tensor-parallel rank, data-parallel rank, data-parallel degree).
    pub fn coords(&self) -> (usize, usize, usize) {
        (self.tp_rank, self.dp_rank, self.dp)
    }

    /// Runs the next iteration.
    pub fn step(&mut self) -> Result<TpStepReport> {
        let iter = self.params.step + 1;
        let (b, t) = (self.cfg.train.batch, self.cfg.model.seq);
        let (x_tok, y_tok) = self.corpus.batch(self.cfg.train.seed, iter, self.dp_rank, b, t);
        let k = self.spec.sub_batches;
        // sub-batch j: sequences [cut[j], cut[j+1])
        let cut: Vec<usize> = (0..=k).map(|j| j * b / k).collect();
        let layers = self.cfg.model.layers;
        let mut w = TpWork {
            tr: self,
            x_tok: &x_tok,
            y_tok: &y_tok,
            cut,
            x_in: vec![vec![None; k]; layers],
            x1: vec![vec![None; k]; layers],
            g_cur: vec![None; k],
            grads: self.params.list.iter().map(|p| vec![0.0; p.w.len()]).collect(),
            loss: 0.0,
        };
        let groups = [self.tp_comm.as_ref(), self.dp_comm.as_ref()];
        let stats = execute(&self.program, &self.steps, &groups, &mut w).map_err(|e| match e {
            ironweave_overlap::OverlapError::Transport(t) => TrainError::Transport(t),
            other => TrainError::Config(other.to_string()),
        })?;
        let exec_end = std::time::Instant::now();
        let (mut loss, grads) = (w.loss, w.grads);
        if let Some(d) = self.dp_comm.as_ref().filter(|_| self.dp > 1) {
            let mut l = [loss];
            d.all_reduce(&mut l, ReduceOp::Avg)?;
            loss = l[0];
        }
        adamw(&mut self.params, &grads, self.cfg.train.lr, self.cfg.train.weight_decay);
        let outside_s = exec_end.elapsed().as_secs_f64();
        Ok(TpStepReport { iter, loss, stats, outside_s })
    }

    /// SHA-256 of this rank's parameters, both moments and the step.
    pub fn state_digest(&self) -> [u8; 32] {
        let mut h = Sha256::new();
        h.update(self.params.step.to_le_bytes());
        for p in &self.params.list {
            h.update(p.name.as_bytes());
            for v in [&p.w, &p.m, &p.v] {
                h.update(bytemuck::cast_slice::<f32, u8>(v));
            }
        }
        h.finalize().into()
    }

    fn t(&self, name: &str) -> candle_core::Result<Tensor> {
        let p = &self.params.list[self.params.idx(name)];
        Tensor::from_slice(&p.w, p.shape.as_slice(), &self.dev)
    }

    fn v(&self, name: &str) -> candle_core::Result<Var> {
        let p = &self.params.list[self.params.idx(name)];
        Var::from_slice(&p.w, p.shape.as_slice(), &self.dev)
    }

    /// This rank's heads of attention on `a` (`ln1` of the layer input), through its rows of
    /// the output projection: a partial sum of the attention output.
    fn attn_partial(&self, a: &Tensor, wq: &Tensor, wk: &Tensor, wv: &Tensor, wo: &Tensor) -> candle_core::Result<Tensor> {
        let m = &self.cfg.model;
        let (n, _) = a.dims2()?;
        let t = m.seq;
        let (nh, hd) = (m.heads / self.spec.tp, m.hidden / m.heads);
        let heads = |w: &Tensor| a.matmul(w)?.reshape((n / t, t, nh, hd))?.transpose(1, 2)?.contiguous();
        let (q, k, v) = (heads(wq)?, heads(wk)?, heads(wv)?);
        let att =
            q.matmul(&k.transpose(2, 3)?.contiguous()?)?.affine(1.0 / (hd as f64).sqrt(), 0.0)?.broadcast_add(&self.mask)?;
        let att = softmax_last(&att).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        att.matmul(&v)?.transpose(1, 2)?.contiguous()?.reshape((n, nh * hd))?.matmul(wo)
    }
}

fn ln(x: &Tensor, g: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    layer_norm(x, g, b).map_err(|e| candle_core::Error::Msg(e.to_string()))
}

/// The program: per layer a forward stage for attention and for the MLP, then per layer in
/// reverse a backward stage for each, then the embeddings' backward. With data parallelism,
/// one tail per layer (and one for the head) averages its gradients once they are final.
/// Returns the program and the indices into `params` of each tail's gradients.
pub fn program(cfg: &TrainConfig, params: &Params, k: usize, dp: bool) -> (Program, Vec<Vec<usize>>) {
    let layers = cfg.model.layers;
    let tp = Some(CommSpec { group: 0, op: ReduceOp::Sum });
    let mut stages = Vec::new();
    for l in 0..layers {
        stages.push(Stage { name: format!("L{l}.attn"), comm: tp });
        stages.push(Stage { name: format!("L{l}.mlp"), comm: tp });
    }
    for l in (0..layers).rev() {
        let head = if l + 1 == layers { "head+" } else { "" };
        stages.push(Stage { name: format!("{head}L{l}.mlp.bwd"), comm: tp });
        stages.push(Stage { name: format!("L{l}.attn.bwd"), comm: tp });
    }
    stages.push(Stage { name: "embed.bwd".into(), comm: None });
    let mut tails = Vec::new();
    let mut tail_params = Vec::new();
    if dp {
        let idx = |pred: &dyn Fn(&str) -> bool| -> Vec<usize> {
            params.list.iter().enumerate().filter(|(_, p)| pred(&p.name)).map(|(i, _)| i).collect()
        };
        let avg = CommSpec { group: 1, op: ReduceOp::Avg };
        // the head's gradients are final after the first backward stage; layer l's after the
        // stage that finishes its first layer norm (the next stage, or the embeddings')
        tails.push(Tail { name: "head.grads".into(), after_stage: 2 * layers, comm: avg });
        tail_params.push(idx(&|n| n.starts_with("lnf.") || n == "head"));
        for l in (0..layers).rev() {
            let after = if l == 0 { 4 * layers } else { 2 * layers + 2 * (layers - l) };
            let pre = format!("l{l}.");
            tails.push(Tail { name: format!("L{l}.grads"), after_stage: after, comm: avg });
            tail_params.push(idx(&|n| n.starts_with(&pre) || (l == 0 && n.ends_with("_emb"))));
        }
    }
    (Program { stages, tails, sub_batches: k }, tail_params)
}

/// The state of one iteration the compute tasks share.
struct TpWork<'a> {
    tr: &'a TpTrainer,
    x_tok: &'a [u32],
    y_tok: &'a [u32],
    cut: Vec<usize>,
    /// Per layer and sub-batch: the layer's input, and its input plus attention (`x1`).
    x_in: Vec<Vec<Option<Tensor>>>,
    x1: Vec<Vec<Option<Tensor>>>,
    /// Per sub-batch: the gradient of the residual stream where backward has reached.
    g_cur: Vec<Option<Tensor>>,
    grads: Vec<Vec<f32>>,
    loss: f32,
}

impl TpWork<'_> {
    fn add_grad(&mut self, name: &str, g: &candle_core::backprop::GradStore, v: &Var) -> candle_core::Result<()> {
        if let Some(gi) = g.get(v.as_tensor()) {
            let i = self.tr.params.idx(name);
            for (a, b) in self.grads[i].iter_mut().zip(gi.flatten_all()?.to_vec1::<f32>()?) {
                *a += b;
            }
        }
        Ok(())
    }

    /// Backward through layer norm `pre` (`l3.ln1`) at `x` with output gradient `gy`: adds the
    /// norm's gradients, returns the input's.
    fn ln_backward(&mut self, pre: &str, x: &Tensor, gy: &Tensor) -> candle_core::Result<Tensor> {
        let xv = Var::from_tensor(&x.detach())?;
        let (gv, bv) = (self.tr.v(&format!("{pre}.g"))?, self.tr.v(&format!("{pre}.b"))?);
        let y = ln(xv.as_tensor(), gv.as_tensor(), bv.as_tensor())?;
        let g = (y * gy)?.sum_all()?.backward()?;
        self.add_grad(&format!("{pre}.g"), &g, &gv)?;
        self.add_grad(&format!("{pre}.b"), &g, &bv)?;
        g.get(xv.as_tensor()).cloned().map_or_else(|| xv.as_tensor().zeros_like(), Ok)
    }

    fn run(&mut self, stage: usize, j: usize, input: Option<Vec<f32>>) -> candle_core::Result<Vec<f32>> {
        let tr = self.tr;
        let (layers, h, t) = (tr.cfg.model.layers, tr.cfg.model.hidden, tr.cfg.model.seq);
        let (s0, s1) = (self.cut[j], self.cut[j + 1]);
        let n = (s1 - s0) * t;
        let input = match input {
            Some(v) => Some(Tensor::from_vec(v, (n, h), &tr.dev)?),
            None => None,
        };
        let need = |i: Option<Tensor>| i.ok_or_else(|| candle_core::Error::Msg(format!("stage {stage} has no input")));
        let flat = |x: Tensor| x.flatten_all()?.to_vec1::<f32>();
        if stage < 2 * layers {
            let l = stage / 2;
            let p = |s: &str| format!("l{l}.{s}");
            if stage % 2 == 0 {
                let x = if l == 0 {
                    let model =
                        crate::model::Model::new(&tr.cfg, &tr.params).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
                    model.embed(&self.x_tok[s0 * t..s1 * t], s1 - s0).map_err(|e| candle_core::Error::Msg(e.to_string()))?
                } else {
                    (self.x1[l - 1][j].clone().expect("forward order") + need(input)?)?
                };
                let a = ln(&x, &tr.t(&p("ln1.g"))?, &tr.t(&p("ln1.b"))?)?;
                let part = tr.attn_partial(
                    &a,
                    &tr.t(&p("attn.wq"))?,
                    &tr.t(&p("attn.wk"))?,
                    &tr.t(&p("attn.wv"))?,
                    &tr.t(&p("attn.wo"))?,
                )?;
                self.x_in[l][j] = Some(x);
                return flat(part);
            }
            let x1 = (self.x_in[l][j].clone().expect("forward order") + need(input)?)?;
            let hn = ln(&x1, &tr.t(&p("ln2.g"))?, &tr.t(&p("ln2.b"))?)?;
            let part = gelu(&hn.matmul(&tr.t(&p("mlp.w1"))?)?)
                .map_err(|e| candle_core::Error::Msg(e.to_string()))?
                .matmul(&tr.t(&p("mlp.w2"))?)?;
            // the last layer's x1 stays for the head; others until the next layer's input
            self.x1[l][j] = Some(x1);
            return flat(part);
        }
        if stage == 4 * layers {
            // the embeddings: finish layer 0's first layer norm, then scatter into the tables
            let x0 = self.x_in[0][j].take().expect("forward ran");
            let g0 = (self.g_cur[j].take().expect("backward order") + self.ln_backward("l0.ln1", &x0, &need(input)?)?)?;
            let model = crate::model::Model::new(&tr.cfg, &tr.params).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
            model
                .embed_backward(&self.x_tok[s0 * t..s1 * t], s1 - s0, &g0, &mut self.grads)
                .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
            return Ok(Vec::new());
        }
        let b = stage - 2 * layers;
        let l = layers - 1 - b / 2;
        let p = |s: &str| format!("l{l}.{s}");
        if b % 2 == 0 {
            // the MLP's backward, after the head (last layer) or the next layer's first norm
            let g = if l + 1 == layers {
                let x_l = (self.x1[l][j].clone().expect("forward ran") + need(input)?)?;
                self.head(&x_l, j)?
            } else {
                let x_next = self.x_in[l + 1][j].take().expect("forward ran");
                (self.g_cur[j].take().expect("backward order")
                    + self.ln_backward(&format!("l{}.ln1", l + 1), &x_next, &need(input)?)?)?
            };
            let x1 = self.x1[l][j].as_ref().expect("forward ran");
            let hn = ln(x1, &tr.t(&p("ln2.g"))?, &tr.t(&p("ln2.b"))?)?;
            let hv = Var::from_tensor(&hn)?;
            let (w1, w2) = (tr.v(&p("mlp.w1"))?, tr.v(&p("mlp.w2"))?);
            let y = gelu(&hv.as_tensor().matmul(w1.as_tensor())?)
                .map_err(|e| candle_core::Error::Msg(e.to_string()))?
                .matmul(w2.as_tensor())?;
            let gs = (y * &g)?.sum_all()?.backward()?;
            self.add_grad(&p("mlp.w1"), &gs, &w1)?;
            self.add_grad(&p("mlp.w2"), &gs, &w2)?;
            self.g_cur[j] = Some(g);
            let gh = gs.get(hv.as_tensor()).cloned().map_or_else(|| hv.as_tensor().zeros_like(), Ok)?;
            return flat(gh);
        }
        // attention's backward, after finishing the MLP's: the second norm and the residual
        let x1 = self.x1[l][j].take().expect("forward ran");
        let g1 = (self.g_cur[j].take().expect("backward order") + self.ln_backward(&p("ln2"), &x1, &need(input)?)?)?;
        let x = self.x_in[l][j].as_ref().expect("forward ran");
        let a = ln(x, &tr.t(&p("ln1.g"))?, &tr.t(&p("ln1.b"))?)?;
        let av = Var::from_tensor(&a)?;
        let ws: Vec<Var> =
            ["attn.wq", "attn.wk", "attn.wv", "attn.wo"].iter().map(|w| tr.v(&p(w))).collect::<candle_core::Result<_>>()?;
        let y = tr.attn_partial(av.as_tensor(), ws[0].as_tensor(), ws[1].as_tensor(), ws[2].as_tensor(), ws[3].as_tensor())?;
        let gs = (y * &g1)?.sum_all()?.backward()?;
        for (w, v) in ["attn.wq", "attn.wk", "attn.wv", "attn.wo"].iter().zip(&ws) {
            self.add_grad(&p(w), &gs, v)?;
        }
        self.g_cur[j] = Some(g1);
        let ga = gs.get(av.as_tensor()).cloned().map_or_else(|| av.as_tensor().zeros_like(), Ok)?;
        flat(ga)
    }

    /// The head on sub-batch `j`'s final activations: adds the weighted loss and the head's
    /// gradients, returns the gradient of the activations.
    fn head(&mut self, x: &Tensor, j: usize) -> candle_core::Result<Tensor> {
        let tr = self.tr;
        let t = tr.cfg.model.seq;
        let (s0, s1) = (self.cut[j], self.cut[j + 1]);
        // the batch's loss is the mean over every token: sub-batch j weighs its share
        let weight = (s1 - s0) as f64 / *self.cut.last().expect("k+1 cuts") as f64;
        let (gv, bv, hv) = (tr.v("lnf.g")?, tr.v("lnf.b")?, tr.v("head")?);
        let xv = Var::from_tensor(&x.detach())?;
        let logits = ln(xv.as_tensor(), gv.as_tensor(), bv.as_tensor())?.matmul(hv.as_tensor())?;
        let tg = Tensor::from_slice(&self.y_tok[s0 * t..s1 * t], (s1 - s0) * t, &tr.dev)?;
        let loss = candle_nn::loss::cross_entropy(&logits, &tg)?;
        let g = loss.affine(weight, 0.0)?.backward()?;
        self.loss += (weight * loss.to_scalar::<f32>()? as f64) as f32;
        self.add_grad("lnf.g", &g, &gv)?;
        self.add_grad("lnf.b", &g, &bv)?;
        self.add_grad("head", &g, &hv)?;
        g.get(xv.as_tensor()).cloned().map_or_else(|| xv.as_tensor().zeros_like(), Ok)
    }
}

impl Work for TpWork<'_> {
    fn compute(&mut self, stage: usize, sub: usize, input: Option<Vec<f32>>) -> std::result::Result<Vec<f32>, BoxErr> {
        self.run(stage, sub, input).map_err(|e| Box::new(e) as BoxErr)
    }

    fn tail_input(&mut self, tail: usize) -> Vec<f32> {
        self.tr.tail_params[tail].iter().flat_map(|&i| self.grads[i].iter().copied()).collect()
    }

    fn tail_output(&mut self, tail: usize, data: Vec<f32>) {
        let mut off = 0;
        for &i in &self.tr.tail_params[tail] {
            let n = self.grads[i].len();
            self.grads[i].copy_from_slice(&data[off..off + n]);
            off += n;
        }
    }
}
