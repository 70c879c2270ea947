//! The HTML report of a training run: the loss curves, the forecast against the observed
//! values at a target station through the test period, and the stations on a map of the
//! states coloured by domain. One self-contained file (inline SVG, no scripts, no network).

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use crate::data::AirData;
use crate::train::{Evaluation, Losses, Prepared};

/// A state on the map: name, role (`target`, `source`, `unseen`, `other`), rings (lon, lat).
pub type MapState = (String, String, Vec<Vec<(f64, f64)>>);

/// What the report shows (also written as `report.json` beside the page).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ReportData {
    /// Heading.
    pub title: String,
    /// Lines of the summary (method, states, settings, scores).
    pub summary: Vec<String>,
    /// Loss curve: (total, regression, domain) per iteration.
    pub losses: Vec<(f32, f32, f32)>,
    /// The station of the forecast chart.
    pub station: String,
    /// Dates of the forecast chart.
    pub dates: Vec<String>,
    /// Observed PM10 (`None`: missing).
    pub observed: Vec<Option<f32>>,
    /// The model's forecast for each date, made the day before (`None`: no forecast).
    pub forecast: Vec<Option<f32>>,
    /// Persistence's forecast for each date.
    pub persistence: Vec<Option<f32>>,
    /// States: name, role (`target`, `source`, `unseen`, `other`), rings (lon, lat).
    pub states: Vec<MapState>,
    /// Stations: code, lon, lat, state index.
    pub stations: Vec<(String, f64, f64, usize)>,
}

impl ReportData {
    /// Collects the report of a run of `prep` whose forecasts at the target's test windows are
    /// `(window day, station, forecast)`.
    pub fn new(
        prep: &Prepared,
        title: String,
        mut summary: Vec<String>,
        losses: &[Losses],
        eval: &Evaluation,
        persistence: &Evaluation,
        forecasts: &[(usize, usize, f32)],
    ) -> ReportData {
        let d: &AirData = &prep.data;
        let t = &prep.task;
        summary.push(format!(
            "target {} test RMSE {:.2} µg/m³ (persistence {:.2}), MAE {:.2} ({:.2}); {} forecasts",
            d.states[t.target].name,
            eval.target.rmse,
            persistence.target.rmse,
            eval.target.mae,
            persistence.target.mae,
            eval.target.n
        ));
        if let (Some(s), Some(p)) = (&eval.sources, &persistence.sources) {
            summary.push(format!("sources test RMSE {:.2} (persistence {:.2})", s.rmse, p.rmse));
        }
        if let Some(dm) = eval.domain {
            summary.push(format!(
                "domain classifier on test windows: balanced accuracy {:.3} (chance {:.3}) over {} windows",
                dm.balanced_accuracy, dm.chance, dm.windows
            ));
        }
        if let Some(pr) = eval.probe {
            summary.push(format!(
                "domain information in the features: a linear probe tells the domains apart with balanced accuracy {:.3} (chance {:.3})",
                pr.balanced_accuracy, pr.chance
            ));
        }
        if let (Some(u), Some(p)) = (&eval.unseen, &persistence.unseen) {
            summary.push(format!("never-seen state test RMSE {:.2} (persistence {:.2})", u.rmse, p.rmse));
        }
        // the target station with the most forecasts
        let mut count = std::collections::BTreeMap::<usize, usize>::new();
        for &(_, s, _) in forecasts {
            *count.entry(s).or_default() += 1;
        }
        let st = count.iter().max_by_key(|(s, n)| (**n, std::cmp::Reverse(**s))).map(|(s, _)| *s).unwrap_or(0);
        // the first half year of the test period: two years of daily points are unreadable
        let days = t.split.test.start..t.split.test.end.min(t.split.test.start + 182);
        let series = d.series(st);
        let mut fc = vec![None; days.len()];
        let mut pe = vec![None; days.len()];
        for &(day, s, f) in forecasts {
            if s == st && day + 1 >= days.start && day + 1 < days.end {
                fc[day + 1 - days.start] = Some(f);
                pe[day + 1 - days.start] = Some(series[day]);
            }
        }
        let role = |i: usize| -> &str {
            if i == t.target {
                "target"
            } else if t.sources.contains(&i) && prep.method.uses_sources() {
                "source"
            } else if t.unseen == Some(i) {
                "unseen"
            } else {
                "other"
            }
        };
        ReportData {
            title,
            summary,
            losses: losses.iter().map(|l| (l.total, l.regression, l.domain)).collect(),
            station: d.stations.get(st).map(|s| s.code.clone()).unwrap_or_default(),
            dates: days.clone().map(|x| d.date(x)).collect(),
            observed: series[days].iter().map(|v| v.is_finite().then_some(*v)).collect(),
            forecast: fc,
            persistence: pe,
            states: d.states.iter().enumerate().map(|(i, s)| (s.name.clone(), role(i).to_string(), simplify(&s.rings))).collect(),
            stations: d.stations.iter().map(|s| (s.code.clone(), s.lon, s.lat, s.state)).collect(),
        }
    }
}

