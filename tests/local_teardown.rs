//! Tearing a rank down while a peer still reads its memory: the rank's pool must not hand back
//! buffers whose deferred free has not completed (a peer's all-gather pulls straight from them).

use std::time::Duration;

use collsched::backend::local::{LocalConfig, LocalWorld};
use collsched::backend::{Backend, CollDesc, Collective, RankGroup, Stream};
use collsched::kernels::ElemType;

/// Rank 0 launches an in-place all-gather, drops the in-flight collective and then its whole
/// rank handle before rank 1 even arrives; rank 1 must still read rank 0's shard intact. The
/// shard is large (8 MiB) so that a premature free returns it to the OS and a late read would
/// fault or see other data.
#[test]
fn a_dropped_rank_keeps_memory_a_peer_still_reads() {
    const ELEMS: usize = 2 << 20; // f32 elements per rank
    let world = LocalWorld::with_config(
        2,
        LocalConfig { timeout: Duration::from_secs(20), ..LocalConfig::default() },
    )
    .expect("world");
    let results = world.run(|rank| -> Result<Option<Vec<u8>>, collsched::backend::BackendError> {
        let r = rank.rank();
        let desc = CollDesc::all_gather(RankGroup::world(2), ElemType::F32, ELEMS).with_tag(1);
        let mut output = rank.alloc(2 * ELEMS * 4)?;
        let shard = vec![(r as u8 + 1) * 17; ELEMS * 4];
        rank.write_from_host(&mut output, r * ELEMS * 4, &shard)?;
        if r == 1 {
            // Arrive late, after rank 0 has dropped everything it had.
            std::thread::sleep(Duration::from_millis(300));
        }
        let op = Collective { desc, input: None, output };
        let flight = rank.launch(Stream::AllGather, &[], op).map_err(|e| e.error)?;
        if r == 0 {
            drop(flight);
            drop(rank);
            return Ok(None);
        }
        let done = flight.wait(Duration::from_secs(20)).map_err(|e| e.into_error())?;
        let mut host = vec![0u8; 2 * ELEMS * 4];
        rank.read_to_host(&done[0].output, 0, &mut host)?;
        Ok(Some(host))
    });
    let results = results.expect("world run");
    let mut iter = results.into_iter();
    let rank0 = iter.next().expect("rank 0").expect("rank 0 thread");
    assert!(rank0.expect("rank 0 result").is_none());
    let got =
        iter.next().expect("rank 1").expect("rank 1 thread").expect("rank 1 result").expect("rank 1 output");
    let bad0 = got[..ELEMS * 4].iter().filter(|&&b| b != 17).count();
    let bad1 = got[ELEMS * 4..].iter().filter(|&&b| b != 34).count();
    assert_eq!((bad0, bad1), (0, 0), "rank 1 read a torn all-gather (wrong bytes from rank 0, rank 1)");
}
