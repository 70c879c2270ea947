//! Idle windows of a link within an iteration, anchored to layer boundaries, and their
//! prediction for the next iteration.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::profiler::{CommKind, IterationProfile, Phase};

/// Where a window starts, relative to the layer phase running at that moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Anchor {
    /// The layer phase in progress (or the last one finished) when the window opens; `None`
    /// before the first layer phase of the iteration.
    pub at: Option<(Phase, u32)>,
    /// The window's ordinal among windows with the same `at`.
    pub ordinal: u32,
}

/// A span of a link free of training traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Window {
    /// Link index.
    pub link: u32,
    /// Offset of the window's start from the iteration start, ns.
    pub offset_ns: u64,
    /// Length, ns.
    pub len_ns: u64,
    /// Position relative to the layers.
    pub anchor: Anchor,
    /// Index (among the iteration's training communications on this link, in order of their
    /// ends) of the communication whose end opens the window; `None`: the iteration start.
    /// The checkpoint engine releases a window's chunk when that communication ends.
    pub after_comm: Option<u32>,
}

/// The idle windows of `link` in `p`: gaps of at least `min_len_ns` between training
/// communications (and before the first / after the last), in time order.
pub fn idle_windows(p: &IterationProfile, link: u32, min_len_ns: u64) -> Vec<Window> {
    let mut busy: Vec<(u64, u64)> = p
        .comms
        .iter()
        .filter(|c| c.link == link && c.kind == CommKind::Training)
        .map(|c| (c.start_ns.max(p.start_ns), c.end_ns.min(p.end_ns)))
        .filter(|(a, b)| b > a)
        .collect();
    busy.sort_unstable();
    let mut gaps = Vec::new();
    let mut cursor = p.start_ns;
    for (a, b) in busy {
        if a > cursor {
            gaps.push((cursor, a));
        }
        cursor = cursor.max(b);
    }
    if p.end_ns > cursor {
        gaps.push((cursor, p.end_ns));
    }
    let mut ends: Vec<u64> =
        p.comms.iter().filter(|c| c.link == link && c.kind == CommKind::Training).map(|c| c.end_ns).collect();
    ends.sort_unstable();
    let mut layers: Vec<_> = p.layers.clone();
    layers.sort_by_key(|l| (l.start_ns, l.end_ns));
    let mut ordinals: BTreeMap<Option<(Phase, u32)>, u32> = BTreeMap::new();
    gaps.into_iter()
        .filter(|(a, b)| b - a >= min_len_ns.max(1))
        .map(|(a, b)| {
            // the phase running at `a`, or else the last one that started before it
            let at = layers
                .iter()
                .filter(|l| l.start_ns <= a)
                .max_by_key(|l| (l.start_ns <= a && a < l.end_ns, l.start_ns))
                .map(|l| (l.phase, l.layer));
            let ord = ordinals.entry(at).or_insert(0);
            let anchor = Anchor { at, ordinal: *ord };
            *ord += 1;
            let ended = ends.partition_point(|&e| e <= a) as u32;
            Window { link, offset_ns: a - p.start_ns, len_ns: b - a, anchor, after_comm: ended.checked_sub(1) }
        })
        .collect()
}

/// Predicts the next iteration's windows from the profiled ones: windows are matched by link
/// and anchor across profiles; the prediction takes the smaller of the last observed length
/// and an exponential moving average (a window that shrank is trusted at once, one that grew
/// only gradually), so chunks sized to it rarely overrun.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WindowPredictor {
    alpha: f64,
    state: BTreeMap<(u32, Anchor), Track>,
    observed: u64,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
struct Track {
    ewma_ns: f64,
    last_ns: u64,
    offset_ns: u64,
    after_comm: Option<u32>,
    seen_at: u64,
}

impl WindowPredictor {
    /// `alpha`: weight of the newest observation in the average, in (0, 1].
    pub fn new(alpha: f64) -> Self {
        WindowPredictor { alpha: alpha.clamp(1e-6, 1.0), state: BTreeMap::new(), observed: 0 }
    }

    /// Feed the windows of one profiled iteration (all links).
    pub fn observe(&mut self, windows: &[Window]) {
        self.observed += 1;
        for w in windows {
            let key = (w.link, w.anchor);
            let t = self.state.entry(key).or_insert(Track {
                ewma_ns: w.len_ns as f64,
                last_ns: w.len_ns,
                offset_ns: w.offset_ns,
                after_comm: w.after_comm,
                seen_at: 0,
            });
            t.ewma_ns = self.alpha * w.len_ns as f64 + (1.0 - self.alpha) * t.ewma_ns;
            t.last_ns = w.len_ns;
            t.offset_ns = w.offset_ns;
            t.after_comm = w.after_comm;
            t.seen_at = self.observed;
        }
        // windows absent from the newest profile are gone
        let now = self.observed;
        self.state.retain(|_, t| t.seen_at == now);
    }

    /// Profiles observed so far.
    pub fn observed(&self) -> u64 {
        self.observed
    }

    /// Predicted windows of `link`, in time order.
    pub fn predict(&self, link: u32) -> Vec<Window> {
        let mut v: Vec<Window> = self
            .state
            .iter()
            .filter(|((l, _), _)| *l == link)
            .map(|((l, a), t)| Window {
                link: *l,
                offset_ns: t.offset_ns,
                len_ns: (t.ewma_ns.round() as u64).min(t.last_ns),
                anchor: *a,
                after_comm: t.after_comm,
            })
            .collect();
        v.sort_by_key(|w| w.offset_ns);
        v
    }
}
