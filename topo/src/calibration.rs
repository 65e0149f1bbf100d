//! Cost profiles measured on a machine (`collsched calibrate`), and the checked fit that makes
//! them: pure arithmetic, no clocks or I/O (the measuring is `collsched::calibrate`'s).
//!
//! # The fit
//! A collective of `S` bytes (nccl-tests' size: the whole gathered or unreduced buffer) is
//! modelled as `t(S) = fixed + per_byte * S`. [`fit_linear`] takes measured `(S, t)` points and
//! finds `fixed` and `per_byte` by least squares on **relative** residuals (each point weighted
//! by `1 / t^2`), so a fit over sizes spanning decades is not decided by the largest ones alone.
//! It refuses, naming why, instead of returning an absurd value: fewer than
//! [`MIN_FIT_POINTS`] points or fewer than two distinct sizes, a size or time that is not finite
//! and positive, a negative fixed cost (a latency below zero), or a per-byte cost that is not
//! positive or means a bandwidth above [`MAX_PLAUSIBLE_BANDWIDTH_BPS`]. Where that last is why
//! and the time is flat over the sizes (within [`FLAT_TOLERANCE`]), [`fit_latency_only`] gives
//! the fit a latency-bound link has: a fixed cost, bandwidth beyond what the sizes show.
//!
//! # The profile file
//! [`CostProfile`] is JSON (`CostProfile::to_json`, [`CostProfile::from_json`]):
//! ```json
//! {"format": "collsched-cost-profile", "version": 1, "backend": "shm", "ranks": 2,
//!  "machine": "2 core(s)", "launch_s": 2.1e-6, "host_per_collective_s": 3.4e-5,
//!  "compute_slowdown": 1.9, "compute_overlap": 0.2,
//!  "collectives": [{"kind": "all_gather", "ranks": 2, "fixed_s": 6.0e-6, "per_byte_s": 1.2e-10,
//!                   "points": [{"bytes": 4096, "seconds": 6.5e-6, "residual": 0.01}, ...]}, ...]}
//! ```
//! `fixed_s` and `per_byte_s` are the fit (seconds, seconds per byte), `points` what it was fitted
//! to with each point's relative residual `(fit - measured) / measured`. `launch_s` is the host
//! time of one launch call; `host_per_collective_s` the runtime's host time per collective
//! launched in a training step (scheduling, copies in and out, the update, spread over the
//! step's collectives), or `null` when not measured. `compute_slowdown` and `compute_overlap`
//! (optional) say how compute shares a CPU machine: the slowdown of a compute burst when every
//! rank computes at once, and the fraction of collective time that overlaps compute (the
//! simulator stretches compute by the rest). [`CostProfile::time`] prices a collective from it.

use serde::{Deserialize, Serialize};

use crate::CollectiveKind;

/// `format` of a cost profile file.
pub const PROFILE_FORMAT: &str = "collsched-cost-profile";
/// `version` of a cost profile file.
pub const PROFILE_VERSION: u32 = 1;
/// Fewest points [`fit_linear`] accepts: two determine a line, the third checks it.
pub const MIN_FIT_POINTS: usize = 3;
/// Highest bandwidth a fit may mean (bytes per second): 10 TB/s, above any memory system or
/// link a collective of this library runs on; a fit above it measured noise, not a slope.
pub const MAX_PLAUSIBLE_BANDWIDTH_BPS: f64 = 1e13;
/// The per-byte cost of a latency-only fit ([`fit_latency_only`]): that of the highest
/// plausible bandwidth (0.1 us a MiB).
pub const LATENCY_ONLY_PER_BYTE_S: f64 = 1.0 / MAX_PLAUSIBLE_BANDWIDTH_BPS;
/// The largest relative residual a latency-only fit may leave: a quarter, the spread of one
/// collective's time across repeated probes of a shared 2-core machine's link (benches/README.md,
/// "Across two hosts": 191-294 us for one all-gather).
pub const FLAT_TOLERANCE: f64 = 0.25;

