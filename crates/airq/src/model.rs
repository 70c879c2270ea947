//! The network: a 1D-CNN feature extractor over the input days, a bi-directional GRU and a
//! bi-directional LSTM over its output, a regression head, and a domain classifier behind a
//! gradient-reversal layer (two adversarial strategies, [`Adversary`]).
//!
//! **Regression head.** It forecasts the change from today's (normalised) value — the output
//! is `today + head(features)` — so an untrained network starts at persistence and learns the
//! correction; persistence is the bar every method must clear.
//!
//! **Strategy 1, [`Adversary::MultiClass`]** (DANN, Ganin & Lempitsky 2015): one classifier
//! over `sources + 1` classes (each source domain and the target) learns which domain a
//! window's features come from; the reversal layer hands the feature extractor the negated,
//! `λ`-scaled gradient, so the features become domain-invariant while the forecast stays good.
//!
//! **Strategy 2, [`Adversary::PerSource`]** (multi-source adversarial networks, MDAN-style,
//! Zhao et al. 2018): one binary discriminator per source domain, each telling *its* source
//! from the target; the features are pushed to match the target against every source
//! separately (the losses averaged), not only against the mixture — a source that looks like
//! the target is not drowned out by the others.
//!
//! **The convolutions are ours** ([`TimeConv`]: shifted copies of the input side by side, then a
//! linear layer — im2col): candle 0.11.1's CPU `conv1d` gives wrong kernel gradients for a
//! batch of more than one window (found by this crate's finite-difference test; batch 1 is
//! right), so the network would have trained on them silently.
//!
//! The whole forward is one [`Staged`] stage: the output is `[forecast (horizon) | domain
//! logits]`, and the loss ([`Net::loss`]) splits it.

use std::cell::{Cell, RefCell};

use candle_core::{DType, Device, Module, Tensor, D};
use candle_nn::rnn::{GRUConfig, LSTMConfig, GRU, LSTM, RNN};
use candle_nn::{linear, Linear, VarBuilder, VarMap};
use ironweave::candle::Staged;
use serde::Serialize;

use crate::pipeline::Batch;
use crate::Result;

/// The adversarial part of the network.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Adversary {
    /// No domain classifier: the plain network.
    None,
    /// Strategy 1: gradient reversal and one multi-class domain classifier.
    MultiClass,
    /// Strategy 2: gradient reversal and one binary discriminator per source domain.
    PerSource,
}

/// Sizes of the network.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct NetConfig {
    /// Input days.
    pub lookback: usize,
    /// Forecast days.
    pub horizon: usize,
    /// Input channels per step (the first: the normalised series the forecast starts from).
    pub channels: usize,
    /// Channels of the convolutions.
    pub conv: usize,
    /// Hidden units of each recurrent direction.
    pub hidden: usize,
    /// Source domains (the domain classifier's classes are these and the target).
    pub sources: usize,
    /// The adversary.
    pub adversary: Adversary,
}

/// The gradient-reversal layer: the identity forward; backward, the incoming gradient times
/// `-lambda`. Written as `x̄ + (x − x̄)·(−λ)` with `x̄` a detached copy of `x`: the second term is
/// exactly zero forward (so the output is `x`, bit for bit) and carries the whole gradient.
pub fn grad_reverse(x: &Tensor, lambda: f64) -> candle_core::Result<Tensor> {
    let fixed = x.detach();
    &fixed + ((x - &fixed)? * -lambda)?
}

/// DANN's schedule for the reversal's weight: 0 at the start, towards 1 as training goes on
/// (`2 / (1 + e^(−10p)) − 1`, `p` the share of training done), so the domain loss does not
/// disturb the features while they are still noise.
pub fn lambda_schedule(progress: f64) -> f64 {
    2.0 / (1.0 + (-10.0 * progress.clamp(0.0, 1.0)).exp()) - 1.0
}

/// A 1D convolution over time with kernel `k` (odd) and "same" zero padding, on time-major
/// input `[n, t, in]` → `[n, t, out]`: the `k` shifted copies of the padded input side by side
/// (`[n, t, k·in]`), then one linear layer. Only narrow, cat and matmul: ops whose gradients
/// candle gets right.
#[derive(Debug)]
pub struct TimeConv {
    k: usize,
    lin: Linear,
}

