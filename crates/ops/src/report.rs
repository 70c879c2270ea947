//! `ironweave report DIR`: one self-contained HTML page from a train or bench run directory —
//! the loss curve, iteration time and exposed checkpoint time per iteration, the strategy
//! comparisons of `bench ckpt|scaling|overlap|sdp` as bar charts, and the run's timeline.
//! Charts are drawn with plotters' SVG backend and inlined, so the page needs nothing else.

use std::path::{Path, PathBuf};

use crate::error::{bail, Context, Result};

/// `ironweave report`'s options.
#[derive(Debug, Clone, clap::Args)]
pub struct ReportArgs {
    /// The run directory (target/train-report, target/bench/ckpt, target/bench/scaling, ...).
    pub dir: PathBuf,
    /// Where to write the page (default: DIR/report.html).
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// `ironweave report DIR`: writes the page and prints its path.
pub fn command(a: &ReportArgs) -> Result<i32> {
    let p = write(&a.dir, a.out.as_deref())?;
    println!("{}", p.display());
    Ok(0)
}
use plotters::prelude::*;
use serde_json::Value;

use crate::rundir::Report;

const W: u32 = 760;
const H: u32 = 300;

fn chart_err<E: std::fmt::Debug>(e: E) -> crate::error::Error {
    crate::error::err!("drawing a chart: {e:?}")
}

/// Draws one chart into an SVG string: `draw` gets a white W×H canvas and a chart builder with
/// the title and the common margins.
fn svg_chart(
    title: &str,
    x_label_area: u32,
    draw: impl FnOnce(&mut ChartBuilder<'_, '_, SVGBackend<'_>>) -> Result<()>,
) -> Result<String> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (W, H)).into_drawing_area();
        root.fill(&WHITE).map_err(chart_err)?;
        let mut b = ChartBuilder::on(&root);
        b.caption(title, ("sans-serif", 18)).margin(12).x_label_area_size(x_label_area).y_label_area_size(60);
        draw(&mut b)?;
        root.present().map_err(chart_err)?;
    }
    Ok(svg)
}

/// A line chart of one or more series over iterations 1..=n (an SVG string).
fn lines(title: &str, y_desc: &str, series: &[(&str, &[f64], RGBColor)]) -> Result<String> {
    let n = series.iter().map(|(_, v, _)| v.len()).max().unwrap_or(0).max(2);
    let all = series.iter().flat_map(|(_, v, _)| v.iter().copied()).filter(|x| x.is_finite());
    let (lo, hi) = all.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), x| (a.min(x), b.max(x)));
    let (lo, hi) = if lo.is_finite() { (lo.min(0.0), if hi > lo { hi * 1.05 } else { lo + 1.0 }) } else { (0.0, 1.0) };
    svg_chart(title, 36, |b| {
        let mut chart = b.build_cartesian_2d(1f64..n as f64, lo..hi).map_err(chart_err)?;
        chart.configure_mesh().x_desc("iteration").y_desc(y_desc).draw().map_err(chart_err)?;
        for (name, v, color) in series {
            let c = *color;
            chart
                .draw_series(LineSeries::new(v.iter().enumerate().map(|(i, y)| ((i + 1) as f64, *y)), c.stroke_width(2)))
                .map_err(chart_err)?
                .label(*name)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2)));
        }
        chart.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).draw().map_err(chart_err)?;
        Ok(())
    })
}