/// Why a fit or a profile was refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum CalibrationError {
    /// Too few points, or all at one size.
    #[error("{what}: {points} point(s) at {sizes} distinct size(s); a checked fit needs at least {MIN_FIT_POINTS} points at 2 or more sizes (give a wider size range or a smaller step factor)")]
    TooFewPoints {
        /// What was fitted (e.g. `all_gather on 2 ranks`).
        what: String,
        /// Points given.
        points: usize,
        /// Distinct sizes among them.
        sizes: usize,
    },
    /// A point whose size or time is not finite and positive.
    #[error("{what}: point {index} ({bytes} bytes, {seconds} s) is not a finite positive size and time; the measurement failed")]
    BadPoint {
        /// What was fitted.
        what: String,
        /// Index of the point.
        index: usize,
        /// Its size.
        bytes: f64,
        /// Its time.
        seconds: f64,
    },
    /// The fit's fixed cost is negative.
    #[error("{what}: the fit's fixed cost is {fixed_us:.3} us, below zero: the times do not grow linearly over these sizes (measure again on a quieter machine, or over sizes where the time grows)")]
    NegativeLatency {
        /// What was fitted.
        what: String,
        /// The fixed cost it found, microseconds.
        fixed_us: f64,
    },
    /// The fit's per-byte cost is not positive or means an implausible bandwidth.
    #[error("{what}: the fit's per-byte cost {per_byte_s:e} s/B means a bandwidth of {gbs:.1} GB/s, not a plausible one (0 < B <= {max:.0} GB/s): the time hardly grows with the size over these sizes; measure larger sizes")]
    AbsurdBandwidth {
        /// What was fitted.
        what: String,
        /// The per-byte cost it found.
        per_byte_s: f64,
        /// The bandwidth that means, GB/s (infinite or negative for a non-positive slope).
        gbs: f64,
        /// The limit, GB/s.
        max: f64,
    },
    /// A profile file that cannot be read as one.
    #[error("cost profile: {0}")]
    Format(String),
    /// A profile that has no fit for a collective the caller prices.
    #[error("cost profile ({backend}, measured on {ranks} ranks) has no fit for {kind}; run `collsched calibrate` with that collective, or simulate a plan without it")]
    Missing {
        /// The profile's backend.
        backend: String,
        /// Its ranks.
        ranks: usize,
        /// The collective.
        kind: CollectiveKind,
    },
}

/// One measured point and its relative residual under the fit.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct FitPoint {
    /// Bytes of the whole buffer.
    pub bytes: u64,
    /// Measured seconds.
    pub seconds: f64,
    /// `(fit - measured) / measured`.
    pub residual: f64,
}

/// A checked fit `t(S) = fixed_s + per_byte_s * S`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LinearFit {
    /// Seconds every call pays (latency, launch, synchronisation).
    pub fixed_s: f64,
    /// Seconds per byte of the whole buffer.
    pub per_byte_s: f64,
    /// The points fitted, with their residuals.
    pub points: Vec<FitPoint>,
}

impl LinearFit {
    /// Predicted seconds at `bytes`.
    pub fn time(&self, bytes: f64) -> f64 {
        self.fixed_s + self.per_byte_s * bytes
    }

    /// Largest absolute relative residual.
    pub fn max_residual(&self) -> f64 {
        self.points.iter().map(|p| p.residual.abs()).fold(0.0, f64::max)
    }

    /// Whether it is a latency-only fit ([`fit_latency_only`]): time that did not grow with
    /// the size over the sizes measured.
    pub fn latency_only(&self) -> bool {
        (self.per_byte_s - LATENCY_ONLY_PER_BYTE_S).abs() <= LATENCY_ONLY_PER_BYTE_S * 1e-9
    }

    /// The bandwidth `1 / per_byte_s` in GB/s (algorithm bandwidth: whole-buffer bytes per second).
    pub fn bandwidth_gbs(&self) -> f64 {
        1.0 / self.per_byte_s / 1e9
    }
}

