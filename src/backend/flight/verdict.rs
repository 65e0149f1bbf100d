//! What went wrong, from every rank's flight record: the ranks' collectives put side by side
//! by (group, stream, sequence number), the way they meet.
//!
//! In order, the first finding that applies:
//! 1. **Disagreement**: at some sequence number of a (group, stream), members launched
//!    different collectives (op, tag, count, type, reduction, root): the earliest such.
//! 2. **Never launched**: some members launched a collective that others of its group never
//!    did (their record of that group and stream ends before it): the lowest such.
//! 3. **First failure**: the earliest failure of a rank's own (not one caused by a peer's
//!    death, lateness or failure), else the earliest of any, and its rank.
//! 4. Ranks with no record (dead before writing one, or never started) are named in every case.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

use super::{FlightDump, FlightEntry, FlightState};

/// The finding of [`analyze`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Finding {
    /// Members disagree at `seq` of `group` on `stream`: what each launched.
    Disagree {
        /// The group.
        group: Vec<usize>,
        /// The stream.
        stream: String,
        /// The sequence number.
        seq: u64,
        /// Each member's collective (rank, description), by rank.
        launched: Vec<(usize, String)>,
    },
    /// `missing` never launched `seq` of `group` on `stream`, which `launched_by` did.
    NeverLaunched {
        /// The group.
        group: Vec<usize>,
        /// The stream.
        stream: String,
        /// The sequence number.
        seq: u64,
        /// The collective the others launched.
        what: String,
        /// Ranks that launched it.
        launched_by: Vec<usize>,
        /// Ranks that did not, with the last sequence number they launched there (`None`: none).
        missing: Vec<(usize, Option<u64>)>,
    },
    /// `rank` failed first, in `seq` of `group` on `stream`, with `error`.
    FirstFailure {
        /// The rank.
        rank: usize,
        /// The group.
        group: Vec<usize>,
        /// The stream.
        stream: String,
        /// The sequence number.
        seq: u64,
        /// The collective.
        what: String,
        /// Its error.
        error: String,
    },
    /// Nothing wrong in the records.
    Clean {
        /// Collectives recorded, over every rank.
        entries: usize,
    },
}

/// The verdict: the finding, and the ranks of the world with no record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Verdict {
    /// What went wrong first.
    pub finding: Finding,
    /// Ranks of the world whose record is absent.
    pub no_record: Vec<usize>,
}

impl std::fmt::Display for Verdict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.finding {
            Finding::Disagree { group, stream, seq, launched } => {
                let each: Vec<String> = launched.iter().map(|(r, w)| format!("rank {r} {w}")).collect();
                write!(
                    f,
                    "ranks disagree at collective #{seq} of group {group:?} on stream {stream}: {}",
                    each.join(", ")
                )?;
            }
            Finding::NeverLaunched { group, stream, seq, what, launched_by, missing } => {
                let ranks: Vec<usize> = missing.iter().map(|m| m.0).collect();
                let last: Vec<String> = missing
                    .iter()
                    .map(|(r, l)| match l {
                        Some(l) => format!("rank {r} last launched #{l}"),
                        None => format!("rank {r} launched none there"),
                    })
                    .collect();
                write!(
                    f,
                    "ranks {ranks:?} never launched collective #{seq} of group {group:?} on stream {stream} \
                     ({what}), which ranks {launched_by:?} did ({})",
                    last.join(", ")
                )?;
            }
            Finding::FirstFailure { rank, group, stream, seq, what, error } => write!(
                f,
                "rank {rank} failed first, in collective #{seq} of group {group:?} on stream {stream} ({what}): {error}"
            )?,
            Finding::Clean { entries } => {
                write!(f, "no disagreement, missing collective or failure in {entries} recorded collectives")?
            }
        }
        if !self.no_record.is_empty() {
            write!(
                f,
                "; no record from ranks {:?} (dead before writing one, or never started)",
                self.no_record
            )?;
        }
        Ok(())
    }
}

/// A (group, stream) channel's entries, by rank, by sequence number.
type Channel<'a> = BTreeMap<usize, BTreeMap<u64, &'a FlightEntry>>;

/// What must agree across members (the text of [`FlightEntry::what`], which has every field).
fn key(e: &FlightEntry) -> String {
    e.what()
}