impl TimeConv {
    /// `in_ch` → `out_ch` channels, kernel `k`.
    pub fn new(in_ch: usize, out_ch: usize, k: usize, vb: VarBuilder<'_>) -> candle_core::Result<TimeConv> {
        if k % 2 == 0 {
            candle_core::bail!("TimeConv needs an odd kernel, not {k}");
        }
        Ok(TimeConv { k, lin: linear(k * in_ch, out_ch, vb)? })
    }
}

impl Module for TimeConv {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let t = x.dim(1)?;
        let p = x.pad_with_zeros(1, self.k / 2, self.k / 2)?;
        let cols = (0..self.k).map(|j| p.narrow(1, j, t)).collect::<candle_core::Result<Vec<_>>>()?;
        self.lin.forward(&Tensor::cat(&cols, 2)?)
    }
}

/// The network.
#[derive(Debug)]
pub struct Net {
    cfg: NetConfig,
    conv1: TimeConv,
    conv2: TimeConv,
    gru_f: GRU,
    gru_b: GRU,
    lstm_f: LSTM,
    lstm_b: LSTM,
    head1: Linear,
    head2: Linear,
    disc: Vec<(Linear, Linear)>,
    lambda: Cell<f64>,
    /// Per source: the running mean of its discriminator's loss (strategy 2 with learned
    /// source weights, [`Net::weigh_sources`]).
    source_losses: RefCell<Option<Vec<f64>>>,
}

/// How sharply the learned source weights follow the discriminators' losses: weight ∝
/// exp(loss / this). A discriminator at chance has loss ln 2 ≈ 0.69; one that tells its source
/// from the target perfectly, 0 — at 0.1, the first source's weight is e^6.9 ≈ 1,000 times the
/// second's.
pub const WEIGHT_TEMPERATURE: f64 = 0.1;
/// The running mean's step: about the last 1 / this iterations count.
pub const WEIGHT_SMOOTHING: f64 = 0.05;

impl Net {
    /// Builds the layers in `vm` (initialised from `seed`, deterministically).
    pub fn new(vm: &VarMap, cfg: NetConfig, seed: u64) -> Result<Net> {
        let vb = VarBuilder::from_varmap(vm, DType::F32, &Device::Cpu);
        let h = cfg.hidden;
        let feat = 2 * h;
        let disc = match cfg.adversary {
            Adversary::None => Vec::new(),
            Adversary::MultiClass => {
                vec![(linear(feat, 32, vb.pp("disc0.l1"))?, linear(32, cfg.sources + 1, vb.pp("disc0.l2"))?)]
            }
            Adversary::PerSource => (0..cfg.sources)
                .map(|i| Ok((linear(feat, 16, vb.pp(format!("disc{i}.l1")))?, linear(16, 1, vb.pp(format!("disc{i}.l2")))?)))
                .collect::<candle_core::Result<_>>()?,
        };
        let net = Net {
            cfg,
            conv1: TimeConv::new(cfg.channels, cfg.conv, 3, vb.pp("conv1"))?,
            conv2: TimeConv::new(cfg.conv, cfg.conv, 3, vb.pp("conv2"))?,
            gru_f: candle_nn::rnn::gru(cfg.conv, h, GRUConfig::default(), vb.pp("gru_f"))?,
            gru_b: candle_nn::rnn::gru(cfg.conv, h, GRUConfig::default(), vb.pp("gru_b"))?,
            lstm_f: candle_nn::rnn::lstm(2 * h, h, LSTMConfig::default(), vb.pp("lstm_f"))?,
            lstm_b: candle_nn::rnn::lstm(2 * h, h, LSTMConfig::default(), vb.pp("lstm_b"))?,
            head1: linear(feat, 32, vb.pp("head.l1"))?,
            head2: linear(32, cfg.horizon, vb.pp("head.l2"))?,
            disc,
            lambda: Cell::new(0.0),
            source_losses: RefCell::new(None),
        };
        init_by_name(vm, seed)?;
        Ok(net)
    }

    /// The network's sizes.
    pub fn config(&self) -> &NetConfig {
        &self.cfg
    }

    /// Sets the reversal layer's weight for the next forward.
    pub fn set_lambda(&self, l: f64) {
        self.lambda.set(l);
    }

    /// Learns a weight per source from its discriminator's loss (strategy 2 only): a source
    /// whose discriminator tells it from the target easily (low loss) counts less in the
    /// regression loss, one that looks like the target more. The weights are
    /// `k · softmax(L̄ / WEIGHT_TEMPERATURE)` over the `k` sources, `L̄` each discriminator's
    /// running mean loss (starting at ln 2, chance); they average 1 and carry no gradient.
    pub fn weigh_sources(&self) -> Result<()> {
        if self.cfg.adversary != Adversary::PerSource || self.cfg.sources == 0 {
            return Err(crate::Error::Config(
                "learned source weights need one discriminator per source (grl-per-source's network)".into(),
            ));
        }
        *self.source_losses.borrow_mut() = Some(vec![std::f64::consts::LN_2; self.cfg.sources]);
        Ok(())
    }