/// Rings with points closer than ~1 km to the last kept one dropped (the polygons have tens of
/// thousands of points; a map 500 pixels wide needs a few thousand).
fn simplify(rings: &[Vec<(f64, f64)>]) -> Vec<Vec<(f64, f64)>> {
    rings
        .iter()
        .filter(|r| r.len() >= 3)
        .map(|r| {
            let mut out = vec![r[0]];
            for &p in &r[1..] {
                let q = out[out.len() - 1];
                if (p.0 - q.0).abs() + (p.1 - q.1).abs() > 0.015 {
                    out.push(p);
                }
            }
            out
        })
        .filter(|r| r.len() >= 3)
        .collect()
}

const PALETTE: [&str; 16] = [
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf", "#393b79",
    "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd",
];

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

/// A line chart of several series (NaN breaks a line) with axes and a legend.
/// `series`: (name, colour, values, drawn as dots rather than a line).
fn chart(id: &str, title: &str, xlabel: &str, series: &[(&str, &str, &[f32], bool)], x_ticks: &[(usize, String)]) -> String {
    let (w, h, l, r, t, b) = (860.0, 300.0, 60.0, 20.0, 30.0, 40.0);
    let n = series.iter().map(|s| s.2.len()).max().unwrap_or(0).max(2);
    let vals = series.iter().flat_map(|s| s.2.iter().copied()).filter(|v| v.is_finite());
    let (lo, hi) = vals.fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), v| (a.min(v), b.max(v)));
    let (lo, hi) = if lo.is_finite() { (lo.min(0.0), if hi > lo { hi } else { lo + 1.0 }) } else { (0.0, 1.0) };
    let x = |i: usize| l + (w - l - r) * i as f64 / (n - 1) as f64;
    let y = |v: f32| t + (h - t - b) * f64::from(1.0 - (v - lo) / (hi - lo));
    let mut s = format!("<figure id=\"{id}\"><figcaption>{}</figcaption><svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" viewBox=\"0 0 {w} {h}\">", esc(title));
    let _ =
        write!(s, "<rect x=\"{l}\" y=\"{t}\" width=\"{}\" height=\"{}\" fill=\"none\" stroke=\"#444\"/>", w - l - r, h - t - b);
    for k in 0..=4 {
        let v = lo + (hi - lo) * k as f32 / 4.0;
        let _ = write!(s, "<text x=\"{}\" y=\"{:.1}\" font-size=\"11\" text-anchor=\"end\">{v:.2}</text>", l - 4.0, y(v) + 4.0);
        let _ = write!(s, "<line x1=\"{l}\" x2=\"{}\" y1=\"{:.1}\" y2=\"{:.1}\" stroke=\"#ddd\"/>", w - r, y(v), y(v));
    }
    for (i, lab) in x_ticks {
        let _ = write!(
            s,
            "<text x=\"{:.1}\" y=\"{}\" font-size=\"11\" text-anchor=\"middle\">{}</text>",
            x(*i),
            h - b + 14.0,
            esc(lab)
        );
    }
    let _ = write!(
        s,
        "<text x=\"{:.1}\" y=\"{}\" font-size=\"12\" text-anchor=\"middle\">{}</text>",
        (l + w - r) / 2.0,
        h - 6.0,
        esc(xlabel)
    );
    for (k, (name, colour, v, dots)) in series.iter().enumerate() {
        if *dots {
            for (i, p) in v.iter().enumerate().filter(|(_, p)| p.is_finite()) {
                let _ = write!(s, "<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"1.6\" fill=\"{colour}\"/>", x(i), y(*p));
            }
        } else {
            let mut run: Vec<String> = Vec::new();
            let flush = |run: &mut Vec<String>, s: &mut String| {
                if run.len() > 1 {
                    let _ = write!(
                        s,
                        "<polyline fill=\"none\" stroke=\"{colour}\" stroke-width=\"1.4\" points=\"{}\"/>",
                        run.join(" ")
                    );
                }
                run.clear();
            };
            for (i, p) in v.iter().enumerate() {
                if p.is_finite() {
                    run.push(format!("{:.1},{:.1}", x(i), y(*p)));
                } else {
                    flush(&mut run, &mut s);
                }
            }
            flush(&mut run, &mut s);
        }
        let _ = write!(
            s,
            "<rect x=\"{}\" y=\"{}\" width=\"12\" height=\"4\" fill=\"{colour}\"/><text x=\"{}\" y=\"{}\" font-size=\"12\">{}</text>",
            l + 10.0 + 170.0 * k as f64,
            t - 14.0,
            l + 26.0 + 170.0 * k as f64,
            t - 9.0,
            esc(name)
        );
    }
    s + "</svg></figure>\n"
}