/// The fit of `points` whose time does not grow with the size over the sizes measured (where
/// [`fit_linear`] finds no plausible bandwidth: a link whose latency is all of a collective's
/// time at these sizes): the fixed cost the points' mean (weighted as [`fit_linear`] weighs
/// them), the per-byte cost [`LATENCY_ONLY_PER_BYTE_S`]. `None` where a point is not finite and
/// positive, there are fewer than [`MIN_FIT_POINTS`] or fewer than two sizes, or a point is
/// more than [`FLAT_TOLERANCE`] off the mean (the time does change with the size, or the
/// probe measured noise).
pub fn fit_latency_only(points: &[(f64, f64)]) -> Option<LinearFit> {
    let valid = |&(s, t): &(f64, f64)| s.is_finite() && s > 0.0 && t.is_finite() && t > 0.0;
    let mut sizes: Vec<f64> = points.iter().map(|p| p.0).collect();
    sizes.sort_by(f64::total_cmp);
    sizes.dedup();
    if points.len() < MIN_FIT_POINTS || sizes.len() < 2 || !points.iter().all(valid) {
        return None;
    }
    // Minimising sum (a - t)^2 / t^2 gives a = sum(1/t) / sum(1/t^2).
    let fixed_s =
        points.iter().map(|p| 1.0 / p.1).sum::<f64>() / points.iter().map(|p| 1.0 / (p.1 * p.1)).sum::<f64>();
    let per_byte_s = LATENCY_ONLY_PER_BYTE_S;
    let points: Vec<FitPoint> = points
        .iter()
        .map(|&(s, t)| FitPoint { bytes: s as u64, seconds: t, residual: (fixed_s + per_byte_s * s - t) / t })
        .collect();
    let fit = LinearFit { fixed_s, per_byte_s, points };
    (fit.max_residual() <= FLAT_TOLERANCE).then_some(fit)
}

/// Fits `t = fixed + per_byte * S` to `points` (`(bytes, seconds)`) by least squares on
/// relative residuals. `what` names the probe in errors.
///
/// # Errors
/// [`CalibrationError::TooFewPoints`], [`CalibrationError::BadPoint`],
/// [`CalibrationError::NegativeLatency`] or [`CalibrationError::AbsurdBandwidth`], as the
/// module docs say.
///
/// # Examples
/// ```
/// use collsched_topo::calibration::fit_linear;
/// let pts: Vec<(f64, f64)> = [4096.0, 65536.0, 1048576.0].iter().map(|&s| (s, 5e-6 + s * 1e-10)).collect();
/// let fit = fit_linear("all_gather on 2 ranks", &pts)?;
/// assert!((fit.fixed_s - 5e-6).abs() < 1e-12 && (fit.per_byte_s - 1e-10).abs() < 1e-18);
/// # Ok::<(), collsched_topo::calibration::CalibrationError>(())
/// ```
pub fn fit_linear(what: &str, points: &[(f64, f64)]) -> Result<LinearFit, CalibrationError> {
    for (index, &(bytes, seconds)) in points.iter().enumerate() {
        if !(bytes.is_finite() && bytes > 0.0 && seconds.is_finite() && seconds > 0.0) {
            return Err(CalibrationError::BadPoint { what: what.to_owned(), index, bytes, seconds });
        }
    }
    let mut sizes: Vec<f64> = points.iter().map(|p| p.0).collect();
    sizes.sort_by(f64::total_cmp);
    sizes.dedup();
    if points.len() < MIN_FIT_POINTS || sizes.len() < 2 {
        return Err(CalibrationError::TooFewPoints {
            what: what.to_owned(),
            points: points.len(),
            sizes: sizes.len(),
        });
    }
    // Weighted least squares, weight w = 1/t^2: minimise sum w (a + b s - t)^2. Centred sums
    // keep the normal equations well conditioned when sizes span decades.
    let (mut sw, mut sws, mut swt) = (0.0, 0.0, 0.0);
    for &(s, t) in points {
        let w = 1.0 / (t * t);
        sw += w;
        sws += w * s;
        swt += w * t;
    }
    let (ms, mt) = (sws / sw, swt / sw);
    let (mut sxx, mut sxy) = (0.0, 0.0);
    for &(s, t) in points {
        let w = 1.0 / (t * t);
        sxx += w * (s - ms) * (s - ms);
        sxy += w * (s - ms) * (t - mt);
    }
    let per_byte_s = sxy / sxx;
    let fixed_s = mt - per_byte_s * ms;
    // A fixed cost below zero by more than rounding (relative to the smallest time) is refused.
    let t_min = points.iter().map(|p| p.1).fold(f64::INFINITY, f64::min);
    if fixed_s < -1e-9 * t_min {
        return Err(CalibrationError::NegativeLatency { what: what.to_owned(), fixed_us: fixed_s * 1e6 });
    }
    let fixed_s = fixed_s.max(0.0);
    if !(per_byte_s.is_finite() && per_byte_s > 0.0 && 1.0 / per_byte_s <= MAX_PLAUSIBLE_BANDWIDTH_BPS) {
        return Err(CalibrationError::AbsurdBandwidth {
            what: what.to_owned(),
            per_byte_s,
            gbs: 1.0 / per_byte_s / 1e9,
            max: MAX_PLAUSIBLE_BANDWIDTH_BPS / 1e9,
        });
    }
    let points = points
        .iter()
        .map(|&(s, t)| FitPoint { bytes: s as u64, seconds: t, residual: (fixed_s + per_byte_s * s - t) / t })
        .collect();
    Ok(LinearFit { fixed_s, per_byte_s, points })
}

