//! [`Progress`]: a line on stderr now and then during a long run (`collsched demo --steps
//! 100000000` would otherwise run silently for hours).
//!
//! Knob: `COLLSCHED_PROGRESS_SECS` (default 10): seconds between lines; `0` turns them off. A run
//! shorter than that prints nothing.

use std::time::{Duration, Instant};

/// Seconds between progress lines unless `COLLSCHED_PROGRESS_SECS` says otherwise.
pub const DEFAULT_PROGRESS_SECS: u64 = 10;

/// Prints `what: k of n steps (p%), elapsed, about t left` at most once per interval.
#[derive(Debug)]
pub struct Progress {
    what: String,
    total: u64,
    start: Instant,
    last: Instant,
    every: Option<Duration>,
}

impl Progress {
    /// Progress of `total` steps of `what`, with the interval from the environment.
    pub fn new(what: impl Into<String>, total: u64) -> Progress {
        let every = std::env::var("COLLSCHED_PROGRESS_SECS")
            .ok()
            .and_then(|v| v.trim().parse::<f64>().ok())
            .filter(|s| s.is_finite() && *s >= 0.0)
            .unwrap_or(DEFAULT_PROGRESS_SECS as f64);
        Progress::every(what, total, (every > 0.0).then(|| Duration::from_secs_f64(every.min(1e9))))
    }

    /// Progress with an explicit interval (`None`: silent).
    pub fn every(what: impl Into<String>, total: u64, every: Option<Duration>) -> Progress {
        let now = Instant::now();
        Progress { what: what.into(), total, start: now, last: now, every }
    }

    /// `done` steps are done: prints a line if the interval passed since the last one. Returns
    /// the line printed, if any.
    pub fn tick(&mut self, done: u64) -> Option<String> {
        let every = self.every?;
        let now = Instant::now();
        if now.duration_since(self.last) < every {
            return None;
        }
        self.last = now;
        let elapsed = now.duration_since(self.start).as_secs_f64();
        let left = if done > 0 && done < self.total {
            let rest = elapsed / done as f64 * (self.total - done) as f64;
            format!(", about {} left", human(rest))
        } else {
            String::new()
        };
        let pct = if self.total > 0 { 100.0 * done as f64 / self.total as f64 } else { 100.0 };
        let line = format!(
            "{}: {done} of {} steps ({pct:.1}%), {} elapsed{left}",
            self.what,
            self.total,
            human(elapsed)
        );
        eprintln!("{line}");
        Some(line)
    }
}

fn human(secs: f64) -> String {
    if secs < 120.0 {
        format!("{secs:.0} s")
    } else if secs < 7200.0 {
        format!("{:.0} min", secs / 60.0)
    } else {
        format!("{:.1} h", secs / 3600.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_come_once_per_interval_with_counts_and_estimates() {
        let mut p = Progress::every("demo", 1000, Some(Duration::from_millis(20)));
        assert_eq!(p.tick(1), None, "no line before the first interval");
        std::thread::sleep(Duration::from_millis(25));
        let line = p.tick(250).expect("a line after the interval");
        assert!(line.starts_with("demo: 250 of 1000 steps (25.0%)") && line.contains("left"), "{line}");
        assert_eq!(p.tick(251), None, "a second line within the interval");
        let mut off = Progress::every("demo", 10, None);
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(off.tick(5), None);
    }
}