fn map(d: &ReportData) -> String {
    let (mut x0, mut x1, mut y0, mut y1) = (f64::INFINITY, f64::NEG_INFINITY, f64::INFINITY, f64::NEG_INFINITY);
    let ring_points = d.states.iter().flat_map(|s| s.2.iter().flatten().copied());
    for (x, y) in ring_points.chain(d.stations.iter().map(|s| (s.1, s.2))) {
        x0 = x0.min(x);
        x1 = x1.max(x);
        y0 = y0.min(y);
        y1 = y1.max(y);
    }
    if !x0.is_finite() {
        (x0, x1, y0, y1) = (0.0, 1.0, 0.0, 1.0);
    }
    // equirectangular, longitude shrunk by cos(latitude)
    let k = ((y0 + y1) / 2.0).to_radians().cos();
    let (w, h, map_w) = (800.0, 620.0, 520.0);
    let sc = ((map_w - 20.0) / ((x1 - x0) * k).max(1e-9)).min((h - 20.0) / (y1 - y0).max(1e-9));
    let px = |x: f64| 10.0 + (x - x0) * k * sc;
    let py = |y: f64| 10.0 + (y1 - y) * sc;
    // colours by rank among the states that hold stations (distinct for up to 16 of them)
    let mut colour = vec![PALETTE[PALETTE.len() - 1]; d.states.len()];
    let mut next = 0;
    for (i, c) in colour.iter_mut().enumerate() {
        if d.stations.iter().any(|s| s.3 == i) {
            *c = PALETTE[next % PALETTE.len()];
            next += 1;
        }
    }
    let mut s = format!(
        "<figure id=\"map\"><figcaption>Stations by state (domain); thick outline: target (red), sources (blue), never seen (orange)</figcaption>\
         <svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" viewBox=\"0 0 {w} {h}\">"
    );
    for (i, (name, role, rings)) in d.states.iter().enumerate() {
        let (stroke, width) = match role.as_str() {
            "target" => ("#d62728", 3.0),
            "source" => ("#1f77b4", 2.0),
            "unseen" => ("#ff7f0e", 2.5),
            _ => ("#888", 0.6),
        };
        for ring in rings {
            let p: Vec<String> = ring.iter().map(|&(x, y)| format!("{:.1},{:.1}", px(x), py(y))).collect();
            let _ = write!(
                s,
                "<polygon class=\"state\" points=\"{}\" fill=\"{}\" fill-opacity=\"0.12\" stroke=\"{stroke}\" stroke-width=\"{width}\"><title>{} ({role})</title></polygon>",
                p.join(" "),
                colour[i],
                esc(name)
            );
        }
    }
    // legend: the states that hold stations, in their marker colour, with their role
    let mut row = 0.0;
    for (i, (name, role, _)) in d.states.iter().enumerate() {
        let n = d.stations.iter().filter(|s| s.3 == i).count();
        if n == 0 {
            continue;
        }
        let role = if role == "other" { String::new() } else { format!(", {role}") };
        let _ = write!(
            s,
            "<circle cx=\"{}\" cy=\"{}\" r=\"5\" fill=\"{}\" stroke=\"#000\" stroke-width=\"0.6\"/><text x=\"{}\" y=\"{}\" font-size=\"12\">{} ({n}{role})</text>",
            map_w + 20.0,
            30.0 + row,
            colour[i],
            map_w + 32.0,
            34.0 + row,
            esc(name)
        );
        row += 20.0;
    }
    for (code, x, y, st) in &d.stations {
        let _ = write!(
            s,
            "<circle class=\"station\" cx=\"{:.1}\" cy=\"{:.1}\" r=\"4.5\" fill=\"{}\" stroke=\"#000\" stroke-width=\"0.6\"><title>{} ({})</title></circle>",
            px(*x),
            py(*y),
            colour.get(*st).copied().unwrap_or("#000"),
            esc(code),
            esc(d.states.get(*st).map_or("", |s| s.0.as_str()))
        );
    }
    s + "</svg></figure>\n"
}