    /// The learned source weights (`None` unless [`Net::weigh_sources`]).
    pub fn source_weights(&self) -> Option<Vec<f64>> {
        self.source_losses.borrow().as_deref().map(weights_of)
    }

    /// Domain logits per window.
    pub fn domain_outputs(&self) -> usize {
        match self.cfg.adversary {
            Adversary::None => 0,
            Adversary::MultiClass => self.cfg.sources + 1,
            Adversary::PerSource => self.cfg.sources,
        }
    }

    /// The features of `x` (`[n, lookback, channels]` → `[n, 2·hidden]`).
    pub fn features(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let t = x.dim(1)?;
        let c = self.conv1.forward(x)?.relu()?;
        let c = self.conv2.forward(&c)?.relu()?.contiguous()?; // [n, t, conv]
        let rev = Tensor::from_vec((0..t as u32).rev().collect::<Vec<_>>(), t, x.device())?;
        let g_f = Tensor::stack(&self.gru_f.seq(&c)?.iter().map(|s| s.h().clone()).collect::<Vec<_>>(), 1)?;
        let g_b =
            Tensor::stack(&self.gru_b.seq(&c.index_select(&rev, 1)?)?.iter().map(|s| s.h().clone()).collect::<Vec<_>>(), 1)?
                .index_select(&rev, 1)?;
        let g = Tensor::cat(&[g_f, g_b], 2)?.contiguous()?; // [n, t, 2h]
        let l_f = self.lstm_f.seq(&g)?;
        let l_b = self.lstm_b.seq(&g.index_select(&rev, 1)?)?;
        let last = |v: &[candle_nn::rnn::LSTMState]| v.last().map(|s| s.h().clone());
        match (last(&l_f), last(&l_b)) {
            (Some(f), Some(b)) => Tensor::cat(&[f, b], 1),
            _ => candle_core::bail!("a window of no days"),
        }
    }

    /// The forecast (normalised, `[n, horizon]`).
    pub fn forecast(&self, x: &Tensor, features: &Tensor) -> candle_core::Result<Tensor> {
        let today = x.narrow(1, x.dim(1)? - 1, 1)?.narrow(2, 0, 1)?.squeeze(2)?; // [n, 1]
        let d = self.head2.forward(&self.head1.forward(features)?.relu()?)?;
        d.broadcast_add(&today)
    }

    /// The domain logits of `features` behind the reversal layer.
    pub fn domain_logits(&self, features: &Tensor) -> candle_core::Result<Option<Tensor>> {
        if self.disc.is_empty() {
            return Ok(None);
        }
        let f = grad_reverse(features, self.lambda.get())?;
        let outs = self.disc.iter().map(|(a, b)| b.forward(&a.forward(&f)?.relu()?)).collect::<candle_core::Result<Vec<_>>>()?;
        Ok(Some(Tensor::cat(&outs, 1)?))
    }

