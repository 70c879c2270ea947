//! The MoE GPT on candle, trained layer by layer: the forward pass keeps only each layer's
//! input; the backward pass recomputes one layer's local graph at a time and back-propagates
//! the gradient of its output through it, so every layer's forward and backward are timed
//! separately (and an expert-parallel version can put communication between the pieces).
//! Parameters and AdamW moments live in host `Vec<f32>`s: they are what the checkpoint engine
//! snapshots.

use candle_core::{DType, Device, Tensor, Var, D};

use crate::config::TrainConfig;
use crate::dist::Dist;
use crate::error::Result;
use crate::gelu::gelu;

/// SplitMix64 (seeded, the same on every machine).
pub use ironweave_units::SplitMix64 as Rng;

/// One named parameter with its AdamW moments.
#[derive(Debug, Clone)]
pub struct Param {
    /// Name.
    pub name: String,
    /// Shape.
    pub shape: Vec<usize>,
    /// Values.
    pub w: Vec<f32>,
    /// First moment.
    pub m: Vec<f32>,
    /// Second moment.
    pub v: Vec<f32>,
}

/// All parameters, in a fixed order.
#[derive(Debug, Clone)]
pub struct Params {
    /// Parameters.
    pub list: Vec<Param>,
    /// Optimizer steps taken.
    pub step: u64,
}

impl Params {
    /// SHA-256 of the step and every parameter's name, values and both moments, in order
    /// (little-endian floats): equal digests, equal training states.
    pub fn digest(&self) -> [u8; 32] {
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        h.update(self.step.to_le_bytes());
        for p in &self.list {
            h.update(p.name.as_bytes());
            for v in [&p.w, &p.m, &p.v] {
                for x in v.iter() {
                    h.update(x.to_le_bytes());
                }
            }
        }
        h.finalize().into()
    }

    /// Index of a parameter by name.
    pub fn idx(&self, name: &str) -> usize {
        self.list.iter().position(|p| p.name == name).unwrap_or_else(|| panic!("no parameter {name}"))
    }
}

/// Initialise deterministically from the seed.
pub fn init(cfg: &TrainConfig) -> Params {
    init_keeping(cfg, |_| true)
}

/// [`init`] keeping only the parameters whose name `keep` accepts: each kept one has the value
/// it has in [`init`] (the generator still draws the others' values), and the others are never
/// allocated — a rank of a large expert-parallel model holds its own experts only.
pub fn init_keeping(cfg: &TrainConfig, keep: impl Fn(&str) -> bool) -> Params {
    let m = &cfg.model;
    let (h, f, e) = (m.hidden, m.hidden * m.ffn_mult, m.experts);
    let mut rng = Rng(cfg.train.seed ^ 0x1f0f_1f0f);
    let mut list = Vec::new();
    let mut add = |name: String, shape: Vec<usize>, kind: u8| {
        let n: usize = shape.iter().product();
        if !keep(&name) {
            if kind <= 1 {
                (0..n).for_each(|_| {
                    rng.normal();
                });
            }
            return;
        }
        let fan_in = shape.first().copied().unwrap_or(1) as f64;
        let w: Vec<f32> = match kind {
            0 => (0..n).map(|_| (rng.normal() * 0.02) as f32).collect(),
            1 => (0..n).map(|_| (rng.normal() / fan_in.sqrt()) as f32).collect(),
            2 => vec![1.0; n],
            _ => vec![0.0; n],
        };
        list.push(Param { name, shape, m: vec![0.0; n], v: vec![0.0; n], w });
    };
    add("tok_emb".into(), vec![256, h], 0);
    add("pos_emb".into(), vec![m.seq, h], 0);
    for l in 0..m.layers {
        add(format!("l{l}.ln1.g"), vec![h], 2);
        add(format!("l{l}.ln1.b"), vec![h], 3);
        for w in ["wq", "wk", "wv", "wo"] {
            add(format!("l{l}.attn.{w}"), vec![h, h], 1);
        }
        add(format!("l{l}.ln2.g"), vec![h], 2);
        add(format!("l{l}.ln2.b"), vec![h], 3);
        if cfg.is_moe(l) {
            add(format!("l{l}.gate"), vec![h, e], 1);
            for x in 0..e {
                add(format!("l{l}.e{x}.w1"), vec![h, f], 1);
                add(format!("l{l}.e{x}.w2"), vec![f, h], 1);
            }
        } else {
            add(format!("l{l}.mlp.w1"), vec![h, f], 1);
            add(format!("l{l}.mlp.w2"), vec![f, h], 1);
        }
    }
    add("lnf.g".into(), vec![h], 2);
    add("lnf.b".into(), vec![h], 3);
    add("head".into(), vec![h, 256], 1);
    Params { list, step: 0 }
}