/// Puts the ranks' records side by side and says what went wrong first.
pub fn analyze(dumps: &[FlightDump]) -> Verdict {
    let world = dumps.iter().map(|d| d.world).max().unwrap_or(0);
    let have: BTreeSet<usize> = dumps.iter().map(|d| d.rank).collect();
    let no_record: Vec<usize> = (0..world).filter(|r| !have.contains(r)).collect();
    let mut channels: BTreeMap<(Vec<usize>, String), Channel<'_>> = BTreeMap::new();
    for d in dumps {
        for e in &d.entries {
            channels
                .entry((e.group.clone(), e.stream.clone()))
                .or_default()
                .entry(d.rank)
                .or_default()
                .insert(e.seq, e);
        }
    }
    let oldest_kept = |rank: usize| dumps.iter().find(|d| d.rank == rank).is_some_and(|d| d.dropped > 0);

    // 1. Disagreements: the earliest launched, over every channel.
    let mut disagree: Option<(u64, Finding)> = None;
    for ((group, stream), by_rank) in &channels {
        let seqs: BTreeSet<u64> = by_rank.values().flat_map(|m| m.keys().copied()).collect();
        for seq in seqs {
            let at: Vec<(usize, &FlightEntry)> =
                by_rank.iter().filter_map(|(r, m)| m.get(&seq).map(|e| (*r, *e))).collect();
            let first = key(at[0].1);
            if at.iter().any(|(_, e)| key(e) != first) {
                let when = at.iter().map(|(_, e)| e.launched_ns).min().unwrap_or(0);
                if disagree.as_ref().is_none_or(|(t, _)| when < *t) {
                    let launched = at.iter().map(|(r, e)| (*r, e.what())).collect();
                    disagree = Some((
                        when,
                        Finding::Disagree { group: group.clone(), stream: stream.clone(), seq, launched },
                    ));
                }
                break;
            }
        }
    }
    if let Some((_, finding)) = disagree {
        return Verdict { finding, no_record };
    }

    // 2. Never launched: the lowest sequence number some member with a record lacks.
    let mut never: Option<(u64, Finding)> = None;
    for ((group, stream), by_rank) in &channels {
        let members: Vec<usize> = group.iter().copied().filter(|r| have.contains(r)).collect();
        let last = |r: usize| by_rank.get(&r).and_then(|m| m.keys().next_back().copied());
        let Some(top) = members.iter().filter_map(|&r| last(r)).max() else { continue };
        let behind: Vec<(usize, Option<u64>)> = members
            .iter()
            .filter(|&&r| last(r).is_none_or(|l| l < top) && !(last(r).is_none() && oldest_kept(r)))
            .map(|&r| (r, last(r)))
            .collect();
        if behind.is_empty() {
            continue;
        }
        let seq = behind.iter().map(|(_, l)| l.map_or(0, |l| l + 1)).min().unwrap_or(0);
        let launched_by: Vec<usize> = members
            .iter()
            .copied()
            .filter(|&r| by_rank.get(&r).is_some_and(|m| m.contains_key(&seq)))
            .collect();
        let Some(sample) = launched_by.first().and_then(|r| by_rank[r].get(&seq)) else { continue };
        let missing: Vec<(usize, Option<u64>)> =
            behind.into_iter().filter(|(_, l)| l.is_none_or(|l| l < seq)).collect();
        if never.as_ref().is_none_or(|(t, _)| sample.launched_ns < *t) {
            never = Some((
                sample.launched_ns,
                Finding::NeverLaunched {
                    group: group.clone(),
                    stream: stream.clone(),
                    seq,
                    what: sample.what(),
                    launched_by,
                    missing,
                },
            ));
        }
    }
    if let Some((_, finding)) = never {
        return Verdict { finding, no_record };
    }

    // 3. The first failure: of a rank's own (a failure because of a peer comes after it, in
    // effect if not always on the clock), else the first of any.
    let failures = || {
        dumps
            .iter()
            .flat_map(|d| d.entries.iter().map(move |e| (d.rank, e)))
            .filter(|(_, e)| e.state == FlightState::Failed)
    };
    let failed = failures()
        .filter(|(_, e)| !e.peers_fault)
        .min_by_key(|(r, e)| (e.ended_ns, *r))
        .or_else(|| failures().min_by_key(|(r, e)| (e.ended_ns, *r)));
    let finding = match failed {
        Some((rank, e)) => Finding::FirstFailure {
            rank,
            group: e.group.clone(),
            stream: e.stream.clone(),
            seq: e.seq,
            what: e.what(),
            error: e.error.clone().unwrap_or_default(),
        },
        None => Finding::Clean { entries: dumps.iter().map(|d| d.entries.len()).sum() },
    };
    Verdict { finding, no_record }
}

/// A table of each rank's record: entries, dropped, and per (group, stream) the last
/// sequence number launched and the state it got to.
pub fn summary(dumps: &[FlightDump]) -> String {
    let mut out = String::new();
    for d in dumps {
        let _ = writeln!(
            out,
            "rank {} (pid {}): {} collectives recorded, {} older dropped; taken because: {}",
            d.rank,
            d.pid,
            d.entries.len(),
            d.dropped,
            d.reason
        );
        let mut last: BTreeMap<(Vec<usize>, String), &FlightEntry> = BTreeMap::new();
        for e in &d.entries {
            last.insert((e.group.clone(), e.stream.clone()), e);
        }
        for ((group, stream), e) in last {
            let state = match e.state {
                FlightState::Launched => "launched",
                FlightState::Started => "started",
                FlightState::Completed => "completed",
                FlightState::Failed => "failed",
            };
            let _ = writeln!(out, "  group {group:?} stream {stream}: last #{} {} {state}", e.seq, e.what());
        }
    }
    out
}
