//! The recorder: scoped per-layer timers, communication spans per link, iteration boundaries.

use ironweave_units::Locked;
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use crate::clock::Clock;

/// Which part of a layer's work.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Phase {
    /// Forward pass.
    Forward,
    /// Backward pass.
    Backward,
    /// Optimizer step (layer index is ignored by convention, use 0).
    Optimizer,
}

/// Traffic class of a communication.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CommKind {
    /// The model's own communication (all-to-all, all-reduce, ...).
    Training,
    /// Checkpoint chunks.
    Checkpoint,
}

/// One timed layer phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerSpan {
    /// Layer index.
    pub layer: u32,
    /// Phase.
    pub phase: Phase,
    /// Start, ns.
    pub start_ns: u64,
    /// End, ns.
    pub end_ns: u64,
}

/// One communication on one link.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CommSpan {
    /// Link index (as in the communicator).
    pub link: u32,
    /// Class.
    pub kind: CommKind,
    /// Start, ns.
    pub start_ns: u64,
    /// End, ns.
    pub end_ns: u64,
    /// Bytes moved.
    pub bytes: u64,
}

/// Everything recorded in one iteration.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct IterationProfile {
    /// Iteration number.
    pub iter: u64,
    /// Start, ns.
    pub start_ns: u64,
    /// End, ns.
    pub end_ns: u64,
    /// Whether layer and communication timing was on (speculative activation may turn it off).
    pub detailed: bool,
    /// Layer phases, in completion order.
    pub layers: Vec<LayerSpan>,
    /// Communications, in completion order.
    pub comms: Vec<CommSpan>,
}

impl IterationProfile {
    /// Duration of the iteration.
    pub fn duration_ns(&self) -> u64 {
        self.end_ns.saturating_sub(self.start_ns)
    }
}

#[derive(Debug, Default)]
struct State {
    current: Option<IterationProfile>,
    history: Vec<IterationProfile>,
}

/// The profiler of one rank. `Sync`: communication may be recorded from progress threads.
pub struct Profiler<C: Clock> {
    clock: C,
    state: Mutex<State>,
    detailed: std::sync::atomic::AtomicBool,
    keep: usize,
    hook: Mutex<Option<CommHook>>,
}

/// Called after each training communication is recorded (the checkpoint engine releases the
/// chunks of the window that just opened).
pub type CommHook = std::sync::Arc<dyn Fn(&CommSpan) + Send + Sync>;

impl<C: Clock + std::fmt::Debug> std::fmt::Debug for Profiler<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Profiler")
            .field("clock", &self.clock)
            .field("detailed", &self.detailed())
            .field("keep", &self.keep)
            .finish()
    }
}

impl<C: Clock> Profiler<C> {
    /// A profiler on `clock` keeping the last `keep` iterations.
    pub fn new(clock: C, keep: usize) -> Self {
        Profiler { clock, state: Mutex::new(State::default()), detailed: true.into(), keep: keep.max(1), hook: Mutex::new(None) }
    }

    /// The clock's time, ns.
    pub fn now_ns(&self) -> u64 {
        self.clock.now_ns()
    }

    /// Set (or clear) the hook called after every training communication is recorded.
    pub fn set_comm_hook(&self, hook: Option<CommHook>) {
        *self.hook.locked() = hook;
    }

    /// Turn per-layer recording on or off (iteration boundaries and communications, which are
    /// cheap and which the checkpoint engine schedules by, are always recorded). Takes effect
    /// at the next record.
    pub fn set_detailed(&self, on: bool) {
        self.detailed.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether detailed recording is on.
    pub fn detailed(&self) -> bool {
        self.detailed.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Start iteration `iter` (ends the previous one if still open).
    pub fn begin_iteration(&self, iter: u64) {
        let now = self.now_ns();
        let detailed = self.detailed();
        let mut s = self.state.locked();
        if let Some(mut open) = s.current.take() {
            open.end_ns = now;
            Self::push(&mut s, open, self.keep);
        }
        s.current = Some(IterationProfile { iter, start_ns: now, end_ns: now, detailed, ..Default::default() });
    }

    /// End the current iteration; returns a copy of its profile.
    pub fn end_iteration(&self) -> Option<IterationProfile> {
        let now = self.now_ns();
        let mut s = self.state.locked();
        let mut p = s.current.take()?;
        p.end_ns = now;
        Self::push(&mut s, p.clone(), self.keep);
        Some(p)
    }

    fn push(s: &mut State, p: IterationProfile, keep: usize) {
        s.history.push(p);
        if s.history.len() > keep {
            let extra = s.history.len() - keep;
            s.history.drain(..extra);
        }
    }

    /// Finished iterations, oldest first.
    pub fn history(&self) -> Vec<IterationProfile> {
        self.state.locked().history.clone()
    }

    /// Time a layer phase until the guard drops.
    pub fn layer(&self, layer: u32, phase: Phase) -> LayerTimer<'_, C> {
        LayerTimer { prof: self, layer, phase, start_ns: if self.detailed() { self.now_ns() } else { u64::MAX } }
    }

    /// Record a layer phase measured elsewhere.
    pub fn record_layer(&self, span: LayerSpan) {
        if !self.detailed() {
            return;
        }
        if let Some(p) = self.state.locked().current.as_mut() {
            p.layers.push(span);
        }
    }

    /// Time a communication until the guard drops.
    pub fn comm(&self, link: u32, kind: CommKind, bytes: u64) -> CommTimer<'_, C> {
        CommTimer { prof: self, link, kind, bytes, start_ns: self.now_ns() }
    }

    /// Record a communication measured elsewhere.
    pub fn record_comm(&self, span: CommSpan) {
        if let Some(p) = self.state.locked().current.as_mut() {
            p.comms.push(span);
        }
        if span.kind == CommKind::Training {
            let hook = self.hook.locked().clone();
            if let Some(h) = hook {
                h(&span);
            }
        }
    }
}

/// Scoped layer timer; records on drop.
#[derive(Debug)]
pub struct LayerTimer<'a, C: Clock> {
    prof: &'a Profiler<C>,
    layer: u32,
    phase: Phase,
    start_ns: u64,
}

impl<C: Clock> Drop for LayerTimer<'_, C> {
    fn drop(&mut self) {
        if self.start_ns != u64::MAX {
            let end_ns = self.prof.now_ns();
            self.prof.record_layer(LayerSpan { layer: self.layer, phase: self.phase, start_ns: self.start_ns, end_ns });
        }
    }
}

/// Scoped communication timer; records on drop.
#[derive(Debug)]
pub struct CommTimer<'a, C: Clock> {
    prof: &'a Profiler<C>,
    link: u32,
    kind: CommKind,
    bytes: u64,
    start_ns: u64,
}

impl<C: Clock> Drop for CommTimer<'_, C> {
    fn drop(&mut self) {
        if self.start_ns != u64::MAX {
            let end_ns = self.prof.now_ns();
            self.prof.record_comm(CommSpan {
                link: self.link,
                kind: self.kind,
                start_ns: self.start_ns,
                end_ns,
                bytes: self.bytes,
            });
        }
    }
}
