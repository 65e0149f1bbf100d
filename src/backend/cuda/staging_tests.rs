//! The staging ring on fake fences: a block a copy may still read is never handed out again,
//! the host never waits, and steady state allocates nothing.

use std::cell::Cell;
use std::rc::Rc;

use super::*;

/// A fence the test passes (or fails) by hand.
#[derive(Clone, Debug, Default)]
struct FakeFence(Rc<Cell<Option<Result<(), &'static str>>>>);

impl FakeFence {
    fn pass(&self) {
        self.0.set(Some(Ok(())));
    }
    fn fail(&self) {
        self.0.set(Some(Err("CUDA_ERROR_LAUNCH_FAILED")));
    }
}

impl Fence for FakeFence {
    fn passed(&self) -> Result<bool, String> {
        match self.0.get() {
            None => Ok(false),
            Some(Ok(())) => Ok(true),
            Some(Err(e)) => Err(e.to_string()),
        }
    }
}

/// Takes a block as the staging does: an idle one, or a "fresh allocation" at a new address.
fn take(ring: &mut StagingRing<FakeFence>, bytes: usize, next_addr: &mut usize) -> (Block, bool) {
    let mut errors = Vec::new();
    let t = ring.take(bytes, &mut errors);
    assert!(errors.is_empty(), "{errors:?}");
    match t {
        Take::Idle(b) => (b, false),
        Take::Allocate(size) => {
            ring.adopt();
            *next_addr += 1 << 20;
            (Block { addr: *next_addr, size }, true)
        }
    }
}

#[test]
fn a_block_is_reused_only_once_the_copy_that_read_it_completed() {
    let mut ring = StagingRing::default();
    let mut addr = 0;
    let (a, fresh) = take(&mut ring, 100, &mut addr);
    assert!(fresh && a.size == MIN_BLOCK);
    let fence_a = FakeFence::default();
    ring.give_back(a, fence_a.clone());

    // The copy from `a` is still pending: a second table must not get `a`.
    let (b, fresh) = take(&mut ring, 100, &mut addr);
    assert!(fresh, "no idle block, so a new one");
    assert_ne!(b.addr, a.addr, "a block still read by a pending copy was handed out again");
    let fence_b = FakeFence::default();
    ring.give_back(b, fence_b.clone());

    fence_a.pass();
    let (c, fresh) = take(&mut ring, 200, &mut addr);
    assert_eq!((c, fresh), (a, false), "the block whose copy completed is reused");
    ring.give_back_unused(c);
    let (d, fresh) = take(&mut ring, 10, &mut addr);
    assert_eq!((d, fresh), (a, false), "a block whose copy was refused is idle at once");
    assert_eq!(ring.blocks(), 2);
    let _ = fence_b;
}

#[test]
fn requests_take_the_smallest_idle_block_that_fits() {
    let mut ring = StagingRing::default();
    let mut addr = 0;
    let (small, _) = take(&mut ring, 10, &mut addr);
    let (big, _) = take(&mut ring, 3 * MIN_BLOCK, &mut addr);
    assert_eq!(big.size, 4 * MIN_BLOCK, "sizes are powers of two");
    ring.give_back_unused(big);
    ring.give_back_unused(small);
    let (got, fresh) = take(&mut ring, 1, &mut addr);
    assert_eq!((got, fresh), (small, false));
    let (got, fresh) = take(&mut ring, 2 * MIN_BLOCK, &mut addr);
    assert_eq!((got, fresh), (big, false));
    let (got, fresh) = take(&mut ring, 5 * MIN_BLOCK, &mut addr);
    assert!(fresh && got.size == 8 * MIN_BLOCK, "nothing idle fits: {got:?}");
}

#[test]
fn steady_state_allocates_no_more_blocks_than_copies_pending_at_once() {
    let mut ring = StagingRing::default();
    let mut addr = 0;
    let mut fences: Vec<FakeFence> = Vec::new();
    let mut allocated = 0;
    // Three copies in flight at any time (a pack, a reduction, an unpack), for 100 steps; a
    // copy completes three launches after its own.
    for step in 0..100 {
        if step >= 3 {
            fences[step - 3].pass();
        }
        let (b, fresh) = take(&mut ring, 1000 + step, &mut addr);
        allocated += usize::from(fresh);
        let f = FakeFence::default();
        ring.give_back(b, f.clone());
        fences.push(f);
    }
    assert_eq!(allocated, 3, "the ring grew beyond the copies pending at once");
    assert_eq!(ring.blocks(), 3);
}

#[test]
fn a_failed_fence_leaks_its_block_and_says_so() {
    let mut ring = StagingRing::default();
    let mut addr = 0;
    let (a, _) = take(&mut ring, 10, &mut addr);
    let f = FakeFence::default();
    ring.give_back(a, f.clone());
    f.fail();
    let mut errors = Vec::new();
    let t = ring.take(10, &mut errors);
    assert_eq!(errors, ["CUDA_ERROR_LAUNCH_FAILED"]);
    assert!(
        matches!(t, Take::Allocate(_)),
        "a block whose copy may or may not have run was handed out: {t:?}"
    );
    assert_eq!((ring.leaked(), ring.blocks()), (1, 0));
}

#[test]
fn teardown_frees_idle_blocks_and_leaks_pending_ones() {
    let mut ring = StagingRing::default();
    let mut addr = 0;
    let (a, _) = take(&mut ring, 10, &mut addr);
    let (b, _) = take(&mut ring, 10, &mut addr);
    let (c, _) = take(&mut ring, 10, &mut addr);
    let (fa, fb) = (FakeFence::default(), FakeFence::default());
    ring.give_back(a, fa.clone());
    ring.give_back(b, fb);
    ring.give_back_unused(c);
    fa.pass();
    let mut errors = Vec::new();
    let (mut idle, pending) = ring.release(&mut errors);
    idle.sort_by_key(|b| b.addr);
    assert_eq!(idle, [a, c], "only blocks no copy reads are freed");
    assert_eq!(pending, 1);
    assert!(errors.is_empty());
}
