//! The reversal layer's gradient against finite differences, through the whole network: the
//! feature extractor must receive the gradient of `regression − λ·domain` and the domain
//! classifier that of `regression + domain`, for both adversarial strategies.

use candle_core::{Device, Tensor};
use candle_nn::VarMap;
use ironweave::candle::Staged;
use ironweave_airq::model::{Adversary, Net, NetConfig};
use ironweave_airq::pipeline::{Batch, CHANNELS};
use ironweave_airq::Rng;

fn batch(cfg: &NetConfig, n: usize) -> Batch {
    let mut r = Rng::new(&[42]);
    let mut u = move || (r.next_u64() >> 40) as f32 / (1u64 << 24) as f32;
    let mut b = Batch { n, ..Default::default() };
    for _ in 0..n * cfg.lookback {
        b.x.extend([u() * 2.0 - 1.0, 1.0, u(), u()]);
    }
    for i in 0..n * cfg.horizon {
        b.y.push(u() * 2.0 - 1.0);
        b.mask.push(if i % 3 == 1 { 0.0 } else { 1.0 });
    }
    b.domain = (0..n).map(|i| (i % (cfg.sources + 1)) as u32).collect();
    b
}

/// (regression, domain) of `net` on `b`.
fn losses(net: &Net, x: &Tensor, b: &Batch) -> (f64, f64) {
    let out = net.forward_stage(0, x).unwrap();
    let (_, reg, dom) = net.loss(&out, b).unwrap();
    (f64::from(reg.to_scalar::<f32>().unwrap()), f64::from(dom.unwrap().to_scalar::<f32>().unwrap()))
}

fn check(adversary: Adversary) {
    let cfg = NetConfig { lookback: 5, horizon: 2, channels: CHANNELS, conv: 4, hidden: 3, sources: 2, adversary };
    let vm = VarMap::new();
    let net = Net::new(&vm, cfg, 7).unwrap();
    let lambda = 1.0;
    net.set_lambda(lambda);
    let b = batch(&cfg, 6);
    let x = Tensor::from_slice(&b.x, (b.n, cfg.lookback, CHANNELS), &Device::Cpu).unwrap();
    let out = net.forward_stage(0, &x).unwrap();
    let (total, _, _) = net.loss(&out, &b).unwrap();
    let grads = total.backward().unwrap();

    let mut vars: Vec<(String, candle_core::Var)> =
        vm.data().lock().unwrap().iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    let eps = 2e-3f32;
    let (mut checked, mut told_apart, mut kinks) = (0, 0, 0);
    let base = losses(&net, &x, &b);
    for (name, var) in &vars {
        let feature = ["conv", "gru", "lstm"].iter().any(|p| name.starts_with(p));
        let disc = name.starts_with("disc");
        if !feature && !disc {
            continue;
        }
        let g: Vec<f32> = grads.get(var.as_tensor()).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        let v0: Vec<f32> = var.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
        let shape = var.as_tensor().dims().to_vec();
        for i in 0..v0.len() {
            let at = |d: f32| {
                let mut v = v0.clone();
                v[i] += d;
                var.set(&Tensor::from_vec(v, shape.as_slice(), &Device::Cpu).unwrap()).unwrap();
                let l = losses(&net, &x, &b);
                var.set(&Tensor::from_vec(v0.clone(), shape.as_slice(), &Device::Cpu).unwrap()).unwrap();
                l
            };
            let ((r1, d1), (r0, d0)) = (at(eps), at(-eps));
            let e = f64::from(eps);
            let fd_reg = (r1 - r0) / (2.0 * e);
            let fd_dom = (d1 - d0) / (2.0 * e);
            // a ReLU kink within ±eps makes the two one-sided slopes disagree: no derivative to
            // compare there (counted, and there must be few)
            let one_sided = |p: f64, m: f64, c: f64| ((p - c) / e - (c - m) / e).abs();
            if one_sided(r1, r0, base.0) + one_sided(d1, d0, base.1) > 6e-4 {
                kinks += 1;
                continue;
            }
            // what the parameter must get: the extractor the reversed domain gradient, the
            // classifier the plain one
            let want = if feature { fd_reg - lambda * fd_dom } else { fd_reg + fd_dom };
            let got = f64::from(g[i]);
            let tol = 3e-4 + 0.02 * want.abs();
            assert!((got - want).abs() <= tol, "{adversary:?} {name}[{i}]: backward {got:.6}, finite differences {want:.6}");
            // and without the reversal the extractor's gradient would be told apart
            if feature && ((fd_reg + lambda * fd_dom) - got).abs() > 4.0 * tol {
                told_apart += 1;
            }
            checked += 1;
        }
    }
    eprintln!("{adversary:?}: {checked} elements checked, {kinks} at a kink, {told_apart} where reversal and none differ by > 4x the tolerance");
    assert!(checked >= 100 && kinks * 20 < checked, "{checked} elements checked, {kinks} at a kink");
    assert!(told_apart >= 5, "{adversary:?}: the domain gradient is too small to tell reversal from none ({told_apart})");
}

#[test]
fn multi_class_reversal_matches_finite_differences() {
    check(Adversary::MultiClass);
}

#[test]
fn per_source_reversal_matches_finite_differences() {
    check(Adversary::PerSource);
}