/// The fit of one collective kind on a number of ranks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CollectiveFit {
    /// The collective.
    pub kind: CollectiveKind,
    /// Ranks of the group it was measured on.
    pub ranks: usize,
    /// The fit.
    #[serde(flatten)]
    pub fit: LinearFit,
}

/// What `collsched calibrate` measured on one machine and backend (the module docs give the
/// file format).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CostProfile {
    /// [`PROFILE_FORMAT`].
    pub format: String,
    /// [`PROFILE_VERSION`].
    pub version: u32,
    /// The backend measured (`local`, `shm`, `mpi`, `cuda`).
    pub backend: String,
    /// Ranks of the world measured.
    pub ranks: usize,
    /// A description of the machine (free text).
    #[serde(default)]
    pub machine: String,
    /// Host seconds of one launch call.
    pub launch_s: f64,
    /// Host seconds per collective launched in a training step, or `None` when not measured.
    pub host_per_collective_s: Option<f64>,
    /// How much longer a compute burst takes when every rank computes at once than when one
    /// rank does (>= 1; about `ranks / cores` when the ranks outnumber the cores), or `None`.
    #[serde(default)]
    pub compute_slowdown: Option<f64>,
    /// The fraction of collective time that proceeds alongside compute (0: the collectives and
    /// the compute share the cores and take turns; 1: they overlap freely), or `None`.
    #[serde(default)]
    pub compute_overlap: Option<f64>,
    /// One fit per measured collective kind (and rank count).
    pub collectives: Vec<CollectiveFit>,
}

impl CostProfile {
    /// A profile of `backend` on `ranks` ranks with no fits yet.
    pub fn new(backend: &str, ranks: usize) -> CostProfile {
        CostProfile {
            format: PROFILE_FORMAT.to_owned(),
            version: PROFILE_VERSION,
            backend: backend.to_owned(),
            ranks,
            machine: String::new(),
            launch_s: 0.0,
            host_per_collective_s: None,
            compute_slowdown: None,
            compute_overlap: None,
            collectives: Vec::new(),
        }
    }