    /// The training loss of `out` (this model's output on `batch`): masked MSE of the forecast
    /// plus the adversary's domain loss. Returns (total, regression, domain).
    pub fn loss(&self, out: &Tensor, batch: &Batch) -> candle_core::Result<(Tensor, Tensor, Option<Tensor>)> {
        let (n, h) = (batch.n, self.cfg.horizon);
        let dev = out.device();
        let pred = out.narrow(1, 0, h)?;
        let y = Tensor::from_slice(&batch.y, (n, h), dev)?;
        // learned source weights scale each source window's share of the regression loss
        let weights = self.source_weights();
        let row_mask: Vec<f32> = match &weights {
            Some(w) => batch
                .mask
                .iter()
                .enumerate()
                .map(|(i, &m)| m * w.get(batch.domain[i / h] as usize).map_or(1.0, |&x| x as f32))
                .collect(),
            None => batch.mask.clone(),
        };
        let mask = Tensor::from_slice(&row_mask, (n, h), dev)?;
        let sum = row_mask.iter().sum::<f32>();
        let count = if weights.is_some() { sum.max(1e-6) } else { sum.max(1.0) };
        let reg = ((pred - y)?.sqr()? * &mask)?.sum_all()?.affine(1.0 / f64::from(count), 0.0)?;
        let dom = match self.cfg.adversary {
            Adversary::None => None,
            Adversary::MultiClass => {
                let logits = out.narrow(1, h, self.cfg.sources + 1)?;
                let labels = Tensor::from_slice(&batch.domain, n, dev)?;
                Some(candle_nn::loss::cross_entropy(&logits, &labels)?)
            }
            Adversary::PerSource => {
                let k = self.cfg.sources;
                let z = out.narrow(1, h, k)?;
                // source i: discriminator i says 1; target (label k): every discriminator says 0
                let (mut w, mut t) = (vec![0f32; n * k], vec![0f32; n * k]);
                for (r, &d) in batch.domain.iter().enumerate() {
                    let d = d as usize;
                    if d < k {
                        w[r * k + d] = 1.0;
                        t[r * k + d] = 1.0;
                    } else {
                        w[r * k..(r + 1) * k].fill(1.0 / k as f32);
                    }
                }
                let w = Tensor::from_vec(w, (n, k), dev)?;
                let t = Tensor::from_vec(t, (n, k), dev)?;
                // binary cross-entropy with logits, stable: max(z, 0) − z·t + log(1 + e^(−|z|))
                let bce = ((z.relu()? - (&z * &t)?)? + (z.abs()?.neg()?.exp()? + 1.0)?.log()?)?;
                if let Some(avg) = self.source_losses.borrow_mut().as_mut() {
                    // each discriminator's loss over its source's windows and the target's
                    let (b, wv): (Vec<Vec<f32>>, Vec<Vec<f32>>) = (bce.to_vec2()?, w.to_vec2()?);
                    for (i, a) in avg.iter_mut().enumerate() {
                        let (num, den) = b
                            .iter()
                            .zip(&wv)
                            .fold((0f64, 0f64), |(s, c), (br, wr)| (s + f64::from(br[i] * wr[i]), c + f64::from(wr[i])));
                        if den > 0.0 {
                            *a += WEIGHT_SMOOTHING * (num / den - *a);
                        }
                    }
                }
                Some((bce * w)?.sum_all()?.affine(1.0 / n as f64, 0.0)?)
            }
        };
        let total = match &dom {
            Some(d) => (&reg + d)?,
            None => reg.clone(),
        };
        Ok((total, reg, dom))
    }

    /// The input tensor of a batch.
    pub fn input(&self, batch: &Batch) -> candle_core::Result<Tensor> {
        Tensor::from_slice(&batch.x, (batch.n, self.cfg.lookback, self.cfg.channels), &Device::Cpu)
    }
}

impl Staged for Net {
    fn stages(&self) -> usize {
        1
    }
    fn forward_stage(&self, _k: usize, x: &Tensor) -> candle_core::Result<Tensor> {
        let f = self.features(x)?;
        let pred = self.forecast(x, &f)?;
        match self.domain_logits(&f)? {
            Some(d) => Tensor::cat(&[pred, d], D::Minus1),
            None => Ok(pred),
        }
    }
}

/// `k · softmax(losses / WEIGHT_TEMPERATURE)`: the source weights of [`Net::weigh_sources`].
pub fn weights_of(losses: &[f64]) -> Vec<f64> {
    let top = losses.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = losses.iter().map(|l| ((l - top) / WEIGHT_TEMPERATURE).exp()).collect();
    let sum: f64 = e.iter().sum();
    e.iter().map(|x| x * losses.len() as f64 / sum).collect()
}

/// Sets every variable of `vm` uniform in ±1/√fan-in from its own stream, seeded by `seed` and
/// the variable's name: a layer's initial weights do not depend on which other layers exist,
/// so one seed gives every method the same feature extractor and regression head (with one
/// stream over all variables in name order, a domain classifier's `disc*` variables shifted
/// the recurrent layers' draws).
pub fn init_by_name(vm: &VarMap, seed: u64) -> Result<()> {
    ironweave::candle::init_uniform_per_variable(vm, |name| {
        // FNV-1a of the name
        let h = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3));
        crate::Rng::new(&[seed, h]).0
    })?;
    Ok(())
}

