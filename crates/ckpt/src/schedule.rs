//! When each chunk of a snapshot may go: Capricorn releases a chunk when the training
//! communication that opens its window ends; Gemini releases fixed-size chunks at time offsets
//! from the iteration start; leftovers go after the iteration's training traffic. Pure: the
//! engine feeds it events and sends what it returns.

use std::collections::VecDeque;

use ironweave_profile::Window;
use serde::{Deserialize, Serialize};

use crate::partition::{partition, partition_fixed, Chunk};

/// What releases a chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Trigger {
    /// The iteration starts.
    Start,
    /// The `k`-th training communication of the iteration (on the checkpoint link) ends.
    AfterComm(u32),
    /// `ns` after the iteration start.
    At(u64),
    /// After the iteration's training traffic (the leftover).
    End,
}

/// A chunk and its trigger.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Scheduled {
    /// The bytes.
    pub chunk: Chunk,
    /// When.
    pub trigger: Trigger,
    /// The window's predicted length, ns (0 for leftovers).
    pub window_ns: u64,
    /// Link slot the chunk goes over (0: the training link; see [`capricorn_links`]).
    pub link: u32,
}

/// Capricorn: chunks sized to `fill` of each predicted window at `bytes_per_s`.
pub fn capricorn(
    total: u64,
    windows: &[Window],
    bytes_per_s: f64,
    fill: f64,
    min_chunk: u64,
    max_leftover: u64,
) -> Vec<Scheduled> {
    capricorn_links(total, &[(windows, bytes_per_s)], fill, min_chunk, max_leftover)
}

/// Capricorn over several links (beyond the paper): every link's predicted windows, each at
/// its link's rate, filled in the order the windows open (on ties, the lower slot), so each
/// chunk goes over the link whose window opens first. `links[k]` is slot `k`'s windows and
/// rate; slot 0 is the training link and carries the leftovers (after the iteration's
/// training traffic). With one link this is the paper's schedule.
pub fn capricorn_links(total: u64, links: &[(&[Window], f64)], fill: f64, min_chunk: u64, max_leftover: u64) -> Vec<Scheduled> {
    let mut all: Vec<(usize, Window)> = links.iter().enumerate().flat_map(|(k, (w, _))| w.iter().map(move |w| (k, *w))).collect();
    all.sort_by_key(|(k, w)| (w.offset_ns, *k));
    let caps: Vec<u64> = all.iter().map(|(k, w)| (w.len_ns as f64 * 1e-9 * links[*k].1 * fill).floor().max(0.0) as u64).collect();
    partition(total, &caps, min_chunk, max_leftover)
        .into_iter()
        .map(|c| match c.window {
            Some(i) => {
                let (k, w) = all[i];
                Scheduled {
                    chunk: c,
                    trigger: w.after_comm.map(Trigger::AfterComm).unwrap_or(Trigger::Start),
                    window_ns: w.len_ns,
                    link: k as u32,
                }
            }
            None => Scheduled { chunk: c, trigger: Trigger::End, window_ns: 0, link: 0 },
        })
        .collect()
}

/// Gemini: fixed chunks placed into the spans profiled at the start, released by time; a span
/// never takes more whole chunks than `fill` of it can carry (1: the whole span). `chunk` 0:
/// sized from the spans and the state ([`crate::partition::gemini_chunk`]).
pub fn gemini(total: u64, spans: &[Window], bytes_per_s: f64, chunk: u64, fill: f64) -> Vec<Scheduled> {
    let caps: Vec<u64> = spans.iter().map(|w| (w.len_ns as f64 * 1e-9 * bytes_per_s * fill).floor() as u64).collect();
    let chunk = if chunk == 0 { crate::partition::gemini_chunk(total, &caps, 256 << 10) } else { chunk };
    let mut placed_in = vec![0u64; spans.len()];
    partition_fixed(total, chunk, &caps)
        .into_iter()
        .map(|c| match c.window {
            Some(i) => {
                let at = spans[i].offset_ns + (placed_in[i] as f64 / bytes_per_s * 1e9) as u64;
                placed_in[i] += c.len;
                Scheduled { chunk: c, trigger: Trigger::At(at), window_ns: spans[i].len_ns, link: 0 }
            }
            None => Scheduled { chunk: c, trigger: Trigger::End, window_ns: 0, link: 0 },
        })
        .collect()
}

/// `plan` for the bytes from `offset` on (a plan made for one part of a snapshot).
pub fn shifted(mut plan: Vec<Scheduled>, offset: u64) -> Vec<Scheduled> {
    for s in &mut plan {
        s.chunk.offset += offset;
    }
    plan
}

/// Hands out chunks in order as their triggers fire (a chunk never overtakes an earlier one).
#[derive(Debug, Clone, Default)]
pub struct Releaser {
    queue: VecDeque<Scheduled>,
    comms_done: Option<u32>,
    started: bool,
    elapsed_ns: u64,
    ended: bool,
}

impl Releaser {
    /// A new iteration's plan.
    pub fn new(plan: Vec<Scheduled>) -> Self {
        Releaser { queue: plan.into(), ..Default::default() }
    }

    fn fired(&self, t: Trigger) -> bool {
        match t {
            Trigger::Start => self.started,
            Trigger::AfterComm(k) => self.comms_done.is_some_and(|d| d >= k),
            Trigger::At(ns) => self.started && self.elapsed_ns >= ns,
            Trigger::End => self.ended,
        }
    }

    fn drain(&mut self) -> Vec<Scheduled> {
        let mut out = Vec::new();
        while self.queue.front().is_some_and(|s| self.fired(s.trigger)) {
            out.push(self.queue.pop_front().expect("non-empty"));
        }
        out
    }