/// The page.
pub fn render(d: &ReportData) -> String {
    let mut s = format!(
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{t}</title>\
         <style>body{{font-family:sans-serif;margin:24px;max-width:900px}}figure{{margin:18px 0}}figcaption{{font-weight:bold;margin-bottom:4px}}</style>\
         </head><body><h1>{t}</h1><ul id=\"summary\">",
        t = esc(&d.title)
    );
    for l in &d.summary {
        let _ = write!(s, "<li>{}</li>", esc(l));
    }
    s += "</ul>\n";
    let total: Vec<f32> = d.losses.iter().map(|l| l.0).collect();
    let reg: Vec<f32> = d.losses.iter().map(|l| l.1).collect();
    let dom: Vec<f32> = d.losses.iter().map(|l| l.2).collect();
    let n = d.losses.len();
    let ticks: Vec<(usize, String)> =
        (0..=4).map(|k| (k * n.saturating_sub(1) / 4, (k * n.saturating_sub(1) / 4 + 1).to_string())).collect();
    let mut series: Vec<(&str, &str, &[f32], bool)> =
        vec![("total (avg over ranks)", "#333", &total, false), ("regression (rank 0)", "#1f77b4", &reg, false)];
    if dom.iter().any(|&x| x != 0.0) {
        series.push(("domain (rank 0)", "#d62728", &dom, false));
    }
    s += &chart("loss", "Training loss", "iteration", &series, &ticks);
    let nan = |v: &[Option<f32>]| -> Vec<f32> { v.iter().map(|x| x.unwrap_or(f32::NAN)).collect() };
    let (obs, fc, pe) = (nan(&d.observed), nan(&d.forecast), nan(&d.persistence));
    let m = d.dates.len();
    let ticks: Vec<(usize, String)> =
        (0..=4).map(|k| k * m.saturating_sub(1) / 4).map(|i| (i, d.dates.get(i).cloned().unwrap_or_default())).collect();
    s += &chart(
        "forecast",
        &format!(
            "PM10 at {} (target state), first {m} days of the test period: forecast for each day made the day before, µg/m³",
            d.station
        ),
        "date",
        &[("observed", "#333", &obs, true), ("forecast", "#d62728", &fc, false), ("persistence", "#2ca02c", &pe, false)],
        &ticks,
    );
    s += &map(d);
    s + "</body></html>\n"
}

