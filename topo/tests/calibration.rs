//! The calibration fit: it recovers known fixed and per-byte costs from synthetic points, its
//! residuals are the points' relative errors, it refuses what cannot be fitted with an error
//! naming why; and a cost profile prices collectives and reads back what it wrote.

use collsched_topo::calibration::{
    fit_latency_only, fit_linear, CalibrationError, CollectiveFit, FLAT_TOLERANCE, LATENCY_ONLY_PER_BYTE_S,
    MIN_FIT_POINTS,
};
use collsched_topo::{CollectiveKind, CostProfile};
use proptest::prelude::*;

fn sizes(min_shift: u32, count: usize, step: u32) -> Vec<f64> {
    (0..count).map(|i| f64::from(1u32 << (min_shift + step * i as u32))).collect()
}

proptest! {
    /// Exact points: the fit recovers both costs within float error, every residual is ~0.
    #[test]
    fn recovers_known_costs(
        fixed_us in 0.0f64..5000.0,
        gbs in 0.001f64..5000.0,
        min_shift in 0u32..16,
        count in MIN_FIT_POINTS..10,
        step in 1u32..3,
    ) {
        let per_byte = 1.0 / (gbs * 1e9);
        let pts: Vec<(f64, f64)> =
            sizes(min_shift, count, step).into_iter().map(|s| (s, fixed_us * 1e-6 + per_byte * s)).collect();
        let fit = fit_linear("probe", &pts).unwrap();
        let scale = pts.iter().map(|p| p.1).fold(0.0, f64::max);
        prop_assert!((fit.fixed_s - fixed_us * 1e-6).abs() <= 1e-9 * scale, "fixed {} vs {}", fit.fixed_s, fixed_us * 1e-6);
        // The slope is known to the times' rounding over the size span: tiny per-byte costs
        // under a large fixed one are recovered to that, not to their own relative precision.
        let span = pts.last().unwrap().0 - pts[0].0;
        let slope_err = 1e-7 * per_byte + 1e-12 * scale / span;
        prop_assert!((fit.per_byte_s - per_byte).abs() <= slope_err, "per byte {} vs {per_byte}", fit.per_byte_s);
        prop_assert!(fit.max_residual() <= 1e-9, "residual {}", fit.max_residual());
        prop_assert_eq!(fit.points.len(), pts.len());
    }

    /// Noisy points: each residual is the fit's relative error at that point.
    #[test]
    fn residuals_are_relative_errors(
        noise in proptest::collection::vec(-0.05f64..0.05, 4..8),
    ) {
        let pts: Vec<(f64, f64)> = noise
            .iter()
            .enumerate()
            .map(|(i, e)| {
                let s = f64::from(4096u32 << (2 * i as u32));
                (s, (10e-6 + s * 1e-10) * (1.0 + e))
            })
            .collect();
        match fit_linear("probe", &pts) {
            Ok(fit) => {
                for (p, &(s, t)) in fit.points.iter().zip(&pts) {
                    let want = (fit.fixed_s + fit.per_byte_s * s - t) / t;
                    prop_assert!((p.residual - want).abs() <= 1e-12);
                }
                // 5% noise cannot move the fit far from the truth.
                prop_assert!(fit.max_residual() < 0.2, "{}", fit.max_residual());
            }
            // Noise may tip the fixed cost below zero: refused, never returned.
            Err(e) => prop_assert!(matches!(e, CalibrationError::NegativeLatency { .. }), "{e}"),
        }
    }

    /// Whatever the points, a fit returned has a fixed cost >= 0 and a plausible bandwidth.
    #[test]
    fn never_returns_an_absurd_fit(
        pts in proptest::collection::vec((1.0f64..1e9, 1e-7f64..1.0), 0..8),
    ) {
        if let Ok(fit) = fit_linear("probe", &pts) {
            prop_assert!(fit.fixed_s >= 0.0);
            prop_assert!(fit.per_byte_s > 0.0 && fit.bandwidth_gbs() <= 1e4);
        }
    }
}