/// Masked mean squared error on host values (the loss's definition, for tests and evaluation).
pub fn masked_mse_host(pred: &[f32], y: &[f32], mask: &[f32]) -> f32 {
    let (mut s, mut n) = (0f32, 0f32);
    for ((p, t), m) in pred.iter().zip(y).zip(mask) {
        s += m * (p - t) * (p - t);
        n += m;
    }
    s / n.max(1.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Var;

    #[test]
    fn reversal_is_the_identity_forward_and_negates_the_gradient() {
        let x = Var::from_vec(vec![0.5f32, -1.25, 3.0], 3, &Device::Cpu).unwrap();
        let y = grad_reverse(x.as_tensor(), 0.7).unwrap();
        assert_eq!(y.to_vec1::<f32>().unwrap(), vec![0.5, -1.25, 3.0]);
        let g = y.sqr().unwrap().sum_all().unwrap().backward().unwrap();
        let gx = g.get(x.as_tensor()).unwrap().to_vec1::<f32>().unwrap();
        for (a, b) in gx.iter().zip([0.5f32, -1.25, 3.0]) {
            assert!((a - (-0.7 * 2.0 * b)).abs() < 1e-6, "{gx:?}");
        }
    }

    #[test]
    fn one_seed_gives_every_method_the_same_extractor_and_head() {
        let cfg = |sources, adversary| NetConfig {
            lookback: 14,
            horizon: 3,
            channels: crate::pipeline::CHANNELS,
            conv: 8,
            hidden: 8,
            sources,
            adversary,
        };
        let values = |c: NetConfig, seed: u64| {
            let vm = VarMap::new();
            Net::new(&vm, c, seed).unwrap();
            let data = vm.data().lock().unwrap();
            let mut v: Vec<(String, Vec<f32>)> =
                data.iter().map(|(k, v)| (k.clone(), v.as_tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap())).collect();
            v.sort_by(|a, b| a.0.cmp(&b.0));
            v
        };
        let plain = values(cfg(0, Adversary::None), 7);
        for other in [cfg(4, Adversary::None), cfg(4, Adversary::MultiClass), cfg(2, Adversary::PerSource)] {
            let v = values(other, 7);
            for (name, w) in &plain {
                let o = &v.iter().find(|(n, _)| n == name).unwrap_or_else(|| panic!("{name} missing")).1;
                assert_eq!(o, w, "`{name}` differs between {:?} and the plain network", other.adversary);
            }
        }
        // and another seed gives other weights
        assert_ne!(values(cfg(0, Adversary::None), 8)[0].1, plain[0].1);
    }

    #[test]
    fn lambda_rises_from_zero_towards_one() {
        assert_eq!(lambda_schedule(0.0), 0.0);
        assert!(lambda_schedule(0.5) > 0.98 && lambda_schedule(1.0) < 1.0);
    }

    #[test]
    fn learned_source_weights_follow_the_discriminators_losses() {
        // at chance everywhere: all 1; a source told apart perfectly: near 0, the other near 2
        assert_eq!(weights_of(&[0.5, 0.5, 0.5]), vec![1.0, 1.0, 1.0]);
        let w = weights_of(&[std::f64::consts::LN_2, 0.0]);
        assert!((w.iter().sum::<f64>() - 2.0).abs() < 1e-12 && w[1] < 0.002 && w[0] > 1.99, "{w:?}");
        let cfg = |adversary| NetConfig {
            lookback: 4,
            horizon: 1,
            channels: crate::pipeline::CHANNELS,
            conv: 4,
            hidden: 3,
            sources: 2,
            adversary,
        };
        let vm = VarMap::new();
        assert!(Net::new(&vm, cfg(Adversary::MultiClass), 1).unwrap().weigh_sources().is_err());
        let vm = VarMap::new();
        let net = Net::new(&vm, cfg(Adversary::PerSource), 1).unwrap();
        assert_eq!(net.source_weights(), None);
        net.weigh_sources().unwrap();
        assert_eq!(net.source_weights(), Some(vec![1.0, 1.0]));
        // a batch of a window per source and one of the target: the losses move the weights,
        // which still average 1
        let b = Batch {
            n: 3,
            x: (0..3 * 4 * crate::pipeline::CHANNELS).map(|i| (i % 7) as f32 * 0.3 - 1.0).collect(),
            y: vec![0.5, -0.5, 0.0],
            mask: vec![1.0, 1.0, 0.0],
            domain: vec![0, 1, 2],
        };
        let out = net.forward_stage(0, &net.input(&b).unwrap()).unwrap();
        net.loss(&out, &b).unwrap();
        let w = net.source_weights().unwrap();
        assert!(w != vec![1.0, 1.0] && (w[0] + w[1] - 2.0).abs() < 1e-9, "{w:?}");
    }
}