/// A bar chart of named values: bars numbered 1..n on the axis (names are long), then the
/// numbered names with their values as a list (SVG then HTML).
fn bars(title: &str, y_desc: &str, rows: &[(String, f64)]) -> Result<String> {
    let hi = rows.iter().map(|(_, v)| *v).filter(|v| v.is_finite()).fold(0.0f64, f64::max).max(1e-9) * 1.1;
    let n = rows.len().max(1);
    let names: Vec<String> = (1..=rows.len()).map(|i| i.to_string()).collect();
    let mut html =
        svg_chart(title, 40, |b| {
            let mut chart = b.build_cartesian_2d(0f64..n as f64, 0f64..hi).map_err(chart_err)?;
            chart
                .configure_mesh()
                .disable_x_mesh()
                .x_labels(n * 2 + 1)
                .x_label_formatter(&|x| {
                    let i = x.floor() as usize;
                    if (x - i as f64 - 0.5).abs() < 1e-6 {
                        names.get(i).cloned().unwrap_or_default()
                    } else {
                        String::new()
                    }
                })
                .y_desc(y_desc)
                .draw()
                .map_err(chart_err)?;
            chart
                .draw_series(rows.iter().enumerate().map(|(i, (_, v))| {
                    Rectangle::new([(i as f64 + 0.15, 0.0), (i as f64 + 0.85, *v)], Palette99::pick(i).filled())
                }))
                .map_err(chart_err)?;
            Ok(())
        })?;
    html.push_str("<ol class=\"bars\">");
    for (name, v) in rows {
        html.push_str(&format!("<li>{}: {v:.1} {}</li>", escape(name), escape(y_desc)));
    }
    html.push_str("</ol>\n");
    Ok(html)
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

/// The comparison rows of a bench JSON file: (name, mean iteration seconds), plus tokens/s
/// where the rows have them.
fn bench_rows(v: &Value) -> Vec<(String, f64, Option<f64>)> {
    // a list of rows, or an object holding them under "rows" (bench overlap)
    let Some(rows) = v.as_array().or_else(|| v["rows"].as_array()) else { return Vec::new() };
    rows.iter()
        .filter_map(|r| {
            let name = ["strategy", "schedule", "label"].iter().find_map(|k| r[*k].as_str())?;
            let t = ["iter_time_s", "mean_iter_s"].iter().find_map(|k| r[*k].as_f64())?;
            Some((name.to_string(), t, r["tokens_per_s"].as_f64()))
        })
        .collect()
}

/// Writes `DIR/report.html` (or `out`); returns its path.
pub fn write(dir: &Path, out: Option<&Path>) -> Result<PathBuf> {
    if !dir.is_dir() {
        bail!(
            "{} is not a directory: give a train report directory (target/train-report) or a bench output directory",
            dir.display()
        );
    }
    let mut sections: Vec<(String, String, String)> = Vec::new(); // (id, heading, html)
    let mut summary = String::new();
    let rp = dir.join("report.json");
    let tp_run = rp.exists()
        && serde_json::from_slice::<Value>(&std::fs::read(&rp)?)
            .is_ok_and(|v| v.get("schedule").is_some() && v.get("tp").is_some());
    if tp_run {
        let r: crate::rundir::TpReport =
            serde_json::from_slice(&std::fs::read(&rp)?).with_context(|| format!("reading {}", rp.display()))?;
        summary = format!(
            "{}: tensor parallel {} x data parallel {}, schedule {} with {} sub-batches, {} iterations, loss {:.3} → {:.3}, median iteration {:.1} ms, {:.0}% of tensor-parallel communication hidden",
            escape(&r.config),
            r.tp,
            r.dp,
            escape(&r.schedule),
            r.sub_batches,
            r.iterations,
            r.loss.first().copied().unwrap_or(f32::NAN),
            r.loss.last().copied().unwrap_or(f32::NAN),
            r.median_iter_s() * 1e3,
            r.hidden_fraction().unwrap_or(0.0) * 100.0
        );
        let loss: Vec<f64> = r.loss.iter().map(|&x| f64::from(x)).collect();
        sections.push(("loss".into(), "Loss".into(), lines("Training loss", "nats per byte", &[("loss", &loss, BLUE)])?));
        let ms = |v: &[f64]| -> Vec<f64> { v.iter().map(|s| s * 1e3).collect() };
        let (it, co, hi) = (ms(&r.iter_time_s), ms(&r.tp_comm_s), ms(&r.tp_hidden_s));
        let series: Vec<(&str, &[f64], RGBColor)> =
            vec![("iteration time", &it, BLUE), ("tensor-parallel communication", &co, RED), ("of it hidden", &hi, GREEN)];
        sections.push(("iteration-time".into(), "Time per iteration".into(), lines("Time per iteration", "ms", &series)?));
    } else if rp.exists() {
        let r: Report = serde_json::from_slice(&std::fs::read(&rp)?).with_context(|| format!("reading {}", rp.display()))?;
        summary = format!(
            "{} on {} rank{} x {} thread{}, checkpoint strategy {}: {} iterations, loss {:.3} → {:.3}, {:.0} tokens/s{}",
            escape(&r.config),
            r.ranks,
            if r.ranks == 1 { "" } else { "s" },
            r.threads_per_rank,
            if r.threads_per_rank == 1 { "" } else { "s" },
            escape(&r.strategy),
            r.iterations,
            r.loss.first().copied().unwrap_or(f32::NAN),
            r.loss.last().copied().unwrap_or(f32::NAN),
            r.tokens_per_s(),
            r.comm_hidden_fraction().map(|h| format!(", {:.0}% of gradient communication hidden", h * 100.0)).unwrap_or_default(),
        );
        let loss: Vec<f64> = r.loss.iter().map(|&x| f64::from(x)).collect();
        sections.push(("loss".into(), "Loss".into(), lines("Training loss", "nats per byte", &[("loss", &loss, BLUE)])?));
        let it_ms: Vec<f64> = r.iter_time_s.iter().map(|s| s * 1e3).collect();
        let ex_ms: Vec<f64> = r.ckpt_exposed_s.iter().map(|s| s * 1e3).collect();
        let mut series: Vec<(&str, &[f64], RGBColor)> =
            vec![("iteration time", &it_ms, BLUE), ("exposed checkpoint time", &ex_ms, RED)];
        let dp_ms: Vec<f64> = r.dp_comm_s.iter().map(|s| s * 1e3).collect();
        if dp_ms.iter().any(|&x| x > 0.0) {
            series.push(("gradient communication", &dp_ms, GREEN));
        }
        sections.push(("iteration-time".into(), "Time per iteration".into(), lines("Time per iteration", "ms", &series)?));
    }
    for (file, what) in [
        ("ckpt.json", "checkpoint strategies"),
        ("scaling.json", "scaling"),
        ("overlap.json", "schedules"),
        ("sdp.json", "sharding strategies"),
    ] {
        let p = dir.join(file);
        if !p.exists() {
            continue;
        }
        let v: Value = serde_json::from_slice(&std::fs::read(&p)?).with_context(|| format!("reading {}", p.display()))?;
        let rows = bench_rows(&v);
        if rows.is_empty() {
            bail!("{} has no rows with a name and an iteration time", p.display());
        }
        let id = file.trim_end_matches(".json").to_string();
        let t: Vec<(String, f64)> = rows.iter().map(|(n, t, _)| (n.clone(), t * 1e3)).collect();
        let mut html = bars(&format!("Mean iteration time: {what}"), "ms", &t)?;
        let tps: Vec<(String, f64)> = rows.iter().filter_map(|(n, _, k)| k.map(|k| (n.clone(), k))).collect();
        if !tps.is_empty() {
            html.push_str(&bars(&format!("Tokens per second: {what}"), "tokens/s", &tps)?);
        }
        sections.push((id, format!("Comparison of {what} ({file})"), html));
    }
    let tl = dir.join("timeline.svg");
    if tl.exists() {
        let svg = std::fs::read_to_string(&tl).with_context(|| format!("reading {}", tl.display()))?;
        let what =
            if tp_run { "Every rank's lanes in the last iteration" } else { "Timeline of the last profiled iteration (rank 0)" };
        sections.push(("timeline".into(), what.into(), svg));
    }
    if sections.is_empty() {
        bail!(
            "{} holds none of report.json, ckpt.json, scaling.json, overlap.json, sdp.json, timeline.svg: nothing to report",
            dir.display()
        );
    }
    let mut html = String::from(
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>ironweave report</title>\n\
         <style>body{font-family:sans-serif;margin:24px;color:#222;background:#fff}section{margin:18px 0}\
         h1{font-size:22px}h2{font-size:17px;border-bottom:1px solid #ddd}svg{max-width:100%;height:auto;display:block}\
         ol.bars{font-size:13px;margin:4px 0 16px 60px}</style>\n\
         </head><body>\n",
    );
    html.push_str(&format!("<h1>ironweave report: {}</h1>\n", escape(&dir.display().to_string())));
    if !summary.is_empty() {
        html.push_str(&format!("<p id=\"summary\">{summary}</p>\n"));
    }
    for (id, h, body) in &sections {
        html.push_str(&format!("<section id=\"{id}\"><h2>{}</h2>\n{body}\n</section>\n", escape(h)));
    }
    html.push_str("</body></html>\n");
    let out = out.map(Path::to_path_buf).unwrap_or_else(|| dir.join("report.html"));
    std::fs::write(&out, html).with_context(|| format!("writing {}", out.display()))?;
    Ok(out)
}