#[test]
fn refuses_too_few_points_or_one_size() {
    let e = fit_linear("all_gather on 2 ranks", &[(4096.0, 1e-5), (8192.0, 2e-5)]).unwrap_err();
    assert!(matches!(e, CalibrationError::TooFewPoints { points: 2, .. }), "{e}");
    assert!(e.to_string().contains("all_gather on 2 ranks") && e.to_string().contains("size range"), "{e}");
    let e = fit_linear("p", &[(4096.0, 1e-5), (4096.0, 1.1e-5), (4096.0, 0.9e-5)]).unwrap_err();
    assert!(matches!(e, CalibrationError::TooFewPoints { sizes: 1, .. }), "{e}");
    assert!(fit_linear("p", &[]).is_err());
}

#[test]
fn refuses_bad_points() {
    for bad in [f64::NAN, f64::INFINITY, 0.0, -1e-6] {
        let e = fit_linear("p", &[(4096.0, 1e-5), (8192.0, bad), (16384.0, 3e-5)]).unwrap_err();
        assert!(matches!(e, CalibrationError::BadPoint { index: 1, .. }), "{bad}: {e}");
    }
}

#[test]
fn refuses_negative_latency() {
    // Time grows faster than the size: the line through these crosses zero above 0 bytes.
    let pts = [(1e6, 1e-4), (2e6, 3e-4), (4e6, 7e-4)];
    let e = fit_linear("reduce_scatter on 3 ranks", &pts).unwrap_err();
    assert!(matches!(e, CalibrationError::NegativeLatency { .. }), "{e}");
    assert!(e.to_string().contains("below zero"), "{e}");
}

#[test]
fn refuses_absurd_bandwidth() {
    // Flat (latency only): the slope is ~0, an unbounded bandwidth.
    let flat = [(4096.0, 2e-4), (16384.0, 2e-4), (65536.0, 2e-4)];
    let e = fit_linear("all_gather on 2 ranks", &flat).unwrap_err();
    assert!(matches!(e, CalibrationError::AbsurdBandwidth { .. }), "{e}");
    // Shrinking with size: a negative slope.
    let falling = [(4096.0, 3e-4), (16384.0, 2e-4), (65536.0, 1e-4)];
    assert!(matches!(fit_linear("p", &falling).unwrap_err(), CalibrationError::AbsurdBandwidth { .. }));
    // 1 ns over 1 GB: 10^18 B/s.
    let fast = [(1e9, 1e-3), (2e9, 1e-3 + 1e-9), (4e9, 1e-3 + 3e-9)];
    assert!(matches!(fit_linear("p", &fast).unwrap_err(), CalibrationError::AbsurdBandwidth { .. }));
}

#[test]
fn a_flat_probe_has_a_latency_only_fit_within_the_tolerance() {
    // What fit_linear refuses as flat: the mean of the times, the bound's per-byte cost.
    let flat = [(4096.0, 2e-4), (16384.0, 2e-4), (65536.0, 2e-4)];
    let fit = fit_latency_only(&flat).unwrap();
    assert!(fit.latency_only() && (fit.fixed_s - 2e-4).abs() < 1e-15, "{fit:?}");
    assert_eq!(fit.per_byte_s, LATENCY_ONLY_PER_BYTE_S);
    assert!(fit.max_residual() < 1e-4 && fit.points.len() == 3);
    // Times apart by up to a quarter of the mean: still latency only; a linear fit is not.
    let noisy = [(4096.0, 2.2e-4), (16384.0, 1.9e-4), (65536.0, 1.8e-4)];
    let fit = fit_latency_only(&noisy).unwrap();
    assert!(fit.max_residual() <= FLAT_TOLERANCE && fit.fixed_s > 1.8e-4 && fit.fixed_s < 2.2e-4, "{fit:?}");
    let sloped: Vec<(f64, f64)> = [4096.0, 65536.0, 1e6].iter().map(|&s| (s, 5e-6 + s * 1e-10)).collect();
    assert!(!fit_linear("p", &sloped).unwrap().latency_only());
    // Halving over the sizes, too few points, one size, a bad point: none.
    assert!(fit_latency_only(&[(4096.0, 2e-4), (16384.0, 1.5e-4), (65536.0, 1e-4)]).is_none());
    assert!(fit_latency_only(&flat[..2]).is_none());
    assert!(fit_latency_only(&[(4096.0, 2e-4), (4096.0, 2e-4), (4096.0, 2e-4)]).is_none());
    assert!(fit_latency_only(&[(4096.0, 2e-4), (16384.0, f64::NAN), (65536.0, 2e-4)]).is_none());
}