pub(crate) fn var(p: &Param, dev: &Device) -> Result<Var> {
    Ok(Var::from_slice(&p.w, p.shape.as_slice(), dev)?)
}

pub(crate) fn layer_norm(x: &Tensor, g: &Tensor, b: &Tensor) -> Result<Tensor> {
    let mean = x.mean_keepdim(D::Minus1)?;
    let xc = x.broadcast_sub(&mean)?;
    let var = xc.sqr()?.mean_keepdim(D::Minus1)?;
    let y = xc.broadcast_div(&var.affine(1.0, 1e-5)?.sqrt()?)?;
    Ok(y.broadcast_mul(g)?.broadcast_add(b)?)
}

pub(crate) fn softmax_last(x: &Tensor) -> Result<Tensor> {
    let mx = x.max_keepdim(D::Minus1)?.detach();
    let e = x.broadcast_sub(&mx)?.exp()?;
    Ok(e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?)
}

/// Which tokens each expert of one MoE layer takes (decided in the forward pass, reused when
/// the layer is recomputed for backward).
#[derive(Debug, Clone, Default)]
pub struct Routing {
    /// Per expert, the token rows it processes.
    pub tokens: Vec<Vec<u32>>,
    /// Per expert, tokens that chose it (before capacity).
    pub wanted: Vec<u64>,
}

fn route(probs: &[f32], n: usize, e: usize, k: usize, capacity: usize) -> Routing {
    let mut r = Routing { tokens: vec![Vec::new(); e], wanted: vec![0; e] };
    let mut order: Vec<usize> = (0..e).collect();
    for t in 0..n {
        let row = &probs[t * e..(t + 1) * e];
        order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
        for &x in order.iter().take(k) {
            r.wanted[x] += 1;
            if r.tokens[x].len() < capacity {
                r.tokens[x].push(t as u32);
            }
        }
    }
    r
}

/// The parameters of one layer as candle variables.
struct LayerVars {
    vars: Vec<(usize, Var)>,
}

impl LayerVars {
    fn get(&self, idx: usize) -> &Tensor {
        self.vars.iter().find(|(i, _)| *i == idx).map(|(_, v)| v.as_tensor()).expect("registered")
    }
}

/// The model bound to its parameters for one iteration.
#[derive(Debug)]
pub struct Model<'a> {
    cfg: &'a TrainConfig,
    params: &'a Params,
    dev: Device,
    mask: Tensor,
    dist: Option<&'a Dist>,
}

/// What the expert-parallel forward of an MoE layer leaves for its backward.
#[derive(Debug, Clone, Default)]
pub struct EpCtx {
    /// Token row of each dispatched row (in send order: by destination rank, local expert, token).
    ids: Vec<u32>,
    /// Expert of each dispatched row.
    cols: Vec<u32>,
    /// Rows sent to each rank.
    send_rows: Vec<usize>,
    /// Rows received from each rank.
    recv_rows: Vec<usize>,
    /// Per local expert, its rows in the received buffer.
    layout: Vec<Vec<u32>>,
    /// The rows received (expert side).
    rows_in: Vec<f32>,
    /// The expert outputs received back (source side, send order).
    y_back: Vec<f32>,
}

/// Everything one layer's forward produced.
#[derive(Debug)]
pub struct LayerOut {
    /// Output activations.
    pub y: Tensor,
    /// Load-balancing loss of the layer (MoE only).
    pub aux: Option<Tensor>,
    /// Routing (MoE only).
    pub routing: Option<Routing>,
    /// Expert-parallel context (MoE layers with more than one rank).
    pub ep: Option<EpCtx>,
}