/// A standalone SVG of [`crate::experiment::GainPoint`]s: each adversary's gain over the
/// network without a classifier (µg/m³, with its 95% interval) against how far a linear probe
/// tells the domains apart from that network's features (balanced accuracy minus chance).
/// Strategy 1 circles, strategy 2 squares; the colour is the setting. Above the zero line the
/// adversary helped.
pub fn gain_svg(points: &[crate::experiment::GainPoint]) -> String {
    let (w, h, l, r, t, b) = (760.0, 420.0, 64.0, 20.0, 24.0, 110.0);
    let fin = |v: f64| if v.is_finite() { v } else { 0.0 };
    let xmax = points.iter().map(|p| fin(p.probe_excess)).fold(0.05f64, f64::max) * 1.1;
    let xmin = points.iter().map(|p| fin(p.probe_excess)).fold(0.0f64, f64::min);
    let ylo = points.iter().map(|p| fin(p.gain - p.half_width)).fold(-0.1f64, f64::min);
    let yhi = points.iter().map(|p| fin(p.gain + p.half_width)).fold(0.1f64, f64::max);
    let x = |v: f64| l + (w - l - r) * (fin(v) - xmin) / (xmax - xmin);
    let y = |v: f64| t + (h - t - b) * (1.0 - (fin(v) - ylo) / (yhi - ylo));
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" viewBox=\"0 0 {w} {h}\" font-family=\"sans-serif\">\
         <rect width=\"{w}\" height=\"{h}\" fill=\"#fff\"/>\
         <rect x=\"{l}\" y=\"{t}\" width=\"{}\" height=\"{}\" fill=\"none\" stroke=\"#444\"/>",
        w - l - r,
        h - t - b
    );
    for k in 0..=4 {
        let v = ylo + (yhi - ylo) * f64::from(k) / 4.0;
        let _ = write!(s, "<text x=\"{}\" y=\"{:.1}\" font-size=\"11\" text-anchor=\"end\">{v:+.2}</text>", l - 4.0, y(v) + 4.0);
        let u = xmin + (xmax - xmin) * f64::from(k) / 4.0;
        let _ = write!(s, "<text x=\"{:.1}\" y=\"{}\" font-size=\"11\" text-anchor=\"middle\">{u:.3}</text>", x(u), h - b + 14.0);
    }
    let _ = write!(
        s,
        "<line x1=\"{l}\" x2=\"{}\" y1=\"{:.1}\" y2=\"{:.1}\" stroke=\"#888\" stroke-dasharray=\"4 3\"/>",
        w - r,
        y(0.0),
        y(0.0)
    );
    let _ = write!(
        s,
        "<text x=\"{:.1}\" y=\"{}\" font-size=\"12\" text-anchor=\"middle\">probe balanced accuracy above chance, network without a classifier</text>\
         <text x=\"14\" y=\"{:.1}\" font-size=\"12\" text-anchor=\"middle\" transform=\"rotate(-90 14 {:.1})\">adversary's gain over it, µg/m³ (95% CI)</text>",
        (l + w - r) / 2.0,
        h - b + 30.0,
        (t + h - b) / 2.0,
        (t + h - b) / 2.0
    );
    let mut settings: Vec<&str> = Vec::new();
    for p in points {
        if !settings.contains(&p.setting.as_str()) {
            settings.push(&p.setting);
        }
    }
    for p in points {
        let c = PALETTE[settings.iter().position(|x| *x == p.setting).unwrap_or(0) % PALETTE.len()];
        let (cx, cy) = (x(p.probe_excess), y(p.gain));
        let tip = esc(&format!("{}, sources {}, {}: {:+.2} ± {:.2}", p.setting, p.k, p.method, p.gain, p.half_width));
        let _ = write!(
            s,
            "<g><title>{tip}</title><line x1=\"{cx:.1}\" x2=\"{cx:.1}\" y1=\"{:.1}\" y2=\"{:.1}\" stroke=\"{c}\"/>",
            y(p.gain - p.half_width),
            y(p.gain + p.half_width)
        );
        if p.method == crate::train::Method::MultiClass.name() {
            let _ = write!(s, "<circle cx=\"{cx:.1}\" cy=\"{cy:.1}\" r=\"4\" fill=\"{c}\"/></g>");
        } else {
            let _ = write!(s, "<rect x=\"{:.1}\" y=\"{:.1}\" width=\"8\" height=\"8\" fill=\"{c}\"/></g>", cx - 4.0, cy - 4.0);
        }
    }
    for (i, name) in settings.iter().enumerate() {
        let (lx, ly) = (l + 250.0 * (i % 3) as f64, h - b + 52.0 + 16.0 * (i / 3) as f64);
        let _ = write!(
            s,
            "<rect x=\"{lx}\" y=\"{}\" width=\"10\" height=\"10\" fill=\"{}\"/><text x=\"{}\" y=\"{ly}\" font-size=\"11\">{}</text>",
            ly - 9.0,
            PALETTE[i % PALETTE.len()],
            lx + 14.0,
            esc(name)
        );
    }
    let ly = h - b + 52.0 + 16.0 * (settings.len().div_ceil(3)) as f64;
    let _ = write!(
        s,
        "<circle cx=\"{}\" cy=\"{}\" r=\"4\" fill=\"#444\"/><text x=\"{}\" y=\"{ly}\" font-size=\"11\">strategy 1 (multi-class)</text>\
         <rect x=\"{}\" y=\"{}\" width=\"8\" height=\"8\" fill=\"#444\"/><text x=\"{}\" y=\"{ly}\" font-size=\"11\">strategy 2 (per source)</text>",
        l + 5.0,
        ly - 4.0,
        l + 14.0,
        l + 246.0,
        ly - 8.0,
        l + 264.0
    );
    s + "</svg>\n"
}

