//! The kernels allocate nothing: a counting allocator sees no allocation on the calling thread
//! while they run (the backend wants zero allocations in steady state).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use collsched_kernels::{
    accumulate, cast, copy_in, copy_out, reduce, reduce_in_place, CopySegment, ElemType, ReduceOp, Scaling,
};

struct Counting;

thread_local! {
    static ALLOCS: Cell<u64> = const { Cell::new(0) };
}

// SAFETY: forwards every call to `System` unchanged; only counts allocations per thread.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCS.with(|c| c.set(c.get() + 1));
        // SAFETY: same contract as ours, forwarded.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as ours, forwarded.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCS.with(|c| c.set(c.get() + 1));
        // SAFETY: same contract as ours, forwarded.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn allocations_during(f: impl FnOnce()) -> u64 {
    let before = ALLOCS.with(Cell::get);
    f();
    ALLOCS.with(Cell::get) - before
}

#[test]
fn kernels_do_not_allocate() {
    let n = 3 * 1024 + 5; // several blocks and a tail
    let a: Vec<u8> = (0..4 * n).map(|i| (i % 251) as u8 & 0x3F).collect();
    let b: Vec<u8> = (0..4 * n).map(|i| (i % 241) as u8 & 0x3F).collect();
    let mut out = vec![0u8; 4 * n];
    let mut half = vec![0u8; 2 * n];
    let segs: Vec<CopySegment> = (0..8)
        .map(|i| CopySegment { buffer: i % 2, buffer_offset: i * 10, packed_offset: i * 10, len: 10 })
        .collect();
    for ty in [ElemType::F32, ElemType::F16, ElemType::BF16] {
        let bytes = n * ty.size();
        let s = Scaling { pre_divide: 3.0, post_divide: 2.0 };
        let count = allocations_during(|| {
            reduce(ty, ReduceOp::Avg, s, &mut out[..bytes], &[&a[..bytes], &b[..bytes]]).unwrap();
            reduce(ty, ReduceOp::Sum, s, &mut out[..bytes], &[&a[..bytes]; 7]).unwrap();
            reduce_in_place(ty, ReduceOp::Avg, s, &mut out[..bytes], &[&a[..bytes]; 6]).unwrap();
            accumulate(ty, &mut out[..bytes], &b[..bytes]).unwrap();
            cast(ty, &a[..bytes], ElemType::F16, &mut half).unwrap();
            cast(ElemType::BF16, &a[..2 * n], ty, &mut out[..bytes]).unwrap();
        });
        assert_eq!(count, 0, "{}: reduce/accumulate/cast allocated", ty.name());
    }
    let count = allocations_during(|| {
        copy_in(&mut out, &[&a, &b], &segs, 4).unwrap();
        let (x, y) = half.split_at_mut(n);
        copy_out(&mut [x, y], &a, &segs, 2).unwrap();
    });
    assert_eq!(count, 0, "copy_in/copy_out allocated");
    // The counter works: an allocation is seen.
    assert_eq!(allocations_during(|| drop(std::hint::black_box(vec![1u8; 16]))), 1);
}