impl<'a> Model<'a> {
    /// Bind.
    pub fn new(cfg: &'a TrainConfig, params: &'a Params) -> Result<Self> {
        let dev = Device::Cpu;
        let t = cfg.model.seq;
        let mask: Vec<f32> = (0..t * t).map(|i| if i % t > i / t { -1e9 } else { 0.0 }).collect();
        let mask = Tensor::from_slice(&mask, (t, t), &dev)?;
        Ok(Model { cfg, params, dev, mask, dist: None })
    }

    /// Bind for expert and data parallelism over `dist` (`params` holds this rank's experts only).
    pub fn with_dist(mut self, dist: &'a Dist) -> Self {
        if dist.world() > 1 {
            self.dist = Some(dist);
        }
        self
    }

    fn layer_vars(&self, l: usize) -> Result<LayerVars> {
        let prefix = format!("l{l}.");
        let vars = self
            .params
            .list
            .iter()
            .enumerate()
            .filter(|(_, p)| p.name.starts_with(&prefix))
            .map(|(i, p)| Ok((i, var(p, &self.dev)?)))
            .collect::<Result<Vec<_>>>()?;
        Ok(LayerVars { vars })
    }

    /// Embedding of a batch of byte sequences `[b, t]` → `[b·t, h]`.
    pub fn embed(&self, tokens: &[u32], b: usize) -> Result<Tensor> {
        let (t, h) = (self.cfg.model.seq, self.cfg.model.hidden);
        let p = self.params;
        let te = Tensor::from_slice(&p.list[p.idx("tok_emb")].w, (256, h), &self.dev)?;
        let pe = Tensor::from_slice(&p.list[p.idx("pos_emb")].w, (t, h), &self.dev)?;
        let ids = Tensor::from_slice(tokens, b * t, &self.dev)?;
        let x = te.index_select(&ids, 0)?.reshape((b, t, h))?.broadcast_add(&pe)?;
        Ok(x.reshape((b * t, h))?)
    }

    fn layer(&self, l: usize, x: &Tensor, v: &LayerVars, routing: Option<&Routing>) -> Result<LayerOut> {
        let m = &self.cfg.model;
        let p = self.params;
        let pi = |s: &str| p.idx(&format!("l{l}.{s}"));
        let (x, hn) = self.attention(l, x, v)?;
        if !self.cfg.is_moe(l) {
            let f = gelu(&hn.matmul(v.get(pi("mlp.w1")))?)?.matmul(v.get(pi("mlp.w2")))?;
            return Ok(LayerOut { y: (x + f)?, aux: None, routing: None, ep: None });
        }
        let (n, h) = x.dims2()?;
        let e = m.experts;
        let probs = softmax_last(&hn.matmul(v.get(pi("gate")))?)?;
        let routing = match routing {
            Some(r) => r.clone(),
            None => {
                let cap = ((m.capacity_factor * (n * m.top_k) as f64 / e as f64).ceil() as usize).max(1);
                route(&probs.flatten_all()?.to_vec1::<f32>()?, n, e, m.top_k, cap)
            }
        };
        let mut out = Tensor::zeros((n, h), DType::F32, &self.dev)?;
        for x_e in 0..e {
            let idx = &routing.tokens[x_e];
            if idx.is_empty() {
                continue;
            }
            let ids = Tensor::from_slice(idx, idx.len(), &self.dev)?;
            let ge = probs.index_select(&ids, 0)?.narrow(1, x_e, 1)?;
            let ye = self.expert_ffn(l, x_e, &hn.index_select(&ids, 0)?, v)?;
            out = out.index_add(&ids, &ye.broadcast_mul(&ge)?, 0)?;
        }
        let aux = self.aux_loss(&probs, &routing)?;
        Ok(LayerOut { y: (x + out)?, aux: Some(aux), routing: Some(routing), ep: None })
    }

