//! Pictures of a simulated run: Chrome trace JSON (Perfetto, `chrome://tracing`) and an SVG
//! timeline of one rank's step.
//!
//! - [`write_chrome_trace`]: one process per rank (`pid` = rank), one thread per stream
//!   (`tid` 0 compute, 1 all-gather, 2 reduce-scatter), `"X"` complete events with `ts`/`dur`
//!   in microseconds.
//! - [`write_svg`]: one lane per stream of one rank for one step; compute in blue/green,
//!   waits (exposed communication) in red, host overhead in grey, collectives in orange
//!   (prefetched ones lighter), so overlap is visible at a glance.

use std::io::{self, Write};

use super::report::{Lane, SimReport, Span, SpanKind};

fn label(report: &SimReport, span: &Span) -> String {
    let tl = report.timeline.as_ref();
    match span.kind {
        SpanKind::Forward | SpanKind::Recompute | SpanKind::Backward => {
            let name = tl.and_then(|t| t.layer_names.get(span.index as usize)).map_or("?", String::as_str);
            format!("{} {name}", span.kind.name())
        }
        SpanKind::Wait if span.index == u32::MAX => "wait device drain".to_owned(),
        SpanKind::Wait => format!("wait bucket {}", span.index),
        SpanKind::Host => format!("host launch bucket {}", span.index),
        SpanKind::Hook => match tl.and_then(|t| t.layer_names.get(span.index as usize)) {
            Some(name) => format!("host hook {name}"),
            None => "host drain".to_owned(),
        },
        SpanKind::AllGather | SpanKind::ReduceScatter => {
            format!(
                "{} bucket {}{}",
                span.kind.name(),
                span.index,
                if span.prefetch { " (prefetch)" } else { "" }
            )
        }
    }
}

fn micros(ns: u64) -> String {
    format!("{}.{:03}", ns / 1000, ns % 1000)
}

/// Writes the run as Chrome trace JSON (`{"traceEvents": [...]}`), every rank.
///
/// # Errors
/// A failed write, or [`io::ErrorKind::InvalidInput`] when the report has no timeline (run with
/// `SimConfig::timeline`).
pub fn write_chrome_trace(out: &mut impl Write, report: &SimReport) -> io::Result<()> {
    let tl = report
        .timeline
        .as_ref()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "the simulation recorded no timeline"))?;
    out.write_all(b"{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n")?;
    let mut first = true;
    let mut sep = |out: &mut dyn Write| -> io::Result<()> {
        if !std::mem::take(&mut first) {
            out.write_all(b",\n")?;
        }
        Ok(())
    };
    for (rank, spans) in tl.compute.iter().enumerate() {
        sep(out)?;
        write!(
            out,
            "{{\"ph\":\"M\",\"name\":\"process_name\",\"pid\":{rank},\"args\":{{\"name\":\"rank {rank}\"}}}}"
        )?;
        for (tid, lane) in Lane::ALL.iter().enumerate() {
            sep(out)?;
            write!(
                out,
                "{{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":{rank},\"tid\":{tid},\"args\":{{\"name\":\"{}\"}}}}",
                lane.name()
            )?;
        }
        let lanes = [(0usize, spans.as_slice()), (1, &tl.collectives[0]), (2, &tl.collectives[1])];
        for (tid, list) in lanes {
            for s in list {
                sep(out)?;
                let name = serde_json::to_string(&label(report, s)).map_err(io::Error::other)?;
                write!(
                    out,
                    "{{\"ph\":\"X\",\"pid\":{rank},\"tid\":{tid},\"name\":{name},\"cat\":\"{}\",\"ts\":{},\"dur\":{},\"args\":{{\"step\":{}}}}}",
                    s.kind.name(),
                    micros(s.start_ns),
                    micros(s.dur_ns),
                    s.step + 1
                )?;
            }
        }
    }
    out.write_all(b"\n]}\n")
}

fn color(s: &Span) -> &'static str {
    match s.kind {
        SpanKind::Forward => "#4e79a7",
        SpanKind::Recompute => "#a0cbe8",
        SpanKind::Backward => "#59a14f",
        SpanKind::Wait => "#e15759",
        SpanKind::Host | SpanKind::Hook => "#9d9d9d",
        SpanKind::AllGather | SpanKind::ReduceScatter if s.prefetch => "#ffbe7d",
        SpanKind::AllGather | SpanKind::ReduceScatter => "#f28e2b",
    }
}

