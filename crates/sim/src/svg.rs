//! Timelines as SVG: one lane per resource, one box per op, coloured by tag.

use std::fmt::Write as _;

use crate::engine::{Dag, Trace, Work};

fn colour(tag: &str) -> &'static str {
    match tag {
        "compute" => "#4c78a8",
        "a2a" | "tp-comm" | "gather" => "#f58518",
        "grad" | "dp-comm" => "#e45756",
        "reshard" => "#b279a2",
        "ckpt" => "#54a24b",
        _ => "#9d9d9d",
    }
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

/// Draw ops that overlap `[t0, t1]` (the whole run when `None`).
pub fn timeline(dag: &Dag, trace: &Trace, title: &str, range: Option<(f64, f64)>) -> String {
    let (t0, t1) = range.unwrap_or((0.0, trace.makespan.max(1e-9)));
    let span = (t1 - t0).max(1e-12);
    let (left, width, lane_h) = (150.0, 1100.0, 28.0);
    let lanes = dag.resources.len();
    let height = 60.0 + lanes as f64 * lane_h + 40.0;
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{}" height="{height}" font-family="sans-serif" font-size="11">"#,
        left + width + 20.0
    );
    let _ = writeln!(s, r#"<text x="10" y="20" font-size="14">{}</text>"#, esc(title));
    for (r, res) in dag.resources.iter().enumerate() {
        let y = 40.0 + r as f64 * lane_h;
        let _ = writeln!(s, r#"<text x="10" y="{}">{}</text>"#, y + 17.0, esc(&res.name));
        let _ = writeln!(s, r##"<rect x="{left}" y="{y}" width="{width}" height="{}" fill="#f4f4f4"/>"##, lane_h - 4.0);
    }
    for (i, op) in dag.ops.iter().enumerate() {
        let r = match op.work {
            Work::Compute { res, .. } | Work::Transfer { res, .. } => res,
            _ => continue,
        };
        let rec = trace.ops[i];
        if rec.end <= t0 || rec.start >= t1 || rec.end <= rec.start {
            continue;
        }
        let x0 = left + (rec.start.max(t0) - t0) / span * width;
        let x1 = left + (rec.end.min(t1) - t0) / span * width;
        let y = 40.0 + r as f64 * lane_h;
        let _ = writeln!(
            s,
            r#"<rect x="{x0:.2}" y="{:.1}" width="{:.2}" height="{:.1}" fill="{}" stroke="white" stroke-width="0.3"><title>{} ({:.3}-{:.3} ms)</title></rect>"#,
            y + 2.0,
            (x1 - x0).max(0.3),
            lane_h - 8.0,
            colour(&op.tag),
            esc(&op.name),
            rec.start * 1e3,
            rec.end * 1e3
        );
    }
    let ya = 40.0 + lanes as f64 * lane_h + 15.0;
    for k in 0..=10 {
        let x = left + k as f64 / 10.0 * width;
        let _ =
            writeln!(s, r#"<text x="{x:.1}" y="{ya}" text-anchor="middle">{:.1} ms</text>"#, (t0 + span * k as f64 / 10.0) * 1e3);
    }
    let legend = [
        ("compute", "compute"),
        ("training comm", "a2a"),
        ("gradients", "grad"),
        ("resharding", "reshard"),
        ("checkpoint", "ckpt"),
    ];
    for (k, (label, tag)) in legend.iter().enumerate() {
        let x = left + k as f64 * 160.0;
        let _ = writeln!(s, r#"<rect x="{x}" y="{}" width="12" height="12" fill="{}"/>"#, ya + 10.0, colour(tag));
        let _ = writeln!(s, r#"<text x="{}" y="{}">{label}</text>"#, x + 16.0, ya + 20.0);
    }
    s.push_str("</svg>\n");
    s
}