    /// Attention with its residual, then the second layer norm: `(x1, ln2(x1))`.
    fn attention(&self, l: usize, x: &Tensor, v: &LayerVars) -> Result<(Tensor, Tensor)> {
        let m = &self.cfg.model;
        let p = self.params;
        let (n, h) = x.dims2()?;
        let t = m.seq;
        let b = n / t;
        let (nh, hd) = (m.heads, m.hidden / m.heads);
        let pi = |s: &str| p.idx(&format!("l{l}.{s}"));
        let a = layer_norm(x, v.get(pi("ln1.g")), v.get(pi("ln1.b")))?;
        let heads =
            |w: &str| -> Result<Tensor> { Ok(a.matmul(v.get(pi(w)))?.reshape((b, t, nh, hd))?.transpose(1, 2)?.contiguous()?) };
        let (q, k, vv) = (heads("attn.wq")?, heads("attn.wk")?, heads("attn.wv")?);
        let att =
            q.matmul(&k.transpose(2, 3)?.contiguous()?)?.affine(1.0 / (hd as f64).sqrt(), 0.0)?.broadcast_add(&self.mask)?;
        let att = softmax_last(&att)?;
        let o = att.matmul(&vv)?.transpose(1, 2)?.contiguous()?.reshape((n, h))?;
        let x1 = (x + o.matmul(v.get(pi("attn.wo")))?)?;
        let hn = layer_norm(&x1, v.get(pi("ln2.g")), v.get(pi("ln2.b")))?;
        Ok((x1, hn))
    }

    /// Attention, the second layer norm and the gate (the part of an MoE layer on the tokens' rank).
    fn source(&self, l: usize, x: &Tensor, v: &LayerVars) -> Result<(Tensor, Tensor, Tensor)> {
        let (x1, hn) = self.attention(l, x, v)?;
        let probs = softmax_last(&hn.matmul(v.get(self.params.idx(&format!("l{l}.gate"))))?)?;
        Ok((x1, hn, probs))
    }

    fn expert_ffn(&self, l: usize, e: usize, rows: &Tensor, v: &LayerVars) -> Result<Tensor> {
        let p = self.params;
        let w1 = v.get(p.idx(&format!("l{l}.e{e}.w1")));
        let w2 = v.get(p.idx(&format!("l{l}.e{e}.w2")));
        Ok(gelu(&rows.matmul(w1)?)?.matmul(w2)?)
    }

    fn aux_loss(&self, probs: &Tensor, routing: &Routing) -> Result<Tensor> {
        let e = self.cfg.model.experts;
        let total: u64 = routing.wanted.iter().sum::<u64>().max(1);
        let f: Vec<f32> = routing.wanted.iter().map(|&c| c as f32 / total as f32).collect();
        let f = Tensor::from_slice(&f, e, &self.dev)?;
        Ok((probs.mean(0)? * f)?.sum_all()?.affine(e as f64, 0.0)?)
    }

