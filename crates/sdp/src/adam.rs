//! AdamW, element by element: the one update of the workspace (the sharded engine, the GPT
//! trainer and the candle adapter all call [`adam_update`]), so a sharded step equals the
//! replicated one bit for bit.

use serde::{Deserialize, Serialize};

/// AdamW's settings — the one update of the workspace (`ironweave-train`'s `adamw` and the candle
/// adapter call [`adam_update`] too), element by element and
/// in the same precision, so a sharded step equals a replicated one.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct Adam {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    /// Decoupled weight decay (on the layers marked to decay).
    pub weight_decay: f64,
}

impl Default for Adam {
    fn default() -> Self {
        Adam { lr: 1e-3, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.0 }
    }
}

/// AdamW on one block: parameters, moments and the averaged gradient, step `t` (from 1);
/// `decay`: whether weight decay applies (matrices, not norms or biases).
pub fn adam_update(a: &Adam, t: u64, decay: bool, p: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32]) {
    let t = t.min(i32::MAX as u64) as i32;
    let (c1, c2) = (1.0 - a.beta1.powi(t), 1.0 - a.beta2.powi(t));
    let wd = if decay { a.weight_decay } else { 0.0 };
    for i in 0..p.len() {
        let gi = g[i] as f64;
        let mn = a.beta1 * m[i] as f64 + (1.0 - a.beta1) * gi;
        let vn = a.beta2 * v[i] as f64 + (1.0 - a.beta2) * gi * gi;
        m[i] = mn as f32;
        v[i] = vn as f32;
        let upd = (mn / c1) / ((vn / c2).sqrt() + a.eps);
        p[i] = (p[i] as f64 * (1.0 - a.lr * wd) - a.lr * upd) as f32;
    }
}
