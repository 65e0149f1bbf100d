//! The rank threads' meeting point: a barrier that collects each rank's row and that a failing
//! rank breaks instead of leaving the others waiting.

use std::sync::{Condvar, Mutex, PoisonError};

use super::RankRow;
use crate::backend::Exchange;

/// How the ranks of a bench hand each other their rows: threads of one process meet in a
/// [`Collector`], processes through the job's exchange ([`ProcessRows`]).
pub trait RowExchange: Sync {
    /// Hands in `row` for `rank` and waits for every rank; returns all rows in rank order.
    ///
    /// # Errors
    /// The failure of another rank.
    fn exchange(&self, rank: usize, row: RankRow) -> Result<Vec<RankRow>, String>;
    /// Marks the run failed, so that no other rank waits for this one.
    fn break_with(&self, why: String);
}

impl RowExchange for Collector {
    fn exchange(&self, rank: usize, row: RankRow) -> Result<Vec<RankRow>, String> {
        Collector::exchange(self, rank, row)
    }

    fn break_with(&self, why: String) {
        Collector::break_with(self, why);
    }
}

/// Rows exchanged between processes through the job's hub. A rank that fails exits, and the
/// others' exchange fails naming it (the hub watches the processes).
#[derive(Debug)]
pub struct ProcessRows<E>(pub Mutex<E>);

impl<E: Exchange> RowExchange for ProcessRows<E> {
    fn exchange(&self, _rank: usize, row: RankRow) -> Result<Vec<RankRow>, String> {
        let mut bytes = Vec::with_capacity(33);
        bytes.extend_from_slice(&row.grouped.to_le_bytes());
        bytes.extend_from_slice(&row.separate.unwrap_or(f64::NAN).to_le_bytes());
        bytes.push(u8::from(row.separate.is_some()));
        bytes.extend_from_slice(&row.wrong.to_le_bytes());
        bytes.extend_from_slice(&row.launch.to_le_bytes());
        let all = self
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .all_gather_bytes(&bytes)
            .map_err(|e| e.to_string())?;
        all.iter()
            .map(|b| {
                let f = |i: usize| b.get(i..i + 8).and_then(|s| s.try_into().ok()).map(f64::from_le_bytes);
                let w = b.get(17..25).and_then(|s| s.try_into().ok()).map(u64::from_le_bytes);
                match (f(0), f(8), b.get(16), w, f(25)) {
                    (Some(grouped), Some(sep), Some(&has), Some(wrong), Some(launch)) => {
                        Ok(RankRow { grouped, separate: (has == 1).then_some(sep), wrong, launch })
                    }
                    _ => Err("a rank sent a malformed bench row".to_string()),
                }
            })
            .collect()
    }

    fn break_with(&self, _why: String) {}
}

/// A barrier of the rank threads that a failing rank breaks instead of leaving the others
/// waiting, and that collects each rank's row.
pub struct Collector {
    n: usize,
    state: Mutex<CollectorState>,
    cv: Condvar,
}

#[derive(Default)]
struct CollectorState {
    rows: Vec<Option<RankRow>>,
    arrived: usize,
    generation: u64,
    broken: Option<String>,
    last: Vec<RankRow>,
}

impl Collector {
    /// A collector for `n` ranks.
    pub fn new(n: usize) -> Self {
        Collector {
            n,
            state: Mutex::new(CollectorState { rows: vec![None; n], ..Default::default() }),
            cv: Condvar::new(),
        }
    }

    /// Marks the run failed: every waiter returns an error.
    pub fn break_with(&self, why: String) {
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        st.broken.get_or_insert(why);
        self.cv.notify_all();
    }

    /// Hands in `row` for `rank` and waits for every rank; returns all rows (in rank order).
    ///
    /// # Errors
    /// The failure of another rank.
    pub fn exchange(&self, rank: usize, row: RankRow) -> Result<Vec<RankRow>, String> {
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(b) = &st.broken {
            return Err(b.clone());
        }
        st.rows[rank] = Some(row);
        st.arrived += 1;
        let generation = st.generation;
        if st.arrived == self.n {
            st.last = st.rows.iter_mut().map(|r| r.take().unwrap_or_default()).collect();
            st.arrived = 0;
            st.generation += 1;
            self.cv.notify_all();
        }
        while st.generation == generation {
            if let Some(b) = &st.broken {
                return Err(b.clone());
            }
            st = self.cv.wait(st).unwrap_or_else(PoisonError::into_inner);
        }
        Ok(st.last.clone())
    }
}

/// Breaks the collector if its rank's thread unwinds, so the other ranks stop waiting for it.
pub struct BreakOnPanic<'a> {
    /// The collector to break.
    pub collector: &'a dyn RowExchange,
    /// The rank this guard belongs to.
    pub rank: usize,
}

impl Drop for BreakOnPanic<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.collector.break_with(format!("rank {} panicked", self.rank));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_broken_collector_releases_every_waiter() {
        let c = Collector::new(3);
        std::thread::scope(|s| {
            let waiter = s.spawn(|| c.exchange(0, RankRow::default()));
            let panicker = s.spawn(|| {
                let _g = BreakOnPanic { collector: &c, rank: 2 };
                panic!("rank 2 falls over");
            });
            assert!(panicker.join().is_err());
            let e = waiter.join().expect("no panic").expect_err("broken");
            assert!(e.contains("rank 2 panicked"), "{e}");
        });
        assert!(c.exchange(1, RankRow::default()).is_err());
    }
}
