//! How the host waits for the device: at low latency first, within a bound always.
//!
//! # Polling
//! A host wait ([`wait_until`]: an event's [`BackendEvent::wait`](crate::backend::BackendEvent),
//! the backend's fences, teardown) polls a completion (`cuEventQuery`) in three phases, timed
//! from the start of the wait:
//! 1. for [`SPIN_FOR`], back to back with [`std::hint::spin_loop`] between polls: work about
//!    to finish (a kernel, a small collective) is seen within a poll, a microsecond or so;
//! 2. until [`YIELD_UNTIL`], [`std::thread::yield_now`] between polls: still prompt, and the
//!    core goes to another thread that wants it;
//! 3. then sleeps, from [`FIRST_SLEEP`] doubling up to [`MAX_SLEEP`]: a long collective costs
//!    one wake-up per [`MAX_SLEEP`] at most, and its completion is seen at most that late.
//!
//! Every sleep is cut to the time left, so a wait ends at its timeout (not up to a sleep after
//! it), after one last poll. Between polls of pending work a *watch* runs (NCCL's asynchronous
//! errors of the communicators the work uses, [`super::comms`]): at the first pending poll,
//! then at most every [`WATCH_EVERY`], and at the last poll, so that a failed peer ends the wait
//! with its error instead of at the timeout. A timeout of zero polls once (and watches once if
//! the work is pending).
//!
//! # Teardown
//! [`drain`] is the bounded wait of the backend's and the pool's `Drop`: it waits for every
//! fence up to the backend's timeout; if they are not all passed then (or a watch reports a
//! failure), it aborts the communicators (their kernels exit, so the streams can drain; the
//! aborts themselves run on threads of their own, [`super::comms`]) and waits up to
//! [`ABORT_GRACE`] more. What is still pending after that is *wedged*: the caller
//! leaks the memory the device may still use rather than free it under running work or hang.
//!
//! Everything here is pure logic over a [`WaitClock`]; the tests run it on a virtual clock.

use std::time::{Duration, Instant};

/// Phase 1 of a wait: poll back to back, with a spin hint between polls.
pub const SPIN_FOR: Duration = Duration::from_micros(20);
/// Phase 2 of a wait: poll with a `yield_now` between polls until this much time passed.
pub const YIELD_UNTIL: Duration = Duration::from_micros(200);
/// Phase 3 of a wait: the first sleep between polls; each next one doubles.
pub const FIRST_SLEEP: Duration = Duration::from_micros(10);
/// Phase 3 of a wait: the longest sleep between polls (how late a long wait may see completion).
pub const MAX_SLEEP: Duration = Duration::from_millis(1);
/// How often a wait checks its watch (NCCL's asynchronous errors) while the work is pending.
pub const WATCH_EVERY: Duration = Duration::from_micros(100);
/// How long teardown waits for the streams to drain after aborting the communicators (the
/// backend's timeout instead, if that is shorter).
pub const ABORT_GRACE: Duration = Duration::from_secs(10);

/// What a waiting thread does between two polls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pause {
    /// A spin-loop hint (`std::hint::spin_loop`).
    Spin,
    /// Gives the core away once (`std::thread::yield_now`).
    Yield,
    /// Sleeps this long.
    Sleep(Duration),
}

/// The time a wait runs on: the host's, or a virtual one in tests.
pub trait WaitClock {
    /// Time since an arbitrary fixed start (monotonic).
    fn elapsed(&self) -> Duration;
    /// Does `pause` (and lets time pass).
    fn pause(&mut self, pause: Pause);
}

/// The host's clock: [`Instant`], real spins, yields and sleeps.
#[derive(Debug)]
pub struct HostClock(Instant);

impl HostClock {
    /// A clock started now.
    pub fn start() -> Self {
        HostClock(Instant::now())
    }
}

impl WaitClock for HostClock {
    fn elapsed(&self) -> Duration {
        self.0.elapsed()
    }

    fn pause(&mut self, pause: Pause) {
        match pause {
            Pause::Spin => std::hint::spin_loop(),
            Pause::Yield => std::thread::yield_now(),
            Pause::Sleep(d) => std::thread::sleep(d),
        }
    }
}