/// A table of an experiment and the column its plot shows.
#[derive(Debug, Clone)]
pub struct TableSection {
    /// The heading above the table.
    pub heading: String,
    /// The markdown table as `airq experiment` / `airq hourly` print it.
    pub markdown: String,
    /// The column plotted: cells `m`, `m ± sd` or `m [lo, hi]` (rows with `–` are left out).
    pub plot_column: String,
    /// The columns whose cells name a row in the plot.
    pub label_columns: Vec<String>,
}

/// A cell's value and its error bar: `m ± sd` (sd), `m [lo, hi]` (the interval), `m` (none).
fn cell_value(c: &str) -> Option<(f64, f64, f64)> {
    let c = c.trim();
    let num = |s: &str| s.trim().replace('−', "-").parse::<f64>().ok();
    if let Some((m, sd)) = c.split_once('±') {
        let (m, sd) = (num(m)?, num(sd)?);
        return Some((m, m - sd, m + sd));
    }
    if let Some((m, rest)) = c.split_once('[') {
        let (lo, hi) = rest.trim_end_matches(']').split_once(',')?;
        return Some((num(m)?, num(lo)?, num(hi)?));
    }
    num(c).map(|m| (m, m, m))
}

/// The rows of a markdown table (header first), cells trimmed.
fn markdown_rows(md: &str) -> Vec<Vec<String>> {
    md.lines()
        .filter(|l| l.starts_with('|') && !l.starts_with("|---"))
        .map(|l| l.trim().trim_matches('|').split('|').map(|c| c.trim().to_string()).collect())
        .collect()
}

/// A horizontal dot plot of `section`'s plot column: a row per table row with a value, the
/// error bar its cell gives, a dashed line at zero when zero is in range.
pub fn table_plot(section: &TableSection) -> String {
    let rows = markdown_rows(&section.markdown);
    let Some(header) = rows.first() else { return String::new() };
    let Some(col) = header.iter().position(|h| *h == section.plot_column) else { return String::new() };
    let labels: Vec<usize> = section.label_columns.iter().filter_map(|l| header.iter().position(|h| h == l)).collect();
    let points: Vec<(String, (f64, f64, f64))> = rows[1..]
        .iter()
        .filter_map(|r| {
            let v = cell_value(r.get(col)?)?;
            let label = labels.iter().filter_map(|&i| r.get(i).map(String::as_str)).collect::<Vec<_>>().join(" · ");
            Some((label, v))
        })
        .collect();
    if points.is_empty() {
        return String::new();
    }
    let (w, l, r, t, row_h) = (760.0, 300.0, 24.0, 10.0, 18.0);
    let h = t + row_h * points.len() as f64 + 40.0;
    let lo = points.iter().map(|p| p.1 .1).fold(f64::INFINITY, f64::min);
    let hi = points.iter().map(|p| p.1 .2).fold(f64::NEG_INFINITY, f64::max);
    let pad = ((hi - lo) * 0.05).max(1e-9);
    let (lo, hi) = (lo - pad, hi + pad);
    let x = |v: f64| l + (w - l - r) * (v - lo) / (hi - lo);
    let mut s = format!(
        "<figure><figcaption>{}: {} (bars: ± one sd over seeds, or the 95% interval)</figcaption><svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" viewBox=\"0 0 {w} {h}\" font-family=\"sans-serif\">",
        esc(&section.heading),
        esc(&section.plot_column)
    );
    if lo < 0.0 && hi > 0.0 {
        let _ = write!(
            s,
            "<line x1=\"{:.1}\" x2=\"{:.1}\" y1=\"{t}\" y2=\"{:.1}\" stroke=\"#888\" stroke-dasharray=\"4 3\"/>",
            x(0.0),
            x(0.0),
            h - 30.0
        );
    }
    for (i, (label, (m, a, b))) in points.iter().enumerate() {
        let y = t + row_h * (i as f64 + 0.5);
        let _ = write!(
            s,
            "<g><title>{}: {}</title><text x=\"{:.1}\" y=\"{:.1}\" font-size=\"11\" text-anchor=\"end\">{}</text>\
             <line x1=\"{:.1}\" x2=\"{:.1}\" y1=\"{y:.1}\" y2=\"{y:.1}\" stroke=\"#1f77b4\"/>\
             <circle cx=\"{:.1}\" cy=\"{y:.1}\" r=\"3.5\" fill=\"#1f77b4\"/></g>",
            esc(label),
            m,
            l - 6.0,
            y + 4.0,
            esc(label),
            x(*a),
            x(*b),
            x(*m)
        );
    }
    for k in 0..=4 {
        let v = lo + (hi - lo) * f64::from(k) / 4.0;
        let _ = write!(s, "<text x=\"{:.1}\" y=\"{:.1}\" font-size=\"11\" text-anchor=\"middle\">{v:.2}</text>", x(v), h - 14.0);
    }
    s + "</svg></figure>\n"
}