    /// The iteration started.
    pub fn start(&mut self) -> Vec<Scheduled> {
        self.started = true;
        self.drain()
    }

    /// Training communication number `k` (0-based) ended.
    pub fn comm_done(&mut self, k: u32) -> Vec<Scheduled> {
        self.comms_done = Some(self.comms_done.map_or(k, |d| d.max(k)));
        self.drain()
    }

    /// Time passed: `ns` since the iteration start.
    pub fn tick(&mut self, ns: u64) -> Vec<Scheduled> {
        self.elapsed_ns = self.elapsed_ns.max(ns);
        self.drain()
    }

    /// The iteration's training traffic is over: everything left goes.
    pub fn end(&mut self) -> Vec<Scheduled> {
        self.started = true;
        self.ended = true;
        self.comms_done = Some(u32::MAX);
        self.elapsed_ns = u64::MAX;
        self.drain()
    }

    /// The next time-triggered release, if the head of the queue waits for a time.
    pub fn next_time(&self) -> Option<u64> {
        match self.queue.front()?.trigger {
            Trigger::At(ns) => Some(ns),
            _ => None,
        }
    }

    /// Chunks not yet released.
    pub fn pending(&self) -> usize {
        self.queue.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ironweave_profile::Anchor;

    fn w(offset_ms: u64, len_ms: u64, after: Option<u32>) -> Window {
        Window {
            link: 0,
            offset_ns: offset_ms * 1_000_000,
            len_ns: len_ms * 1_000_000,
            anchor: Anchor { at: None, ordinal: 0 },
            after_comm: after,
        }
    }

    #[test]
    fn capricorn_chunks_follow_the_communications() {
        // 1 GB/s: a 10 ms window holds 10 MB; fill 0.9 → 9 MB
        let plan = capricorn(30_000_000, &[w(0, 10, None), w(12, 10, Some(0)), w(30, 5, Some(1))], 1e9, 0.9, 1, 4_000_000);
        let lens: Vec<u64> = plan.iter().map(|s| s.chunk.len).collect();
        assert_eq!(lens, vec![9_000_000, 9_000_000, 4_500_000, 4_000_000, 3_500_000]);
        let mut r = Releaser::new(plan);
        assert_eq!(r.start().len(), 1);
        assert_eq!(r.comm_done(0).len(), 1);
        assert!(r.tick(u64::MAX / 2).is_empty(), "time does not release Capricorn chunks");
        assert_eq!(r.comm_done(1).len(), 1);
        assert_eq!(r.end().len(), 2);
        assert_eq!(r.pending(), 0);
    }

    #[test]
    fn several_links_take_chunks_in_the_order_their_windows_open() {
        // link 0 (training): windows at 0 ms (after nothing) and 12 ms (after comm 0), 10 ms
        // each at 1 GB/s; link 1 (no training traffic): one 40 ms window at 0.25 GB/s
        let l0 = [w(0, 10, None), w(12, 10, Some(0))];
        let mut l1 = [w(0, 40, None)];
        l1[0].link = 1;
        let plan = capricorn_links(30_000_000, &[(&l0, 1e9), (&l1, 0.25e9)], 0.9, 1, 4_000_000);
        let got: Vec<(u64, u32, Trigger)> = plan.iter().map(|s| (s.chunk.len, s.link, s.trigger)).collect();
        assert_eq!(
            got,
            vec![
                (9_000_000, 0, Trigger::Start),
                (9_000_000, 1, Trigger::Start),
                (9_000_000, 0, Trigger::AfterComm(0)),
                (3_000_000, 0, Trigger::End),
            ]
        );
        // one link: the paper's schedule, all on slot 0
        assert!(capricorn(30_000_000, &l0, 1e9, 0.9, 1, 4_000_000).iter().all(|s| s.link == 0));
        let total: u64 = plan.iter().map(|s| s.chunk.len).sum();
        assert_eq!(total, 30_000_000);
    }

    #[test]
    fn gemini_chunks_go_by_the_clock_in_order() {
        let plan = gemini(5_000_000, &[w(0, 3, None), w(10, 2, Some(0))], 1e9, 1_000_000, 1.0);
        let trig: Vec<Trigger> = plan.iter().map(|s| s.trigger).collect();
        assert_eq!(
            trig,
            vec![
                Trigger::At(0),
                Trigger::At(1_000_000),
                Trigger::At(2_000_000),
                Trigger::At(10_000_000),
                Trigger::At(11_000_000)
            ]
        );
        let mut r = Releaser::new(plan);
        assert_eq!(r.start().len(), 1);
        assert_eq!(r.next_time(), Some(1_000_000));
        assert_eq!(r.tick(2_500_000).len(), 2);
        assert!(r.comm_done(5).is_empty(), "communications do not release Gemini chunks");
        assert_eq!(r.tick(10_000_000).len(), 1);
        assert_eq!(r.end().len(), 1);
    }

    #[test]
    fn gemini_s_fill_leaves_part_of_each_span_free() {
        // at 0.7, the 3 ms span carries 2.1 MB: two whole 1 MB chunks, the 2 ms span one; the
        // other two chunks wait for the end
        let plan = gemini(5_000_000, &[w(0, 3, None), w(10, 2, Some(0))], 1e9, 1_000_000, 0.7);
        let trig: Vec<Trigger> = plan.iter().map(|s| s.trigger).collect();
        assert_eq!(trig, vec![Trigger::At(0), Trigger::At(1_000_000), Trigger::At(10_000_000), Trigger::End, Trigger::End]);
    }
}
