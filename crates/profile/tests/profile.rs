//! The profiler's cores, driven by a manual clock: exact windows, prediction, drift and
//! speculative activation.

use ironweave_profile::export::{chrome_trace, svg_timeline};
use ironweave_profile::{
    idle_windows, Anchor, CommKind, ExpertLoad, ManualClock, Phase, Profiler, SpeculativeActivation, WindowPredictor,
};

const MS: u64 = 1_000_000;

/// One iteration: 2 layers forward then backward, each 10 ms; an all-to-all of 3 ms at the end
/// of every forward phase and at the start of every backward phase on link 0.
fn iteration(p: &Profiler<ManualClock>, clock: &ManualClock, iter: u64, a2a_ms: u64) {
    p.begin_iteration(iter);
    for l in 0..2 {
        let _t = p.layer(l, Phase::Forward);
        clock.advance(10 * MS - a2a_ms * MS);
        let _c = p.comm(0, CommKind::Training, 1000);
        clock.advance(a2a_ms * MS);
    }
    for l in (0..2).rev() {
        let _t = p.layer(l, Phase::Backward);
        {
            let _c = p.comm(0, CommKind::Training, 1000);
            clock.advance(a2a_ms * MS);
        }
        clock.advance(10 * MS - a2a_ms * MS);
    }
    p.end_iteration();
}

#[test]
fn windows_are_exact_and_anchored() {
    let clock = ManualClock::new();
    let p = Profiler::new(clock.clone(), 8);
    iteration(&p, &clock, 0, 3);
    let prof = &p.history()[0];
    assert_eq!(prof.layers.len(), 4);
    assert_eq!(prof.duration_ns(), 40 * MS);
    let w = idle_windows(prof, 0, 1);
    // busy: [7,10) [17,23) [30,33); idle: [0,7) [10,17) [23,30) [33,40)
    let got: Vec<(u64, u64)> = w.iter().map(|w| (w.offset_ns / MS, w.len_ns / MS)).collect();
    assert_eq!(got, vec![(0, 7), (10, 7), (23, 7), (33, 7)]);
    assert_eq!(w.iter().map(|w| w.after_comm).collect::<Vec<_>>(), vec![None, Some(0), Some(2), Some(3)]);
    assert_eq!(w[0].anchor, Anchor { at: Some((Phase::Forward, 0)), ordinal: 0 });
    assert_eq!(w[1].anchor, Anchor { at: Some((Phase::Forward, 1)), ordinal: 0 });
    assert_eq!(w[2].anchor, Anchor { at: Some((Phase::Backward, 1)), ordinal: 0 });
    assert_eq!(w[3].anchor, Anchor { at: Some((Phase::Backward, 0)), ordinal: 0 });
    // windows shorter than the minimum are dropped; other links have one window: the iteration
    assert!(idle_windows(prof, 0, 8 * MS).is_empty());
    assert_eq!(idle_windows(prof, 1, 1).len(), 1);
}

#[test]
fn prediction_trusts_shrinking_windows_at_once() {
    let clock = ManualClock::new();
    let p = Profiler::new(clock.clone(), 8);
    let mut pred = WindowPredictor::new(0.5);
    for it in 0..3 {
        iteration(&p, &clock, it, 3);
        pred.observe(&idle_windows(p.history().last().unwrap(), 0, 1));
    }
    let lens: Vec<u64> = pred.predict(0).iter().map(|w| w.len_ns / MS).collect();
    assert_eq!(lens, vec![7, 7, 7, 7]);
    // all-to-alls get longer (hot experts): windows shrink to 5 ms, predicted at once
    iteration(&p, &clock, 3, 5);
    pred.observe(&idle_windows(p.history().last().unwrap(), 0, 1));
    assert_eq!(pred.predict(0).iter().map(|w| w.len_ns / MS).collect::<Vec<_>>(), vec![5, 5, 5, 5]);
    // and back to 7 ms: the prediction grows gradually (EWMA 0.5: 6 ms)
    iteration(&p, &clock, 4, 3);
    pred.observe(&idle_windows(p.history().last().unwrap(), 0, 1));
    assert_eq!(pred.predict(0).iter().map(|w| w.len_ns / MS).collect::<Vec<_>>(), vec![6, 6, 6, 6]);
    assert_eq!(pred.observed(), 5);
}

