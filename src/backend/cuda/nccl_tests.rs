//! Unit tests of the NCCL layer that run without a GPU (library loading, refusals).

use super::*;

#[test]
fn call_errors_name_op_bucket_rank_and_nccls_words() {
    let e = NcclError::Call(Box::new(NcclCallError {
        site: CallSite::op("all_gather").bucket(3).rank(5),
        api: "ncclAllGather",
        code: 1,
        code_name: result_name(1),
        message: "unhandled cuda error".into(),
        last_error: "Cuda failure 'out of memory'".into(),
    }));
    let s = e.to_string();
    assert_eq!(
        s,
        "all_gather(bucket 3, rank 5): ncclAllGather failed with ncclUnhandledCudaError (1): unhandled cuda error; NCCL says: Cuda failure 'out of memory'"
    );
    assert_eq!(result_name(42), "an unknown ncclResult_t");
}

#[test]
fn nccl_loads_from_its_knob_or_reports_what_it_tried() {
    // Where NCCL is installed (COLLSCHED_NCCL_LIB, or the system), its own strings come
    // through our symbol table; elsewhere the error says what was tried.
    match version() {
        Ok((major, minor, patch)) => {
            println!("NCCL {major}.{minor}.{patch} from {}", library_path().unwrap_or("?"));
            assert!(major >= 2 && (major > 2 || minor >= 18), "NCCL {major}.{minor}");
            let s = error_string(4).unwrap();
            assert!(!s.is_empty());
            assert!(!library_path().unwrap().is_empty());
            // An empty group needs no GPU.
            let park = ErrorPark::new();
            Group::start(park.clone()).unwrap().end().unwrap();
            drop(Group::start(park.clone()).unwrap()); // ended by Drop
            assert!(park.take().is_empty());
            match (UniqueId::generate(), UniqueId::generate()) {
                (Ok(a), Ok(b)) => {
                    assert_ne!(a, b, "two unique ids are equal");
                    if collsched_kernels::cuda::loader::driver().is_err() {
                        // Without a GPU, NCCL's own failure comes back as an error that
                        // names the op and rank and carries NCCL's words.
                        let e = Communicator::init_rank(&a, 1, 0, park.clone()).unwrap_err();
                        let s = e.to_string();
                        println!("{s}");
                        assert!(s.starts_with("comm_init(rank 0): ncclCommInitRank failed with nccl"), "{s}");
                    }
                }
                (Err(e), _) | (_, Err(e)) => println!("ncclGetUniqueId here: {e}"),
            }
        }
        Err(e) => {
            let s = e.to_string();
            println!("skipped the NCCL part: {s}");
            assert!(s.starts_with("no NCCL found: tried "), "{s}");
            assert!(s.contains("libnccl.so.2"), "{s}");
        }
    }
}