    /// Expert-parallel forward of MoE layer `l`.
    fn forward_ep(&self, l: usize, x: &Tensor, d: &Dist) -> Result<LayerOut> {
        let m = &self.cfg.model;
        let (w, me) = (d.world(), d.rank());
        let v = self.layer_vars(l)?;
        let (x1, hn, probs) = self.source(l, x, &v)?;
        let (n, h) = x1.dims2()?;
        let e = m.experts;
        let per = e / w;
        let cap = ((m.capacity_factor * (n * m.top_k) as f64 / e as f64).ceil() as usize).max(1);
        let routing = route(&probs.flatten_all()?.to_vec1::<f32>()?, n, e, m.top_k, cap);
        let mut ctx = EpCtx { send_rows: vec![0; w], ..Default::default() };
        let mut counts = vec![0i64; w * per];
        for dst in 0..w {
            for j in 0..per {
                let ex = dst + j * w;
                for &t in &routing.tokens[ex] {
                    ctx.ids.push(t);
                    ctx.cols.push(ex as u32);
                }
                counts[dst * per + j] = routing.tokens[ex].len() as i64;
                ctx.send_rows[dst] += routing.tokens[ex].len();
            }
        }
        let rc = d.exchange_counts(&counts)?;
        ctx.recv_rows = (0..w).map(|s| (0..per).map(|j| rc[s * per + j] as usize).sum()).collect();
        ctx.layout = vec![Vec::new(); per];
        let mut row = 0u32;
        for s in 0..w {
            for j in 0..per {
                for _ in 0..rc[s * per + j] {
                    ctx.layout[j].push(row);
                    row += 1;
                }
            }
        }
        let ids = Tensor::from_slice(&ctx.ids, ctx.ids.len(), &self.dev)?;
        let sel = if ctx.ids.is_empty() { Vec::new() } else { hn.index_select(&ids, 0)?.flatten_all()?.to_vec1::<f32>()? };
        ctx.rows_in = d.exchange(&sel, &ctx.send_rows, &ctx.recv_rows, h)?;
        let mut y_out = vec![0f32; ctx.rows_in.len()];
        if !ctx.rows_in.is_empty() {
            let rows = Tensor::from_slice(&ctx.rows_in, (ctx.rows_in.len() / h, h), &self.dev)?;
            for j in 0..per {
                if ctx.layout[j].is_empty() {
                    continue;
                }
                let li = Tensor::from_slice(&ctx.layout[j], ctx.layout[j].len(), &self.dev)?;
                let y = self.expert_ffn(l, me + j * w, &rows.index_select(&li, 0)?, &v)?.flatten_all()?.to_vec1::<f32>()?;
                for (k, &r) in ctx.layout[j].iter().enumerate() {
                    y_out[r as usize * h..(r as usize + 1) * h].copy_from_slice(&y[k * h..(k + 1) * h]);
                }
            }
        }
        ctx.y_back = d.exchange(&y_out, &ctx.recv_rows, &ctx.send_rows, h)?;
        let out = self.combine(&x1, &probs, &ctx, &Tensor::from_slice(&ctx.y_back, (ctx.ids.len(), h), &self.dev)?)?;
        let aux = self.aux_loss(&probs, &routing)?;
        Ok(LayerOut { y: out, aux: Some(aux), routing: Some(routing), ep: Some(ctx) })
    }

    fn combine(&self, x1: &Tensor, probs: &Tensor, ctx: &EpCtx, y: &Tensor) -> Result<Tensor> {
        if ctx.ids.is_empty() {
            return Ok(x1.clone());
        }
        let ids = Tensor::from_slice(&ctx.ids, ctx.ids.len(), &self.dev)?;
        let cols = Tensor::from_slice(&ctx.cols, (ctx.cols.len(), 1), &self.dev)?;
        let gate = probs.index_select(&ids, 0)?.gather(&cols, 1)?;
        Ok(x1.index_add(&ids, &y.broadcast_mul(&gate)?, 0)?)
    }

