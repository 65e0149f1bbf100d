//! Agreement between ranks: every rank's plan fingerprint is exchanged when a coordinator is
//! created and after a trainability refresh, so ranks that built different plans get
//! `PlanMismatch` naming the first differing bucket instead of a hang.

use collsched_kernels::ElemType;
use collsched_schedule::{PlanDigests, Scheduler};
use std::time::Duration;

use super::RuntimeError;
use crate::backend::{Backend, BackendEvent, CollDesc, Collective, RankGroup, Stream};

/// Exchanges this plan's digests with every rank (an all-gather on the compute stream)
/// and checks them: a mismatch names the first differing bucket.
pub(crate) fn exchange_fingerprints<B: Backend>(be: &B, sched: &mut Scheduler) -> Result<(), RuntimeError> {
    let n = be.world_size();
    if n == 1 {
        return Ok(());
    }
    let rank = be.rank();
    let mine = sched.digests().clone();
    let header = [mine.fingerprint, mine.buckets.len() as u64];
    let all = all_gather_words(be, &header, "plan fingerprint exchange")?;
    let fps: Vec<u64> = all.chunks(2).map(|c| c[0]).collect();
    if fps.iter().all(|&f| f == mine.fingerprint) {
        return Ok(());
    }
    let longest = all.chunks(2).map(|c| c[1] as usize).max().unwrap_or(0);
    let mut words = mine.buckets.clone();
    words.resize(longest, 0);
    let digests = all_gather_words(be, &words, "plan fingerprint exchange")?;
    let peers: Vec<(u32, PlanDigests)> = (0..n)
        .filter(|&r| r != rank)
        .map(|r| {
            let len = (all[2 * r + 1] as usize).min(longest);
            let buckets = digests[r * longest..r * longest + len].to_vec();
            (r as u32, PlanDigests { fingerprint: fps[r], buckets })
        })
        .collect();
    Ok(sched.check_peers(peers.iter().map(|(r, d)| (*r, d)))?)
}

/// All-gathers `words` (the same count on every rank) over the world on the compute stream;
/// `op` names the exchange in errors.
pub(crate) fn all_gather_words<B: Backend>(
    be: &B,
    words: &[u64],
    op: &'static str,
) -> Result<Vec<u64>, RuntimeError> {
    let rank = be.rank();
    let n = be.world_size();
    let err = |source| RuntimeError::Backend { rank, op, bucket: None, source };
    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    // Words travel as pairs of f32 bit patterns: an all-gather copies them untouched.
    let desc = CollDesc::all_gather(RankGroup::world(n), ElemType::F32, 2 * words.len()).with_tag(0xF1_4E6E);
    let mut input = be.alloc(bytes.len().max(1)).map_err(err)?;
    be.write_from_host(&mut input, 0, &bytes).map_err(err)?;
    let output = be.alloc((bytes.len() * n).max(1)).map_err(err)?;
    if words.is_empty() {
        be.free(input, None);
        be.free(output, None);
        return Ok(Vec::new());
    }
    let flight = be
        .launch(Stream::Compute, &[], Collective { desc, input: Some(input), output })
        .map_err(|e| err(e.error))?;
    let _ = flight.event().query();
    // Longer than the collective's own wait for its members, so that a member that never
    // comes is reported by the collective, which names it, not by this wait.
    let patience = be.timeout().saturating_mul(2).saturating_add(Duration::from_secs(1));
    let mut done = flight.wait(patience).map_err(|e| err(e.into_error()))?;
    let mut host = vec![0u8; bytes.len() * n];
    let r = be.read_to_host(&done[0].output, 0, &mut host);
    for c in done.drain(..) {
        if let Some(i) = c.input {
            be.free(i, None);
        }
        be.free(c.output, None);
    }
    r.map_err(err)?;
    Ok(host.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().unwrap_or([0; 8]))).collect())
}