#[test]
fn detail_off_records_boundaries_and_communication_only() {
    let clock = ManualClock::new();
    let p = Profiler::new(clock.clone(), 2);
    p.set_detailed(false);
    p.begin_iteration(7);
    {
        let _l = p.layer(0, Phase::Forward);
        let _t = p.comm(0, CommKind::Training, 10);
        let _c = p.comm(0, CommKind::Checkpoint, 20);
        clock.advance(MS);
    }
    let prof = p.end_iteration().unwrap();
    assert!(prof.layers.is_empty() && !prof.detailed);
    assert_eq!(prof.comms.len(), 2);
    assert_eq!(prof.duration_ns(), MS);
    // history is bounded
    for i in 0..5 {
        p.begin_iteration(i);
        p.end_iteration();
    }
    assert_eq!(p.history().len(), 2);
}

fn load(shares: &[&[u64]]) -> ExpertLoad {
    ExpertLoad { tokens: shares.iter().map(|l| l.to_vec()).collect() }
}

#[test]
fn drift_is_total_variation_of_the_worst_layer() {
    let a = load(&[&[50, 50, 0, 0], &[25, 25, 25, 25]]);
    let b = load(&[&[0, 0, 50, 50], &[25, 25, 25, 25]]);
    assert_eq!(a.drift(&b).unwrap(), 1.0);
    assert_eq!(a.drift(&a).unwrap(), 0.0);
    let c = load(&[&[100, 100, 0, 0], &[1, 1, 1, 1]]); // same distribution, other volume
    assert_eq!(a.drift(&c).unwrap(), 0.0);
    assert!(a.drift(&load(&[&[1, 2, 3]])).is_err());
}

/// Synthetic trace: 4 MoE layers x 16 experts, popular experts wobble by ±2% per iteration;
/// at `shift` the popular half moves to the other experts.
fn trace(iters: u64, shift: Option<u64>) -> Vec<ExpertLoad> {
    (0..iters)
        .map(|i| {
            let moved = shift.is_some_and(|s| i >= s);
            ExpertLoad {
                tokens: (0..4)
                    .map(|m| {
                        (0..16u64)
                            .map(|e| {
                                let hot = (e < 8) != moved;
                                let base = if hot { 1000 } else { 200 };
                                base + (i * 7 + e * 13 + m * 5) % 40
                            })
                            .collect()
                    })
                    .collect(),
            }
        })
        .collect()
}

fn activations_with(mut s: SpeculativeActivation, t: &[ExpertLoad]) -> Vec<usize> {
    let mut at = Vec::new();
    for (i, l) in t.iter().enumerate() {
        if s.decide(l) {
            at.push(i);
        }
    }
    assert_eq!(s.activations() as usize, at.len());
    at
}

fn activations(t: &[ExpertLoad]) -> Vec<usize> {
    activations_with(SpeculativeActivation::new(DEFAULT_THRESHOLD), t)
}

/// The engine's default threshold (`EngineConfig::drift_threshold`).
const DEFAULT_THRESHOLD: f64 = 0.3;

#[test]
fn speculative_activation_on_synthetic_traces() {
    // stable load: profiled once, at the start
    assert_eq!(activations(&trace(50, None)), vec![0]);
    // the popular experts move at iteration 20: caught within 2 iterations, and the smoothed
    // load settling on the new experts re-profiles at most once more
    let at = activations(&trace(50, Some(20)));
    assert_eq!(at[0], 0);
    assert!(at.len() >= 2 && (20..=22).contains(&at[1]), "{at:?}");
    assert!(at.len() <= 3, "{at:?}");
    // without smoothing, the same detector reacts in the very iteration
    assert_eq!(activations_with(SpeculativeActivation::with_alpha(0.1, 1.0), &trace(50, Some(20))), vec![0, 20]);
}

/// moe-small's recorded expert load (80 iterations, 2 MoE layers x 8 experts, one rank's
/// batch of 8 sequences): from one iteration to the next the raw shares move by a median 0.09
/// and up to 0.6 in total variation.
fn recorded() -> Vec<ExpertLoad> {
    parse_trace(include_str!("data/moe-small-load.json"))
}