    /// Reads a profile from JSON and checks it: its format and version, finite non-negative
    /// costs, positive per-byte costs, at least one fit.
    ///
    /// # Errors
    /// [`CalibrationError::Format`] naming what is wrong.
    pub fn from_json(text: &str) -> Result<CostProfile, CalibrationError> {
        let p: CostProfile =
            serde_json::from_str(text).map_err(|e| CalibrationError::Format(e.to_string()))?;
        if p.format != PROFILE_FORMAT || p.version != PROFILE_VERSION {
            return Err(CalibrationError::Format(format!(
                "format `{}` version {}, expected `{PROFILE_FORMAT}` version {PROFILE_VERSION} (a file `collsched calibrate --out` wrote)",
                p.format, p.version
            )));
        }
        let ok = |x: f64| x.is_finite() && x >= 0.0;
        if !ok(p.launch_s) || p.host_per_collective_s.is_some_and(|h| !ok(h)) {
            return Err(CalibrationError::Format(
                "launch_s and host_per_collective_s must be finite and >= 0".to_owned(),
            ));
        }
        if p.compute_slowdown.is_some_and(|x| !(x.is_finite() && x >= 1.0))
            || p.compute_overlap.is_some_and(|x| !(0.0..=1.0).contains(&x))
        {
            return Err(CalibrationError::Format(
                "compute_slowdown must be >= 1 and compute_overlap within 0..1".to_owned(),
            ));
        }
        if p.collectives.is_empty() {
            return Err(CalibrationError::Format("no collectives: the profile has no fit".to_owned()));
        }
        for c in &p.collectives {
            if c.ranks < 2 || !ok(c.fit.fixed_s) || !(c.fit.per_byte_s.is_finite() && c.fit.per_byte_s > 0.0)
            {
                return Err(CalibrationError::Format(format!(
                    "{} on {} ranks: fixed_s {} and per_byte_s {} must be finite, >= 0 and > 0, on 2 ranks or more",
                    c.kind, c.ranks, c.fit.fixed_s, c.fit.per_byte_s
                )));
            }
        }
        Ok(p)
    }

    /// The profile as pretty JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_default()
    }

    /// Whether the profile can price `kind` (on any rank count).
    pub fn covers(&self, kind: CollectiveKind) -> bool {
        self.collectives.iter().any(|c| c.kind == kind)
    }

    /// Seconds a collective `kind` of `bytes` (nccl-tests' size) takes on a group of `ranks`
    /// ranks. A group of one costs 0. A fit measured on that rank count is used as it is;
    /// otherwise the fit of the nearest rank count is scaled as a ring scales: its fixed cost
    /// by `(n-1)/(m-1)` and its per-byte cost by `((n-1)/n) / ((m-1)/m)` from `m` measured
    /// ranks to `n`.
    ///
    /// # Errors
    /// [`CalibrationError::Missing`] when the profile has no fit of `kind`.
    pub fn time(&self, kind: CollectiveKind, bytes: u64, ranks: usize) -> Result<f64, CalibrationError> {
        if ranks <= 1 {
            return Ok(0.0);
        }
        let nearest = self
            .collectives
            .iter()
            .filter(|c| c.kind == kind)
            .min_by_key(|c| c.ranks.abs_diff(ranks))
            .ok_or_else(|| CalibrationError::Missing {
                backend: self.backend.clone(),
                ranks: self.ranks,
                kind,
            })?;
        let (n, m) = (ranks as f64, nearest.ranks as f64);
        let (fixed, per_byte) = if nearest.ranks == ranks {
            (nearest.fit.fixed_s, nearest.fit.per_byte_s)
        } else {
            (
                nearest.fit.fixed_s * (n - 1.0) / (m - 1.0),
                nearest.fit.per_byte_s * ((n - 1.0) / n) / ((m - 1.0) / m),
            )
        };
        Ok(fixed + per_byte * bytes as f64)
    }
}

/// The fraction of collective time that proceeds alongside compute, from a compute burst alone
/// (`compute_s`), collectives alone (`comm_s`) and both started together (`both_s`, until both
/// ended): the time hidden, `compute + comm - both`, over the most that could be,
/// `min(compute, comm)`; clamped to `0..=1` (noise can push it past either end). `None` when a
/// time is not finite and positive.
///
/// # Examples
/// ```
/// use collsched_topo::calibration::overlap_fraction;
/// assert_eq!(overlap_fraction(1.0, 1.0, 2.0), Some(0.0)); // took turns
/// assert_eq!(overlap_fraction(1.0, 1.0, 1.0), Some(1.0)); // overlapped freely
/// assert_eq!(overlap_fraction(2.0, 1.0, 2.5), Some(0.5));
/// ```
pub fn overlap_fraction(compute_s: f64, comm_s: f64, both_s: f64) -> Option<f64> {
    let ok = |x: f64| x.is_finite() && x > 0.0;
    if !(ok(compute_s) && ok(comm_s) && ok(both_s)) {
        return None;
    }
    Some(((compute_s + comm_s - both_s) / compute_s.min(comm_s)).clamp(0.0, 1.0))
}
