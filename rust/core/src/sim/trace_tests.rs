use super::*;

#[test]
fn gamma_refuses_a_shape_that_is_not_a_finite_number_above_0() {
    let mut rng = SplitMix::new(1);
    for shape in [0.0, -1.0, f64::INFINITY, f64::NEG_INFINITY, f64::NAN] {
        assert_eq!(gamma(&mut rng, shape), None, "shape {shape}");
    }
}

#[test]
fn gamma_draws_for_every_shape_the_cv_range_gives() {
    // The extremes of 1/cv^2 over MIN_ARRIVAL_CV..=MAX_ARRIVAL_CV, and shapes between: every draw
    // is finite and at least 0, and the mean of a thousand is near the shape (all but the tiniest,
    // whose draws are almost all 0).
    let mut rng = SplitMix::new(7);
    for shape in [1e-300, 1e-100, 1e-3, 0.5, 1.0, 3.0, 1e3, 1e100, 1e300] {
        let draws: Vec<f64> = (0..1000).map(|_| gamma(&mut rng, shape).unwrap()).collect();
        assert!(draws.iter().all(|g| g.is_finite() && *g >= 0.0), "shape {shape}");
        if shape >= 0.5 {
            let mean = draws.iter().sum::<f64>() / 1000.0;
            assert!((mean / shape - 1.0).abs() < 0.1, "shape {shape}: mean {mean}");
        }
    }
}

fn trace() -> Trace {
    Trace::generate(Workload::Uniform, 4, 1000, 2).unwrap()
}

#[test]
fn gamma_arrivals_refuse_a_cv_whose_shape_rounds_to_0_or_infinity() {
    // 1e-200 squared is 0 (shape infinite: the sampler looped forever); 1e200 squared is infinite
    // (shape 0: every arrival NaN).
    for cv in [1e-200, 1e-160, 1e160, 1e200, f64::NAN, f64::INFINITY, 0.0, -1.0] {
        let err = trace().with_gamma_arrivals(10.0, cv, 0).unwrap_err();
        assert!(matches!(err, Error::Spec(_)), "{err}");
        assert!(err.to_string().contains("arrival cv must be a number in 1e-150..=1e150"), "{err}");
    }
    for cv in [MIN_ARRIVAL_CV, MAX_ARRIVAL_CV] {
        let t = trace().with_gamma_arrivals(10.0, cv, 0).unwrap();
        assert!(t.requests().iter().all(|r| r.arrival.is_some_and(f64::is_finite)), "cv {cv}");
    }
}

#[test]
fn gamma_arrivals_refuse_a_scale_or_times_past_the_floats() {
    // cv 1e100 (shape 1e-200) at 1e-300 requests/s: the scale is infinite and every draw of 0
    // would have arrived at NaN.
    let err = trace().with_gamma_arrivals(1e-300, 1e100, 0).unwrap_err().to_string();
    assert!(err.contains("arrival rate 1e-300 with cv 1e100") && err.contains("Gamma scale"), "{err}");
    // Gaps of some 1e306 seconds add up past the largest float within a thousand requests.
    let err = trace().with_gamma_arrivals(1e-306, 1.0, 0).unwrap_err().to_string();
    assert!(err.contains("pass the largest number") && err.contains("1000 requests"), "{err}");
    assert!(trace().with_gamma_arrivals(1e-300, 1.0, 0).is_ok());
}