fn parse_trace(text: &str) -> Vec<ExpertLoad> {
    let v: serde_json::Value = serde_json::from_str(text).unwrap();
    v["iterations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|it| ExpertLoad {
            tokens: it
                .as_array()
                .unwrap()
                .iter()
                .map(|l| l.as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect())
                .collect(),
        })
        .collect()
}

#[test]
fn speculative_activation_is_rare_on_a_real_load_and_quick_after_a_flip() {
    let t = recorded();
    assert_eq!(t.len(), 80);
    // after the first 10 iterations (training still moving fast), at most 10% re-profiled
    let at = activations(&t);
    let steady = at.iter().filter(|&&i| i >= 10).count();
    assert!(steady * 10 <= 70, "{steady} of 70 steady iterations re-profiled: {at:?}");
    // the raw load would have re-profiled far more often
    let raw = activations_with(SpeculativeActivation::with_alpha(DEFAULT_THRESHOLD, 1.0), &t);
    assert!(raw.iter().filter(|&&i| i >= 10).count() > steady, "{raw:?} vs {at:?}");
    // the router's preferred experts flipped at iteration 50: re-profiled within 2 iterations
    let flipped: Vec<ExpertLoad> = t
        .iter()
        .enumerate()
        .map(|(i, l)| {
            if i < 50 {
                l.clone()
            } else {
                ExpertLoad { tokens: l.tokens.iter().map(|x| x.iter().rev().copied().collect()).collect() }
            }
        })
        .collect();
    let at = activations(&flipped);
    let first = at.iter().copied().find(|&i| i >= 50);
    assert!(first.is_some_and(|i| i <= 52), "flip at 50, re-profiled at {at:?}");
}

/// Issue 29: the 10% above comes from the trace the smoothing was tuned on. moe-wide's load,
/// recorded live (80 iterations, 4 MoE layers x 16 experts, the bench's workload) and never used
/// for tuning, says what a live run gets: this test prints the rate and checks only what the
/// design promises on any trace — fewer activations than re-profiling on every raw change, and
/// none once the smoothed load is still. The rate itself is reported in docs/BENCHMARKS.md.
#[test]
fn speculative_activation_on_a_trace_it_was_not_tuned_on() {
    let t = parse_trace(include_str!("data/moe-wide-load.json"));
    assert_eq!(t.len(), 80);
    let at = activations(&t);
    let raw = activations_with(SpeculativeActivation::with_alpha(DEFAULT_THRESHOLD, 1.0), &t);
    let steady = at.iter().filter(|&&i| i >= 10).count();
    eprintln!(
        "moe-wide, live trace: {} activations in 80 iterations ({} of the 70 after iteration 10); raw load: {}; at {at:?}",
        at.len(),
        steady,
        raw.len()
    );
    assert!(at.len() < raw.len(), "smoothing must re-profile less than the raw load: {at:?} vs {raw:?}");
    // the same load held still after iteration 40: no activation after the smoothing settles
    let held: Vec<ExpertLoad> = t.iter().enumerate().map(|(i, l)| if i < 40 { l.clone() } else { t[39].clone() }).collect();
    let at = activations(&held);
    assert!(at.iter().all(|&i| i < 45), "a still load re-profiled: {at:?}");
}

#[test]
fn exports_describe_the_iteration() {
    let clock = ManualClock::new();
    let p = Profiler::new(clock.clone(), 4);
    iteration(&p, &clock, 0, 3);
    let prof = p.history()[0].clone();
    let w = idle_windows(&prof, 0, 1);
    let t = chrome_trace(std::slice::from_ref(&prof), &w.iter().map(|w| (prof.start_ns, *w)).collect::<Vec<_>>(), 3);
    let ev = t["traceEvents"].as_array().unwrap();
    let layers = ev.iter().filter(|e| e["cat"] == "layer").count();
    let windows: Vec<_> = ev.iter().filter(|e| e["cat"] == "window").collect();
    assert_eq!(layers, 4);
    assert_eq!(windows.len(), 4);
    assert_eq!(windows[1]["ts"].as_f64().unwrap(), 10_000.0); // µs
    assert!(ev.iter().all(|e| e["pid"] == 3));
    let svg = svg_timeline(&prof, &w, "it 0");
    assert!(svg.starts_with("<svg") && svg.matches("<rect").count() >= 4 + 4 + 4);
}
