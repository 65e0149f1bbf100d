//! A real run's collectives as a Chrome trace (Perfetto, `chrome://tracing`), on the tracks the
//! simulator's trace has (`sim::timeline`): one process per rank (`pid` = rank), one thread
//! per stream (`tid` 1 all-gather, 2 reduce-scatter, 0 anything else), `"X"` events from when
//! a collective's stream reached it to when it ended, in microseconds from the earliest
//! launch or compute span of any rank (the records' clocks are the machines' wall clocks: ranks of one machine
//! share it). Collectives not ended are left out; the time each waited in its stream's queue
//! (launched to reached) is in its `args`. The compute a record holds (`FlightDump::compute`)
//! is on the compute track (`tid` 0), its category the span's first word (`forward`,
//! `backward`) and its step (1-based) in its `args`, as the simulator's compute spans are. A
//! collective an engine launched has that engine's number and step (1-based) in its `args`
//! (`engine`, `step`), so that a record of several engines can be read one engine at a time.

use std::fmt::Write as _;

use super::{FlightDump, FlightEntry};

/// The simulator's thread of a stream name.
fn tid(stream: &str) -> u32 {
    match stream {
        "all_gather" => 1,
        "reduce_scatter" => 2,
        _ => 0,
    }
}

const TRACKS: [(u32, &str); 3] = [(0, "compute"), (1, "all-gather"), (2, "reduce-scatter")];

fn ended(e: &FlightEntry) -> bool {
    e.started_ns > 0 && e.ended_ns >= e.started_ns
}

/// The Chrome trace JSON of `dumps` (every rank's flight record).
pub fn chrome_trace(dumps: &[FlightDump]) -> String {
    let launches = dumps.iter().flat_map(|d| &d.entries).map(|e| e.launched_ns);
    let computes = dumps.iter().flat_map(|d| &d.compute).map(|c| c.start_ns);
    let t0 = launches.chain(computes).filter(|&t| t > 0).min().unwrap_or(0);
    let us = |ns: u64| ns.saturating_sub(t0) as f64 / 1000.0;
    let mut events: Vec<String> = Vec::new();
    for d in dumps {
        let rank = d.rank;
        events.push(format!(
            "{{\"ph\":\"M\",\"name\":\"process_name\",\"pid\":{rank},\"args\":{{\"name\":\"rank {rank}\"}}}}"
        ));
        for (t, name) in TRACKS {
            events.push(format!(
                "{{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":{rank},\"tid\":{t},\"args\":{{\"name\":\"{name}\"}}}}"
            ));
        }
        for e in d.entries.iter().filter(|e| ended(e)) {
            // An engine's collective: its engine and step (1-based, as the compute spans').
            let origin = match (e.engine, e.step) {
                (Some(engine), Some(step)) => format!(",\"engine\":{engine},\"step\":{}", step + 1),
                _ => String::new(),
            };
            let mut ev = String::new();
            let op = serde_json::to_string(&e.op).unwrap_or_else(|_| "\"?\"".to_owned());
            let name =
                serde_json::to_string(&format!("{} bucket {}", e.op, e.tag)).unwrap_or_else(|_| op.clone());
            let _ = write!(
                ev,
                "{{\"ph\":\"X\",\"pid\":{rank},\"tid\":{},\"name\":{name},\"cat\":{op},\"ts\":{:.3},\
                 \"dur\":{:.3},\"args\":{{\"seq\":{},\"bytes\":{},\"ops\":{},\"queued_us\":{:.3},\"state\":\"{:?}\"{origin}}}}}",
                tid(&e.stream),
                us(e.started_ns),
                (e.ended_ns - e.started_ns) as f64 / 1000.0,
                e.seq,
                e.bytes,
                e.ops,
                e.started_ns.saturating_sub(e.launched_ns) as f64 / 1000.0,
                e.state,
            );
            events.push(ev);
        }
        for c in d.compute.iter().filter(|c| c.start_ns > 0 && c.end_ns >= c.start_ns) {
            let name = serde_json::to_string(&c.name).unwrap_or_else(|_| "\"?\"".to_owned());
            let cat = c.name.split_whitespace().next().unwrap_or("compute");
            let cat = serde_json::to_string(cat).unwrap_or_else(|_| "\"compute\"".to_owned());
            events.push(format!(
                "{{\"ph\":\"X\",\"pid\":{rank},\"tid\":0,\"name\":{name},\"cat\":{cat},\"ts\":{:.3},\"dur\":{:.3},\
                 \"args\":{{\"step\":{}}}}}",
                us(c.start_ns),
                (c.end_ns - c.start_ns) as f64 / 1000.0,
                c.step + 1,
            ));
        }
    }
    format!("{{\"traceEvents\":[\n{}\n],\"displayTimeUnit\":\"ms\"}}\n", events.join(",\n"))
}
