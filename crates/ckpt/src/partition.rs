//! Splitting a snapshot into chunks that fit the predicted idle windows (Capricorn) or into
//! fixed-size chunks (Gemini). Pure functions, tested exactly.

use serde::{Deserialize, Serialize};

/// A piece of the snapshot and the window it is meant for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Chunk {
    /// Offset in the snapshot.
    pub offset: u64,
    /// Length.
    pub len: u64,
    /// Index of the window it fits in; `None`: leftover, sent after the last window.
    pub window: Option<usize>,
}

/// Capricorn: fill windows in order, each with a chunk of at most its capacity (bytes the
/// link moves in the window), skipping windows smaller than `min_chunk` unless what remains
/// is smaller; whatever does not fit becomes leftover chunks of at most `max_leftover` bytes.
/// Chunks cover `[0, total)` exactly, in order.
pub fn partition(total: u64, capacities: &[u64], min_chunk: u64, max_leftover: u64) -> Vec<Chunk> {
    let mut out = Vec::new();
    let mut offset = 0u64;
    for (i, &cap) in capacities.iter().enumerate() {
        let left = total - offset;
        if left == 0 {
            break;
        }
        let len = cap.min(left);
        if len == 0 || (len < min_chunk && len < left) {
            continue;
        }
        out.push(Chunk { offset, len, window: Some(i) });
        offset += len;
    }
    let step = max_leftover.max(1);
    while offset < total {
        let len = (total - offset).min(step);
        out.push(Chunk { offset, len, window: None });
        offset += len;
    }
    out
}

/// Gemini: fixed-size chunks, as many per span as fit whole (`span capacity / chunk`), in
/// order; the rest is leftover.
pub fn partition_fixed(total: u64, chunk: u64, capacities: &[u64]) -> Vec<Chunk> {
    let chunk = chunk.max(1);
    let mut out = Vec::new();
    let mut offset = 0u64;
    for (i, &cap) in capacities.iter().enumerate() {
        let mut room = cap;
        while offset < total && room >= chunk.min(total - offset) {
            let len = chunk.min(total - offset);
            out.push(Chunk { offset, len, window: Some(i) });
            offset += len;
            room -= len;
        }
    }
    while offset < total {
        let len = chunk.min(total - offset);
        out.push(Chunk { offset, len, window: None });
        offset += len;
    }
    out
}

/// Gemini's chunk size for a state of `total` bytes and spans of `capacities` bytes, when no
/// size is configured: of the candidate sizes (each span's capacity, and the whole state), the
/// one that places the most bytes into whole chunks inside the spans, the larger on ties (fewer
/// chunks); never below `min_chunk` unless the state is smaller. Without spans: the whole state
/// (one transfer at the end).
pub fn gemini_chunk(total: u64, capacities: &[u64], min_chunk: u64) -> u64 {
    let total = total.max(1);
    let placed = |c: u64| -> u64 { capacities.iter().map(|&cap| (cap / c) * c).sum::<u64>().min(total) };
    capacities
        .iter()
        .copied()
        .chain(std::iter::once(total))
        .map(|c| c.clamp(min_chunk.min(total).max(1), total))
        .max_by(|&a, &b| placed(a).cmp(&placed(b)).then(a.cmp(&b)))
        .unwrap_or(total)
}

/// Bytes that did not fit any window.
pub fn leftover(chunks: &[Chunk]) -> u64 {
    chunks.iter().filter(|c| c.window.is_none()).map(|c| c.len).sum()
}

/// One checkpoint chunk's transfer to one holder, as the sender logged it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkSpan {
    /// Iteration of the snapshot the chunk belongs to.
    pub snapshot: u64,
    /// Released as a leftover (after the iteration's windows, when it ended).
    pub leftover: bool,
    /// Link (profiler index) it went over.
    pub link: u32,
    /// Transfer start and end, profiler nanoseconds.
    pub start_ns: u64,
    /// End.
    pub end_ns: u64,
}

/// Partition accuracy of one iteration: of the chunk transfers the iteration released
/// (`released`: chunks × holders, whether they finished or not), the share that ran entirely
/// inside an idle window — finished before the iteration's end (`end_ns`), not a leftover, and
/// overlapping no training communication on its link (`training`: link, start, end). A
/// transfer still running at the end,
/// or a leftover, counts as outside. `spans` are the transfers of this iteration's snapshot.
/// None when nothing was released.
pub fn partition_accuracy(training: &[(u32, u64, u64)], spans: &[ChunkSpan], released: usize, end_ns: u64) -> Option<f64> {
    if released == 0 {
        return None;
    }
    let inside = spans
        .iter()
        .filter(|c| {
            !c.leftover && c.end_ns <= end_ns && !training.iter().any(|&(l, a, b)| l == c.link && a < c.end_ns && c.start_ns < b)
        })
        .count();
    Some(inside.min(released) as f64 / released as f64)
}

/// A replica chunk as its holder received it: when its last byte arrived (the holder's
/// profiler clock), its size, and the link (profiler index) it came over.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Arrival {
    /// Link (profiler index).
    pub link: u32,
    /// Last byte in, profiler nanoseconds.
    pub end_ns: u64,
    /// Payload bytes.
    pub len: u64,
}

