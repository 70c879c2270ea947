//! Chrome-trace (Perfetto) JSON and SVG timelines of profiled iterations.

use std::fmt::Write as _;

use serde_json::{json, Value};

use crate::profiler::{CommKind, IterationProfile, Phase};
use crate::windows::Window;

fn phase_name(p: Phase) -> &'static str {
    match p {
        Phase::Forward => "fwd",
        Phase::Backward => "bwd",
        Phase::Optimizer => "optimizer",
    }
}

/// Chrome trace events of `profiles` for `rank` (process id), with `windows` drawn on their
/// own lane. Load the JSON in Perfetto (ui.perfetto.dev) or chrome://tracing.
pub fn chrome_trace(profiles: &[IterationProfile], windows: &[(u64, Window)], rank: u32) -> Value {
    let us = |ns: u64| ns as f64 / 1e3;
    let mut ev = vec![
        json!({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": format!("rank {rank}")}}),
        json!({"ph": "M", "name": "thread_name", "pid": rank, "tid": 0, "args": {"name": "layers"}}),
    ];
    let mut links = std::collections::BTreeSet::new();
    for p in profiles {
        ev.push(json!({"ph": "X", "name": format!("iteration {}", p.iter), "cat": "iteration", "pid": rank, "tid": 0,
            "ts": us(p.start_ns), "dur": us(p.duration_ns())}));
        for l in &p.layers {
            ev.push(
                json!({"ph": "X", "name": format!("L{} {}", l.layer, phase_name(l.phase)), "cat": "layer", "pid": rank, "tid": 0,
                "ts": us(l.start_ns), "dur": us(l.end_ns.saturating_sub(l.start_ns))}),
            );
        }
        for c in &p.comms {
            links.insert(c.link);
            let (tid, cat) = match c.kind {
                CommKind::Training => (100 + c.link * 3, "training"),
                CommKind::Checkpoint => (101 + c.link * 3, "checkpoint"),
            };
            ev.push(json!({"ph": "X", "name": format!("{cat} {} B", c.bytes), "cat": cat, "pid": rank, "tid": tid,
                "ts": us(c.start_ns), "dur": us(c.end_ns.saturating_sub(c.start_ns)), "args": {"bytes": c.bytes}}));
        }
    }
    for (start, w) in windows {
        links.insert(w.link);
        ev.push(json!({"ph": "X", "name": "idle window", "cat": "window", "pid": rank, "tid": 102 + w.link * 3,
            "ts": us(start + w.offset_ns), "dur": us(w.len_ns)}));
    }
    for l in links {
        for (k, what) in ["training", "checkpoint", "idle windows"].iter().enumerate() {
            ev.push(json!({"ph": "M", "name": "thread_name", "pid": rank, "tid": 100 + l * 3 + k as u32,
                "args": {"name": format!("link {l} {what}")}}));
        }
    }
    json!({"traceEvents": ev, "displayTimeUnit": "ms"})
}

/// An SVG timeline of one iteration: layers, each link's training traffic, checkpoint chunks
/// and idle windows.
pub fn svg_timeline(p: &IterationProfile, windows: &[Window], title: &str) -> String {
    let span = p.duration_ns().max(1) as f64;
    let (left, width, lane) = (130.0, 1100.0, 26.0);
    let mut links: Vec<u32> = p.comms.iter().map(|c| c.link).chain(windows.iter().map(|w| w.link)).collect();
    links.sort_unstable();
    links.dedup();
    let lanes = 1 + links.len() * 3;
    let h = 50.0 + lanes as f64 * lane + 40.0;
    let x = |ns: u64| left + (ns.saturating_sub(p.start_ns)) as f64 / span * width;
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{}" height="{h}" font-family="sans-serif" font-size="11">"#,
        left + width + 20.0
    );
    let _ = writeln!(s, r#"<text x="10" y="20" font-size="14">{}</text>"#, title.replace('&', "&amp;").replace('<', "&lt;"));
    let lane_y = |k: usize| 35.0 + k as f64 * lane;
    let label = |s: &mut String, k: usize, name: &str| {
        let _ = writeln!(
            s,
            r##"<text x="8" y="{}">{name}</text><rect x="{left}" y="{}" width="{width}" height="{}" fill="#f4f4f4"/>"##,
            lane_y(k) + 16.0,
            lane_y(k),
            lane - 4.0
        );
    };
    label(&mut s, 0, "layers");
    for (i, l) in links.iter().enumerate() {
        label(&mut s, 1 + 3 * i, &format!("link {l} training"));
        label(&mut s, 2 + 3 * i, &format!("link {l} checkpoint"));
        label(&mut s, 3 + 3 * i, &format!("link {l} idle"));
    }
    let rect = |s: &mut String, k: usize, a: u64, b: u64, fill: &str, tip: &str| {
        let _ = writeln!(
            s,
            r#"<rect x="{:.2}" y="{:.1}" width="{:.2}" height="{:.1}" fill="{fill}" stroke="white" stroke-width="0.3"><title>{tip}</title></rect>"#,
            x(a),
            lane_y(k) + 2.0,
            (x(b) - x(a)).max(0.3),
            lane - 8.0
        );
    };
    for l in &p.layers {
        let fill = match l.phase {
            Phase::Forward => "#4c78a8",
            Phase::Backward => "#72b7b2",
            Phase::Optimizer => "#9d755d",
        };
        rect(&mut s, 0, l.start_ns, l.end_ns, fill, &format!("L{} {}", l.layer, phase_name(l.phase)));
    }
    for c in &p.comms {
        let i = links.iter().position(|&l| l == c.link).unwrap_or(0);
        let (k, fill) = match c.kind {
            CommKind::Training => (1 + 3 * i, "#f58518"),
            CommKind::Checkpoint => (2 + 3 * i, "#54a24b"),
        };
        rect(&mut s, k, c.start_ns, c.end_ns, fill, &format!("{} bytes", c.bytes));
    }
    for w in windows {
        let i = links.iter().position(|&l| l == w.link).unwrap_or(0);
        let a = p.start_ns + w.offset_ns;
        rect(&mut s, 3 + 3 * i, a, a + w.len_ns, "#bab0ac", &format!("window {:.3} ms", w.len_ns as f64 / 1e6));
    }
    let ya = 35.0 + lanes as f64 * lane + 14.0;
    for k in 0..=10 {
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{ya}" text-anchor="middle">{:.1} ms</text>"#,
            left + k as f64 / 10.0 * width,
            span / 1e6 * k as f64 / 10.0
        );
    }
    s.push_str("</svg>\n");
    s
}
