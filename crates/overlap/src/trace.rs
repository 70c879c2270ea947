//! What the lanes did: spans of compute and communication, the overlap between them, and
//! their Perfetto trace / SVG drawing.

use std::time::{Instant, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

/// Where a span ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Lane {
    /// The rank's compute (the caller's thread).
    Compute,
    /// Collectives of group `0` (its collective thread).
    Comm(usize),
}

/// One task's time on a lane.
#[derive(Debug, Clone, PartialEq)]
pub struct Span {
    /// Lane.
    pub lane: Lane,
    /// Label (stage name, sub-batch).
    pub name: String,
    /// Start.
    pub start: Instant,
    /// End.
    pub end: Instant,
}

/// A span in wall-clock seconds (comparable between the processes of one machine, and what
/// travels to rank 0 for the trace).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SpanRec {
    /// Lane.
    pub lane: Lane,
    /// Label.
    pub name: String,
    /// Start, seconds since the Unix epoch.
    pub start_s: f64,
    /// End, seconds since the Unix epoch.
    pub end_s: f64,
}

/// Converts spans to wall-clock records (one clock reading pairs `Instant` and `SystemTime`).
pub fn to_records(spans: &[Span]) -> Vec<SpanRec> {
    let (i0, w0) = (Instant::now(), SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64()));
    let at = |t: Instant| {
        if t <= i0 {
            w0 - (i0 - t).as_secs_f64()
        } else {
            w0 + (t - i0).as_secs_f64()
        }
    };
    spans.iter().map(|s| SpanRec { lane: s.lane, name: s.name.clone(), start_s: at(s.start), end_s: at(s.end) }).collect()
}

/// Seconds of `a` covered by `b` (each list's spans do not overlap each other).
pub fn covered_s(a: &[(Instant, Instant)], b: &[(Instant, Instant)]) -> f64 {
    let mut s = 0.0;
    for &(a0, a1) in a {
        for &(b0, b1) in b {
            let (lo, hi) = (a0.max(b0), a1.min(b1));
            if hi > lo {
                s += (hi - lo).as_secs_f64();
            }
        }
    }
    s
}

fn lane_name(l: Lane, groups: &[&str]) -> String {
    match l {
        Lane::Compute => "compute".into(),
        Lane::Comm(g) => format!("comm {}", groups.get(g).copied().unwrap_or("?")),
    }
}

fn lane_row(l: Lane) -> usize {
    match l {
        Lane::Compute => 0,
        Lane::Comm(g) => 1 + g,
    }
}