    /// Expert-parallel backward of MoE layer `l` (two exchanges each way, see module docs).
    fn backward_ep(
        &self,
        l: usize,
        x: &Tensor,
        ctx: &EpCtx,
        routing: &Routing,
        grad_y: &Tensor,
        grads: &mut [Vec<f32>],
    ) -> Result<Tensor> {
        let Some(d) = self.dist else {
            return Err(candle_core::Error::Msg("expert-parallel backward without a job".into()).into());
        };
        let m = &self.cfg.model;
        let (w, me) = (d.world(), d.rank());
        let per = m.experts / w;
        let h = m.hidden;
        let v = self.layer_vars(l)?;
        let xv = Var::from_tensor(&x.detach())?;
        let (x1, hn, probs) = self.source(l, xv.as_tensor(), &v)?;
        // The gradient of an expert output row is the output gradient of its token times its
        // gate: no backward pass through the source graph is needed before the exchange (the
        // single backward below, once the experts' answer is back, covers everything).
        let ids = Tensor::from_slice(&ctx.ids, ctx.ids.len(), &self.dev)?;
        let gy = if ctx.ids.is_empty() {
            Vec::new()
        } else {
            let cols = Tensor::from_slice(&ctx.cols, (ctx.cols.len(), 1), &self.dev)?;
            let gate = probs.detach().index_select(&ids, 0)?.gather(&cols, 1)?;
            grad_y.index_select(&ids, 0)?.broadcast_mul(&gate)?.flatten_all()?.to_vec1::<f32>()?
        };
        // expert side: gradient of the outputs arrives, gradient of the inputs goes back
        let gy_in = d.exchange(&gy, &ctx.send_rows, &ctx.recv_rows, h)?;
        let mut g_rows = vec![0f32; ctx.rows_in.len()];
        if !ctx.rows_in.is_empty() {
            for j in 0..per {
                if ctx.layout[j].is_empty() {
                    continue;
                }
                let li = Tensor::from_slice(&ctx.layout[j], ctx.layout[j].len(), &self.dev)?;
                let all = Tensor::from_slice(&ctx.rows_in, (ctx.rows_in.len() / h, h), &self.dev)?;
                let rv = Var::from_tensor(&all.index_select(&li, 0)?)?;
                let gys = Tensor::from_slice(&gy_in, (gy_in.len() / h, h), &self.dev)?.index_select(&li, 0)?;
                let y = self.expert_ffn(l, me + j * w, rv.as_tensor(), &v)?;
                let ge = (y * gys)?.sum_all()?.backward()?;
                self.collect(&v, &ge, grads, None)?;
                if let Some(gr) = ge.get(rv.as_tensor()) {
                    let gr = gr.flatten_all()?.to_vec1::<f32>()?;
                    for (k, &r) in ctx.layout[j].iter().enumerate() {
                        g_rows[r as usize * h..(r as usize + 1) * h].copy_from_slice(&gr[k * h..(k + 1) * h]);
                    }
                }
            }
        }
        let g_sel = d.exchange(&g_rows, &ctx.recv_rows, &ctx.send_rows, h)?;
        // one backward through the source side: the combine (expert outputs held constant),
        // the load-balancing loss, and the gradient of the dispatched rows from the experts;
        // experts' parameters appear only in the expert-side graphs above
        let y_back = Tensor::from_slice(&ctx.y_back, (ctx.ids.len(), h), &self.dev)?;
        let out = self.combine(&x1, &probs, ctx, &y_back)?;
        let mut obj = ((out * grad_y)?.sum_all()? + self.aux_loss(&probs, routing)?.affine(m.aux_loss_coef, 0.0)?)?;
        if !ctx.ids.is_empty() {
            let gs = Tensor::from_slice(&g_sel, (ctx.ids.len(), h), &self.dev)?;
            obj = (obj + (hn.index_select(&ids, 0)? * gs)?.sum_all()?)?;
        }
        let g = obj.backward()?;
        self.collect(&v, &g, grads, Some(&format!("l{l}.e")))?;
        Ok(g.get(xv.as_tensor()).cloned().unwrap_or(xv.as_tensor().zeros_like()?))
    }

    /// Add the gradients `g` holds for the layer's variables into `grads`, except those whose
    /// name starts with `skip`.
    fn collect(
        &self,
        v: &LayerVars,
        g: &candle_core::backprop::GradStore,
        grads: &mut [Vec<f32>],
        skip: Option<&str>,
    ) -> Result<()> {
        for (i, var) in &v.vars {
            if skip.is_some_and(|s| self.params.list[*i].name.starts_with(s)) {
                continue;
            }
            if let Some(gi) = g.get(var.as_tensor()) {
                for (a, b) in grads[*i].iter_mut().zip(gi.flatten_all()?.to_vec1::<f32>()?) {
                    *a += b;
                }
            }
        }
        Ok(())
    }

    /// Forward of layer `l` (inputs detached: only this layer's graph).
    pub fn forward_layer(&self, l: usize, x: &Tensor) -> Result<LayerOut> {
        if let (Some(d), true) = (self.dist, self.cfg.is_moe(l)) {
            return self.forward_ep(l, &x.detach(), d);
        }
        let v = self.layer_vars(l)?;
        self.layer(l, &x.detach(), &v, None)
    }