/// Wire accuracy at a holder: of the chunks that arrived (`arrivals`), how many were on the
/// wire entirely inside an idle window of the holder's link — their wire time, the
/// `len / bytes_per_s` before the last byte arrived, overlaps none of the holder's own training
/// communications on that link (`training`: link, start, end) and lies within the iteration
/// `[start_ns, end_ns]`. A chunk that arrived outside the iteration (a leftover sent after it)
/// counts as outside. Returns (inside, arrived).
pub fn wire_accuracy(
    training: &[(u32, u64, u64)],
    arrivals: &[Arrival],
    bytes_per_s: impl Fn(u32) -> f64,
    start_ns: u64,
    end_ns: u64,
) -> (u64, u64) {
    let inside = arrivals
        .iter()
        .filter(|a| {
            let rate = bytes_per_s(a.link);
            let wire_ns = if rate > 0.0 { (a.len as f64 / rate * 1e9) as u64 } else { 0 };
            let from = a.end_ns.saturating_sub(wire_ns);
            a.end_ns >= start_ns.saturating_add(wire_ns)
                && a.end_ns <= end_ns
                && !training.iter().any(|&(l, x, y)| l == a.link && x < a.end_ns && from < y)
        })
        .count() as u64;
    (inside, arrivals.len() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_accuracy_judges_a_chunk_by_its_time_on_the_wire_at_the_holder() {
        // 1 byte/ns: a chunk of 5 bytes was on the wire for the 5 ns before it arrived.
        // The holder's training on link 0 at [10,20) and [30,40); the iteration is [0,50].
        let training = [(0, 10, 20), (0, 30, 40)];
        let a = |end_ns, len| Arrival { link: 0, end_ns, len };
        let rate = |_| 1e9;
        // arrived at 27 after 5 ns: [22,27] is idle
        assert_eq!(wire_accuracy(&training, &[a(27, 5)], rate, 0, 50), (1, 1));
        // arrived at 24 after 5 ns: [19,24] touches training that ended at 20
        assert_eq!(wire_accuracy(&training, &[a(24, 5)], rate, 0, 50), (0, 1));
        // the send call returned early, but the bytes were on the wire during training: a
        // chunk of 15 bytes arriving at 29 left at 14
        assert_eq!(wire_accuracy(&training, &[a(29, 15)], rate, 0, 50), (0, 1));
        // after the iteration (a leftover), or before it: outside
        assert_eq!(wire_accuracy(&training, &[a(55, 2), a(2, 5)], rate, 0, 50), (0, 2));
        // another link's chunk does not collide with link 0's training
        let other = Arrival { link: 1, ..a(24, 5) };
        assert_eq!(wire_accuracy(&training, &[other], rate, 0, 50), (1, 1));
    }

    fn span(start_ns: u64, end_ns: u64, leftover: bool) -> ChunkSpan {
        ChunkSpan { snapshot: 7, leftover, link: 0, start_ns, end_ns }
    }

    #[test]
    fn accuracy_counts_only_transfers_inside_windows_of_the_releasing_iteration() {
        // training on the link at [0,10) [20,30) [40,50); the iteration ends at 60
        let training = [(0, 0, 10), (0, 20, 30), (0, 40, 50)];
        let spans = [
            span(10, 20, false), // fills the window [10,20): inside
            span(31, 39, false), // inside [30,40)
            span(15, 25, false), // runs into training at 20: outside
            span(51, 58, true),  // a leftover, though the link is idle: outside
            span(52, 70, false), // ends after the iteration: outside
        ];
        // 8 transfers released, 3 never finished: 2 of 8 inside
        assert_eq!(partition_accuracy(&training, &spans, 8, 60), Some(0.25));
        // with nothing released there is no accuracy; released never below what is logged
        assert_eq!(partition_accuracy(&training, &spans, 0, 60), None);
        assert_eq!(partition_accuracy(&[], &spans[..2], 1, 60), Some(1.0));
        // a transfer on another link does not collide with this link's training
        let other = [ChunkSpan { link: 1, ..span(15, 25, false) }];
        assert_eq!(partition_accuracy(&training, &other, 1, 60), Some(1.0));
    }

    #[test]
    fn gemini_s_chunk_fills_the_spans_without_overfilling_any() {
        // 14 MB of state, spans of 3, 5 and 4 MB: 3 MB chunks place one per span, 9 MB; 4 MB
        // chunks 0 + 4 + 4 = 8; 5 MB chunks 5; the whole state none: 3 MB wins
        let mb = 1 << 20;
        let caps = [3 * mb, 5 * mb, 4 * mb];
        assert_eq!(gemini_chunk(14 * mb, &caps, 256 << 10), 3 * mb);
        let chunks = partition_fixed(14 * mb, gemini_chunk(14 * mb, &caps, 256 << 10), &caps);
        for (i, &cap) in caps.iter().enumerate() {
            let in_span: u64 = chunks.iter().filter(|c| c.window == Some(i)).map(|c| c.len).sum();
            assert!(in_span <= cap, "span {i} overfilled: {in_span} > {cap}");
        }
        assert_eq!(leftover(&chunks), 5 * mb);
        // everything fits one span: one chunk; no spans: the whole state at the end; tiny
        // spans do not make chunks smaller than the floor
        assert_eq!(gemini_chunk(mb, &[8 * mb], 1), mb);
        assert_eq!(gemini_chunk(14 * mb, &[], 1), 14 * mb);
        assert_eq!(gemini_chunk(14 * mb, &[10, 20], 256 << 10), 14 * mb);
    }
}