/// Chrome/Perfetto trace events: one process per rank, one thread per lane.
pub fn chrome_trace(ranks: &[(usize, Vec<SpanRec>)], groups: &[&str]) -> serde_json::Value {
    let t0 = ranks.iter().flat_map(|(_, v)| v.iter().map(|s| s.start_s)).fold(f64::INFINITY, f64::min);
    let mut ev = Vec::new();
    for (rank, spans) in ranks {
        ev.push(serde_json::json!({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": format!("rank {rank}")}}));
        for row in 0..=groups.len() {
            let l = if row == 0 { Lane::Compute } else { Lane::Comm(row - 1) };
            ev.push(serde_json::json!({"ph": "M", "name": "thread_name", "pid": rank, "tid": row, "args": {"name": lane_name(l, groups)}}));
        }
        for s in spans {
            ev.push(serde_json::json!({"ph": "X", "name": s.name, "pid": rank, "tid": lane_row(s.lane),
                "ts": (s.start_s - t0) * 1e6, "dur": (s.end_s - s.start_s) * 1e6}));
        }
    }
    serde_json::json!({ "traceEvents": ev, "displayTimeUnit": "ms" })
}

/// An SVG of every rank's lanes over one iteration: compute in blue, each group's
/// collectives in its own colour, so the overlap shows as stacked bars.
pub fn svg_lanes(ranks: &[(usize, Vec<SpanRec>)], groups: &[&str], title: &str) -> String {
    let t0 = ranks.iter().flat_map(|(_, v)| v.iter().map(|s| s.start_s)).fold(f64::INFINITY, f64::min);
    let t1 = ranks.iter().flat_map(|(_, v)| v.iter().map(|s| s.end_s)).fold(f64::NEG_INFINITY, f64::max);
    let span = (t1 - t0).max(1e-9);
    // lanes no rank used (groups of one rank, whose collectives are the identity) are left out
    let lane_of = |row: usize| if row == 0 { Lane::Compute } else { Lane::Comm(row - 1) };
    let rows: Vec<usize> = (0..=groups.len())
        .filter(|&row| row == 0 || ranks.iter().any(|(_, v)| v.iter().any(|sp| sp.lane == lane_of(row))))
        .collect();
    let lanes = rows.len();
    let (left, width, row_h) = (190.0, 900.0, 22.0);
    let height = 50.0 + (ranks.len() * lanes) as f64 * row_h + ranks.len() as f64 * 8.0 + 30.0;
    let colours = ["#4e79a7", "#e15759", "#59a14f", "#f28e2b", "#b07aa1", "#76b7b2", "#edc948", "#9c755f"];
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{height}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n<text x=\"10\" y=\"20\" font-size=\"14\">{}</text>\n",
        left + width + 20.0,
        xml(title)
    );
    let mut y = 40.0;
    for (rank, spans) in ranks {
        for (i, &row) in rows.iter().enumerate() {
            let l = lane_of(row);
            s.push_str(&format!("<text x=\"10\" y=\"{:.1}\">rank {rank} {}</text>\n", y + 15.0, xml(&lane_name(l, groups))));
            for sp in spans.iter().filter(|sp| sp.lane == l) {
                let x = left + (sp.start_s - t0) / span * width;
                let w = ((sp.end_s - sp.start_s) / span * width).max(0.5);
                s.push_str(&format!(
                    "<rect x=\"{x:.2}\" y=\"{:.1}\" width=\"{w:.2}\" height=\"{:.1}\" fill=\"{}\" stroke=\"white\" stroke-width=\"0.3\"><title>{} {:.2} ms</title></rect>\n",
                    y + 2.0,
                    row_h - 4.0,
                    colours[i % colours.len()],
                    xml(&sp.name),
                    (sp.end_s - sp.start_s) * 1e3
                ));
            }
            y += row_h;
        }
        y += 8.0;
    }
    s.push_str(&format!("<text x=\"{left}\" y=\"{:.1}\">0 ms</text>\n", y + 15.0));
    s.push_str(&format!(
        "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\">{:.1} ms</text>\n</svg>\n",
        left + width,
        y + 15.0,
        span * 1e3
    ));
    s
}

fn xml(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn covered_counts_only_the_overlap() {
        let t = Instant::now();
        let ms = |x: u64| t + Duration::from_millis(x);
        let comm = [(ms(0), ms(10)), (ms(20), ms(30))];
        let comp = [(ms(5), ms(25))];
        assert!((covered_s(&comm, &comp) - 0.010).abs() < 1e-9);
    }

    #[test]
    fn the_trace_and_the_drawing_carry_every_span() {
        let t = Instant::now();
        let spans = vec![
            Span { lane: Lane::Compute, name: "L0.attn/0".into(), start: t, end: t + Duration::from_millis(3) },
            Span {
                lane: Lane::Comm(0),
                name: "L0.attn/0 <&>".into(),
                start: t + Duration::from_millis(3),
                end: t + Duration::from_millis(5),
            },
        ];
        let recs = to_records(&spans);
        assert!((recs[1].end_s - recs[0].start_s - 0.005).abs() < 1e-6);
        let ranks = vec![(0, recs.clone()), (1, recs)];
        let tr = chrome_trace(&ranks, &["tp"]);
        let x = tr["traceEvents"].as_array().unwrap().iter().filter(|e| e["ph"] == "X").count();
        assert_eq!(x, 4);
        let svg = svg_lanes(&ranks, &["tp"], "t");
        assert_eq!(svg.matches("<rect x=").count(), 4);
        assert!(svg.contains("rank 1 comm tp") && svg.contains("&lt;&amp;&gt;"));
    }
}
