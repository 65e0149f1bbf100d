//! The waiting policy on a virtual clock: phases, the bound, the watch, teardown's drain.

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::time::Duration;

use super::*;

/// Virtual time: a spin costs 1 us, a yield 5 us, a sleep what it says; every pause is kept.
/// The time is shared ([`FakeClock::now`]) so that a fake completion can read it.
#[derive(Default)]
struct FakeClock {
    now: Rc<Cell<Duration>>,
    pauses: Vec<(Duration, Pause)>,
}

impl FakeClock {
    fn now(&self) -> Rc<Cell<Duration>> {
        Rc::clone(&self.now)
    }
}

impl WaitClock for FakeClock {
    fn elapsed(&self) -> Duration {
        self.now.get()
    }

    fn pause(&mut self, pause: Pause) {
        let t = self.now.get();
        self.pauses.push((t, pause));
        self.now.set(
            t + match pause {
                Pause::Spin => Duration::from_micros(1),
                Pause::Yield => Duration::from_micros(5),
                Pause::Sleep(d) => d,
            },
        );
    }
}

#[test]
fn a_wait_spins_then_yields_then_sleeps_doubling_to_the_cap_and_ends_at_its_timeout() {
    let mut clock = FakeClock::default();
    let timeout = Duration::from_millis(20);
    let mut polls = 0u32;
    let r = wait_until(
        timeout,
        &mut clock,
        || {
            polls += 1;
            Ok::<_, ()>(false)
        },
        || Ok(()),
    );
    assert_eq!(r, Ok(false));
    assert_eq!(clock.elapsed(), timeout, "the wait must end at its timeout, not a sleep after it");
    let mut last_sleep = None;
    for (i, &(at, p)) in clock.pauses.iter().enumerate() {
        match p {
            Pause::Spin => assert!(at < SPIN_FOR, "pause {i}: a spin at {at:?}"),
            Pause::Yield => assert!((SPIN_FOR..YIELD_UNTIL).contains(&at), "pause {i}: a yield at {at:?}"),
            Pause::Sleep(d) => {
                assert!(at >= YIELD_UNTIL, "pause {i}: a sleep at {at:?}, before the yield phase ended");
                assert!(d <= MAX_SLEEP, "pause {i}: a sleep of {d:?} beyond the cap");
                let want = last_sleep.map_or(FIRST_SLEEP, |l: Duration| (l * 2).min(MAX_SLEEP));
                // Only the last sleep may be shorter: cut to the time left.
                if at + d < timeout {
                    assert_eq!(d, want, "pause {i}: sleeps double from {FIRST_SLEEP:?} up to {MAX_SLEEP:?}");
                } else {
                    assert_eq!(at + d, timeout, "pause {i}: the last sleep is cut to the time left");
                }
                last_sleep = Some(d);
            }
        }
    }
    // The phases are in order, and each is used.
    let kinds: Vec<u8> = clock
        .pauses
        .iter()
        .map(|(_, p)| match p {
            Pause::Spin => 0,
            Pause::Yield => 1,
            Pause::Sleep(_) => 2,
        })
        .collect();
    assert!(kinds.windows(2).all(|w| w[0] <= w[1]), "phases out of order: {kinds:?}");
    assert_eq!(kinds.first(), Some(&0));
    assert!(kinds.contains(&1));
    assert_eq!(kinds.last(), Some(&2));
    // Bounded work: no more polls than the phases allow (20 spins, 36 yields, the doubling
    // sleeps, then one per MAX_SLEEP), plus the last one.
    let bound = 20 + 36 + 8 + (timeout.as_micros() / MAX_SLEEP.as_micros()) as u32 + 1;
    assert!(polls <= bound, "{polls} polls in a wait of {timeout:?} (at most {bound})");
}

#[test]
fn completion_is_seen_at_the_poll_that_finds_it() {
    let mut clock = FakeClock::default();
    let mut polls = 0;
    let r = wait_until(
        Duration::from_secs(1),
        &mut clock,
        || {
            polls += 1;
            Ok::<_, ()>(polls == 3)
        },
        || Ok(()),
    );
    assert_eq!(r, Ok(true));
    assert_eq!(clock.pauses.iter().map(|p| p.1).collect::<Vec<_>>(), [Pause::Spin, Pause::Spin]);

    // Work that ends late in a long wait is seen at most one capped sleep later (virtual time).
    for done_at in [Duration::from_micros(150), Duration::from_micros(7_300), Duration::from_millis(250)] {
        let mut clock = FakeClock::default();
        let now = clock.now();
        let r =
            wait_until(Duration::from_secs(1), &mut clock, || Ok::<_, ()>(now.get() >= done_at), || Ok(()));
        assert_eq!(r, Ok(true));
        let seen = clock.elapsed();
        assert!(seen >= done_at && seen <= done_at + MAX_SLEEP, "done at {done_at:?}, seen at {seen:?}");
    }
}

#[test]
fn a_zero_timeout_polls_once_and_watches_pending_work_once() {
    let mut clock = FakeClock::default();
    let (mut polls, mut watches) = (0, 0);
    let r = wait_until(
        Duration::ZERO,
        &mut clock,
        || {
            polls += 1;
            Ok::<_, ()>(false)
        },
        || {
            watches += 1;
            Ok(())
        },
    );
    assert_eq!((r, polls, watches), (Ok(false), 1, 1));
    assert!(clock.pauses.is_empty());
}