/// The pauses of one wait, phase by phase (see the module docs).
#[derive(Clone, Debug)]
pub struct Backoff {
    next_sleep: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff { next_sleep: FIRST_SLEEP }
    }
}

impl Backoff {
    /// The pause after a poll `elapsed` into the wait, with `left` until its timeout (`left`
    /// is not zero: a wait with no time left polls no more).
    pub fn next(&mut self, elapsed: Duration, left: Duration) -> Pause {
        if elapsed < SPIN_FOR {
            Pause::Spin
        } else if elapsed < YIELD_UNTIL {
            Pause::Yield
        } else {
            let sleep = self.next_sleep.min(left);
            self.next_sleep = (self.next_sleep * 2).min(MAX_SLEEP);
            Pause::Sleep(sleep)
        }
    }
}

/// Polls `poll` until it says done (`Ok(true)`) or `timeout` passed (`Ok(false)`, after one
/// last poll), pausing as [`Backoff`] says; while pending, runs `watch` at the first pending
/// poll, then every [`WATCH_EVERY`] and at the last poll.
///
/// # Errors
/// The first error of `poll` or `watch`, at once.
pub fn wait_until<E>(
    timeout: Duration,
    clock: &mut impl WaitClock,
    mut poll: impl FnMut() -> Result<bool, E>,
    mut watch: impl FnMut() -> Result<(), E>,
) -> Result<bool, E> {
    let start = clock.elapsed();
    let mut backoff = Backoff::default();
    let mut next_watch = Duration::ZERO;
    loop {
        if poll()? {
            return Ok(true);
        }
        let t = clock.elapsed().saturating_sub(start);
        let last = t >= timeout;
        if last || t >= next_watch {
            watch()?;
            next_watch = t + WATCH_EVERY;
        }
        if last {
            return Ok(false);
        }
        clock.pause(backoff.next(t, timeout - t));
    }
}

/// How a [`drain`] ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Drained {
    /// Everything passed within the timeout; nothing was aborted.
    Clean,
    /// Not everything passed in time (or a watch failed): the communicators were aborted, and
    /// then everything passed within [`ABORT_GRACE`].
    AfterAbort,
    /// Still pending after the abort and its grace (or unknowable: a poll failed): the caller
    /// must leak what the device may still use.
    Wedged,
}

/// Teardown's bounded wait: `poll` (everything passed?) for up to `timeout` with `watch`
/// running as in [`wait_until`]; then, if not passed, `abort` and up to `grace` more. Errors of
/// `poll` and `watch` are collected in `errors` (a failing poll cannot say whether the work
/// ended, so it ends the drain as [`Drained::Wedged`]).
pub fn drain<E>(
    timeout: Duration,
    grace: Duration,
    clock: &mut impl WaitClock,
    mut poll: impl FnMut() -> Result<bool, E>,
    watch: impl FnMut() -> Result<(), E>,
    abort: impl FnOnce(),
    errors: &mut Vec<E>,
) -> Drained {
    // A failing watch ends the first phase as `Err(None)` (its error kept aside): the failure
    // will not heal, so the drain aborts at once; a failing poll ends it as `Err(Some(_))`.
    let mut watch = watch;
    let mut watched = Vec::new();
    let first = wait_until(
        timeout,
        clock,
        || poll().map_err(Some),
        || {
            watch().map_err(|e| {
                watched.push(e);
                None
            })
        },
    );
    errors.append(&mut watched);
    match first {
        Ok(true) => return Drained::Clean,
        Ok(false) | Err(None) => {}
        Err(Some(e)) => {
            errors.push(e);
            abort();
            return Drained::Wedged;
        }
    }
    abort();
    match wait_until(grace, clock, || poll().map_err(Some), || Ok::<(), Option<E>>(())) {
        Ok(true) => Drained::AfterAbort,
        Ok(false) => Drained::Wedged,
        Err(e) => {
            errors.extend(e);
            Drained::Wedged
        }
    }
}

#[cfg(test)]
#[path = "wait_tests.rs"]
mod tests;
