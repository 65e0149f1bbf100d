//! The simulator's collectives: each stream's launches in order, when they start and end
//! ([`Colls::try_resolve`]), and how long they run during a compute op
//! ([`Colls::busy_between`]), with or without a link shared by the two streams.

use collsched_schedule::LaunchId;

pub(super) struct Coll {
    pub(super) id: LaunchId,
    pub(super) dur: u64,
    /// The part of `dur` that is not a transfer (latency, launch): first, never shared.
    pub(super) fixed: u64,
    pub(super) issued: u32,
    pub(super) ready: u64,
    pub(super) start: u64,
    pub(super) end: u64,
    pub(super) resolved: bool,
    pub(super) prefetch: bool,
    pub(super) step: u32,
}

#[derive(Default)]
pub(super) struct Colls {
    pub(super) all: Vec<Coll>,
    pub(super) by_serial: Vec<u32>,
    pub(super) lane: [Vec<u32>; 2],
    pub(super) resolved: [usize; 2],
    /// [`SimConfig::shared_link`](super::config::SimConfig::shared_link).
    pub(super) shared: bool,
}

impl Colls {
    pub(super) fn get(&self, id: LaunchId) -> Option<&Coll> {
        let i = *self.by_serial.get(id.serial as usize)?;
        self.all.get(i as usize)
    }

    /// Nanoseconds of `[from, to)` the resolved collectives of both streams run, summed over
    /// the streams. With a shared link a collective runs its fixed part, then transfers only
    /// where the other stream's transfers leave the link free: the time it waits for the link
    /// is not counted, so the two streams' transfers count once where their spans cover the
    /// same time (the link carries one at a time).
    pub(super) fn busy_between(&self, from: u64, to: u64) -> u64 {
        let clip = |a: u64, b: u64| b.min(to).saturating_sub(a.max(from));
        if !self.shared {
            return (0..2).flat_map(|s| self.running(s, from)).map(|c| clip(c.start, c.end)).sum();
        }
        let fixed: u64 =
            (0..2).flat_map(|s| self.running(s, from)).map(|c| clip(c.start, c.start + c.fixed)).sum();
        let transfer = |s: usize| {
            self.running(s, from)
                .map(move |c| ((c.start + c.fixed).max(from), c.end.min(to)))
                .filter(|(a, b)| a < b)
        };
        let length = |s: usize| transfer(s).map(|(a, b)| b - a).sum::<u64>();
        fixed + length(0) + length(1) - overlap(transfer(0), transfer(1))
    }

    /// Lane `s`'s resolved collectives that end after `from`, latest first (a lane's
    /// collectives end in order, so the scan stops at the first that ended by `from`).
    fn running(&self, s: usize, from: u64) -> impl Iterator<Item = &Coll> + '_ {
        self.lane[s][..self.resolved[s]]
            .iter()
            .rev()
            .map(|&i| &self.all[i as usize])
            .take_while(move |c| c.end > from)
    }

    pub(super) fn try_resolve(&mut self, s: usize, world: u32) {
        while let Some(&i) = self.lane[s].get(self.resolved[s]) {
            if self.all[i as usize].issued < world {
                break;
            }
            let prev = match self.resolved[s] {
                0 => 0,
                k => self.all[self.lane[s][k - 1] as usize].end,
            };
            let c = &self.all[i as usize];
            let start = prev.max(c.ready);
            let end = if self.shared {
                self.shared_end(1 - s, start + c.fixed, c.dur - c.fixed)
            } else {
                start + c.dur
            };
            let c = &mut self.all[i as usize];
            c.start = start;
            c.end = end;
            c.resolved = true;
            self.resolved[s] += 1;
        }
    }

    /// Where a transfer of `ns` nanoseconds from `from` ends when it runs only while lane
    /// `other`'s resolved transfers leave the link free. Each of those holds the link from its
    /// start's fixed part to its end: the parts of that span where it waited for this lane's
    /// transfers lie before `from` (this lane's collectives run one after another).
    fn shared_end(&self, other: usize, from: u64, ns: u64) -> u64 {
        let done = &self.lane[other][..self.resolved[other]];
        // A lane's collectives end in order: skip those that ended by `from`.
        let first = done.partition_point(|&i| self.all[i as usize].end <= from);
        let (mut t, mut left) = (from, ns);
        for &i in &done[first..] {
            let c = &self.all[i as usize];
            let busy_from = c.start + c.fixed;
            if busy_from > t {
                let free = busy_from - t;
                if free >= left {
                    return t + left;
                }
                left -= free;
            }
            t = t.max(c.end);
        }
        t + left
    }
}

/// Nanoseconds two lists of disjoint spans, each latest first, cover together.
fn overlap(mut a: impl Iterator<Item = (u64, u64)>, mut b: impl Iterator<Item = (u64, u64)>) -> u64 {
    let (mut x, mut y) = (a.next(), b.next());
    let mut total = 0;
    while let (Some((a0, a1)), Some((b0, b1))) = (x, y) {
        total += a1.min(b1).saturating_sub(a0.max(b0));
        // The later-starting span meets nothing further down the other list (those end
        // before the other's current span starts, which is no later than it).
        if a0 >= b0 {
            x = a.next();
        } else {
            y = b.next();
        }
    }
    total
}