#[test]
fn the_watch_runs_while_pending_and_its_error_ends_the_wait_before_the_timeout() {
    // A peer fails 2 ms into a wait of 300 s: the wait ends with the error right after.
    let mut clock = FakeClock::default();
    let now = clock.now();
    let fails = Duration::from_millis(2);
    let r = wait_until(
        Duration::from_secs(300),
        &mut clock,
        || Ok(false),
        || if now.get() >= fails { Err("ncclRemoteError on all_gather(bucket 3)") } else { Ok(()) },
    );
    assert_eq!(r, Err("ncclRemoteError on all_gather(bucket 3)"));
    let t = clock.elapsed();
    assert!(
        t >= fails && t <= fails + WATCH_EVERY + MAX_SLEEP,
        "the error at {fails:?} ended the wait at {t:?}"
    );

    // Spacing: at the first pending poll, then at most every WATCH_EVERY, and at the last poll.
    let mut clock = FakeClock::default();
    let now = clock.now();
    let watched = RefCell::new(Vec::new());
    let timeout = Duration::from_millis(3);
    let r = wait_until(
        timeout,
        &mut clock,
        || Ok::<_, ()>(false),
        || {
            watched.borrow_mut().push(now.get());
            Ok(())
        },
    );
    assert_eq!(r, Ok(false));
    let w = watched.into_inner();
    assert_eq!(w.first(), Some(&Duration::ZERO), "not watched at the first pending poll");
    assert_eq!(w.last(), Some(&timeout), "not watched at the last poll");
    for pair in w[..w.len() - 1].windows(2) {
        assert!(pair[1] - pair[0] >= WATCH_EVERY, "watched at {:?} and again at {:?}", pair[0], pair[1]);
    }
}

#[test]
fn a_poll_error_ends_the_wait_at_once() {
    let mut clock = FakeClock::default();
    let r = wait_until(
        Duration::from_secs(1),
        &mut clock,
        || Err::<bool, _>("CUDA_ERROR_LAUNCH_FAILED"),
        || Ok(()),
    );
    assert_eq!(r, Err("CUDA_ERROR_LAUNCH_FAILED"));
    assert!(clock.pauses.is_empty());
}

/// A fake device for [`drain`]: its work passes at `passes_at` (virtual), or only once aborted
/// (`after_abort`), or never.
struct FakeWork {
    passes_at: Option<Duration>,
    after_abort: bool,
}

fn run_drain(
    work: FakeWork,
    watch_fails_at: Option<Duration>,
) -> (Drained, Vec<&'static str>, Option<Duration>, Duration) {
    let mut clock = FakeClock::default();
    let now = clock.now();
    let aborted = Cell::new(None);
    let mut errors = Vec::new();
    let d = drain(
        Duration::from_secs(300),
        ABORT_GRACE,
        &mut clock,
        || {
            let t = now.get();
            Ok(work.passes_at.is_some_and(|p| t >= p) || (work.after_abort && aborted.get().is_some()))
        },
        || match watch_fails_at {
            Some(at) if now.get() >= at => Err("ncclRemoteError"),
            _ => Ok(()),
        },
        || aborted.set(Some(now.get())),
        &mut errors,
    );
    (d, errors, aborted.get(), clock.elapsed())
}

#[test]
fn teardown_drains_within_the_timeout_or_aborts_then_leaks_what_stays_pending() {
    let timeout = Duration::from_secs(300);
    // Work that ends in time: nothing aborted.
    let (d, errors, aborted, _) =
        run_drain(FakeWork { passes_at: Some(Duration::from_millis(40)), after_abort: false }, None);
    assert_eq!((d, errors.len(), aborted), (Drained::Clean, 0, None));

    // A hung collective that the abort ends: aborted at the timeout, then drained.
    let (d, errors, aborted, _) = run_drain(FakeWork { passes_at: None, after_abort: true }, None);
    assert_eq!(d, Drained::AfterAbort);
    assert!(errors.is_empty());
    assert_eq!(aborted, Some(timeout), "aborted exactly when the timeout ran out");

    // Work that not even the abort ends: wedged, after timeout + grace, not later.
    let (d, _, aborted, end) = run_drain(FakeWork { passes_at: None, after_abort: false }, None);
    assert_eq!((d, aborted), (Drained::Wedged, Some(timeout)));
    assert_eq!(end, timeout + ABORT_GRACE, "teardown must end after the timeout and the grace");

    // A peer's NCCL error seen by the watch aborts at once instead of waiting for the timeout.
    let fails = Duration::from_millis(2);
    let (d, errors, aborted, _) = run_drain(FakeWork { passes_at: None, after_abort: true }, Some(fails));
    assert_eq!(d, Drained::AfterAbort);
    assert_eq!(errors, ["ncclRemoteError"]);
    let at = aborted.expect("aborted");
    assert!(
        at >= fails && at <= fails + WATCH_EVERY + MAX_SLEEP,
        "aborted at {at:?}, the error came at {fails:?}"
    );
}

#[test]
fn teardown_with_a_failing_poll_aborts_and_counts_as_wedged() {
    let mut clock = FakeClock::default();
    let aborted = Cell::new(false);
    let mut errors = Vec::new();
    let d = drain(
        Duration::from_secs(300),
        ABORT_GRACE,
        &mut clock,
        || Err("CUDA_ERROR_ILLEGAL_ADDRESS"),
        || Ok(()),
        || aborted.set(true),
        &mut errors,
    );
    assert_eq!(d, Drained::Wedged);
    assert!(aborted.get());
    assert_eq!(errors, ["CUDA_ERROR_ILLEGAL_ADDRESS"]);
}