/// The page of an experiment: its settings line, then each table with its plot.
pub fn tables_page(title: &str, settings: &str, sections: &[TableSection]) -> String {
    let mut s = format!(
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{t}</title>\
         <style>body{{font-family:sans-serif;margin:24px;max-width:1100px}}table{{border-collapse:collapse;font-size:12px}}\
         td,th{{border:1px solid #ccc;padding:2px 6px;text-align:right}}figure{{margin:12px 0 28px}}figcaption{{font-weight:bold}}</style>\
         </head><body><h1>{t}</h1><p id=\"settings\">{}</p>\n",
        esc(settings),
        t = esc(title)
    );
    for sec in sections {
        let _ = write!(s, "<h2>{}</h2><table>", esc(&sec.heading));
        for (i, row) in markdown_rows(&sec.markdown).iter().enumerate() {
            let tag = if i == 0 { "th" } else { "td" };
            s += "<tr>";
            for c in row {
                let _ = write!(s, "<{tag}>{}</{tag}>", esc(c));
            }
            s += "</tr>";
        }
        s += "</table>\n";
        s += &table_plot(sec);
    }
    s + "</body></html>\n"
}

/// The column each kind of table is plotted by, in order of preference.
const PLOT_COLUMNS: [&str; 5] = [
    "target RMSE",
    "target RMSE, validation years",
    "change (95% CI)",
    "skill vs persistence",
    "gain over no-classifier, µg/m³ (95% CI)",
];
/// The columns that name a row.
const LABEL_COLUMNS: [&str; 6] = ["setting", "sources", "inputs", "method", "λ", "lead"];

/// The page of a `table.md` written by `airq experiment` or `airq hourly`: its settings line,
/// each table (headed by the line above it) and a plot per table.
pub fn page_from_table_md(title: &str, md: &str) -> String {
    let lines: Vec<&str> = md.lines().collect();
    let settings = lines.iter().find(|l| l.starts_with("settings:")).copied().unwrap_or("");
    let mut sections = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        if !lines[i].starts_with('|') {
            i += 1;
            continue;
        }
        let heading = lines[..i]
            .iter()
            .rev()
            .find(|l| !l.trim().is_empty() && !l.starts_with('|'))
            .map(|l| l.trim_end_matches(':').to_string())
            .filter(|l| !l.starts_with("settings:"))
            .unwrap_or_else(|| "results".into());
        let start = i;
        while i < lines.len() && lines[i].starts_with('|') {
            i += 1;
        }
        let markdown = lines[start..i].join("\n");
        let header = markdown_rows(&markdown).into_iter().next().unwrap_or_default();
        let plot_column =
            PLOT_COLUMNS.iter().find(|c| header.iter().any(|h| h == *c)).map_or(String::new(), |c| (*c).to_string());
        let label_columns = LABEL_COLUMNS.iter().filter(|c| header.iter().any(|h| h == *c)).map(|c| (*c).to_string()).collect();
        sections.push(TableSection { heading, markdown, plot_column, label_columns });
    }
    tables_page(title, settings, &sections)
}
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_has_its_three_figures_and_escapes_text() {
        let d = ReportData {
            title: "a <b> & c".into(),
            summary: vec!["x".into()],
            losses: vec![(1.0, 0.8, 0.2), (0.5, 0.4, 0.1), (0.4, 0.3, 0.1)],
            station: "DE1".into(),
            dates: vec!["2008-01-01".into(), "2008-01-02".into()],
            observed: vec![Some(10.0), None],
            forecast: vec![Some(11.0), Some(12.0)],
            persistence: vec![None, Some(10.0)],
            states: vec![("S".into(), "target".into(), vec![vec![(0.0, 0.0), (1.0, 0.0), (1.0, 1.0)]])],
            stations: vec![("DE1".into(), 0.5, 0.3, 0)],
        };
        let h = render(&d);
        for id in ["summary", "loss", "forecast", "map"] {
            assert!(h.contains(&format!("id=\"{id}\"")), "{id}");
        }
        assert!(h.contains("a &lt;b&gt; &amp; c"));
        assert_eq!(h.matches("class=\"station\"").count(), 1);
        assert_eq!(h.matches("<svg").count(), 3);
    }

    #[test]
    fn the_gain_plot_has_a_mark_per_point_and_escapes_text() {
        let p = |m: &str, setting: &str| crate::experiment::GainPoint {
            setting: setting.into(),
            k: "all".into(),
            method: m.into(),
            lambda: Some(1.0),
            probe_excess: 0.04,
            gain: -0.05,
            half_width: 0.03,
            seeds: 5,
        };
        let svg = gain_svg(&[p("grl-multiclass", "A <b>"), p("grl-per-source", "A <b>"), p("grl-per-source", "B")]);
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert_eq!(svg.matches("<title>").count(), 3);
        assert!(svg.contains("A &lt;b&gt;") && !svg.contains("<b>"));
        // one circle per strategy-1 point plus the legend's
        assert_eq!(svg.matches("<circle").count(), 2);
    }

    #[test]
    fn every_table_gets_its_plot_with_error_bars() {
        let md = "| sources | method | seeds | target RMSE | Δ |\n|---|---|---|---|---|\n\
                  | - | persistence | 1 | 7.02 | – |\n| 2 | no-classifier | 5 | 6.47 ± 0.05 | – |\n\
                  | 2 | grl-<x> | 5 | 6.48 ± 0.06 | +0.02 [-0.04, +0.08] |\n";
        let sec = |col: &str| TableSection {
            heading: "90 days".into(),
            markdown: md.into(),
            plot_column: col.into(),
            label_columns: vec!["sources".into(), "method".into()],
        };
        let p = table_plot(&sec("target RMSE"));
        assert_eq!(p.matches("<circle").count(), 3, "{p}");
        assert!(p.contains("2 · grl-&lt;x&gt;") && !p.contains("<x>"), "{p}");
        // the interval column: only rows with a value, and the zero line
        let d = table_plot(&sec("Δ"));
        assert_eq!(d.matches("<circle").count(), 1);
        assert!(d.contains("stroke-dasharray"), "{d}");
        assert_eq!(cell_value("+0.02 [-0.04, +0.08]"), Some((0.02, -0.04, 0.08)));
        assert_eq!(cell_value("6.47 ± 0.05").map(|v| (v.1 * 100.0).round()), Some(642.0));
        assert_eq!(cell_value("–"), None);
        assert!(table_plot(&sec("no such column")).is_empty());
        let page = tables_page("t", "settings: x", &[sec("target RMSE"), sec("Δ")]);
        assert_eq!((page.matches("<table>").count(), page.matches("<svg").count()), (2, 2));
        assert_eq!(page.matches("<tr>").count(), 8);
    }

    #[test]
    fn a_table_md_becomes_a_page_with_a_plot_per_table() {
        let md = "settings: target X, seeds 1,2\n\n| sources | method | seeds | target RMSE |\n|---|---|---|---|\n| 2 | a | 2 | 6.1 ± 0.1 |\n\n\
                  λ chosen on the validation years:\n\n| sources | method | λ | seeds | target RMSE, validation years |\n|---|---|---|---|---|\n\
                  | 2 | a | 1 | 2 | 8.3 ± 0.1 |\n| 2 | a | 0.1 | 2 | 8.2 ± 0.1 |\n";
        let page = page_from_table_md("exp", md);
        assert_eq!((page.matches("<table>").count(), page.matches("<svg").count()), (2, 2), "{page}");
        assert!(page.contains("<h2>results</h2>") && page.contains("<h2>λ chosen on the validation years</h2>"), "{page}");
        assert!(page.contains("2 · a · 0.1") && page.contains("settings: target X"), "{page}");
    }
}