/// Draws `rank`'s step `step` (0-based) as an SVG timeline: one lane per stream, a time axis in
/// milliseconds, a legend.
///
/// # Errors
/// A failed write, or [`io::ErrorKind::InvalidInput`] when there is no timeline or no such
/// rank or step.
pub fn write_svg(out: &mut impl Write, report: &SimReport, rank: usize, step: usize) -> io::Result<()> {
    let invalid = |m: String| io::Error::new(io::ErrorKind::InvalidInput, m);
    let tl = report.timeline.as_ref().ok_or_else(|| invalid("the simulation recorded no timeline".into()))?;
    let &(t0, t1) = tl
        .steps
        .get(rank)
        .and_then(|s| s.get(step))
        .ok_or_else(|| invalid(format!("no step {} of rank {rank} in the timeline", step + 1)))?;
    let span_ns = (t1 - t0).max(1) as f64;
    let (left, width, lane_h, gap, top) = (130.0, 1400.0, 40.0, 14.0, 50.0);
    let x = |ns: u64| left + (ns.saturating_sub(t0) as f64) / span_ns * width;
    let height = top + 3.0 * (lane_h + gap) + 70.0;
    writeln!(
        out,
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{height}\" font-family=\"sans-serif\" font-size=\"12\">",
        left + width + 30.0
    )?;
    writeln!(out, "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>")?;
    writeln!(
        out,
        "<text x=\"{left}\" y=\"22\" font-size=\"15\">{} on {} ranks, policy {}: rank {rank}, step {} ({:.3} ms)</text>",
        xml_escape(&report.workload),
        report.world,
        report.policy,
        step + 1,
        span_ns / 1e6
    )?;
    let lists: [&[Span]; 3] = [&tl.compute[rank], &tl.collectives[0], &tl.collectives[1]];
    for (i, (lane, list)) in Lane::ALL.iter().zip(lists).enumerate() {
        let y = top + i as f64 * (lane_h + gap);
        writeln!(out, "<text x=\"8\" y=\"{}\">{}</text>", y + lane_h / 2.0 + 4.0, lane.name())?;
        writeln!(
            out,
            "<rect x=\"{left}\" y=\"{y}\" width=\"{width}\" height=\"{lane_h}\" fill=\"#f4f4f4\"/>"
        )?;
        for s in list.iter().filter(|s| s.start_ns < t1 && s.start_ns + s.dur_ns > t0) {
            let (a, b) = (x(s.start_ns.max(t0)), x((s.start_ns + s.dur_ns).min(t1)));
            // Thin spans get no separating stroke (it would hide them) and at least 0.6 px.
            let w = (b - a).max(0.6);
            let stroke = if w > 4.0 { " stroke=\"white\" stroke-width=\"0.5\"" } else { "" };
            writeln!(
                out,
                "<rect x=\"{a:.2}\" y=\"{y}\" width=\"{w:.2}\" height=\"{lane_h}\" fill=\"{}\"{stroke}><title>{}</title></rect>",
                color(s),
                xml_escape(&label(report, s))
            )?;
        }
    }
    // Time axis.
    let axis_y = top + 3.0 * (lane_h + gap) + 4.0;
    writeln!(
        out,
        "<line x1=\"{left}\" y1=\"{axis_y}\" x2=\"{}\" y2=\"{axis_y}\" stroke=\"black\"/>",
        left + width
    )?;
    for k in 0..=10 {
        let t = span_ns * f64::from(k) / 10.0;
        let xx = left + width * f64::from(k) / 10.0;
        writeln!(
            out,
            "<line x1=\"{xx}\" y1=\"{axis_y}\" x2=\"{xx}\" y2=\"{}\" stroke=\"black\"/>",
            axis_y + 5.0
        )?;
        writeln!(
            out,
            "<text x=\"{xx}\" y=\"{}\" text-anchor=\"middle\">{:.1} ms</text>",
            axis_y + 18.0,
            t / 1e6
        )?;
    }
    let legend = [
        ("forward", "#4e79a7"),
        ("recompute", "#a0cbe8"),
        ("backward", "#59a14f"),
        ("wait (exposed comm)", "#e15759"),
        ("host overhead", "#9d9d9d"),
        ("collective", "#f28e2b"),
        ("prefetched collective", "#ffbe7d"),
    ];
    let ly = axis_y + 40.0;
    for (i, (name, c)) in legend.iter().enumerate() {
        let lx = left + i as f64 * 170.0;
        writeln!(out, "<rect x=\"{lx}\" y=\"{}\" width=\"14\" height=\"14\" fill=\"{c}\"/>", ly - 11.0)?;
        writeln!(out, "<text x=\"{}\" y=\"{ly}\">{name}</text>", lx + 19.0)?;
    }
    writeln!(out, "</svg>")
}

fn xml_escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}
