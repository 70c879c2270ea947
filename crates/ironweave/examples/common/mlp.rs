//! The examples' own model: a three-stage MLP regressing a fixed smooth function of its input,
//! on data every rank draws for itself from (iteration, rank) — nothing of ironweave's.

use candle_core::{DType, Device, Module, Result, Tensor};
use candle_nn::{linear, Linear, VarBuilder, VarMap};
use ironweave::candle::Staged;

pub const IN: usize = 32;
pub const HIDDEN: usize = 256;

/// Three stages: the adapter averages the last stage's gradients while the first two compute.
pub struct Mlp {
    l1: Linear,
    l2: Linear,
    l3: Linear,
}

impl Mlp {
    /// Builds the layers in `vm` and sets them from `seed` (candle's CPU init cannot be seeded).
    pub fn new(vm: &VarMap, seed: u64) -> std::result::Result<Mlp, Box<dyn std::error::Error + Send + Sync>> {
        let vb = VarBuilder::from_varmap(vm, DType::F32, &Device::Cpu);
        let m = Mlp {
            l1: linear(IN, HIDDEN, vb.pp("l1"))?,
            l2: linear(HIDDEN, HIDDEN, vb.pp("l2"))?,
            l3: linear(HIDDEN, 1, vb.pp("l3"))?,
        };
        ironweave::candle::init_uniform(vm, seed)?;
        Ok(m)
    }
}

impl Staged for Mlp {
    fn stages(&self) -> usize {
        3
    }
    fn forward_stage(&self, k: usize, x: &Tensor) -> Result<Tensor> {
        match k {
            0 => self.l1.forward(x)?.tanh(),
            1 => self.l2.forward(x)?.tanh(),
            _ => self.l3.forward(x),
        }
    }
}

/// Rank `rank`'s batch of iteration `iter`: inputs in [-1, 1), targets `sum_i sin((i + 1) x_i) / 8`.
pub fn batch(iter: u64, rank: usize, n: usize) -> Result<(Tensor, Tensor)> {
    let mut s = iter.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (rank as u64).wrapping_mul(0xD1B5_4A32_D192_ED03);
    let mut x = Vec::with_capacity(n * IN);
    for _ in 0..n * IN {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        x.push(((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0);
    }
    let y: Vec<f32> =
        x.chunks(IN).map(|r| r.iter().enumerate().map(|(i, v)| ((i + 1) as f32 * v).sin()).sum::<f32>() / 8.0).collect();
    Ok((Tensor::from_vec(x, (n, IN), &Device::Cpu)?, Tensor::from_vec(y, (n, 1), &Device::Cpu)?))
}

/// Mean squared error against `y`.
pub fn mse(out: &Tensor, y: &Tensor) -> Result<Tensor> {
    (out - y)?.sqr()?.mean_all()
}