fn profile() -> CostProfile {
    let mut p = CostProfile::new("shm", 2);
    let pts: Vec<(f64, f64)> = [4096.0, 65536.0, 1048576.0].iter().map(|&s| (s, 6e-6 + s * 2e-10)).collect();
    p.collectives.push(CollectiveFit {
        kind: CollectiveKind::AllGather,
        ranks: 2,
        fit: fit_linear("all_gather on 2 ranks", &pts).unwrap(),
    });
    p.launch_s = 1e-6;
    p.host_per_collective_s = Some(3e-5);
    p
}

#[test]
fn profile_prices_measured_and_scaled_rank_counts() {
    let p = profile();
    let t = p.time(CollectiveKind::AllGather, 8192, 2).unwrap();
    assert!((t - (6e-6 + 8192.0 * 2e-10)).abs() < 1e-15, "{t}");
    assert_eq!(p.time(CollectiveKind::AllGather, 8192, 1).unwrap(), 0.0);
    // 4 ranks from 2: fixed x3, per byte x (3/4)/(1/2) = 1.5.
    let t4 = p.time(CollectiveKind::AllGather, 8192, 4).unwrap();
    assert!((t4 - (18e-6 + 8192.0 * 3e-10)).abs() < 1e-15, "{t4}");
    let e = p.time(CollectiveKind::ReduceScatter, 8192, 2).unwrap_err();
    assert!(e.to_string().contains("reduce_scatter") && e.to_string().contains("calibrate"), "{e}");
}

#[test]
fn profile_round_trips_and_rejects_bad_files() {
    let p = profile();
    // serde_json reads floats to within an ulp or so, not always bit for bit.
    let back = CostProfile::from_json(&p.to_json()).unwrap();
    let near = |a: f64, b: f64| (a - b).abs() <= 1e-14 * a.abs().max(b.abs());
    assert_eq!((back.backend.as_str(), back.ranks, back.collectives.len()), ("shm", 2, 1));
    assert!(near(back.launch_s, p.launch_s) && near(back.host_per_collective_s.unwrap(), 3e-5));
    let (a, b) = (&back.collectives[0], &p.collectives[0]);
    assert_eq!((a.kind, a.ranks, a.fit.points.len()), (b.kind, b.ranks, b.fit.points.len()));
    assert!(near(a.fit.fixed_s, b.fit.fixed_s) && near(a.fit.per_byte_s, b.fit.per_byte_s));
    for (x, y) in a.fit.points.iter().zip(&b.fit.points) {
        assert!(x.bytes == y.bytes && near(x.seconds, y.seconds));
    }
    let e = CostProfile::from_json("{}").unwrap_err();
    assert!(e.to_string().starts_with("cost profile:"), "{e}");
    let wrong = p.to_json().replace("collsched-cost-profile", "collsched-topology");
    assert!(CostProfile::from_json(&wrong).unwrap_err().to_string().contains("collsched calibrate"));
    let mut neg = p.clone();
    neg.collectives[0].fit.per_byte_s = -1.0;
    assert!(CostProfile::from_json(&neg.to_json()).is_err());
    let mut empty = p;
    empty.collectives.clear();
    assert!(CostProfile::from_json(&empty.to_json()).unwrap_err().to_string().contains("no fit"));
}

proptest! {
    /// Built from a known overlap (compute and collectives run side by side for that fraction
    /// of the shorter), the fraction comes back; it always lies in 0..=1.
    #[test]
    fn overlap_fraction_recovers_the_overlap(
        compute in 1e-6f64..1.0, comm in 1e-6f64..1.0, phi in 0.0f64..=1.0, extra in 0.0f64..1.0,
    ) {
        use collsched_topo::calibration::overlap_fraction;
        let both = compute + comm - phi * compute.min(comm);
        let got = overlap_fraction(compute, comm, both).unwrap();
        prop_assert!((got - phi).abs() <= 1e-9, "{got} vs {phi}");
        let slower = overlap_fraction(compute, comm, both + extra).unwrap();
        prop_assert!((0.0..=1.0).contains(&slower) && slower <= got + 1e-12);
        prop_assert_eq!(overlap_fraction(compute, comm, f64::NAN), None);
        prop_assert_eq!(overlap_fraction(0.0, comm, both), None);
    }
}
