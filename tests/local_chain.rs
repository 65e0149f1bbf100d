//! `Backend::launch_then` on the local backend: a collective chained behind an in-flight one
//! reads its output without a host wait; a refused chain gives the first launch back intact.

use std::time::Duration;

use collsched::backend::local::{LocalBuffer, LocalRank, LocalWorld};
use collsched::backend::{
    Backend, BackendError, ChainError, Chained, CollDesc, Collective, InFlight, RankGroup, Stream,
};
use collsched::kernels::{ElemType, ReduceOp, Scaling};

const T: Duration = Duration::from_secs(30);

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

/// Waits for `flight`, reads the first `count` f32 of its first output, frees its buffers.
fn finish_f32(rank: &LocalRank, flight: InFlight<LocalRank>, count: usize) -> Result<Vec<f32>, BackendError> {
    let mut done = flight.wait(T).map_err(|e| e.into_error())?;
    let mut host = vec![0u8; count * 4];
    rank.read_to_host(&done[0].output, 0, &mut host)?;
    for c in done.drain(..) {
        c.input.into_iter().for_each(|b| rank.free(b, None));
        rank.free(c.output, None);
    }
    Ok(f32s(&host))
}

/// Rank r's reduce-scatter over its pair `{r - r % 2, r - r % 2 + 1}`: input element i is
/// `r * 100 + i`.
fn rs_input(rank: &LocalRank, count: usize) -> Result<Collective<LocalBuffer>, BackendError> {
    let r = rank.rank();
    let vals: Vec<u8> = (0..2 * count).flat_map(|i| ((r * 100 + i) as f32).to_le_bytes()).collect();
    let mut input = rank.alloc(vals.len())?;
    rank.write_from_host(&mut input, 0, &vals)?;
    let output = rank.alloc(count * 4)?;
    let desc =
        CollDesc::reduce_scatter(RankGroup::new(vec![r / 2 * 2, r / 2 * 2 + 1])?, ElemType::F32, count)
            .with_tag(3);
    Ok(Collective { desc, input: Some(input), output })
}

#[test]
fn a_chained_all_reduce_reads_the_reduce_scatter_output_in_stream_order() {
    // Hybrid-like: reduce-scatter within {0,1} and {2,3}, then all-reduce across {r%2, r%2+2}.
    let count = 5;
    let out = LocalWorld::new(4)
        .expect("world")
        .run(|rank| -> Result<Vec<f32>, BackendError> {
            let r = rank.rank();
            let rs = rs_input(&rank, count)?;
            let first = rank.launch(Stream::ReduceScatter, &[], rs).map_err(|e| e.error)?;
            let across = RankGroup::new(vec![r % 2, r % 2 + 2])?;
            let desc = CollDesc::all_reduce(across, ElemType::F32, count)
                .with_reduce(ReduceOp::Sum, Scaling::default())
                .with_tag(3);
            let output = rank.alloc(count * 4)?;
            let chained = rank
                .launch_then(first, Stream::ReduceScatter, [Chained { desc, input_of: 0, output }])
                .map_err(|e| e.error)?;
            finish_f32(&rank, chained, count)
        })
        .expect("ranks");
    for (r, got) in out.into_iter().enumerate() {
        let got = got.expect("rank thread").expect("rank");
        // Position p = r % 2 in its group gets chunk p summed over the group, then summed
        // across the two groups: every rank q contributes q * 100 + (p * count + i).
        let p = r % 2;
        let want: Vec<f32> =
            (0..count).map(|i| (0..4).map(|q| (q * 100 + p * count + i) as f32).sum()).collect();
        assert_eq!(got, want, "rank {r}");
    }
}

#[test]
fn a_refused_chain_gives_the_first_launch_back_intact() {
    let out = LocalWorld::new(2)
        .expect("world")
        .run(|rank| -> Result<Vec<f32>, BackendError> {
            let r = rank.rank();
            let desc = CollDesc::all_gather(RankGroup::world(2), ElemType::F32, 2).with_tag(9);
            let mut input = rank.alloc(8)?;
            rank.write_from_host(
                &mut input,
                0,
                &[(r as f32).to_le_bytes(), (r as f32 + 0.5).to_le_bytes()].concat(),
            )?;
            let output = rank.alloc(16)?;
            let first = rank
                .launch(Stream::AllGather, &[], Collective { desc, input: Some(input), output })
                .map_err(|e| e.error)?;
            let next = Chained {
                desc: CollDesc::all_reduce(RankGroup::world(2), ElemType::F32, 4),
                input_of: 1, // the first launch has one collective
                output: rank.alloc(16)?,
            };
            let ChainError { error, first, outputs } =
                match rank.launch_then(first, Stream::AllGather, [next]) {
                    Ok(_) => panic!("rank {r}: a chain reading collective 1 of a launch of 1 was accepted"),
                    Err(e) => *e,
                };
            assert!(matches!(error, BackendError::InvalidCollective { .. }), "{error}");
            assert!(error.to_string().contains("input_of 1"), "{error}");
            assert_eq!(outputs.len(), 1);
            outputs.into_iter().for_each(|b| rank.free(b, None));
            finish_f32(&rank, first, 4)
        })
        .expect("ranks");
    for got in out {
        assert_eq!(got.expect("rank thread").expect("rank"), vec![0.0, 0.5, 1.0, 1.5]);
    }
}
