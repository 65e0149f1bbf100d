//! Pictures of a simulated run: Chrome trace JSON (Perfetto, `chrome://tracing`) and an SVG
//! timeline of one rank's step.
//!
//! - [`write_chrome_trace`]: one process per rank (`pid` = rank), one thread per stream
//!   (`tid` 0 compute, 1 all-gather, 2 reduce-scatter), `"X"` complete events with `ts`/`dur`
//!   in microseconds.
//! - [`write_svg`]: one lane per stream of one rank for one step; compute in blue/green,
//!   waits (exposed communication) in red, host overhead in grey, collectives in orange
//!   (prefetched ones lighter), so overlap is visible at a glance; with a real run's trace
//!   (`sim --against`), that run's step below on the same scale.

use std::io::{self, Write};

use super::against::RealEvent;
use super::report::{Lane, SimReport, Span, SpanKind};

fn label(report: &SimReport, span: &Span) -> String {
    let tl = report.timeline.as_ref();
    match span.kind {
        SpanKind::Forward | SpanKind::Recompute | SpanKind::Backward => {
            let name = tl.and_then(|t| t.layer_names.get(span.index as usize)).map_or("?", String::as_str);
            format!("{} {name}", span.kind.name())
        }
        SpanKind::Loss | SpanKind::Update => span.kind.name().to_owned(),
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
                // A collective's bytes, as a real record's (`bucket_bytes`).
                let bytes = match tl.bucket_bytes.get(s.index as usize) {
                    Some(b) if tid > 0 => format!(",\"bytes\":{b}"),
                    _ => String::new(),
                };
                write!(
                    out,
                    "{{\"ph\":\"X\",\"pid\":{rank},\"tid\":{tid},\"name\":{name},\"cat\":\"{}\",\"ts\":{},\"dur\":{},\"args\":{{\"step\":{}{bytes}}}}}",
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

/// The colour of the step's compute outside the layers (the loss, the update).
const OUTSIDE: &str = "#76b7b2";

fn color(s: &Span) -> &'static str {
    kind_color(s.kind, s.prefetch)
}

/// The colour of a span of `kind` (a prefetched collective's apart), simulated or real.
fn kind_color(kind: SpanKind, prefetch: bool) -> &'static str {
    match kind {
        SpanKind::Forward => "#4e79a7",
        SpanKind::Recompute => "#a0cbe8",
        SpanKind::Backward => "#59a14f",
        SpanKind::Loss | SpanKind::Update => OUTSIDE,
        SpanKind::Wait => "#e15759",
        SpanKind::Host | SpanKind::Hook => "#9d9d9d",
        SpanKind::AllGather | SpanKind::ReduceScatter if prefetch => "#ffbe7d",
        SpanKind::AllGather | SpanKind::ReduceScatter => "#f28e2b",
    }
}

/// One lane of the SVG: its name and its boxes (start and end in ns from the lane's step start,
/// colour, title).
type Row = (String, Vec<(u64, u64, &'static str, String)>);

/// The real run's lanes of `rank` (of `real`, `sim --against`'s trace) for the step the
/// simulation draws (`step`, 0-based), or the real run's last where it has fewer: the steps are
/// told apart by the compute spans' steps (their `args.step`), or, in a trace that gives none,
/// by cutting them into runs of `per_step` (the simulated step's layer arithmetic on that
/// rank). The window runs from the previous step's last compute span (the rank's first event
/// for the first step) to the step's last compute span, or past it to the end of the
/// reduce-scatters that begin before the next step's compute (the last step: any). `None`
/// where the real trace has no compute on the rank (no step can be told apart). Returns the
/// real step (1-based), the window's length and the lanes.
fn real_rows(real: &[RealEvent], rank: usize, step: usize, per_step: usize) -> Option<(u64, u64, Vec<Row>)> {
    let mine: Vec<&RealEvent> = real.iter().filter(|e| e.rank == rank as u64).collect();
    let compute: Vec<&RealEvent> = mine.iter().copied().filter(|e| e.lane == 2).collect();
    // Each compute span's step (1-based).
    let steps: Vec<u64> = if compute.iter().all(|e| e.step.is_some()) {
        compute.iter().map(|e| e.step.unwrap_or(0)).collect()
    } else {
        let per = per_step.max(1);
        (0..compute.len()).map(|i| (i / per) as u64 + 1).collect()
    };
    let last = *steps.iter().max()?;
    let want = (step as u64 + 1).min(last);
    let k = if steps.contains(&want) { want } else { last };
    let ns = |us: f64| (us * 1000.0).round() as u64;
    let ends_of = |s: u64| {
        compute.iter().zip(&steps).filter(move |(_, &t)| t == s).map(|(e, _)| ns(e.ts_us + e.dur_us))
    };
    let begins_of =
        |s: u64| compute.iter().zip(&steps).filter(move |(_, &t)| t == s).map(|(e, _)| ns(e.ts_us));
    let before =
        compute.iter().zip(&steps).filter(|(_, &t)| t < k).map(|(e, _)| ns(e.ts_us + e.dur_us)).max();
    let start = match before {
        Some(t) => t,
        None => mine.iter().map(|e| ns(e.ts_us)).min()?,
    };
    let done = ends_of(k).max()?;
    let next = begins_of(k + 1).min().unwrap_or(u64::MAX);
    let end = mine
        .iter()
        .filter(|e| e.lane == 1 && ns(e.ts_us) < next && ns(e.ts_us) >= start)
        .map(|e| ns(e.ts_us + e.dur_us))
        .fold(done, u64::max)
        .max(start + 1);
    let mut rows: Vec<Row> = ["real compute", "real all_gather", "real reduce_scatter"]
        .iter()
        .map(|n| ((*n).to_owned(), Vec::new()))
        .collect();
    for e in mine.iter().filter(|e| ns(e.ts_us) < end && ns(e.ts_us + e.dur_us) > start) {
        let (row, kind) = match e.lane {
            // A real compute span's kind is its name's first word (another name: forward).
            2 => (
                0,
                e.name.split_whitespace().next().and_then(SpanKind::from_name).unwrap_or(SpanKind::Forward),
            ),
            lane => (lane + 1, SpanKind::AllGather),
        };
        let colour = kind_color(kind, false);
        let (a, b) = (ns(e.ts_us).max(start) - start, ns(e.ts_us + e.dur_us).min(end) - start);
        rows[row].1.push((a, b, colour, e.name.clone()));
    }
    Some((k, end - start, rows))
}

/// Draws `rank`'s step `step` (0-based) as an SVG timeline: one lane per stream, a time axis in
/// milliseconds, a legend; with `real` (`sim --against`'s trace) where it has compute on that
/// rank, the real run's step (the same step, or its last) in three lanes below, on the same
/// time scale.
///
/// # Errors
/// A failed write, or [`io::ErrorKind::InvalidInput`] when there is no timeline or no such
/// rank or step.
pub fn write_svg(
    out: &mut impl Write,
    report: &SimReport,
    rank: usize,
    step: usize,
    real: Option<&[RealEvent]>,
) -> io::Result<()> {
    let invalid = |m: String| io::Error::new(io::ErrorKind::InvalidInput, m);
    let tl = report.timeline.as_ref().ok_or_else(|| invalid("the simulation recorded no timeline".into()))?;
    let &(t0, t1) = tl
        .steps
        .get(rank)
        .and_then(|s| s.get(step))
        .ok_or_else(|| invalid(format!("no step {} of rank {rank} in the timeline", step + 1)))?;
    let lists: [&[Span]; 3] = [&tl.compute[rank], &tl.collectives[0], &tl.collectives[1]];
    let mut rows: Vec<Row> = Lane::ALL
        .iter()
        .zip(lists)
        .map(|(lane, list)| {
            let boxes = list
                .iter()
                .filter(|s| s.start_ns < t1 && s.start_ns + s.dur_ns > t0)
                .map(|s| {
                    let (a, b) = (s.start_ns.max(t0) - t0, (s.start_ns + s.dur_ns).min(t1) - t0);
                    (a, b, color(s), label(report, s))
                })
                .collect();
            (lane.name().to_owned(), boxes)
        })
        .collect();
    let per_step = tl.compute[rank].iter().filter(|s| s.step as usize == step && s.kind.is_compute()).count();
    let real = real.and_then(|r| real_rows(r, rank, step, per_step));
    let sim_ns = (t1 - t0).max(1);
    let mut title = format!(
        "{} on {} ranks, policy {}: rank {rank}, step {} ({:.3} ms)",
        xml_escape(&report.workload),
        report.world,
        report.policy,
        step + 1,
        sim_ns as f64 / 1e6
    );
    let mut span_ns = sim_ns as f64;
    if let Some((k, real_ns, real_rows)) = real {
        let _ = std::fmt::Write::write_fmt(
            &mut title,
            format_args!("; below, the real run's step {k} ({:.3} ms)", real_ns as f64 / 1e6),
        );
        span_ns = span_ns.max(real_ns as f64);
        rows.extend(real_rows);
    }
    let (left, width, lane_h, gap, top) = (130.0, 1400.0, 40.0, 14.0, 50.0);
    let lanes = rows.len() as f64;
    let height = top + lanes * (lane_h + gap) + 70.0;
    writeln!(
        out,
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{height}\" font-family=\"sans-serif\" font-size=\"12\">",
        left + width + 30.0
    )?;
    writeln!(out, "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>")?;
    writeln!(out, "<text x=\"{left}\" y=\"22\" font-size=\"15\">{title}</text>")?;
    let x = |ns: u64| left + ns as f64 / span_ns * width;
    for (i, (name, boxes)) in rows.iter().enumerate() {
        let y = top + i as f64 * (lane_h + gap);
        writeln!(out, "<text x=\"8\" y=\"{}\">{name}</text>", y + lane_h / 2.0 + 4.0)?;
        writeln!(
            out,
            "<rect x=\"{left}\" y=\"{y}\" width=\"{width}\" height=\"{lane_h}\" fill=\"#f4f4f4\"/>"
        )?;
        for (a, b, colour, what) in boxes {
            let (a, b) = (x(*a), x(*b));
            // Thin spans get no separating stroke (it would hide them) and at least 0.6 px.
            let w = (b - a).max(0.6);
            let stroke = if w > 4.0 { " stroke=\"white\" stroke-width=\"0.5\"" } else { "" };
            writeln!(
                out,
                "<rect x=\"{a:.2}\" y=\"{y}\" width=\"{w:.2}\" height=\"{lane_h}\" fill=\"{colour}\"{stroke}><title>{}</title></rect>",
                xml_escape(what)
            )?;
        }
    }
    // Time axis.
    let axis_y = top + lanes * (lane_h + gap) + 4.0;
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
        ("loss, update", OUTSIDE),
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

#[cfg(test)]
mod tests {
    use super::{real_rows, RealEvent};

    fn ev(lane: usize, name: &str, ts_us: f64, dur_us: f64, step: Option<u64>) -> RealEvent {
        RealEvent { rank: 0, lane, name: name.to_owned(), ts_us, dur_us, step, bytes: None, engine: None }
    }

    /// Two steps of two compute spans each, a reduce-scatter trailing each step's compute, the
    /// second step's gather ahead of its compute and a final gather after everything.
    fn trace(steps: bool) -> Vec<RealEvent> {
        let s = |k: u64| steps.then_some(k);
        vec![
            ev(2, "forward 0", 0.0, 10.0, s(1)),
            ev(2, "backward 0", 10.0, 10.0, s(1)),
            ev(1, "reduce_scatter bucket 1", 15.0, 15.0, None),
            ev(0, "all_gather bucket 0", 35.0, 5.0, None),
            ev(2, "forward 0", 40.0, 10.0, s(2)),
            ev(2, "backward 0", 50.0, 10.0, s(2)),
            ev(1, "reduce_scatter bucket 1", 55.0, 15.0, None),
            ev(0, "all_gather bucket 0", 80.0, 10.0, None),
        ]
    }

    #[test]
    fn a_real_step_runs_from_the_last_compute_before_it_to_its_trailing_reductions() {
        for steps in [true, false] {
            let real = trace(steps);
            let (k, len, rows) = real_rows(&real, 0, 0, 2).expect("a first step");
            assert_eq!((k, len), (1, 30_000), "steps given: {steps}");
            let counts: Vec<usize> = rows.iter().map(|r| r.1.len()).collect();
            assert_eq!(counts, [2, 0, 1], "steps given: {steps}");
            // The last step (asked for, or past the real run's end): from the first step's last
            // compute (20 us) to its own reduce-scatter's end (70 us), without the final gather.
            for want in [1, 5] {
                let (k, len, rows) = real_rows(&real, 0, want, 2).expect("a last step");
                assert_eq!((k, len), (2, 50_000), "steps given: {steps}, step {want}");
                let boxes: Vec<Vec<(u64, u64)>> =
                    rows.iter().map(|r| r.1.iter().map(|b| (b.0, b.1)).collect()).collect();
                assert_eq!(boxes[0], [(20_000, 30_000), (30_000, 40_000)], "steps given: {steps}");
                assert_eq!(boxes[1], [(15_000, 20_000)], "steps given: {steps}");
                assert_eq!(boxes[2], [(0, 10_000), (35_000, 50_000)], "steps given: {steps}");
            }
        }
        assert!(real_rows(&trace(true), 1, 0, 2).is_none(), "a rank without compute");
        let collectives: Vec<RealEvent> = trace(true).into_iter().filter(|e| e.lane != 2).collect();
        assert!(real_rows(&collectives, 0, 0, 2).is_none(), "a trace without compute");
    }
}