    /// Backward of layer `l`: recompute it from its input `x` with the forward's routing and
    /// back-propagate `grad_y` (plus the layer's load-balancing loss). Adds the parameter
    /// gradients into `grads` and returns the gradient of the input.
    pub fn backward_layer(
        &self,
        l: usize,
        x: &Tensor,
        routing: Option<&Routing>,
        ep: Option<&EpCtx>,
        grad_y: &Tensor,
        grads: &mut [Vec<f32>],
    ) -> Result<Tensor> {
        if let (true, Some(ctx), Some(r)) = (self.dist.is_some(), ep, routing) {
            return self.backward_ep(l, x, ctx, r, grad_y, grads);
        }
        let v = self.layer_vars(l)?;
        let xv = Var::from_tensor(&x.detach())?;
        let out = self.layer(l, xv.as_tensor(), &v, routing)?;
        let mut obj = (out.y * grad_y)?.sum_all()?;
        if let Some(aux) = out.aux {
            obj = (obj + aux.affine(self.cfg.model.aux_loss_coef, 0.0)?)?;
        }
        let g = obj.backward()?;
        self.collect(&v, &g, grads, None)?;
        Ok(g.get(xv.as_tensor()).cloned().unwrap_or(xv.as_tensor().zeros_like()?))
    }

    /// The head: loss of `x` against `targets`; adds head gradients and returns (loss, dL/dx).
    pub fn head(&self, x: &Tensor, targets: &[u32], grads: &mut [Vec<f32>]) -> Result<(f32, Tensor)> {
        let p = self.params;
        let ids = [p.idx("lnf.g"), p.idx("lnf.b"), p.idx("head")];
        let vars: Vec<Var> = ids.iter().map(|&i| var(&p.list[i], &self.dev)).collect::<Result<_>>()?;
        let xv = Var::from_tensor(&x.detach())?;
        let hn = layer_norm(xv.as_tensor(), vars[0].as_tensor(), vars[1].as_tensor())?;
        let logits = hn.matmul(vars[2].as_tensor())?;
        let tg = Tensor::from_slice(targets, targets.len(), &self.dev)?;
        let loss = candle_nn::loss::cross_entropy(&logits, &tg)?;
        let g = loss.backward()?;
        for (i, v) in ids.iter().zip(&vars) {
            if let Some(gi) = g.get(v.as_tensor()) {
                for (a, b) in grads[*i].iter_mut().zip(gi.flatten_all()?.to_vec1::<f32>()?) {
                    *a += b;
                }
            }
        }
        let gx = g.get(xv.as_tensor()).cloned().unwrap_or(xv.as_tensor().zeros_like()?);
        Ok((loss.to_scalar::<f32>()?, gx))
    }

    /// Gradients of the embeddings from dL/d(embedding output).
    pub fn embed_backward(&self, tokens: &[u32], b: usize, gx: &Tensor, grads: &mut [Vec<f32>]) -> Result<()> {
        let (t, h) = (self.cfg.model.seq, self.cfg.model.hidden);
        let g = gx.flatten_all()?.to_vec1::<f32>()?;
        let (te, pe) = (self.params.idx("tok_emb"), self.params.idx("pos_emb"));
        for s in 0..b {
            for p in 0..t {
                let row = &g[(s * t + p) * h..(s * t + p + 1) * h];
                let tok = tokens[s * t + p] as usize;
                for j in 0..h {
                    grads[te][tok * h + j] += row[j];
                    grads[pe][p * h + j] += row[j];
                }
            }
        }
        Ok(())
    }
}

/// AdamW on the host vectors (decoupled weight decay on matrices).
pub fn adamw(params: &mut Params, grads: &[Vec<f32>], lr: f64, wd: f64) {
    params.step += 1;
    // the one AdamW of the workspace: the sharded engine's and the candle adapter's too
    let a = ironweave_sdp::Adam { lr, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: wd };
    let t = params.step;
    for (p, g) in params.list.iter_mut().zip(grads) {
        // matrices decay, norms and biases do not
        let decay = p.shape.len() == 2;
        ironweave_sdp::adam_update(&a, t, decay, &mut p.w, &mut p.m, &mut p.v, g);
    }
}
